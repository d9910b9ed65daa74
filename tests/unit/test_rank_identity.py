"""Which requests of a rank must name the job's identity, as the agent's ``Rank`` call answers
them (:class:`tpagent.jobs.calls.RankCalls`), against a node whose rank 0 of job ``j`` is
``0:k``.  (The comparison itself, and a real store's writer steering a move: the rank's
connection, tests/agent/test_rewire_faults.py.)"""

from __future__ import annotations

import dataclasses
import types
from pathlib import Path
from typing import Any

import pytest

from host import paths
from tpagent.common.threads import Threads
from tpagent.jobs.calls import KEY_MAX, RankCalls
from tpagent.jobs.rankentry import Owned, RankEntry
from tpagent.jobs.ranks import NotTheJob, Ranks
from tpagent.migration.api import Refused, Why
from tpagent_rank import protocol as P

IDENTITY = "0:k"


class _Ranks:
    """This node's one rank, as RankCalls sees it: its identity, and what it was asked with."""

    def __init__(self, identity: str = IDENTITY) -> None:
        self.id = identity
        self.asked: list[tuple[str, str | None]] = []
        self.released = 0

    def identity(self, job: str, rank: int) -> str:
        return self.id

    def call(self, job: str, rank: int, request: P.Request[Any], timeout: float, key: str | None = None) -> P.Answer:
        self.asked.append((request.OP.value, key))
        if key is not None and key != self.id:
            raise NotTheJob("another job")
        return P.Agents(agents=("a",), key="the rank's own word") if isinstance(request, P.Peers) else P.Answer()

    def release(self, job: str, rank: int) -> None:
        self.released += 1

    def of_job(self, job: str, rank: int, key: str) -> bool:
        return key == self.id

    def locate(self, job: str, rank: int) -> P.Located:
        return P.Located(state=P.Whereabouts.HERE.value, pid=7)


def _calls(ranks: _Ranks) -> RankCalls:
    return RankCalls(ranks, "node-1", lambda _job, _rank=None: False)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    "request_", [P.Pause(at=5), P.Teardown(), P.Rebuild(gen=2), P.Resume(), P.End(), P.Cancel(), P.Retire()]
)
def test_what_changes_a_rank_must_name_its_jobs_identity(request_: P.Request[Any]) -> None:
    ranks = _Ranks()
    calls = _calls(ranks)
    with pytest.raises(Refused, match="needs the job's identity") as no_key:
        calls("j", 0, request_, 1.0)
    assert no_key.value.why is Why.PRECONDITION and ranks.asked == []  # (never passed on)
    with pytest.raises(Refused, match="is not the rank asked for: its job is another") as other:
        calls("j", 0, request_, 1.0, "0:another")
    assert other.value.why is Why.CONFLICT
    assert calls("j", 0, request_, 1.0, IDENTITY).ok
    assert ranks.asked[-1] == (request_.OP.value, IDENTITY)


def test_a_read_needs_no_identity_and_peers_says_the_one_its_agent_vouches_for() -> None:
    ranks = _Ranks()
    calls = _calls(ranks)
    assert calls("j", 0, P.Where(), 1.0).ok and ranks.asked[-1] == ("where", None)
    answer = calls("j", 0, P.Peers(), 1.0)
    assert isinstance(answer, P.Agents) and answer.key == IDENTITY  # (not the rank's own word)
    with pytest.raises(Refused, match="its job is another"):
        calls("j", 0, P.Where(), 1.0, "0:another")  # (one that names it is held to it)


def test_release_is_refused_for_another_job_but_not_for_a_copy_not_yet_connected() -> None:
    ranks = _Ranks()
    with pytest.raises(Refused, match="its job is another"):
        _calls(ranks)("j", 0, P.Release(), 1.0, "0:another")
    assert ranks.released == 0
    assert _calls(ranks)("j", 0, P.Release(), 1.0, IDENTITY).ok
    restored = _Ranks(identity="")  # (restored here, it has not said hello yet)
    assert _calls(restored)("j", 0, P.Release(), 1.0, IDENTITY).ok and restored.released == 1


