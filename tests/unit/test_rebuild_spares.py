"""Rebuilds of lost ranks and moves, as a review found them wanting: a node lost while a move
of its job was planned or under way (the job was never rebuilt nor told, and its other ranks
were moved meanwhile); a rank that died alone rebuilt on any empty node (no GPU, another
model); a spare given to a rebuild and to a move planned at the same moment; ranks moved home
onto a GPU whose agent still reports it unwell."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from tpagent import __version__
from tpagent.orchestrator import policy
from tpagent.orchestrator.api import Away, Finding, Move, MoveKind, MoveState, TaintKind, View
from tpagent.orchestrator.policy import NewMove
from unit.test_orchestrator_policy import cfg, no_failures, node, plan, rank
from unit.test_orchestrator_review import orchestrator


def test_a_job_whose_node_is_lost_mid_move_is_rebuilt_once_the_move_ends(tmp_path: Path) -> None:
    o = orchestrator(tmp_path, [node("a", (rank(0),)), node("b", (rank(1),)), node("e"), node("f")])
    rebuilt: list[tuple[str, str, tuple[int, ...]]] = []
    o.lost_nodes._recover = lambda view, n, job, ranks, tell: rebuilt.append((n, job, ranks))  # type: ignore[method-assign]
    started: list[str] = []
    o._execute = lambda m, *rest: started.append(m.target)  # type: ignore[method-assign]
    try:
        o.state.taint("a", "", TaintKind.PLANNED, "maintenance", "operator")
        o.tick()
        (m,) = o.state.moves(active=True)
        assert started == ["e"] and m.state is MoveState.RUNNING
        o._declare("b", "has not reported for 60 s")
        assert rebuilt == []  # (the move's agents decide while it runs: it may save the job)
        o._ended(m, MoveState.FAILED, "timed out waiting for a step boundary")
        for name in ("a", "e", "f"):  # (they report on: after the move's end)
            o.nodes[name] = dataclasses.replace(o.nodes[name], reports=9)
        o.tick()
        assert rebuilt == [("b", "j", (1,))]  # once its move has ended
        assert started == ["e"] and not o.state.moves(active=True)  # (no other move of it meanwhile)
        assert "has ranks on b, which stopped reporting" in o.state.taints()[0].waiting
        o.tick()
        assert rebuilt == [("b", "j", (1,))]  # (once)
    finally:
        o.state.close()


def test_a_planned_move_of_a_job_with_a_lost_node_is_cancelled_and_the_job_rebuilt(tmp_path: Path) -> None:
    o = orchestrator(tmp_path, [node("a", (rank(0),)), node("b", (rank(1),)), node("e"), node("f")])
    rebuilt: list[tuple[str, str, tuple[int, ...]]] = []
    o.lost_nodes._recover = lambda view, n, job, ranks, tell: rebuilt.append((n, job, ranks))  # type: ignore[method-assign]
    o._start = lambda dedicated: None  # type: ignore[method-assign]  # (planned, never started)
    try:
        o.state.taint("a", "", TaintKind.PLANNED, "maintenance", "operator")
        o.tick()
        (m,) = o.state.moves(active=True)
        o._declare("b", "has not reported for 60 s")
        o.tick()
        assert o.state.move(m.id).state is MoveState.CANCELLED and "b stopped reporting" in o.state.move(m.id).message
        o.tick()
        assert rebuilt == [("b", "j", (1,))]
    finally:
        o.state.close()


def test_a_gpu_rank_that_died_alone_is_rebuilt_on_a_spare_with_gpus_like_its_own(tmp_path: Path) -> None:
    a = node("a", (rank(0, gpus=("GPU-a-0",)), rank(2, gpus=("GPU-a-1",))), gpus=2)
    b = node("b", (rank(1, gpus=("GPU-b-0",)),), gpus=1)
    o = orchestrator(tmp_path, [a, b, node("login"), node("old", gpus=1, model=("NVIDIA A100 40GB", 40 << 30))])
    o.lost_nodes._recover = lambda *args: None  # type: ignore[method-assign]
    try:
        assert o._spare_for("j", "a", (0,)) is None  # (no spare has 2 H100s for both of a's ranks)
        # Rank 0 is killed: its agent reports it died, and its processes (and so their GPUs) are gone.
        o.report(dataclasses.replace(a, ranks=a.ranks[1:], died=(rank(0),), seen=200.0), __version__)
        assert o.nodes["a"].died[0].gpus == ("GPU-a-0",)  # (kept from its last report)
        o.nodes["new"] = node("new", gpus=1)
        assert o._spare_for("j", "a", (0,)) == ("new", "new:7400")  # (not the node with no GPU, nor the A100)
    finally:
        o.state.close()


def test_a_spare_a_rebuild_takes_while_a_move_onto_it_is_planned_is_not_moved_onto(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    nodes = [node("a", (rank(0),)), node("b", (rank(1),)), node("c", (rank(0, "k"),)), node("x", (rank(1, "k"),))]
    o = orchestrator(tmp_path, [*nodes, node("e")])
    started: list[str] = []
    o._execute = lambda m, *rest: started.append(m.target)  # type: ignore[method-assign]
    real = policy.plan
    rebuild: list[object] = []

    def plan(*args: object, **kw: object) -> policy.Plan:
        p = real(*args, **kw)  # type: ignore[arg-type]
        rebuild.append(o._spare_for("k", "x", (1,)))  # (a report's thread, as this plan was made)
        return p

    monkeypatch.setattr(policy, "plan", plan)
    try:
        o.state.taint("a", "", TaintKind.PLANNED, "maintenance", "operator")
        o.tick()
        assert rebuild == [("e", "e:7400")] and started == []
        monkeypatch.setattr(policy, "plan", real)
        o.tick()
        (m,) = o.state.moves()
        assert m.state is MoveState.CANCELLED and "given to a rebuild" in m.message
    finally:
        o.state.close()


def test_ranks_do_not_return_to_a_gpu_its_agent_still_reports_unwell() -> None:
    """An operator untaints a GPU whose ECC finding its agent still reports (until it restarts):
    the ranks moved home at once, onto it, and the next report tainted it again: two more stops
    of the job.  Now they return only onto GPUs no finding names."""
    home = node("a", gpus=2, findings=(Finding("GPU-a-0", "ecc", "12 uncorrected ECC errors"),))
    away = [Away("j", 0, "a", "e", 1)]
    spare = node("e", (rank(0, gpus=("GPU-e-0",)),), gpus=1)
    one = {"a": dataclasses.replace(home, gpus=home.gpus[:1]), "e": spare}
    assert plan(View(one), [], [], away, no_failures, cfg()).moves == []
    p = plan(View({"a": home, "e": spare}), [], [], away, no_failures, cfg())
    assert p.moves == [NewMove("j", (0,), "e", "a", MoveKind.HOME, 1, 1)]
    (m,) = p.moves
    move = Move(1, m.job, m.ranks, m.source, m.target, m.kind, MoveState.PLANNED, m.taint)
    assert policy.target_gpus(View({"a": home, "e": spare}), [], {}, move) == ("GPU-a-1",)
