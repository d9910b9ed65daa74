"""The init (PID 1) of a workload's PID namespace, started by ``tpagent launch``.

It drops inherited descriptors, makes itself a session leader, opens the workload's stdio *inside* the namespace (CRIU
cannot dump descriptors that point at the parent's mounts), starts the workload, forwards
SIGTERM/SIGINT/SIGHUP to it, reaps every orphan (PID 1's duty) and exits with its status.

    python -m tpagent.nsinit READY_FD STDOUT STDERR CMD [ARG ...]

It reports on READY_FD (then closes it): ``ok`` once the workload started, else the reason.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys


def main(argv: list[str]) -> int:
    ready_fd, stdout_path, stderr_path, *cmd = argv
    ready = int(ready_fd)
    # Every descriptor inherited from outside points at the parent's mounts, which CRIU
    # cannot look up from inside the namespace: keep none of them (but the report pipe).
    os.closerange(3, ready)
    os.closerange(ready + 1, os.sysconf("SC_OPEN_MAX"))
    try:
        os.setsid()
        devnull = os.open(os.devnull, os.O_RDONLY)
        os.dup2(devnull, 0)
        os.close(devnull)
        for fd, path in ((1, stdout_path), (2, stderr_path)):
            target = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_NOFOLLOW, 0o644)  # (root: never via a planted symlink)
            os.dup2(target, fd)
            os.close(target)
        child = subprocess.Popen(cmd, close_fds=True)
    except OSError as e:
        os.write(ready, f"cannot start {cmd[0]}: {e.strerror} ({e.filename or cmd[0]})".encode())
        return 127
    os.write(ready, b"ok")
    os.close(ready)

    def forward(signum: int, _frame: object) -> None:
        try:
            os.kill(child.pid, signum)
        except ProcessLookupError:
            pass

    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, forward)
    while True:
        try:
            pid, status = os.wait()
        except ChildProcessError:
            return 0
        except InterruptedError:
            continue
        if pid == child.pid:
            return os.waitstatus_to_exitcode(status) & 0xFF


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
