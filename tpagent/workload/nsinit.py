"""The init (PID 1) of a workload's PID namespace, started by ``tpagent launch``.

It drops inherited descriptors, makes itself a session leader, opens the workload's stdio *inside* the namespace (CRIU
cannot dump descriptors that point at the parent's mounts), starts the workload, forwards
SIGTERM/SIGINT/SIGHUP to it, reaps every orphan (PID 1's duty) and exits with its status.

    python -m tpagent.workload.nsinit READY_FD STDOUT STDERR CMD [ARG ...]

It reports on READY_FD (then closes it): ``ok`` once the workload started, else the reason.
With ``TPAGENT_NSINIT_AS`` naming a descriptor (a :class:`tpagent.workload.launch.RunAs` as
JSON) the workload runs as that user, its groups, in its directory, with its environment; the
output files are opened as that user too.  The init itself stays root's (CRIU's parasite and the
agent's signals reach it), and takes nothing of that environment.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import json
import os
import re
import signal
import socket
import stat
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from host import safefs
from host.api import UsageError


def _open_log(path: Path, uid: int) -> int:
    """The log, opened for appending as root: through no symlink (safefs's walk), and never an
    existing file with other links or one that someone else than its directory's owner (or
    root) could have put there (a hard link to a root file, say; a user's file in /tmp, which
    they would read root's workload's output from): ``uid`` is whom the workload runs as."""
    parent = safefs.open_dir(path.parent, to=path)
    flags = os.O_WRONLY | os.O_APPEND | os.O_NOFOLLOW | os.O_NOCTTY | os.O_NONBLOCK
    created = False
    try:
        try:  # (not blocking: a FIFO nobody reads, a file someone holds a lease on, would hold root here)
            try:
                fd = os.open(path.name, flags | os.O_CREAT | os.O_EXCL, 0o644, dir_fd=parent)
                created = True
            except FileExistsError:
                fd = os.open(path.name, flags, dir_fd=parent)
        except OSError as e:
            if e.errno not in (errno.ENXIO, errno.EWOULDBLOCK):
                raise
            raise OSError(e.errno, "not a plain file of its own (a FIFO, or a file under a lease)", str(path)) from e
        try:
            return _checked_log(fd, parent, path, uid)
        except BaseException:
            if created:  # (refused: what was made for it goes too, nothing of root's left in their directory)
                with contextlib.suppress(OSError):
                    os.unlink(path.name, dir_fd=parent)
            raise
    finally:
        os.close(parent)


def _checked_log(fd: int, parent: int, path: Path, uid: int) -> int:
    """``fd`` once :func:`_open_log`'s checks pass; else it is closed and OSError raised."""
    os.set_blocking(fd, True)
    st = os.fstat(safefs.owned_fd(parent, fd, path))
    where = os.fstat(parent)
    if st.st_uid not in (0, uid, where.st_uid) and where.st_mode & 0o022:  # (/tmp: root's, sticky)
        os.close(fd)
        raise OSError(errno.EPERM, f"a file of UID {st.st_uid}'s in a directory others may write in", str(path))
    if st.st_nlink > 1 or not stat.S_ISREG(st.st_mode) and path != Path(os.devnull):
        os.close(fd)
        raise OSError(errno.EPERM, "not a plain file of its own (other links, or not a regular file)", str(path))
    if stat.S_ISREG(st.st_mode) and st.st_mode & (stat.S_ISUID | stat.S_ISGID | 0o111):
        os.close(fd)  # (a program, or a script, root's: the workload's output would have been appended to it)
        raise OSError(errno.EPERM, "an executable file, not a log", str(path))
    return fd


MNT_DETACH = 2


def _drop_namespace_handles() -> None:
    """Unmount, in this (private) mount namespace, the namespace files the node had mounted
    when it was copied (``ip netns`` and CNI keep each network namespace as an nsfs mount under
    /run/netns): handles to other workloads' namespaces, never this one's business, and they
    come and go.  Kept, CRIU would dump each as an external mount the restore must find again
    on its node, and a restore after any of them went (or on another node) would fail."""
    libc = ctypes.CDLL(None, use_errno=True)
    handles = []
    for line in Path("/proc/self/mountinfo").read_bytes().splitlines():
        fields, _, rest = line.partition(b" - ")
        if rest.split(b" ", 1)[0] == b"nsfs":  # (the mount point's space, tab, newline, backslash: octal escapes)
            handles.append(re.sub(rb"\\([0-7]{3})", lambda m: bytes([int(m.group(1), 8)]), fields.split(b" ")[4]))
    for target in sorted(handles, key=len, reverse=True):
        libc.umount2(target, MNT_DETACH)  # (best effort: one that will not go stays)


@contextlib.contextmanager
def _as_user(run_as: dict[str, Any] | None) -> Iterator[None]:
    """Within: file access as ``run_as`` (its effective IDs and groups), back to root after."""
    if run_as is None:
        yield
        return
    os.setgroups(run_as["groups"])
    os.setegid(run_as["gid"])
    os.seteuid(run_as["uid"])
    try:
        yield
    finally:
        os.seteuid(0)
        os.setegid(0)
        os.setgroups([])


