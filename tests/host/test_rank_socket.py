"""The socket ranks reach their agent on (tpagent.jobs.ranks), as anyone on the node may reach it:
a hello that names a rank is believed only once that rank's registration is there, and the
connections that wait for one are bounded."""

from __future__ import annotations

import os
import socket
import uuid
from collections.abc import Iterator

import pytest

from host import paths
from tpagent.common.threads import Threads
from tpagent.jobs import ranks
from tpagent_rank import codec
from tpagent_rank import protocol as P

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="the word to come back is root's, in /run/tpagent")


@pytest.fixture
def agent(monkeypatch: pytest.MonkeyPatch) -> Iterator[ranks.Ranks]:
    monkeypatch.setattr(ranks, "PENDING_FOR", 1.0)  # (how long a hello waits for its registration)
    threads = Threads()
    served = ranks.Ranks(f"tpagent-test-{uuid.uuid4().hex[:12]}", "10.0.0.1:7400", threads)
    assert served.start()
    yield served
    threads.stopping.set()
    served.close()
    threads.join(5.0)


def _hello(agent: ranks.Ranks, job: str, rank: int = 1) -> socket.socket:
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.settimeout(10)
    s.connect("\0" + agent.name)
    s.sendall(codec.said(P.Hello(job, rank, 4)))
    return s


def _first_line(s: socket.socket) -> dict[str, object]:
    return codec.parse_line(s.makefile("rb").readline(P.LINE_MAX + 1))


def test_a_hello_for_a_rank_not_registered_spends_no_word_to_come_back(agent: ranks.Ranks) -> None:
    """The word a released rank waits for (a file named after its job and rank) is spent only by
    that rank, once registered: anyone else's hello naming it must not take it away (the rank
    would then never come back, and its job would end)."""
    job = f"job-{uuid.uuid4().hex[:8]}"
    go = paths.RANK_GO / P.go_name(job, 1)
    go.parent.mkdir(parents=True, exist_ok=True)
    go.touch()
    try:
        with _hello(agent, job) as s:
            said = _first_line(s)
        assert codec.is_said(said, P.LineOp.REFUSED) and "not registered" in str(said["error"]), said
        assert go.exists(), "a stranger's hello took the word the rank waits for"
    finally:
        go.unlink(missing_ok=True)


def test_the_connections_waiting_for_a_registration_are_bounded(agent: ranks.Ranks) -> None:
    waiting = [_hello(agent, f"job-{i}") for i in range(ranks.PENDING_MAX)]
    try:
        with _hello(agent, "one-too-many") as s:
            s.settimeout(0.5)  # (refused at once, not after the others' wait)
            said = _first_line(s)
        assert codec.is_said(said, P.LineOp.REFUSED) and "too many connections" in str(said["error"]), said
    finally:
        for s in waiting:
            s.close()
