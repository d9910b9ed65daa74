"""The stand-in channel's door (tpagent.jobs.local.StandInDoor) against users who hold its
connections: real sockets and processes of other UIDs.  A user's subordinate UIDs (a user
namespace of theirs) are that user; a newcomer is never turned away while the one who holds
most has a connection that idles."""

from __future__ import annotations

import contextlib
import json
import os
import socket
import subprocess
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from host import peers
from support.helpers import ROOT
from support.users import NOBODY, as_user, user_python
from tpagent.common.threads import Threads
from tpagent.jobs import local
from tpagent.jobs.rankentry import Owned
from tpagent.migration.api import PeerUnreachable
from tpagent_rank import protocol as P

HOLD = ROOT / "tests" / "attackers" / "held_connections.py"
CLIENT = ROOT / "tests" / "attackers" / "stand_in_client.py"


@pytest.fixture
def door(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    """A door of its own (no agent behind it: nothing is started here), its limits small."""
    (tmp_path / "subuid").write_text("daemon:100000:65536\n")
    monkeypatch.setattr(peers, "SUBUID", tmp_path / "subuid")
    monkeypatch.setattr(local, "CONNECTIONS", 16)
    monkeypatch.setattr(local, "PER_USER", 8)
    name = f"tpagent-test-door-{os.getpid()}"
    threads = Threads()
    d = local.StandInDoor(name, threads, _no_launch, lambda job, rank: None, _no_ask)
    d.start()
    yield name
    threads.stopping.set()
    d.close()


def _no_launch(start: local.Start, caller: local.Caller) -> int:
    raise AssertionError("nothing is started here")


def _no_ask(*args: Any) -> Any:
    raise AssertionError("nothing is asked of an agent here")


def test_one_users_subordinate_uids_cannot_fill_the_channel(door: str) -> None:
    """Four UIDs of daemon's subordinate range each hold 8 connections (32: twice the channel's
    16): as daemon's they are one user, who keeps 8 at most, cutting its own idlest; nobody,
    connecting after, is answered (before: 16 places held, nobody's connection closed at once)."""
    python, env = user_python()
    holders = [
        subprocess.Popen(
            [*as_user((100000 + i, 100000)), python, "-I", str(HOLD), door, "8"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            env={**os.environ, **env},
        )  # fmt: skip
        for i in range(4)
    ]
    try:
        for h in holders:
            assert h.stdout is not None and h.stdout.readline() == "ready\n"
        request = json.dumps({"op": "rank", "job": "x", "rank": 0, "request": {"op": "locate"}})
        said = subprocess.run(
            [*as_user(NOBODY), python, "-I", str(CLIENT), door, request],
            capture_output=True, text=True, timeout=60, env={**os.environ, **env},
        )  # fmt: skip
        assert "was not started here by you" in said.stdout, (said.stdout, said.stderr)  # (answered)
    finally:
        cut = [int(h.communicate("", timeout=60)[0].split()[-1]) for h in holders]
    assert sum(cut) >= 32 - local.PER_USER, cut  # (daemon's own, all but its newest 8)


def test_a_moved_ranks_agent_that_gives_no_answer_is_unreachable_to_the_stand_in_not_a_refusal(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A stand-in follows its moved rank through its node's agent; that agent's word that the
    rank's new agent gave no answer (busy, or restarting) reaches the stand-in as such, which
    asks again, and not as a refusal, on which it gave its rank up ("lost track of rank")."""
    monkeypatch.setattr(peers, "SUBUID", tmp_path / "subuid")
    there = "10.0.0.2:7400"

    def unreachable(*args: Any) -> Any:
        raise PeerUnreachable(f"unreachable, {there} gave no answer in time")

    owned = Owned(owner=os.getuid(), moved_to=there, here=False, claimed=True, identity=f"{os.getuid()}:k")
    name = f"tpagent-test-door-moved-{os.getpid()}"
    threads = Threads()
    d = local.StandInDoor(name, threads, _no_launch, lambda job, rank: owned, unreachable)
    d.start()
    agent = local.LocalAgent(name)
    try:
        with pytest.raises(PeerUnreachable, match="gave no answer in time"):
            agent.to(there).rank("job", 1, P.Locate(), 5)
    finally:
        if agent.conn is not None:
            agent.conn.close()
        threads.stopping.set()
        d.close()


def test_connections_busy_with_a_request_are_never_cut_so_a_users_threads_stay_bounded(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each of a user's connections asks of its moved rank's agent, which gives no answer for a
    while: a connection cut for a newcomer then would keep its thread, and a user connecting again
    and again would grow the agent's threads without end.  Newcomers are refused instead, until
    a place is free; the requests under way are answered."""
    monkeypatch.setattr(peers, "SUBUID", tmp_path / "subuid")
    monkeypatch.setattr(local, "PER_USER", 4)
    asked, free = threading.Semaphore(0), threading.Event()

    def slow(*args: Any) -> Any:  # (the agent the rank moved to, answering only once freed)
        asked.release()
        free.wait(60)
        return P.Located(state=P.Whereabouts.HERE.value, pid=7)

    owned = Owned(owner=os.getuid(), moved_to="10.0.0.2:7400", here=False, claimed=True, identity="0:k")
    name = f"tpagent-test-door-busy-{os.getpid()}"
    threads = Threads()
    d = local.StandInDoor(name, threads, _no_launch, lambda job, rank: owned, slow)
    d.start()
    request = json.dumps({"op": "rank", "job": "j", "rank": 0, "via": "10.0.0.2:7400", "request": {"op": "locate"}})
    busy: list[socket.socket] = []
    try:
        for _ in range(local.PER_USER):
            busy.append(socket.socket(socket.AF_UNIX, socket.SOCK_STREAM))
            busy[-1].connect("\0" + name)
            busy[-1].sendall(request.encode() + b"\n")
            assert asked.acquire(timeout=30)  # (each is being answered)
        for _ in range(3 * local.PER_USER):
            with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as late:
                late.settimeout(30)
                late.connect("\0" + name)
                with contextlib.suppress(OSError):  # (closed before or as it was written)
                    late.sendall(request.encode() + b"\n")
                try:
                    said = late.recv(100)
                except ConnectionResetError:  # (closed with the request unread)
                    said = b""
                assert said == b""  # (refused: closed unanswered)
        assert not asked.acquire(timeout=0.5)  # (no other request was taken on)
        assert len(d.open) == local.PER_USER
        free.set()
        for s in busy:
            s.settimeout(30)
            answer = json.loads(s.makefile("rb").readline())
            assert answer["ok"] and answer["answer"]["state"] == "here", answer
    finally:
        free.set()
        for s in busy:
            s.close()
        threads.stopping.set()
        d.close()