def _run_as() -> dict[str, Any] | None:
    fd = os.environ.pop("TPAGENT_NSINIT_AS", "")
    if not fd.isdigit():
        return None
    with os.fdopen(int(fd), "rb") as f:
        f.seek(0)
        spec: dict[str, Any] = json.loads(f.read())
    return spec


def _join(files: list[str]) -> None:
    """Join (this init, and so the workload) the control groups whose cgroup.procs are ``files``:
    those mounted here; one that is and cannot be joined is an error (the rank would escape it)."""
    for name in files:
        if not os.path.exists(os.path.dirname(name)):
            continue  # (that hierarchy is not mounted in this namespace: ip netns exec's fresh /sys)
        with open(name, "w") as f:
            f.write("0")


def _start(cmd: list[str], run_as: dict[str, Any] | None) -> subprocess.Popen[bytes]:
    if run_as is None:
        return subprocess.Popen(cmd, close_fds=True)
    try:
        _join(list(run_as.get("cgroups", ())))
    except OSError as e:
        raise OSError(e.errno, f"cannot join the stand-in's control group ({e.strerror})", e.filename) from e
    cwd = run_as["cwd"]
    try:
        child = subprocess.Popen(
            cmd,
            close_fds=True,
            env=run_as["env"],
            user=run_as["uid"],
            group=run_as["gid"],
            extra_groups=run_as["groups"],
            preexec_fn=lambda: os.chdir(cwd),  # (as the user, after the IDs changed: not root's chdir)
        )
    except subprocess.SubprocessError as e:
        raise OSError(errno.EACCES, f"cannot enter the directory as the user ({e})", cwd) from e
    # This init works where its workload started (the very directory the user entered: no path
    # is looked up as root), as a launch's by root's own caller does: what its rank's fresh
    # processes (a model-aware move's, a rebuild's) are started in, read from here.
    with contextlib.suppress(OSError):
        os.chdir(f"/proc/{child.pid}/cwd")
    return child


def main(argv: list[str]) -> int:
    ready_fd, stdout_path, stderr_path, *cmd = argv
    ready = int(ready_fd)
    run_as = _run_as()
    _drop_namespace_handles()
    # Every descriptor inherited from outside points at the parent's mounts, which CRIU
    # cannot look up from inside the namespace: keep none of them (but the report pipe).
    os.closerange(3, ready)
    os.closerange(ready + 1, os.sysconf("SC_OPEN_MAX"))
    try:
        os.setsid()
        devnull = os.open(os.devnull, os.O_RDONLY)
        os.dup2(devnull, 0)
        os.close(devnull)
        for fd, flag, path in ((1, "--stdout", stdout_path), (2, "--stderr", stderr_path)):
            try:
                with _as_user(run_as):
                    target = _open_log(Path(path), run_as["uid"] if run_as is not None else 0)
            except OSError as e:  # (the log's fault, not the command's: a directory given, say)
                os.write(ready, f"cannot write its {flag} {path}: {e.strerror}".encode())
                return 127
            os.dup2(target, fd)
            os.close(target)
        child = _start(cmd, run_as)
    except OSError as e:
        os.write(ready, f"cannot start {cmd[0]}: {e.strerror} ({e.filename or cmd[0]})".encode())
        return 127
    except UsageError as e:  # (a log path through a symlink, or in someone else's directory)
        os.write(ready, str(e).rstrip(".").encode())
        return 127
    except ValueError as e:  # (an environment Python refuses to pass: a variable named with "=")
        os.write(ready, f"cannot start {cmd[0]}: {e}".encode(errors="replace"))
        return 127
    os.write(ready, b"ok")
    os.close(ready)

    def forward(signum: int, _frame: object) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.kill(child.pid, signum)

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
            code = os.waitstatus_to_exitcode(status)
            _report_exit(code)
            return code & 0xFF


#: Seconds a rank's init waits for its agent to take the word of its end (then it ends all the same).
EXIT_WORD_WAIT = 30.0


def _report_exit(code: int) -> None:
    """A rank's init tells the agent of the node it ends on (it may have been migrated: its
    stand-in asks that agent): the abstract socket of its network namespace, best effort.  It
    ends only once the agent has taken the word (closed the connection; within
    :data:`EXIT_WORD_WAIT`: a busy agent, on a loaded node, took more than the 2 s it once had,
    and the death of a rank it then refused to hear of was never rebuilt nor passed on): the agent
    believes it only from an init still alive, and a stand-in that sees this namespace gone and
    asks where its rank is must hear how it ended (or that its death is held for a rebuild),
    which a busy agent that read the word late would not yet know."""
    name = os.environ.get("TPAGENT_RANK_SOCKET", "")
    if not name or len(name) > 100:
        return
    try:  # (imported only now: this init is dumped with every launched workload, which need not carry it)
        from tpagent_rank import codec, lines

        said = codec.said(lines.Exit(code))
    except Exception:  # (restored where tpagent is another: the workload's own status comes first)
        return
    with contextlib.suppress(OSError), socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.settimeout(EXIT_WORD_WAIT)
        s.connect("\0" + name)
        s.sendall(said)
        s.shutdown(socket.SHUT_WR)
        s.recv(1)  # (b"": taken; a refusal's first byte: read, and refused)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
