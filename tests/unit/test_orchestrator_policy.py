"""The orchestrator's policy (a pure function) and its database's reservations, on made-up views
of a cluster: which ranks move where, and what is never done (a spare given twice, two moves of
one job, a move off a silent node, a rank sent where it does not fit)."""

from __future__ import annotations

import contextlib
import dataclasses
import os
import sqlite3
from pathlib import Path

import pytest

from host.api import UsageError
from tpagent.orchestrator.api import (
    Away,
    Gpu,
    Move,
    MoveKind,
    MoveState,
    NodeSeen,
    RankSeen,
    Taint,
    TaintKind,
    View,
    job_key,
)
from tpagent.orchestrator.config import OrchestratorConfig
from tpagent.orchestrator.mover import outcome_of
from tpagent.orchestrator.policy import NewMove, Plan, followed, target_gpus
from tpagent.orchestrator.policy import plan as plan_with
from tpagent.orchestrator.scheduler import Pool, Static
from tpagent.orchestrator.state import State

H100 = ("NVIDIA H100 80GB HBM3", 80 << 30)


def cfg(**kw: object) -> OrchestratorConfig:
    return OrchestratorConfig(secret_file=Path("/dev/null"), **kw)  # type: ignore[arg-type]


def node(
    name: str, ranks: tuple[RankSeen, ...] = (), gpus: int = 0, model: tuple[str, int] = H100, **kw: object
) -> NodeSeen:
    g = tuple(Gpu(f"GPU-{name}-{i}", *model) for i in range(gpus))
    return NodeSeen(name, f"{name}:7400", seen=100.0, gpus=g, ranks=ranks, driver="580.1" if gpus else "", **kw)  # type: ignore[arg-type]


def rank(r: int, job: str = "j", gpus: tuple[str, ...] = ()) -> RankSeen:
    return RankSeen(job, r, world=4, gpus=gpus)


def taint(tid: int, node: str, gpu: str = "") -> Taint:
    return Taint(tid, node, gpu, TaintKind.PLANNED, "maintenance", "operator", 0.0)


def cpu_cluster() -> View:
    nodes = [node("a", (rank(0),)), node("b", (rank(1),)), node("c", (rank(2), rank(3))), node("d"), node("e")]
    return View({n.name: n for n in nodes})


def plan(
    view: View, taints: list[Taint], moves: list[Move], away: list[Away], failed: object, c: OrchestratorConfig
) -> Plan:
    """The plan with no scheduler but the configuration (the static one)."""
    return plan_with(view, taints, moves, away, failed, c, lambda job: Static(c).pool(job, frozenset()))  # type: ignore[arg-type]


def no_failures(job: str, source: str, taint: int | None) -> list[Move]:
    return []


def test_a_tainted_nodes_ranks_go_to_the_dedicated_spare_first_together() -> None:
    p = plan(cpu_cluster(), [taint(1, "c")], [], [], no_failures, cfg(dedicated_spares=("e",)))
    assert p.moves == [NewMove("j", (2, 3), "c", "e", MoveKind.AWAY, 1, 1)]
    assert p.waiting == {1: ""}


def test_two_taints_take_two_spares_and_a_third_finds_none_and_says_why() -> None:
    view = cpu_cluster()
    taints = [taint(1, "a"), taint(2, "b")]
    p = plan(view, taints, [], [], no_failures, cfg(dedicated_spares=("d",)))
    assert [m.target for m in p.moves] == ["d"]  # (one move of a job at a time)
    running = [Move(1, "j", (0,), "a", "d", MoveKind.AWAY, MoveState.RUNNING, 1)]
    p = plan(view, taints, running, [], no_failures, cfg(dedicated_spares=("d",)))
    assert p.moves == []  # the job is moving: b's rank waits for that move, not for another spare
    other = View({**view.nodes, "b": node("b", (rank(0, job="k"),))})
    p = plan(other, taints, running, [], no_failures, cfg(dedicated_spares=("d",)))
    assert p.moves == [NewMove("k", (0,), "b", "e", MoveKind.AWAY, 2, 1)]  # floating, the dedicated one held
    full = View({**other.nodes, "e": node("e", (rank(9, job="z"),))})
    p = plan(full, taints, running, [], no_failures, cfg(dedicated_spares=("d",)))
    assert p.moves == [] and "no spare fits: none is free" in p.waiting[2], p.waiting


