"""The stand-in channel's rules (tpagent.jobs.local), on its request handling alone: what a caller
may ask, about which rank, through which agent.  Real sockets, users and ranks:
tests/agent/test_stand_in_security.py."""

from __future__ import annotations

import errno
import json
from typing import Any

import pytest

from tpagent.common.threads import Threads
from tpagent.jobs import local
from tpagent.jobs.calls import RankCalls
from tpagent.jobs.local import Caller, StandInDoor, Start
from tpagent.jobs.rankentry import Owned
from tpagent.migration.api import Refused
from tpagent_rank import protocol as P

ALICE = Caller(pid=100, uid=1000, gid=1000)
MALLORY = Caller(pid=200, uid=2000, gid=2000)


class Agents:
    """The agent around the door: ranks it knows (whose, moved where, running) and what it was asked."""

    def __init__(self) -> None:
        self.ranks: dict[tuple[str, int], Owned] = {}
        self.moves: dict[str, str] = {}  # agent -> the agent the rank moved on to from there
        self.asked: list[tuple[str, str]] = []
        self.keys: list[str] = []  # the job's identity each was asked with

    def launch(self, s: Start, c: Caller) -> int:
        self.ranks[s.job, s.rank] = Owned(c.uid, "", True, True, f"{c.uid}:k")  # (as it said hello)
        return 4242

    def ask(self, via: str, job: str, rank: int, request: P.Request[Any], timeout: float, key: str) -> Any:
        self.asked.append((via, request.OP.value))
        self.keys.append(key)
        if via in self.moves:
            return P.Located(state=P.Whereabouts.MOVED.value, node=self.moves[via])
        return P.Located(state=P.Whereabouts.HERE.value, pid=7)


def door() -> tuple[StandInDoor, Agents]:
    a = Agents()
    return StandInDoor("test", Threads(), a.launch, lambda j, r: a.ranks.get((j, r)), a.ask), a


def start(job: str = "j", **kw: Any) -> bytes:
    d = {"op": "start", "job": job, "rank": 0, "cmd": ["python", "t.py"], "env": {}, "cwd": "/home/a"}
    d.update({"umask": 18, "stdout": "/home/a/o", "stderr": "/home/a/o", **kw})
    return json.dumps(d).encode()


def rank(request: dict[str, Any], via: str = "", job: str = "j") -> bytes:
    return json.dumps({"op": "rank", "job": job, "rank": 0, "via": via, "request": request}).encode()


def test_a_start_is_checked_and_a_rank_is_its_starters_alone() -> None:
    d, a = door()
    assert d._answer(start(), ALICE) == {"ok": True, "pid": 4242}
    byte = start("b", cmd=["python", "t\udcff.py"])  # (a stand-in's argument of a byte that is no UTF-8)
    assert d._answer(byte, ALICE) == {"ok": True, "pid": 4242}
    for bad, words in (
        (start(cwd="home"), "absolute paths"),
        (start(cmd=[]), "a command"),
        (start(job="x\n"), "a command"),
        (start(env={"A": "b\0c"}), "no NUL, no lone surrogate"),
        (start(rank="zero"), "in numbers"),
        # Each of these was taken before, converted: rank 1, 1 and 3, umask 1, a list of pairs
        # as the environment, a command of single characters (the agent ran "/").
        (start(rank=1.9), "in numbers"),
        (start(rank=True), "in numbers"),
        (start(rank="3"), "in numbers"),
        (start(umask=True), "in numbers"),
        (start(env=[["A", "B"]]), "environment as an object"),
        (start(cmd="/bin/sleep"), "command as a list"),
        (start(stdout=None), "in text"),
        # Refused by the kernel or Python at the launch (before: a descriptor of root's leaked at
        # each, or a false "did not start within 30 s").
        (start(cmd=["python", "\ud800"]), "no NUL, no lone surrogate"),
        (start(stdout="/home/a/\ud800"), "no NUL, no lone surrogate"),
        (start(cmd=["python", "x" * local.ARG_MOST]), f"below {local.ARG_MOST} bytes"),
        (start(env={"A=B": "c"}), "name must not be empty nor hold '='"),
        (start(env={"": "c"}), "name must not be empty"),
        (b"[1]", "JSON object"),
        (b"{", "not valid"),
    ):
        answer = d._answer(bad, ALICE)
        assert answer["ok"] is False and words in answer["error"], (bad, answer)
    assert "another user" in d._answer(start(), MALLORY)["error"]
    assert "runs here already" in d._answer(start(), ALICE)["error"]
    assert d._answer(rank({"op": "locate"}), ALICE)["answer"]["state"] == "here"
    for request in ({"op": "locate"}, {"op": "signal", "signum": 9}, {"op": "output", "fd": 1, "offset": 0}):
        assert "not started here by you" in d._answer(rank(request), MALLORY)["error"]
    assert "may only ask" in d._answer(rank({"op": "end"}), ALICE)["error"]
    assert "may only ask" in d._answer(rank({"op": "expect", "pid": 1}), ALICE)["error"]
    assert a.asked == [("", "locate")]
    a.ranks["j", 0] = Owned(ALICE.uid, "", False, True)  # (it ended: its stand-in may yet ask how)
    assert "another user" in d._answer(start(), MALLORY)["error"]
    a.ranks["j", 0] = Owned(ALICE.uid, "", False, False)  # (long since)
    assert d._answer(start(), MALLORY)["ok"]


