"""The orchestrator on what a lost node last said, as a review found it: a node lost in a rewire
said "busy" for ever (its job was never rebuilt nor told); after a rebuild the lost node's last
report still held the job (no move of it again); a rank that died during a move, or a move
planned during a rebuild, ran beside the other; a GPU taint whose GPU the node no longer lists
could not be removed; one refused Slurm placeholder stopped every job's; a rebuild's answer of
another kind ended its thread (the job neither rebuilt nor told)."""

from __future__ import annotations

import dataclasses
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from tpagent import __version__
from tpagent.daemon.rpc import pb
from tpagent.orchestrator import lost, slurm
from tpagent.orchestrator.api import Finding, Move, MoveState, TaintKind
from tpagent.orchestrator.core import Orchestrator
from tpagent.orchestrator.scheduler import SchedulerError, Wanted
from unit.test_orchestrator_policy import node, rank
from unit.test_orchestrator_review import orchestrator
from unit.test_slurm_adapter import NOONE, adapter, job
from unit.test_slurm_adapter import node as snode


def _reported(o: Orchestrator, *names: str) -> None:
    """``names`` report again, twice (fresh after any move's end), as they stood."""
    for n in names:
        o.nodes[n] = dataclasses.replace(o.nodes[n], reports=o.nodes[n].reports + 2, seen=time.monotonic())


def _rebuilds(o: Orchestrator) -> list[tuple[str, str, tuple[int, ...]]]:
    rebuilt: list[tuple[str, str, tuple[int, ...]]] = []
    o.lost_nodes._recover = lambda view, n, job, ranks, tell: rebuilt.append((n, job, ranks))  # type: ignore[method-assign]
    return rebuilt


def _moving_away_from_a(o: Orchestrator) -> Move:
    """Node a tainted, and the move of its rank away planned and started (no agent is called)."""
    o._execute = lambda m, *rest: None  # type: ignore[method-assign]
    o.state.taint("a", "", TaintKind.PLANNED, "maintenance", "operator")
    o.tick()
    (m,) = o.state.moves(active=True)
    return m


def test_a_node_lost_in_a_rewire_of_its_job_has_the_job_rebuilt(tmp_path: Path) -> None:
    """Its last report says the job is being moved, and says it for ever."""
    o = orchestrator(tmp_path, [node("a", (rank(0),)), node("b", (rank(1),), busy=frozenset({"j"})), node("e")])
    rebuilt = _rebuilds(o)
    try:
        o._declare("b", "has not reported for 30 s")
        assert rebuilt == [("b", "j", (1,))]
    finally:
        o.state.close()


def test_a_job_rebuilt_away_from_a_dead_node_moves_again(tmp_path: Path) -> None:
    o = orchestrator(tmp_path, [node("a", (rank(0),)), node("b", (rank(1),)), node("e"), node("f")])
    rebuilt = _rebuilds(o)
    started: list[tuple[str, str]] = []
    o._execute = lambda m, *rest: started.append((m.source, m.target))  # type: ignore[method-assign]
    try:
        o._declare("b", "has not reported for 30 s")
        assert rebuilt == [("b", "j", (1,))]
        o.nodes["e"] = dataclasses.replace(o.nodes["e"], ranks=(rank(1),))  # (rebuilt there; b never reports again)
        _reported(o, "a", "e", "f")
        o.state.taint("a", "", TaintKind.PLANNED, "maintenance", "operator")
        o.tick()
        assert started == [("a", "f")], o.state.taints()[0].waiting
    finally:
        o.state.close()


def test_a_rank_that_dies_during_a_move_of_its_job_is_rebuilt_once_the_move_ends(tmp_path: Path) -> None:
    o = orchestrator(tmp_path, [node("a", (rank(0),)), node("b", (rank(1), rank(2))), node("e"), node("f")])
    rebuilt = _rebuilds(o)
    try:
        m = _moving_away_from_a(o)
        b = dataclasses.replace(o.nodes["b"], ranks=(rank(2),), died=(rank(1),))
        o.report(b, __version__)
        assert rebuilt == []  # (the move's agents decide while it runs)
        o._ended(m, MoveState.FAILED, "rank 1 went away mid-rewire")
        o.report(b, __version__)  # (its agent says the died rank again)
        assert rebuilt == [("b", "j", (1,))]
    finally:
        o.state.close()


def test_no_move_of_a_job_starts_while_its_died_ranks_are_rebuilt(tmp_path: Path) -> None:
    o = orchestrator(tmp_path, [node("a", (rank(0),)), node("b", (rank(2),), died=(rank(1),)), node("e"), node("f")])
    started: list[str] = []
    o._execute = lambda m, *rest: started.append(m.target)  # type: ignore[method-assign]
    try:
        assert o._spare_for("j", "b", (1,)) == ("e", "e:7400")  # (as its rebuild holds it)
        o.state.taint("a", "", TaintKind.PLANNED, "maintenance", "operator")
        o.tick()
        assert started == [] and "lost ranks are being rebuilt" in o.state.taints()[0].waiting
        o._spare_done("j", "e")
        o.nodes["b"] = dataclasses.replace(o.nodes["b"], died=())  # (rebuilt: its agent says it no more)
        _reported(o, "a", "b", "e", "f")
        o.tick()
        assert len(started) == 1
    finally:
        o.state.close()


