"""Jobs of one name are two jobs to the orchestrator where their identities differ (anyone may
name a job as another's): their ranks are not counted together, a move of one does not hold up
the other's, a rank of one is not taken as the other's running elsewhere; agents and schedulers
are given the name (:func:`job_name`), the source agent the identity too (``job_identity``)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tpagent.daemon.rpc import pb
from tpagent.jobs.ranks import digest_of, identity_of
from tpagent.orchestrator import lost
from tpagent.orchestrator.api import (
    Move,
    MoveKind,
    MoveState,
    Refused,
    Taint,
    TaintKind,
    View,
    job_identity,
    job_key,
    job_name,
)
from tpagent.orchestrator.config import OrchestratorConfig
from tpagent.orchestrator.mover import outcome_of
from tpagent.orchestrator.policy import plan
from tpagent.orchestrator.scheduler import Static
from tpagent.orchestrator.service import seen_of
from tpagent_rank import lines

ROOTS = digest_of(identity_of(0, lines.Hello("train", 1, 3, key="k1")))
NOBODYS = digest_of(identity_of(65534, lines.Hello("train", 1, 3, key="k1")))


def report(node: str, *ranks: tuple[str, int, str], died: tuple[tuple[str, int, str], ...] = ()) -> pb.NodeReport:
    """A node's report: ranks (job, rank, identity) running there, and ``died`` ones."""
    return pb.NodeReport(
        node=node,
        agent=f"{node}:7400",
        ranks=[pb.RankReport(job=j, rank=r, world=3, identity=i, users=[65534] * (i == NOBODYS)) for j, r, i in ranks],
        died=[pb.RankReport(job=j, rank=r, world=3, identity=i) for j, r, i in died],
    )


def cluster(*reports: pb.NodeReport) -> View:
    return View({r.node: seen_of(r) for r in reports})


def two_of_one_name() -> View:
    """Root's job "train", ranks 0 on a and 1 on b; nobody's "train", rank 1 on c."""
    return cluster(
        report("a", ("train", 0, ROOTS)), report("b", ("train", 1, ROOTS)), report("c", ("train", 1, NOBODYS))
    )


def test_a_users_identity_differs_from_anothers_with_the_same_key() -> None:
    assert ROOTS != NOBODYS and len(ROOTS) == 16 and int(ROOTS, 16) >= 0


def test_a_key_gives_back_its_name_and_identity_whatever_the_name_holds() -> None:
    for name in ("train", "x#0123456789abcdef", "a#" + "-" * 16, "", "#"):
        key = job_key(name, ROOTS)
        assert (job_name(key), job_identity(key)) == (name, ROOTS)
        assert (job_name(job_key(name, "")), job_identity(job_key(name, ""))) == (name, "")
    assert job_key("x#0123456789abcdef", "") != job_key("x", "0123456789abcdef")
    assert (job_name("j"), job_identity("j")) == ("j", "")  # (a key of no identity: a move from before keys)


def test_two_identities_of_one_name_are_two_jobs_with_their_own_users() -> None:
    view = cluster(
        report("a", ("train", 0, ROOTS)), report("b", ("train", 1, ROOTS)), report("c", ("train", 1, NOBODYS))
    )
    assert {r.job for n in view.nodes.values() for r in n.ranks} == {job_key("train", ROOTS), job_key("train", NOBODYS)}
    assert view.users() == {job_key("train", ROOTS): frozenset(), job_key("train", NOBODYS): frozenset({65534})}


def test_a_rank_of_another_job_of_that_name_is_not_the_lost_one_running_elsewhere() -> None:
    view = cluster(
        report("a", ("train", 0, ROOTS)), report("b", ("train", 1, ROOTS)), report("c", ("train", 1, NOBODYS))
    )
    (lost_one,) = view.nodes["b"].ranks
    assert not lost._elsewhere(view, "b", lost_one)
    assert lost._others(view, "b", lost_one.job) == [0]
    assert lost._agents(view, lost_one.job) == ("a:7400", "b:7400", "")