def test_a_stand_in_follows_its_rank_only_where_it_went() -> None:
    d, a = door()
    d._answer(start(), ALICE)
    assert "never moved to" in d._answer(rank({"op": "locate"}, via="10.0.0.9:7400"), ALICE)["error"]
    moved = Owned(ALICE.uid, "10.0.0.2:7400", False, True, "1000:k")  # (moved from here to .2, and on from .2 to .3)
    a.ranks["j", 0] = moved
    a.moves["10.0.0.2:7400"] = "10.0.0.3:7400"
    assert d._answer(rank({"op": "locate"}, via="10.0.0.2:7400"), ALICE)["ok"]
    del a.moves["10.0.0.2:7400"]
    assert d._answer(rank({"op": "locate"}, via="10.0.0.3:7400"), ALICE)["ok"]  # (learned from .2's answer)
    assert "never moved to" in d._answer(rank({"op": "locate"}, via="10.0.0.4:7400"), ALICE)["error"]
    fresh, b = door()  # (an agent restarted: it knows the first hop from its registry, and follows it)
    b.ranks["j", 0] = moved
    b.moves["10.0.0.2:7400"] = "10.0.0.3:7400"
    assert fresh._answer(rank({"op": "locate"}, via="10.0.0.3:7400"), ALICE)["ok"]
    # Each agent on the way is asked of the rank of this job only (its name may be another user's
    # rank's there by now): a rank that never said which job it is is not followed at all.
    assert a.keys[1:] == ["1000:k"] * (len(a.keys) - 1) and set(b.keys) == {"1000:k"}
    b.ranks["j", 0] = moved._replace(identity="")
    assert "never said which job it is" in fresh._answer(rank({"op": "locate"}, via="10.0.0.3:7400"), ALICE)["error"]
    assert "not started here by you" in fresh._answer(rank({"op": "locate"}, via="10.0.0.3:7400"), MALLORY)["error"]


def test_a_user_has_a_bounded_number_of_ranks_running_on_a_node(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(local, "RANKS_PER_USER", 2)
    d, a = door()
    assert d._answer(start("j1"), ALICE)["ok"] and d._answer(start("j2"), ALICE)["ok"]
    assert "2 ranks running on this node already" in d._answer(start("j3"), ALICE)["error"]
    assert d._answer(start("m1"), MALLORY)["ok"]  # (another user's own count)
    a.ranks["j1", 0] = Owned(ALICE.uid, "", False, True)  # (one of them ended)
    assert d._answer(start("j3"), ALICE)["ok"]


@pytest.mark.parametrize(
    "line",
    [
        b"[" * 200_000,  # (RecursionError in the JSON parser)
        json.dumps({"op": "rank", "job": "j", "rank": 0, "request": [1]}).encode(),  # (AttributeError)
        b'{"op": "rank", "job": "j", "rank": 0, "request": {"op": "locate"}, "timeout": 1' + b"0" * 400 + b"}",
    ],
    ids=["deep", "request-list", "timeout-overflow"],
)
def test_a_request_of_another_shape_is_answered_in_a_sentence(line: bytes) -> None:
    """(These ended their connection's thread with a traceback in the agent's log.)"""
    d, a = door()
    a.ranks["j", 0] = Owned(ALICE.uid, "", True, True)
    answer = d._answer(line, ALICE)
    assert answer["ok"] is False and answer["error"].startswith("the request is not valid"), answer


def test_a_request_the_agent_fails_on_is_answered_never_cut_off() -> None:
    """(Before: an OSError, as pread's of an output offset near 2**63, closed the connection with
    no answer, and the stand-in said its agent had closed it.)"""
    d, a = door()
    d._answer(start(), ALICE)
    for failure, said in ((OSError(22, "Invalid argument"), "could not do it: Invalid argument"),
                          (RuntimeError("a bug"), "failed on the request (RuntimeError)")):  # fmt: skip

        def failing(*_args: Any, e: Exception = failure) -> Any:
            raise e

        d.ask = failing
        answer = d._answer(rank({"op": "output", "fd": 1, "offset": 0}), ALICE)
        assert answer == {"ok": False, "error": f"the agent {said}"}, answer


def test_an_output_offset_past_any_file_is_refused() -> None:
    calls = RankCalls(None, "n", lambda _job, _rank=None: False)  # type: ignore[arg-type]
    with pytest.raises(Refused, match="an offset from 0 below"):
        calls("j", 0, P.Output(fd=1, offset=(1 << 63) - 1), 1.0)


def test_the_door_outlasts_a_lack_of_descriptors() -> None:
    """Out of descriptors (EMFILE), the door waits and takes connections again; it closed for
    good at its first failed accept before."""
    d, _ = door()
    failures = [OSError(errno.EMFILE, "Too many open files"), OSError(errno.ENFILE, "Too many open files in system")]
    waited: list[float] = []

    class Socket:
        def accept(self) -> Any:
            if failures:
                raise failures.pop(0)
            d.sock = None  # (closed: the door ends)
            raise OSError(errno.EBADF, "Bad file descriptor")

    d.sock = Socket()  # type: ignore[assignment]
    d.threads.sleep = lambda seconds: bool(waited.append(seconds))  # type: ignore[method-assign]
    d._accept()
    assert waited == [1.0, 1.0] and not failures
