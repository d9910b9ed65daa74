"""The stand-in channel's rules (tpagent.jobs.local), on its request handling alone: what a caller
may ask, about which rank, through which agent.  Real sockets, users and ranks:
tests/agent/test_stand_in_security.py."""

from __future__ import annotations

import json
from typing import Any

import pytest

from tpagent.common.threads import Threads
from tpagent.jobs import local
from tpagent.jobs.local import Caller, StandInDoor, Start
from tpagent.jobs.rankentry import Owned
from tpagent_rank import protocol as P

ALICE = Caller(pid=100, uid=1000, gid=1000)
MALLORY = Caller(pid=200, uid=2000, gid=2000)


class Agents:
    """The agent around the door: ranks it knows (whose, moved where, running) and what it was asked."""

    def __init__(self) -> None:
        self.ranks: dict[tuple[str, int], Owned] = {}
        self.moves: dict[str, str] = {}  # agent -> the agent the rank moved on to from there
        self.asked: list[tuple[str, str]] = []

    def launch(self, s: Start, c: Caller) -> int:
        self.ranks[s.job, s.rank] = Owned(c.uid, "", True, True)
        return 4242

    def ask(self, via: str, job: str, rank: int, request: P.Request[Any], timeout: float) -> Any:
        self.asked.append((via, request.OP.value))
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
    for bad, words in (
        (start(cwd="home"), "absolute paths"),
        (start(cmd=[]), "a command"),
        (start(job="x\n"), "a command"),
        (start(env={"A": "b\0c"}), "without NUL"),
        (start(rank="zero"), "mangles"),
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
    a.ranks["j", 0] = Owned(ALICE.uid, "10.0.0.2:7400", False, True)  # (moved from here to .2, and on from .2 to .3)
    a.moves["10.0.0.2:7400"] = "10.0.0.3:7400"
    assert d._answer(rank({"op": "locate"}, via="10.0.0.2:7400"), ALICE)["ok"]
    del a.moves["10.0.0.2:7400"]
    assert d._answer(rank({"op": "locate"}, via="10.0.0.3:7400"), ALICE)["ok"]  # (learned from .2's answer)
    assert "never moved to" in d._answer(rank({"op": "locate"}, via="10.0.0.4:7400"), ALICE)["error"]
    fresh, b = door()  # (an agent restarted: it knows the first hop from its registry, and follows it)
    b.ranks["j", 0] = Owned(ALICE.uid, "10.0.0.2:7400", False, True)
    b.moves["10.0.0.2:7400"] = "10.0.0.3:7400"
    assert fresh._answer(rank({"op": "locate"}, via="10.0.0.3:7400"), ALICE)["ok"]
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