def test_a_gpu_taint_moves_only_the_ranks_on_that_gpu_to_gpus_like_theirs() -> None:
    src = node("a", (rank(0, gpus=("GPU-a-0",)), rank(1, gpus=("GPU-a-1",))), gpus=2)
    small = node("b", gpus=2, model=("NVIDIA A100 40GB", 40 << 30))
    spare = node("c", (rank(7, job="k", gpus=("GPU-c-0",)),), gpus=2)
    view = View({n.name: n for n in (src, small, spare)})
    p = plan(view, [taint(1, "a", "GPU-a-1")], [], [], no_failures, cfg())
    assert p.moves == [NewMove("j", (1,), "a", "c", MoveKind.AWAY, 1, 1)]  # c's free GPU; b's are another model
    old_driver = View({**view.nodes, "c": dataclasses.replace(spare, driver="550.0")})
    p = plan(old_driver, [taint(1, "a", "GPU-a-1")], [], [], no_failures, cfg())
    assert p.moves == [] and "driver 550.0, not 580.1" in p.waiting[1], p.waiting


def test_a_rank_needs_only_its_own_jobs_gpus_where_two_jobs_share_rank_numbers() -> None:
    """Rank 0 of job j and rank 0 of job k on one node, each on its own GPU: moving j's needs one
    GPU, not the two that carry a rank 0."""
    src = node("a", (rank(0, gpus=("GPU-a-0",)), rank(0, job="k", gpus=("GPU-a-1",))), gpus=2)
    spare = node("b", (rank(7, job="z", gpus=("GPU-b-0",)),), gpus=2)  # (one GPU of two free)
    view = View({n.name: n for n in (src, spare)})
    p = plan(view, [taint(1, "a", "GPU-a-0")], [], [], no_failures, cfg())
    assert p.moves == [NewMove("j", (0,), "a", "b", MoveKind.AWAY, 1, 1)], p.waiting


def test_a_silent_node_is_neither_moved_from_nor_moved_to() -> None:
    nodes = {**cpu_cluster().nodes, "c": node("c", (rank(2, job="k"), rank(3, job="k")))}
    view = View(nodes, unreachable=frozenset({"b", "d"}))
    p = plan(view, [taint(1, "b"), taint(2, "c")], [], [], no_failures, cfg(dedicated_spares=("d",)))
    assert p.moves == [NewMove("k", (2, 3), "c", "e", MoveKind.AWAY, 2, 1)]
    assert "has not reported" in p.waiting[1]
    # Nor is a job with ranks on it moved (a rewire needs every rank: its lost ones are rebuilt first).
    p = plan(View(cpu_cluster().nodes, unreachable=frozenset({"b"})), [taint(2, "c")], [], [], no_failures, cfg())
    assert p.moves == [] and "job j has ranks on b, which stopped reporting" in p.waiting[2]


def test_a_failed_move_is_tried_on_another_spare_then_reported() -> None:
    failed = [Move(1, "j", (1,), "b", "d", MoveKind.AWAY, MoveState.FAILED, 1, message="restore refused")]
    p = plan(cpu_cluster(), [taint(1, "b")], [], [], lambda *a: failed, cfg(dedicated_spares=("d",), retries=1))
    assert p.moves == [NewMove("j", (1,), "b", "e", MoveKind.AWAY, 1, 2)]
    only_d = View({**cpu_cluster().nodes, "e": node("e", (rank(5, job="k"),))})
    p = plan(only_d, [taint(1, "b")], [], [], lambda *a: failed, cfg(dedicated_spares=("d",), retries=1))
    assert p.moves == [NewMove("j", (1,), "b", "d", MoveKind.AWAY, 1, 2)]  # (no other: the same one again)
    twice = [*failed, Move(2, "j", (1,), "b", "e", MoveKind.AWAY, MoveState.FAILED, 1, attempt=2, message="no room")]
    p = plan(cpu_cluster(), [taint(1, "b")], [], [], lambda *a: twice, cfg(dedicated_spares=("d",), retries=1))
    assert p.moves == [] and "failed 2 times (last: no room)" in p.waiting[1]