def test_a_move_of_another_job_of_that_name_holds_up_no_move_of_this_one() -> None:
    view = cluster(report("a", ("train", 0, ROOTS)), report("b", ("train", 0, NOBODYS)), report("d"), report("e"))
    theirs = Move(1, job_key("train", NOBODYS), (0,), "b", "d", MoveKind.AWAY, MoveState.RUNNING, 2)
    taints = [Taint(1, "a", "", TaintKind.PLANNED, "maintenance", "operator", 0.0)]
    c = OrchestratorConfig(secret_file=Path("/dev/null"), dedicated_spares=("d", "e"))
    p = plan(view, taints, [theirs], [], lambda *_: [], c, lambda job: Static(c).pool(job, frozenset()))
    assert [(m.job, m.source, m.target) for m in p.moves] == [(job_key("train", ROOTS), "a", "e")]


def test_a_move_is_not_settled_by_another_job_of_that_name_on_its_target() -> None:
    m = Move(1, job_key("train", ROOTS), (1,), "b", "d", MoveKind.AWAY, MoveState.RUNNING, 1)
    view = cluster(report("b", ("train", 1, ROOTS)), report("d", ("train", 1, NOBODYS)))
    assert outcome_of(m, view, {"b", "d"}) == (MoveState.INTERRUPTED, "settled: the ranks still run on b")


def test_a_report_with_a_malformed_identity_is_refused_in_one_sentence() -> None:
    for bad in ("0123", "0123456789ABCDEF", "0123456789abcdeg", "-" * 16):
        with pytest.raises(Refused, match="16 hex digits"):
            seen_of(report("a", ("train", 0, bad)))
        with pytest.raises(Refused, match="16 hex digits"):
            seen_of(report("a", died=(("train", 0, bad),)))


def test_a_report_with_a_rank_out_of_bounds_is_refused_in_one_sentence() -> None:
    """A world of 2**31 (a buggy or a stolen agent's) made a rebuild list 2**31 ranks' agents."""
    for rank, world in ((-1, 3), (1 << 20, 0), (0, (1 << 31) - 1), (0, -5)):
        bad = pb.NodeReport(node="a", agent="a:7400", ranks=[pb.RankReport(job="train", rank=rank, world=world)])
        with pytest.raises(Refused, match="a rank in a report is 0 to 1048575, of a job of at most 1048576 ranks"):
            seen_of(bad)
        bad = pb.NodeReport(node="a", agent="a:7400", died=[pb.RankReport(job="train", rank=rank, world=world)])
        with pytest.raises(Refused, match="at most 1048576 ranks"):
            seen_of(bad)
    assert seen_of(report("a", ("train", 2, ROOTS))).ranks[0].world == 3


def test_moves_and_ranks_away_from_before_identities_are_adopted_by_the_one_job_of_their_name(
    tmp_path: Path,
) -> None:
    """An orchestrator's database written before jobs had identities names them bare: each such
    row is given the key of the one job of that name the agents report (two of that name: none,
    until one ends), so that its ranks still come home and its move still holds its place."""
    from tpagent.orchestrator.state import State

    old = State(tmp_path / "state.db")
    done = old.plan("train", (1,), "a", "d", MoveKind.AWAY, 1, 1)
    assert done is not None
    old.end(done.id, MoveState.DONE, "moved")
    assert old.plan("train", (2,), "b", "e", MoveKind.AWAY, 1, 1) is not None
    old.close()
    s = State(tmp_path / "state.db")
    try:
        assert s.legacy == {"train"}
        roots, nobodys = job_key("train", ROOTS), job_key("train", NOBODYS)
        assert s.adopt([roots, nobodys]) == [] and s.adopt([]) == []
        # a rank not yet known by its identity (before its hello, after an upgrade) names no job
        assert s.adopt([job_key("train", "")]) == [] and s.legacy == {"train"}
        assert s.adopt([roots, roots, job_key("other", NOBODYS)]) == [("train", roots)]
        assert [(a.job, a.rank, a.on) for a in s.away()] == [(roots, 1, "d")]
        assert [(m.job, m.ranks) for m in s.moves(active=True)] == [(roots, (2,))]
        assert s.plan(roots, (3,), "c", "f", MoveKind.AWAY, 1, 1) is None  # (one move of a job at a time)
        assert s.legacy == set() and s.adopt([nobodys]) == []
    finally:
        s.close()  # (its lock's descriptor, open for writing, is a write a later test's restart waits for)