@pytest.mark.parametrize("request_", [P.Locate(), P.Signal(signum=9), P.Output(fd=1, offset=0)])
def test_what_a_stand_in_asks_with_its_jobs_identity_is_of_that_jobs_rank_alone(request_: P.Request[Any]) -> None:
    """A user's rank moved on, then ended; another user's rank of that name runs there now: the
    first user's stand-in, relayed with its job's identity, neither finds, signals nor reads it."""
    calls = _calls(_Ranks(identity="2000:theirs"))
    with pytest.raises(Refused, match="is not the rank asked for: its job is another") as other:
        calls("j", 0, request_, 1.0, "1000:mine")
    assert other.value.why is Why.CONFLICT
    assert _calls(_Ranks())("j", 0, P.Locate(), 1.0, IDENTITY).ok


@pytest.mark.parametrize(
    "request_", [P.Save(), P.Save(listen="10.0.0.1"), P.Load(size=10, step=3), P.Load(size=10, step=3, secret="ab")]
)
def test_a_training_state_is_never_given_in_a_rank_call(request_: P.Request[Any]) -> None:
    """A state follows a request's line only on a rank's own line: a Rank call has no room for
    it, and a save or load that does not name a hand-over from rank to rank (where, and the
    move's secret) is refused, whoever names the job's identity."""
    ranks = _Ranks()
    with pytest.raises(Refused, match="never travels inside a Rank call") as refused:
        _calls(ranks)("j", 0, request_, 1.0, IDENTITY)
    assert refused.value.why is Why.INVALID and ranks.asked == []


@pytest.mark.parametrize(
    "request_",
    [P.Save(listen="10.0.0.1", secret="ab" * 16), P.Load(size=10, step=3, source="10.0.0.1:5000", secret="ab" * 16)],
)
def test_a_hand_over_from_rank_to_rank_is_asked_as_a_rank_call_with_the_jobs_identity(
    request_: P.Request[Any],
) -> None:
    ranks = _Ranks()
    with pytest.raises(Refused, match="needs the job's identity"):
        _calls(ranks)("j", 0, request_, 1.0)
    assert ranks.asked == []
    assert _calls(ranks)("j", 0, request_, 1.0, IDENTITY).ok
    assert ranks.asked == [(request_.OP.value, IDENTITY)]


def test_a_key_is_bounded() -> None:
    with pytest.raises(Refused, match="at most") as long:
        _calls(_Ranks())("j", 0, P.Pause(at=5), 1.0, "k" * (KEY_MAX + 1))
    assert long.value.why is Why.INVALID


@pytest.mark.parametrize(
    "request_",
    [
        P.Lost(node="nowhere", why="node b stopped reporting", grace=5.0),
        P.Lost(node="10.0.0.2:7400", why="node b stopped reporting", grace=0.0),
        P.Lost(node="10.0.0.2:7400", why="node b stopped reporting", grace=3601.0),
    ],
)
def test_a_lost_node_is_named_by_its_agent_with_a_bounded_grace(request_: P.Lost) -> None:
    """(The orchestrator's word.)  Anything else is refused before a rank is told."""
    ranks = _Ranks()
    with pytest.raises(Refused, match="lost needs the lost node's agent and a grace") as bad:
        _calls(ranks)("j", 0, request_, 1.0)
    assert bad.value.why is Why.INVALID and ranks.asked == []


class _Node(_Ranks):
    """Four ranks of job ``j`` here: 0 (UID 1000) and 1 (UID 2000) connected, 2 moved away, 3
    not connected; and a thread pool that runs at once."""

    def __init__(self) -> None:
        super().__init__()
        self.threads = self

    def jobs(self) -> list[P.RankRow]:
        return [
            P.RankRow("j", 0, connected=True),
            P.RankRow("j", 1, connected=True),
            P.RankRow("j", 2, moved_to="10.0.0.9:7400"),
            P.RankRow("j", 3),
            P.RankRow("other", 0, connected=True),
        ]

    def entry(self, job: str, rank: int) -> Any:
        return types.SimpleNamespace(uid=2000 if rank == 1 else 1000)

    def digests(self) -> dict[tuple[str, int], str]:
        """Ranks 0 and 3 of one job "j", rank 1 of another of that name (another run)."""
        return {("j", 0): "a" * 16, ("j", 1): "b" * 16, ("j", 3): "a" * 16, ("other", 0): "c" * 16}

    def spawn(self, kind: str, name: str, fn: Any, *args: Any) -> None:
        fn(*args)

    def call(self, job: str, rank: int, request: P.Request[Any], timeout: float, key: str | None = None) -> P.Answer:
        self.asked.append((f"{job}/{rank}/{request.OP.value}", key))
        assert isinstance(request, P.End) and request.grace == 5.0 and timeout > request.grace
        return P.Answer()