def test_a_gpu_tainted_that_its_node_no_longer_lists_is_untainted(tmp_path: Path) -> None:
    """(Replaced, or off the bus: the untaint was refused, "no GPU", and the node stayed drained.)"""
    a = node("a", (rank(0, gpus=("GPU-a-0",)),), gpus=2)
    o = orchestrator(tmp_path, [a, node("b", (rank(1),))])
    try:
        o.report(dataclasses.replace(a, findings=(Finding("GPU-a-1", "xid", "Xid 79"),)), __version__)
        o.report(
            dataclasses.replace(a, gpus=(a.gpus[0], dataclasses.replace(a.gpus[0], uuid="GPU-a-new"))), __version__
        )
        assert [t.gpu for t in o.state.taints()] == ["GPU-a-1"]
        assert [t.gpu for t in o.untaint("a", "GPU-a-1")] == ["GPU-a-1"]
        assert o.state.taints() == [] and o.wanted().drains == {}
    finally:
        o.state.close()


def test_one_placeholder_slurm_refuses_stops_no_other_jobs(monkeypatch: pytest.MonkeyPatch) -> None:
    asked: list[tuple[str, ...]] = []

    def cli(*args: str, timeout: float = 0) -> str:
        asked.append(args)
        if args[0] == "sbatch" and "c" in args:
            raise SchedulerError("Slurm's sbatch failed: Job violates accounting/QOS policy")
        return "99"

    monkeypatch.setattr(slurm, "run", cli)
    nodes = [snode(n, "train", state="allocated" if n in "ab" else "idle", cpus=2) for n in "abcd"]
    s = adapter(nodes, [job(7, ["a"], 100), job(8, ["b"], 100)])
    s.refresh = lambda: (s.read[1], s.read[2])  # type: ignore[method-assign]
    want = Wanted(
        away=frozenset({("7", "c"), ("8", "d")}), where={"7": {1: "c"}, "8": {1: "d"}}, users={"7": NOONE, "8": NOONE}
    )
    said = s.reconcile(lambda: want)
    assert any("c not held for job 7" in x and "QOS" in x for x in said), said
    assert ("scontrol", "update", "JobId=8", "AdminComment=tpagent: rank 1 on d") in asked
    assert any(a[0] == "sbatch" and "d" in a for a in asked)
    assert not [x for x in s.reconcile(lambda: want) if "c not held" in x]  # (said once)


def test_a_rebuild_answered_with_another_kind_tells_the_job(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """(An agent of another version: the thread ended, the job neither rebuilt nor told.)"""

    class Stub:
        def Rank(self, request: Any, timeout: float) -> pb.RankReply:
            reply = pb.RankReply(ok=True)
            reply.paused.SetInParent()
            return reply

    monkeypatch.setattr(lost, "stub", lambda agent, creds: Stub())
    o = orchestrator(tmp_path, [node("a", (rank(0),)), node("b", (rank(1),)), node("e")])
    told: list[tuple[Any, ...]] = []
    o.lost_nodes._tell = lambda *a: told.append(a[:3])  # type: ignore[method-assign]
    try:
        o._declare("b", "has not reported for 30 s")
        for t in threading.enumerate():
            if t.name.startswith("recover-"):
                t.join(30)
        assert told == [("j", (1,), "b")] and not o.lost_nodes.rebuilding and not o.held
    finally:
        o.state.close()


def test_no_move_starts_while_the_scheduler_does_not_answer(tmp_path: Path) -> None:
    """(Its event said "No move starts until it answers", and moves started.)"""
    o = orchestrator(tmp_path, [node("a", (rank(0),)), node("b", (rank(1),)), node("e")])
    started: list[str] = []
    o._execute = lambda m, *rest: started.append(m.target)  # type: ignore[method-assign]
    try:
        o.scheduler_down = "Slurm's scontrol did not answer"
        o.state.taint("a", "", TaintKind.PLANNED, "maintenance", "operator")
        o.tick()
        assert started == [] and [m.state for m in o.state.moves(active=True)] == [MoveState.PLANNED]
        o.scheduler_down = ""
        o.tick()
        assert started == ["e"]
    finally:
        o.state.close()


@pytest.mark.parametrize("held", [False, True], ids=["no-copy", "copy-held"])
def test_a_move_whose_source_dies_settles_at_once_where_its_target_holds_no_copy(tmp_path: Path, held: bool) -> None:
    """(It waited out move_timeout, 30 minutes, for the dead source's reports, and the job's rebuild
    with it, its other ranks standing still.)  A copy the target holds, the move waits for."""
    o = orchestrator(tmp_path, [node("a", (rank(0),)), node("b", (rank(1),)), node("e"), node("f")])
    rebuilt = _rebuilds(o)
    try:
        m = _moving_away_from_a(o)
        o.settling[m.id] = (time.monotonic(), {})  # (the call to its source broke mid-move)
        if held:
            o.nodes["e"] = dataclasses.replace(o.nodes["e"], incoming=("m-1",))
        o._declare("a", "has not reported for 30 s")
        for _ in range(3):
            _reported(o, "b", "e", "f")
            o.tick()
        if held:
            assert o.state.move(m.id).state is MoveState.RUNNING and rebuilt == []
        else:
            assert o.state.move(m.id).state is MoveState.INTERRUPTED, o.state.move(m.id)
            assert "a stopped reporting, and e holds no copy" in o.state.move(m.id).message
            assert rebuilt == [("a", "j", (0,))]
    finally:
        o.state.close()