def test_ranks_return_home_once_untainted_unless_their_job_stays() -> None:
    view = View({**cpu_cluster().nodes, "b": node("b"), "d": node("d", (rank(1),))})
    away = [Away("j", 1, "b", "d", 1)]
    p = plan(view, [], [], away, no_failures, cfg())
    assert p.moves == [NewMove("j", (1,), "d", "b", MoveKind.HOME, 1, 1)]
    assert plan(view, [taint(1, "b")], [], away, no_failures, cfg()).moves == []  # still tainted
    assert plan(view, [], [], away, no_failures, cfg(return_home=False)).moves == []
    assert plan(view, [], [], away, no_failures, cfg(return_home_jobs={"j": False})).moves == []
    assert not any(s.node == "b" for s in plan(view, [], [], away, no_failures, cfg()).spares)  # (its home)


def test_a_planned_move_whose_taint_went_is_cancelled() -> None:
    planned = [Move(4, "j", (1,), "b", "d", MoveKind.AWAY, MoveState.PLANNED, 1)]
    p = plan(cpu_cluster(), [], planned, [], no_failures, cfg())
    assert p.cancels == [(4, "its taint was removed before it started")]


def test_the_database_never_gives_a_spare_twice_nor_moves_a_job_twice(tmp_path: Path) -> None:
    s = State(tmp_path / "db" / "state.db")
    first = s.plan("j", (1,), "b", "d", MoveKind.AWAY, 1, 1)
    assert first is not None
    assert s.plan("k", (0,), "c", "d", MoveKind.AWAY, 2, 1) is None  # d is held
    assert s.plan("j", (2,), "c", "e", MoveKind.AWAY, 2, 1) is None  # j moves already
    assert s.start(first.id) and not s.start(first.id)
    s.end(first.id, MoveState.DONE, "resumed")
    assert s.plan("k", (0,), "c", "d", MoveKind.AWAY, 2, 1) is not None  # free again
    assert [(a.job, a.rank, a.home, a.on) for a in s.away()] == [("j", 1, "b", "d")]
    t = s.taint("b", "", TaintKind.PLANNED, "maintenance", "operator")
    assert t is not None and s.taint("b", "", TaintKind.PLANNED, "again", "operator") is None
    s.close()
    again = State(tmp_path / "db" / "state.db")  # what a restarted orchestrator reads
    assert [m.state for m in again.moves()] == [MoveState.DONE, MoveState.PLANNED]
    assert [x.reason for x in again.taints()] == ["maintenance"]
    assert (tmp_path / "db" / "state.db").stat().st_mode & 0o777 == 0o600
    again.close()


@pytest.mark.parametrize("kind", ["fifo", "symlink"])
def test_a_database_path_that_is_no_regular_file_is_refused_and_left_as_it_was(tmp_path: Path, kind: str) -> None:
    """A --state naming a device, a pipe or a symlink was made 0600 (through the link): given
    /dev/null, the node's /dev/null was root's alone.  Now refused in one sentence."""
    path = tmp_path / "state.db"
    other = tmp_path / "other"
    if kind == "fifo":
        os.mkfifo(path, 0o666)
        os.chmod(path, 0o666)
    else:
        other.write_text("theirs")
        other.chmod(0o644)
        path.symlink_to(other)
    with pytest.raises(UsageError, match="orchestrator's database"):
        State(path)
    assert (path.lstat().st_mode if kind == "fifo" else other.stat().st_mode) & 0o777 == (
        0o666 if kind == "fifo" else 0o644
    )
    assert kind == "fifo" or other.read_text() == "theirs"


def test_a_rank_away_is_followed_only_where_one_node_alone_reports_it_and_nothing_moves_it() -> None:
    """A rank the orchestrator moved b -> d, since moved by hand: its record follows the reports."""
    key = job_key("j", "0123456789abcdef")
    away = [Away(key, 1, "b", "d", 1)]
    nodes = [node("a", (rank(0, key),)), node("b"), node("c", (rank(2, key),)), node("d"), node("e", (rank(1, key),))]
    view = View({n.name: n for n in nodes})
    assert followed(view, [], away) == [(away[0], "e")]
    at_home = View({**view.nodes, "b": node("b", (rank(1, key),)), "e": node("e")})
    assert followed(at_home, [], away) == [(away[0], "b")]
    assert followed(view, [], [Away(job_key("j", ""), 1, "b", "d", 1)]) == []  # (whose job? any user's)
    assert followed(dataclasses.replace(view, held=frozenset({"e"})), [], away) == []  # (a rebuild there)
    assert followed(dataclasses.replace(view, stale=frozenset({"d"})), [], away) == []
    assert followed(View({**view.nodes, "d": node("d", busy=frozenset({key}))}), [], away) == []
    twice = View({**view.nodes, "d": node("d", (rank(1, key),))})
    assert followed(twice, [], away) == []  # (restored and not yet committed: where is it?)
    moving = [Move(4, key, (1,), "e", "b", MoveKind.HOME, MoveState.RUNNING, 1)]
    assert followed(view, moving, away) == []


