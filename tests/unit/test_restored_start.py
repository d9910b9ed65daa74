"""A copy restored held (stopped) is let run as its tree (snapshot.restore.start_restored): every
process CRIU brought back, but one its user had stopped before the dump."""

from __future__ import annotations

import signal
import subprocess
import sys
import types

import psutil

from host import proc
from host.proc import ProcInfo
from snapshot.restore import RestoreResult, start_restored
from support.helpers import wait_until

#: A parent of two children, each waiting (the tree a restore holds stopped).
TREE = """
import subprocess, sys, time
kids = [subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"]) for _ in range(2)]
print(" ".join(str(k.pid) for k in kids), flush=True)
time.sleep(120)
"""


def test_a_restored_process_the_manifest_does_not_list_is_let_run_too() -> None:
    """One that died as CRIU's hook sealed the snapshot is in CRIU's images, not in the manifest's
    list (its command line could no longer be read): restored stopped with the others, it stayed
    stopped for ever, and its migration said done (a reviewer's fault injection)."""
    with subprocess.Popen([sys.executable, "-c", TREE], stdout=subprocess.PIPE, text=True) as parent:
        try:
            assert parent.stdout is not None
            user_stopped, unlisted = (int(pid) for pid in parent.stdout.readline().split())
            for pid in (parent.pid, user_stopped, unlisted):
                psutil.Process(pid).send_signal(signal.SIGSTOP)
            wait_until(lambda: all(_stopped(p) for p in (parent.pid, user_stopped, unlisted)), "the tree to stop")
            listed = [
                ProcInfo(parent.pid, 1, ("python",), (parent.pid,), False),
                ProcInfo(user_stopped, parent.pid, ("python",), (user_stopped,), False, stopped=True),
            ]
            m = types.SimpleNamespace(cuda_pids=[], namespace=False, processes=listed)
            start_restored(RestoreResult(parent.pid, (parent.pid,), m, {}))  # type: ignore[arg-type]
            wait_until(lambda: not _stopped(parent.pid) and not _stopped(unlisted), "the tree to run")
            assert _stopped(user_stopped)
        finally:
            for pid in proc.tree_pids(parent.pid):
                psutil.Process(pid).kill()


def _stopped(pid: int) -> bool:
    return psutil.Process(pid).status() == psutil.STATUS_STOPPED