def test_a_lost_node_ends_only_the_ranks_here_of_the_users_whose_ranks_ran_there() -> None:
    node = _Node()
    lost = P.Lost(node="10.0.0.2:7400", why="node b stopped reporting", grace=5.0, users=(1000,))
    assert RankCalls(node, "node-1", lambda _job, _rank=None: False)("j", 0, lost, 1.0).ok  # type: ignore[arg-type]
    assert node.asked == [("j/0/end", None)]


def test_a_lost_node_ends_only_the_ranks_here_of_the_job_of_that_name_it_ran() -> None:
    """The orchestrator names the job's identity: another job of that name here (of one of those
    users, too: another run) is not told; without one, every rank of those users is."""
    node = _Node()
    lost = P.Lost(node="10.0.0.2:7400", why="lost", grace=5.0, users=(1000, 2000), identity="a" * 16)
    assert RankCalls(node, "node-1", lambda _job, _rank=None: False)("j", 0, lost, 1.0).ok  # type: ignore[arg-type]
    assert node.asked == [("j/0/end", None)]
    node.asked.clear()
    anyone = dataclasses.replace(lost, identity="")
    assert RankCalls(node, "node-1", lambda _job, _rank=None: False)("j", 0, anyone, 1.0).ok  # type: ignore[arg-type]
    assert sorted(node.asked) == [("j/0/end", None), ("j/1/end", None)]


def test_a_lost_node_that_answers_here_or_a_job_being_moved_ends_nothing() -> None:
    node = _Node()
    lost = P.Lost(node="10.0.0.2:7400", why="node b stopped reporting", grace=5.0, users=(1000,))
    answers = RankCalls(node, "node-1", lambda _job, _rank=None: False, lambda _agent: True)("j", 0, lost, 1.0)  # type: ignore[arg-type]
    assert not answers.ok and "answers node-1: its node is not lost" in answers.error
    moving = RankCalls(node, "node-1", lambda _job, _rank=None: True)("j", 0, lost, 1.0)  # type: ignore[arg-type]
    assert not moving.ok and "being moved" in moving.error
    assert node.asked == []


def test_a_ranks_identity_is_kept_across_an_agent_restart_and_a_stranger_is_never_taken_for_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The agent a user's rank moved from relays its stand-in's requests with the identity the
    rank said hello with: kept in its registry, so that a restarted agent still follows it."""
    monkeypatch.setattr(paths, "RANK_GO", tmp_path / "rank-go", raising=False)
    saved = tmp_path / "ranks.json"
    ranks = Ranks("tpagent-test-identity", "10.0.0.1:7400", Threads(), saved=saved)
    moved = RankEntry("j", 0, init=1 << 22, init_start=1, world=2, moved_to="10.0.0.2:7400", owner=1000)
    moved.identity = "1000:k"
    ranks.entries["j", 0] = moved
    with ranks.lock:
        ranks._save()
    again = Ranks("tpagent-test-identity", "10.0.0.1:7400", Threads(), saved=saved)
    assert again.owner_of("j", 0) == Owned(1000, "10.0.0.2:7400", False, True, "1000:k")
    assert again.of_job("j", 0, "1000:k") and not again.of_job("j", 0, "2000:k")
    again.entries["j", 0].identity = ""  # (it never said hello, and its process is gone: nobody's)
    assert not again.of_job("j", 0, "1000:k")
