"""``tpagent launch``: start a workload in its own PID and mount namespace.

Like a container runtime, each workload gets a fresh PID namespace, so the PIDs CRIU must
give back on restore can never collide with processes on the target node; the namespace
gets its own /proc (hence a mount namespace), which CUDA needs to initialise inside it.
The namespace's init is :mod:`tpagent.nsinit`.  The command returns once the init has
started the workload (or says why it could not) and reports the init's PID (as seen from the node), which is what ``tpagent dump`` takes.
"""

from __future__ import annotations

import os
import select
import shutil
import subprocess
import sys
from pathlib import Path

import psutil

from snapshot.api import UsageError


def launch(cmd: list[str], stdout: Path, stderr: Path, timeout: float = 10.0) -> int:
    """Start ``cmd`` in new PID+mount namespaces; return the namespace init's PID."""
    if not cmd:
        raise UsageError("give the command to launch after `--`, e.g. tpagent launch -- python train.py.")
    if os.geteuid() != 0:
        raise UsageError("launching into new namespaces needs root; run as root.")
    if shutil.which(cmd[0]) is None and not Path(cmd[0]).is_file():
        raise UsageError(f"{cmd[0]} was not found; give a program on PATH or a path to it.")
    unshare = shutil.which("unshare")
    if unshare is None:
        raise UsageError("the unshare program (util-linux) is missing; install util-linux.")
    for path in (stdout, stderr):
        if not path.parent.is_dir():
            raise UsageError(f"the directory for {path} does not exist.")
    read_end, write_end = os.pipe()
    argv = [
        unshare, "--pid", "--fork", "--mount-proc", "--propagation", "private", "--",
        sys.executable, "-m", "tpagent.nsinit", str(write_end),
        str(stdout.absolute()), str(stderr.absolute()), *cmd,
    ]  # fmt: skip
    try:
        holder = subprocess.Popen(
            argv,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            start_new_session=True,
            pass_fds=(write_end,),
        )
    finally:
        os.close(write_end)
    try:
        # One read: nsinit writes its whole answer at once, and unshare keeps the pipe open.
        ready, _, _ = select.select([read_end], [], [], timeout)
        answer = os.read(read_end, 4096).decode(errors="replace") if ready else ""
    finally:
        os.close(read_end)
    if answer != "ok":
        holder.kill()
        holder.wait()
        reason = answer or f"it did not start within {timeout:.0f} s"
        raise UsageError(f"the workload could not be launched: {reason}.")
    children = psutil.Process(holder.pid).children()
    if not children:
        raise UsageError("the workload exited at once; see its --stdout/--stderr files.")
    return children[0].pid