@pytest.mark.parametrize(
    "given, said",
    [
        ("passwd", "holds something else than an orchestrator's database"),
        ("etc", "is a directory; give the path of a file in it"),
        ("/state.db", "is not in a directory of its own; give a path such as /var/lib/"),
    ],
)
def test_a_database_path_naming_something_else_is_refused_and_left_as_it_was(
    tmp_path: Path, given: str, said: str
) -> None:
    """--state /etc/passwd made the node's passwd root's alone (then SQLite refused it); --state
    /etc said "/ cannot be a private directory".  Each is one sentence now, nothing changed."""
    passwd = tmp_path / "passwd"
    passwd.write_text("root:x:0:0::/root:/bin/sh\n")
    passwd.chmod(0o644)
    etc = tmp_path / "etc"
    etc.mkdir(mode=0o755)
    with pytest.raises(UsageError, match=said):
        State(Path(given) if given.startswith("/") else tmp_path / given)
    assert passwd.read_text() == "root:x:0:0::/root:/bin/sh\n" and passwd.stat().st_mode & 0o777 == 0o644
    assert sorted(os.listdir(tmp_path)) == ["etc", "passwd"] and os.listdir(etc) == []
    assert etc.stat().st_mode & 0o777 == 0o755 and not Path("/state.db").exists()


def test_another_programs_sqlite_database_is_refused_and_left_as_it_was(tmp_path: Path) -> None:
    """It was made 0600 and given the orchestrator's tables."""
    theirs = tmp_path / "app.db"
    with contextlib.closing(sqlite3.connect(theirs)) as db:
        db.execute("CREATE TABLE notes (text TEXT)")
        db.commit()
    theirs.chmod(0o644)
    before = theirs.read_bytes()
    with pytest.raises(UsageError, match="holds something else than an orchestrator's database"):
        State(theirs)
    assert theirs.read_bytes() == before and theirs.stat().st_mode & 0o777 == 0o644


def test_a_database_made_before_is_taken_up_again(tmp_path: Path) -> None:
    path = tmp_path / "state.db"
    with contextlib.closing(sqlite3.connect(path)) as db:  # (one stopped before it made its tables)
        db.execute("PRAGMA journal_mode=WAL")
    State(path).close()
    State(path).close()
    path.chmod(0o644)
    State(path).close()  # (its header is SQLite's: no "holds something else")
    assert path.stat().st_mode & 0o777 == 0o600


def test_a_planned_move_onto_a_spare_tainted_or_silent_since_is_cancelled() -> None:
    planned = [Move(4, "j", (1,), "b", "d", MoveKind.AWAY, MoveState.PLANNED, 1)]
    p = plan(cpu_cluster(), [taint(1, "b"), taint(2, "d")], planned, [], no_failures, cfg())
    assert p.cancels == [(4, "d was tainted before it started")]
    silent = View(cpu_cluster().nodes, unreachable=frozenset({"d"}))
    assert plan(silent, [taint(1, "b")], planned, [], no_failures, cfg()).cancels == [
        (4, "d stopped reporting before it started")
    ]


def test_an_interrupted_try_counts_but_its_spare_is_not_avoided() -> None:
    cut = [Move(1, "j", (1,), "b", "d", MoveKind.AWAY, MoveState.INTERRUPTED, 1)]
    p = plan(cpu_cluster(), [taint(1, "b")], [], [], lambda *a: cut, cfg(dedicated_spares=("d",)))
    assert p.moves == [NewMove("j", (1,), "b", "d", MoveKind.AWAY, 1, 2)]


def test_a_home_is_kept_only_for_ranks_that_will_return() -> None:
    view = View({**cpu_cluster().nodes, "b": node("b"), "d": node("d", (rank(1),))})
    away = [Away("j", 1, "b", "d", 1)]
    assert not any(s.node == "b" for s in plan(view, [taint(1, "x")], [], away, no_failures, cfg()).spares)
    stays = cfg(return_home_jobs={"j": False})
    assert any(s.node == "b" for s in plan(view, [taint(1, "x")], [], away, no_failures, stays).spares)
    ended = View({**view.nodes, "a": node("a"), "c": node("c"), "d": node("d")})  # (job j reports no rank)
    assert any(s.node == "b" for s in plan(ended, [taint(1, "x")], [], away, no_failures, cfg()).spares)


