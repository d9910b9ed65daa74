"""A signal meant for a process that has exited never reaches the process that took its PID
since (host.signals.signal_exact, which the stand-in's forwarding and the agent's Signal use): a
signal passed on just after a move commits, to the rank's old init here, once hit whatever had
reused that PID."""

from __future__ import annotations

import os
import signal
import subprocess
import time

import pytest

from host import proc, signals
from support.helpers import process_with_pid

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="the test reuses a PID on purpose (ns_last_pid: root's)")


def test_a_signal_for_an_exited_process_spares_the_one_that_took_its_pid() -> None:
    first = subprocess.Popen(["sleep", "300"])
    ticks = proc.start_ticks(first.pid)
    time.sleep(0.05)  # (a rank's init started well before its PID is reused: a clock tick is 10 ms)
    assert signals.signal_exact(first.pid, ticks, signal.SIGTERM)  # (the very process: it gets it)
    assert first.wait(10) == -signal.SIGTERM
    second = process_with_pid(first.pid)
    try:
        assert not signals.signal_exact(first.pid, ticks, signal.SIGTERM)
        assert second.poll() is None, "the signal reached the process that took the PID"
    finally:
        second.kill()
        second.wait()
