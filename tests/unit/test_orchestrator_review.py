"""What a reviewer found the orchestrator decide wrongly, each against the real policy, state and
core (only the cluster's reports are made up): a spare given to two rebuilds, or to a rebuild and a
move; a rebuild put on a tainted GPU or past the scheduler; a rank moved onto its own node and then
"home" from it to it; a planned move kept onto a GPU tainted since, or onto a node that never
reported again after a restart; a home given away before its job reported after a restart; a job
moved twice at once, where another node's agent was moving it."""

from __future__ import annotations

import dataclasses
import time
from pathlib import Path

from tpagent.orchestrator.api import MoveKind, MoveState, NodeSeen, TaintKind, View
from tpagent.orchestrator.config import OrchestratorConfig
from tpagent.orchestrator.core import Orchestrator
from tpagent.orchestrator.policy import NewMove
from tpagent.orchestrator.scheduler import Pool, Static
from tpagent.orchestrator.state import State
from unit.test_orchestrator_policy import cfg, cpu_cluster, no_failures, node, plan, rank, taint


def orchestrator(tmp_path: Path, nodes: list[NodeSeen], c: OrchestratorConfig | None = None) -> Orchestrator:
    """An orchestrator whose nodes reported as ``nodes`` say, just now (no agent is called)."""
    c = c or cfg(lost_grace=60.0)
    o = Orchestrator(c, State(tmp_path / "state.db"), None, Static(c))  # type: ignore[arg-type]
    for n in nodes:
        o.nodes[n.name] = dataclasses.replace(n, seen=time.monotonic())
    return o


def test_a_rebuilds_spare_is_held_from_other_rebuilds_and_moves_until_it_ends(tmp_path: Path) -> None:
    nodes = [node("a", (rank(0, "j1"),)), node("b", (rank(1, "j1"),)), node("c", (rank(0, "j2"),))]
    o = orchestrator(tmp_path, [*nodes, node("x", (rank(1, "j2"),)), node("d", (rank(0, "j4"),)), node("e"), node("f")])
    try:
        assert o._spare_for("j1", "b", (1,)) == ("e", "e:7400")
        assert o._spare_for("j2", "x", (1,)) == ("f", "f:7400")  # (e was given to j1's rebuild)
        assert o._spare_for("j3", "c", (0,)) is None
        o.state.taint("d", "", TaintKind.PLANNED, "maintenance", "operator")  # (j4: no rebuild of it)
        p = plan(o.view(), o.state.taints(), [], [], no_failures, o.cfg)
        assert p.moves == [] and "no spare fits: none is free" in p.waiting[1], p
        o._spare_done("j1", "e")
        assert "e" not in o.view().held and "e" in o.view().stale  # (until it reports what came of it)
        o.nodes["e"] = dataclasses.replace(o.nodes["e"], reports=o.nodes["e"].reports + 2)
        assert [m.target for m in plan(o.view(), o.state.taints(), [], [], no_failures, o.cfg).moves] == ["e"]
    finally:
        o.state.close()


def test_a_rebuilds_spare_has_gpus_like_the_lost_ranks_none_tainted_and_is_the_schedulers(tmp_path: Path) -> None:
    a = node("a", (rank(0, gpus=("GPU-a-0",)),), gpus=1)
    b = node("b", (rank(1, gpus=("GPU-b-0",)),), gpus=1)
    o = orchestrator(tmp_path, [a, b, node("e", gpus=1), node("f", gpus=1)])
    try:
        o.state.taint("e", "GPU-e-0", TaintKind.PREEMPTIVE, "xid 79", "health:xid")
        assert o._spare_for("j", "b", (1,)) == ("f", "f:7400")  # (e's only GPU is tainted)

        class Down(Static):
            def pool(self, job: str, users: frozenset[int]) -> Pool:
                return Pool(self.cfg.dedicated(), floating=frozenset(), why="Slurm has not answered lately")

        o.scheduler = Down(o.cfg)
        assert o._spare_for("j", "a", (0,)) is None  # (a move would get none either)
    finally:
        o.state.close()


def test_a_gpu_taint_never_moves_ranks_onto_their_own_node_nor_home_from_it_to_it(tmp_path: Path) -> None:
    a = node("a", (rank(0, gpus=("GPU-a-0",)), rank(1, gpus=("GPU-a-1",))), gpus=3)  # (GPU-a-2 idle)
    p = plan(View({"a": a, "z": node("z", gpus=1)}), [taint(1, "a", "GPU-a-1")], [], [], no_failures, cfg())
    assert p.moves == [NewMove("j", (1,), "a", "z", MoveKind.AWAY, 1, 1)]
    s = State(tmp_path / "state.db")
    try:
        m = s.plan("j", (1,), "a", "a", MoveKind.AWAY, 1, 1)  # (as an older orchestrator planned it)
        assert m is not None and s.start(m.id)
        s.end(m.id, MoveState.DONE, "resumed")
        moved = node("a", (rank(0, gpus=("GPU-a-0",)), rank(1, gpus=("GPU-a-2",))), gpus=3)
        assert plan(View({"a": moved}), [], [], s.away(), s.failed, cfg()).moves == []
    finally:
        s.close()


