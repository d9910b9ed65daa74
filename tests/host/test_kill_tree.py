"""Ending a tree (host.signals.kill_tree: a copy dropped, an original ended once its copy is
final, a start that failed) ends all of it and nothing else: no child forked while it is being
ended is left running, and a PID that another process has taken is never signalled."""

from __future__ import annotations

import os
import signal
import subprocess
import time
import uuid

import psutil
import pytest

from host import proc, signals
from support.helpers import process_with_pid

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="the test reuses a PID on purpose (ns_last_pid: root's)")


def _marked(marker: str) -> list[psutil.Process]:
    out = []
    for p in psutil.process_iter(["cmdline"]):
        if marker in (p.info["cmdline"] or []) and p.status() != psutil.STATUS_ZOMBIE:
            out.append(p)
    return out


def test_a_tree_that_forks_without_pause_is_ended_whole() -> None:
    """A shell forking children as fast as it can: each round of it is killed while it forks.
    Listed first and killed after, the children forked in between were reparented to init and
    ran on; the tree is now stopped as it is listed, then killed."""
    marker = f"{300 + uuid.uuid4().int % 10_000}.5"  # (sleep's argument: this test's children alone)
    escaped: list[psutil.Process] = []
    try:
        for _ in range(5):
            root = subprocess.Popen(["bash", "-c", f"while :; do sleep {marker} & done"])
            try:
                deadline = time.monotonic() + 10
                while len(proc.tree_pids(root.pid)) < 50 and time.monotonic() < deadline:
                    time.sleep(0.01)
                signals.kill_tree(root.pid, proc.start_ticks(root.pid))
                assert root.wait(10) == -signal.SIGKILL
            finally:
                root.kill()
                root.wait()
            escaped += _marked(marker)
        assert not escaped, f"{len(escaped)} children of the tree ran on after it was ended"
    finally:
        for p in _marked(marker):
            p.kill()


def test_a_pid_taken_by_another_process_is_neither_signalled_nor_waited_for() -> None:
    """The tree's root ended; another process took its PID.  Asked to end the tree started at
    the root's clock tick, nothing is signalled, and the call does not wait for the newcomer."""
    first = subprocess.Popen(["sleep", "300"])
    ticks = proc.start_ticks(first.pid)
    time.sleep(0.05)  # (a clock tick is 10 ms: the newcomer starts at another)
    first.kill()
    first.wait()
    second = process_with_pid(first.pid)
    try:
        began = time.monotonic()
        signals.kill_tree(first.pid, ticks, timeout=30)
        assert signals.signal_tree(first.pid, signal.SIGSTOP, ticks) == []
        assert time.monotonic() - began < 20, "it waited for a process it did not signal"
        assert second.poll() is None and psutil.Process(second.pid).status() != psutil.STATUS_STOPPED
    finally:
        second.kill()
        second.wait()


def test_a_tree_is_stopped_and_continued_whole_root_first() -> None:
    root = subprocess.Popen(["bash", "-c", "sleep 300 & sleep 300 & (sleep 300 & wait) & wait"])
    try:
        deadline = time.monotonic() + 10
        while len(proc.tree_pids(root.pid)) < 5 and time.monotonic() < deadline:
            time.sleep(0.01)
        tree = proc.tree_pids(root.pid)
        assert len(tree) == 5
        stopped = signals.signal_tree(root.pid, signal.SIGSTOP, proc.start_ticks(root.pid))
        assert stopped[0] == root.pid and sorted(stopped) == sorted(tree)
        _wait_states(tree, psutil.STATUS_STOPPED)
        assert sorted(signals.signal_tree(root.pid, signal.SIGCONT)) == sorted(tree)
        _wait_states(tree, psutil.STATUS_SLEEPING)
    finally:
        signals.kill_tree(root.pid)
        root.wait()


def _wait_states(pids: list[int], state: str) -> None:
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        if all(psutil.Process(p).status() == state for p in pids):
            return
        time.sleep(0.01)
    raise AssertionError(f"not every process of the tree became {state}")


def test_the_caller_is_never_stopped_or_killed_as_part_of_a_tree() -> None:
    """A tree named by mistake as one holding the agent itself: it would stop itself first, and
    wait on itself for ever.  It passes itself over."""
    assert signals.signal_tree(os.getpid(), signal.SIGSTOP) == []
    assert not signals.kill_tree(os.getpid(), timeout=1)
    assert psutil.Process().status() != psutil.STATUS_STOPPED