def test_a_move_is_settled_only_from_reports_made_after_it_stopped() -> None:
    m = Move(1, "j", (1,), "b", "d", MoveKind.AWAY, MoveState.RUNNING, 1)
    moved = View({**cpu_cluster().nodes, "b": node("b"), "d": node("d", (rank(1),))})
    assert outcome_of(m, moved, {"b"}) is None  # (d's report may be from before)
    assert outcome_of(m, moved, {"b", "d"}) == (MoveState.DONE, "settled: the ranks run on d")
    gone = View(moved.nodes, unreachable=frozenset({"b"}))
    assert outcome_of(m, gone, {"d"}) == (MoveState.DONE, "settled: the ranks run on d")  # (its source fell silent)
    stayed = cpu_cluster()
    assert outcome_of(m, stayed, {"b", "d"}) == (MoveState.INTERRUPTED, "settled: the ranks still run on b")
    busy = View({**stayed.nodes, "b": node("b", (rank(1),), busy=frozenset({"j"}))})
    assert outcome_of(m, busy, {"b", "d"}) is None  # (the source agent still moves it)


def test_one_orchestrator_to_a_database(tmp_path: Path) -> None:
    first = State(tmp_path / "db" / "state.db")
    with pytest.raises(UsageError, match="another orchestrator uses"):
        State(tmp_path / "db" / "state.db")
    first.close()
    State(tmp_path / "db" / "state.db").close()


def test_the_schedulers_pool_decides_which_nodes_are_spares_and_taken_ones_come_last() -> None:
    view = cpu_cluster()  # (d and e run nothing the agents know of)
    c = cfg()

    def pools(floating: frozenset[str] | None, taken: frozenset[str] = frozenset(), why: str = "") -> object:
        return lambda job: Pool(floating=floating, taken=taken, why=why)

    p = plan_with(view, [taint(1, "b")], [], [], no_failures, c, pools(frozenset({"e"})))  # type: ignore[arg-type]
    assert [(m.ranks, m.target) for m in p.moves] == [((1,), "e")]  # (d: busy as far as the scheduler knows)
    both = pools(frozenset({"e"}), frozenset({"d"}))
    p = plan_with(view, [taint(1, "b")], [], [], no_failures, c, both)  # type: ignore[arg-type]
    assert [m.target for m in p.moves] == ["e"]  # (a free spare before one freed by requeueing work)
    p = plan_with(view, [taint(1, "b")], [], [], no_failures, c, pools(frozenset(), frozenset({"d"})))  # type: ignore[arg-type]
    assert [m.target for m in p.moves] == ["d"]
    p = plan_with(view, [taint(1, "b")], [], [], no_failures, c, pools(frozenset()))  # type: ignore[arg-type]
    assert not p.moves and "none is free" in p.waiting[1]
    down = pools(frozenset(), why="Slurm has not answered lately: no spare is taken")
    p = plan_with(view, [taint(1, "b")], [], [], no_failures, c, down)  # type: ignore[arg-type]
    assert not p.moves and p.waiting[1] == "job j rank(s) 1: Slurm has not answered lately: no spare is taken"


def test_gpus_another_workload_uses_are_no_spare_nor_a_home() -> None:
    """(A node whose GPUs ran another workload, not tpagent's, was taken as an empty spare.)"""
    src = node("a", (rank(0, gpus=("GPU-a-0",)),), gpus=1)
    busy = node("b", gpus=1, foreign=frozenset({"GPU-b-0"}))
    half = node("c", gpus=2, foreign=frozenset({"GPU-c-0"}))
    view = View({n.name: n for n in (src, busy, half)})
    p = plan(view, [taint(1, "a")], [], [], no_failures, cfg())
    assert [(m.target, m.ranks) for m in p.moves] == [("c", (0,))]
    m = Move(1, "j", (0,), "a", "c", MoveKind.AWAY, MoveState.PLANNED, 1)
    assert target_gpus(view, [taint(1, "a")], {}, m) == ("GPU-c-1",)
    p = plan(View({**view.nodes, "c": busy}), [taint(1, "a")], [], [], no_failures, cfg())
    assert p.moves == [] and "no spare fits" in p.waiting[1], p.waiting
