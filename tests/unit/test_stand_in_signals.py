"""A signal for a rank reaches it once, though the rank is being moved when its stand-in gets it:
the moving rank's agent does not take it (frozen, the rank's pending signals may already be in its
images), and the stand-in keeps it, in order, and passes it on where the rank then runs.  (Before:
a refused signal was dropped without a word, and the rank ran on.)  This test's own process is the
rank (SIGHUP, which it records, is the signal passed on)."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import types
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psutil
import pytest

from host import proc
from support.helpers import ROOT
from tpagent.jobs import standin
from tpagent.jobs.calls import RankCalls
from tpagent_rank import protocol as P


class _Agent:
    """The stand-in's view of an agent: it takes a signal, or (``refusing``) says why not."""

    def __init__(self, address: str, refusing: str = "") -> None:
        self.address = address
        self.refusing = refusing
        self.got: list[int] = []

    def rank(self, job: str, rank: int, request: P.Request[Any], timeout: float, key: str = "") -> P.Answer:
        assert isinstance(request, P.Signal)
        if self.refusing:
            return P.failed(self.refusing)
        self.got.append(int(request.signum))
        return P.Answer()


def _stand_in(agent: _Agent, tmp_path: Path) -> standin.StandIn:
    out = tmp_path / "out"
    return standin.StandIn(["true"], agent, lambda _a: agent, out, out, "socket", 0o022, relay=False)


def test_a_signal_the_ranks_node_refuses_is_kept_in_order_and_passed_on_where_it_then_runs(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    here = _Agent("this node's agent", refusing="rank 1 of job j is being moved")
    s = _stand_in(here, tmp_path)
    s._on_signal(signal.SIGTERM, None)
    s._on_signal(signal.SIGINT, None)
    for _ in range(3):  # (asked again each round, said once)
        s._forward(here, "j", 1, 0, None)
    assert here.got == [] and [sig for sig, _ in s.kept] == [signal.SIGTERM, signal.SIGINT]
    said = capsys.readouterr().err
    assert said.count("waits to be passed on") == 1 and "being moved" in said, said
    there = _Agent("10.0.0.3:7400")
    s._on_signal(signal.SIGHUP, None)
    s._forward(there, "j", 1, 0, None)  # (located there meanwhile)
    assert there.got == [signal.SIGTERM, signal.SIGINT, signal.SIGHUP] and s.kept == []


def test_a_signal_never_taken_is_given_up_in_one_sentence(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(standin, "SIGNAL_KEPT", 0.0)
    here = _Agent("this node's agent", refusing="rank 1 of job j does not run on a")
    s = _stand_in(here, tmp_path)
    s._on_signal(signal.SIGTERM, None)
    s._forward(here, "j", 1, 0, None)
    assert s.kept == [] and "signal 15 was not passed on to rank 1 of job j in 0 s" in capsys.readouterr().err


@pytest.fixture
def hangups() -> Iterator[list[int]]:
    got: list[int] = []
    before = signal.signal(signal.SIGHUP, lambda signum, _frame: got.append(signum))
    yield got
    signal.signal(signal.SIGHUP, before)


def test_the_agent_holds_no_signal_for_a_rank_it_is_moving_and_passes_it_on_after(hangups: list[int]) -> None:
    me = types.SimpleNamespace(init=os.getpid(), init_start=proc.start_ticks(os.getpid()), moved_to="")
    me.alive = lambda: True
    ranks = types.SimpleNamespace(entry=lambda job, rank: me)
    moving = {("j", 1)}
    calls = RankCalls(ranks, "a", lambda job, rank=None: (job, rank) in moving)  # type: ignore[arg-type]
    held = calls("j", 1, P.Signal(signum=int(signal.SIGHUP)), 1.0)
    assert not held.ok and "is being moved; its stand-in passes the signal on" in held.error and hangups == []
    moving.clear()
    assert calls("j", 1, P.Signal(signum=int(signal.SIGHUP)), 1.0).ok
    assert hangups == [signal.SIGHUP]


#: A stand-in whose rank (a sleep, run alone here: no agent) gets the launcher's SIGTERM while it
#: starts; prints the rank's PID, then the stand-in's exit status.
STARTING = """
import os, signal, subprocess, sys
from pathlib import Path
from host import proc
from tpagent.jobs import standin

class Nobody:
    address = "no agent"
    def rank(self, *args, **kwargs):
        raise AssertionError(args)

out = Path(sys.argv[1])
s = standin.StandIn(["true"], Nobody(), lambda _a: Nobody(), out, out, "socket", 0o022, relay=False)
rank = subprocess.Popen(["sleep", "60"])
print(rank.pid, flush=True)

def launch(job, r, renv):
    s.init_ticks = proc.start_ticks(rank.pid)
    s.alone = True
    os.kill(os.getpid(), signal.SIGTERM)  # (the launcher ends the job as its rank starts)
    return rank.pid, rank

s._launch = launch
print(s._run("j", 1, {}), flush=True)
"""


def test_a_signal_that_comes_as_the_rank_starts_is_passed_on_once_it_runs(tmp_path: Path) -> None:
    """(Its handlers were set once the rank had started: a SIGTERM then ended the stand-in, and
    the rank ran on alone, its launcher told it had ended.)"""
    with subprocess.Popen(
        [sys.executable, "-c", STARTING, str(tmp_path / "out")], cwd=ROOT, stdout=subprocess.PIPE, text=True
    ) as stand_in:
        assert stand_in.stdout is not None
        rank = int(stand_in.stdout.readline())
        try:
            said = stand_in.stdout.read()
            assert stand_in.wait(30) == 0 and said.split() == [str(128 + signal.SIGTERM)], (stand_in.returncode, said)
            assert not psutil.pid_exists(rank) or psutil.Process(rank).status() == psutil.STATUS_ZOMBIE
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.kill(rank, signal.SIGKILL)