def test_a_planned_move_is_cancelled_once_its_targets_gpu_is_tainted() -> None:
    from tpagent.orchestrator.api import Move

    a = node("a", (rank(0, gpus=("GPU-a-0",)),), gpus=1)
    planned = [Move(4, "j", (0,), "a", "d", MoveKind.AWAY, MoveState.PLANNED, 1)]
    view = View({"a": a, "d": node("d", gpus=1)})
    assert plan(view, [taint(1, "a")], planned, [], no_failures, cfg()).cancels == []
    p = plan(view, [taint(1, "a"), taint(2, "d", "GPU-d-0")], planned, [], no_failures, cfg())
    assert p.cancels == [
        (4, "d no longer fits before it started (0 free GPU(s) like NVIDIA H100 80GB HBM3's, needs 1)")
    ]


def test_after_a_restart_a_home_is_kept_and_a_move_to_a_node_never_heard_from_again_is_cancelled(
    tmp_path: Path,
) -> None:
    s = State(tmp_path / "state.db")
    done = s.plan("j", (1,), "b", "d", MoveKind.AWAY, 1, 1)
    assert done is not None and s.start(done.id)
    s.end(done.id, MoveState.DONE, "resumed")  # (j's rank 1 is away on d, b its home)
    t = s.taint("c", "", TaintKind.PLANNED, "psu", "operator")
    assert t is not None
    s.node_seen("g", "g:7400", ())  # (g had reported)
    assert s.plan("k", (0,), "c", "g", MoveKind.AWAY, t.id, 1) is not None  # (planned; then a restart)
    s.close()
    c = cfg(lost_grace=60.0)
    o = orchestrator(tmp_path, [node("b"), node("c", (rank(0, "k"),)), node("e")], c)
    try:
        o.state.node_seen("d", "d:7400", ())  # (d runs j's rank 1, and has not reported since the restart)
        view = o.view()
        assert not view.heard
        spares = plan(view, o.state.taints(), [], o.state.away(), no_failures, c).spares
        assert [x.node for x in spares] == ["e"]  # (b is kept for j's return)
        o.started -= 10 * c.unreachable_after  # (long after the restart: g never reported again)
        o.nodes["d"] = dataclasses.replace(node("d", (rank(1),)), seen=time.monotonic())
        o.tick()
        (cancelled,) = [m for m in o.state.moves() if m.job == "k"]
        assert cancelled.state is MoveState.CANCELLED and "g stopped reporting" in cancelled.message
    finally:
        o.state.close()


def test_a_job_another_nodes_agent_is_moving_is_not_moved_at_once() -> None:
    v = cpu_cluster()
    v = View({**v.nodes, "c": dataclasses.replace(v.nodes["c"], busy=frozenset({"j"}))})
    p = plan(v, [taint(1, "a")], [], [], no_failures, cfg())
    assert p.moves == [] and "job j is being moved by someone else" in p.waiting[1]


def _started_onto(tmp_path: Path, c: OrchestratorConfig, pool: Pool, ranks: int) -> list[tuple[str, tuple[str, ...]]]:
    """Node a's ``ranks`` ranks (a GPU each) tainted, spare d's three GPUs free, ``pool`` the
    scheduler's: each move the orchestrator started, (target, the GPUs of it the move names)."""

    class Scheduler(Static):
        def pool(self, job: str, users: frozenset[int]) -> Pool:
            return pool

    a = node("a", tuple(rank(r, gpus=(f"GPU-a-{r}",)) for r in range(ranks)), gpus=2)
    o = orchestrator(tmp_path, [a, node("d", gpus=3)], c)
    o.scheduler = Scheduler(c)
    started: list[tuple[str, tuple[str, ...]]] = []
    o._execute = lambda m, source, target, gpus: started.append((m.target, gpus))  # type: ignore[method-assign]
    try:
        o.state.taint("a", "", TaintKind.PLANNED, "maintenance", "operator")
        o.tick()
        for t in list(o.running.values()):
            t.join(10)
        return started
    finally:
        o.state.close()


def test_a_move_names_the_gpus_of_its_spare_the_plan_chose_it_for(tmp_path: Path) -> None:
    """Reserved GPUs of a dedicated spare alone where the scheduler gives it as one; all its free
    GPUs where the scheduler gives the node as floating capacity (Slurm: a dedicated spare that
    is not idle).  Before, the start asked for the reserved GPUs alone whatever the plan had
    counted on: the move stayed planned, never started nor cancelled, holding its spare."""
    c = cfg(lost_grace=60.0, dedicated_spares=("d/GPU-d-1",))
    assert _started_onto(tmp_path / "static", c, Pool(c.dedicated()), 1) == [("d", ("GPU-d-1",))]
    floating = Pool({}, floating=frozenset({"d"}))
    assert _started_onto(tmp_path / "slurm", c, floating, 2) == [("d", ("GPU-d-0", "GPU-d-1", "GPU-d-2"))]
