"""``tpagent launch``: start a workload in its own PID, mount and IPC namespaces.

Like a container runtime, each workload gets a fresh PID namespace, so the PIDs CRIU must
give back on restore can never collide with processes on the target node; the namespace
gets its own /proc (hence a mount namespace), which CUDA needs to initialise inside it, and
its own IPC namespace, without which CRIU cannot save its SysV shared memory or semaphores.
The namespace's init is :mod:`tpagent.workload.nsinit`.  The command returns once the init has
started the workload (or says why it could not) and reports the init's PID (as seen from the
node), which is what ``tpagent dump`` takes.

Each launch leaves a record in a root-only directory (:data:`RECORDS`): the init's PID, start
time and PID-namespace inode, and who launched it.  The agent treats a process as a launched
workload only if such a record matches it (:func:`launched`): a command line can be forged by
any user (``exec -a``), a record cannot.  A restore of a launched workload records its copy.
"""

from __future__ import annotations

import json
import os
import select
import shutil
import subprocess
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

import psutil

from host import paths, proc, signals
from host.api import UsageError, is_whole
from host.safefs import private_dir

#: Where launch records live (root's, mode 700).
RECORDS = paths.LAUNCHED


@dataclass(frozen=True)
class RunAs:
    """A workload run as a user (its stand-in's): who, where, with what environment.  Only the
    workload itself gets ``env``; ``unshare`` and the namespace's init, root's, run with none of it."""

    uid: int
    gid: int
    groups: tuple[int, ...]
    cwd: str
    env: dict[str, str]
    cgroups: tuple[str, ...] = ()  # the cgroup.procs files of the groups it joins (its stand-in's)


#: How long a launched init may take to say it started its command (a Python interpreter starting
#: on a node busy with its other ranks' work).
START_WITHIN = 30.0

#: The variable naming the descriptor of a :class:`RunAs` (JSON) for the init (:mod:`.nsinit`).
RUN_AS = "TPAGENT_NSINIT_AS"


@dataclass(frozen=True)
class LaunchRecord:
    pid: int
    create_time: float
    pidns: int  # the inode of its PID namespace (/proc/PID/ns/pid)
    owner: int  # the UID that launched it (SUDO_UID under sudo), -1 if unknown
    uid: int  # the UID it runs as
    #: When it started, in clock ticks since boot (-1 in a record of an earlier tpagent): what
    #: names it, ``create_time`` being the wall clock's, which a step of the clock shifts.
    start: int = -1


def _pidns(pid: int) -> int:
    return os.stat(f"/proc/{pid}/ns/pid").st_ino


def register(pid: int, owner: int = -1, records: Path = RECORDS) -> LaunchRecord:
    """Record ``pid`` (a namespace init we started, or restored) as a launched workload."""
    p = psutil.Process(pid)
    rec = LaunchRecord(pid, p.create_time(), _pidns(pid), owner, p.uids().real, proc.start_ticks(pid))
    directory = private_dir(records)
    tmp = directory / f".{pid}.{os.getpid()}.tmp"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600)
    with os.fdopen(fd, "w") as f:
        json.dump(asdict(rec), f)
    tmp.rename(directory / f"{pid}.json")
    for old in directory.glob("*.json"):  # records of workloads that have ended go
        if old.stem.isdigit() and launched(int(old.stem), records) is None:
            old.unlink(missing_ok=True)
    return rec


def launched(pid: int, records: Path = RECORDS) -> LaunchRecord | None:
    """The launch record of ``pid`` if it is that very process (same start time, same PID
    namespace), else None.  Records are read only from the root-only directory."""
    path = records / f"{pid}.json"
    try:
        st = os.stat(records)
        if st.st_uid != os.geteuid() or st.st_mode & 0o077:
            return None  # (not ours: planted, never trusted)
        rec = LaunchRecord(**json.loads(path.read_text()))
        started = proc.start_ticks(pid) == rec.start if rec.start >= 0 else proc.is_started(pid, rec.create_time)
        if rec.pid != pid or not started or _pidns(pid) != rec.pidns:
            return None
        return rec
    except (OSError, ValueError, TypeError, IndexError, psutil.Error):
        return None


def launch(cmd: list[str], stdout: Path, stderr: Path, timeout: float = START_WITHIN, umask: int = 0o022) -> int:
    """Start ``cmd`` in new PID+mount namespaces, with ``umask`` (the user's, not tpagent's
    own 077); return the namespace init's PID."""
    return start(cmd, stdout, stderr, timeout, umask)[0]


def start(
    cmd: list[str],
    stdout: Path,
    stderr: Path,
    timeout: float = START_WITHIN,
    umask: int = 0o022,
    env: dict[str, str] | None = None,
    run_as: RunAs | None = None,
) -> tuple[int, subprocess.Popen[bytes]]:
    """As :func:`launch`, with the environment ``env`` (or as ``run_as``, who must be able to
    run the command and write the output files: nothing is looked at here as root); also the
    process that holds the namespace (``unshare``: it ends with the workload's status, as long as
    it runs here)."""
    if not cmd:
        raise UsageError("give the command to launch after `--`, e.g. tpagent launch -- python train.py.")
    if os.geteuid() != 0:
        raise UsageError("launching into new namespaces needs root; run as root.")
    if run_as is None and shutil.which(cmd[0]) is None and not Path(cmd[0]).is_file():
        raise UsageError(f"{cmd[0]} was not found; give a program on PATH or a path to it.")
    unshare = shutil.which("unshare")
    if unshare is None:
        raise UsageError("the unshare program (util-linux) is missing; install util-linux.")
    for path in (stdout, stderr) if run_as is None else ():
        if not path.parent.is_dir():
            raise UsageError(f"the directory for {path} does not exist.")
    spec = -1
    if run_as is not None:
        spec, env = _as_user(run_as)
    read_end, write_end = os.pipe()
    try:
        holder = _spawn(_argv(unshare, write_end, stdout, stderr, cmd), write_end, spec, umask, env)
        # One read: nsinit writes its whole answer at once, and unshare keeps the pipe open.
        ready, _, _ = select.select([read_end], [], [], timeout)
        answer = os.read(read_end, 4096).decode(errors="replace") if ready else ""
    finally:
        os.close(read_end)
    if answer != "ok":
        signals.kill_tree(holder.pid)  # (and the init it forked, whatever it was stuck on: no root process is left)
        holder.wait()
        reason = answer or (
            f"it did not start within {timeout:.0f} s" if not ready else "its init ended without saying why"
        )
        raise UsageError(f"the workload could not be launched: {reason}.")
    children = psutil.Process(holder.pid).children()
    if not children:
        raise UsageError("the workload exited at once; see its --stdout/--stderr files.")
    sudo = os.environ.get("SUDO_UID", "")
    owner = run_as.uid if run_as is not None else int(sudo) if is_whole(sudo) else os.getuid()
    register(children[0].pid, owner=owner)
    return children[0].pid, holder


def _argv(unshare: str, report: int, stdout: Path, stderr: Path, cmd: list[str]) -> list[str]:
    """The command line of the namespace's holder, whose init reports on descriptor ``report``."""
    return [
        unshare,
        "--pid",
        "--ipc",  # (CRIU saves SysV shared memory and semaphores only with an IPC namespace of their own)
        "--fork",
        "--mount-proc",
        "--propagation",
        "private",
        "--",
        sys.executable,
        "-I",  # (nothing imported from the cwd)
        "-m",
        "tpagent.workload.nsinit",
        str(report),
        str(stdout.absolute()),
        str(stderr.absolute()),
        *cmd,
    ]


def _spawn(argv: list[str], report: int, spec: int, umask: int, env: dict[str, str] | None) -> subprocess.Popen[bytes]:
    """The holder started (``report`` and ``spec`` closed here either way); a command the
    kernel or Python refuses (an argument too long, text that is no file name) in one sentence."""
    try:
        return subprocess.Popen(
            argv,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            start_new_session=True,
            pass_fds=(report,) if spec < 0 else (report, spec),
            umask=umask,
            env=env,
        )
    except (OSError, ValueError) as e:  # (UnicodeEncodeError too)
        raise UsageError(f"the workload could not be launched: {getattr(e, 'strerror', None) or e}.") from e
    finally:
        os.close(report)
        if spec >= 0:
            os.close(spec)


def _as_user(run_as: RunAs) -> tuple[int, dict[str, str]]:
    """The descriptor of ``run_as`` for the init, and the environment root's processes get."""
    spec = os.memfd_create("tpagent-run-as", 0)
    os.write(spec, json.dumps(asdict(run_as)).encode())
    return spec, {"PATH": os.defpath, RUN_AS: str(spec), **_kept(run_as.env)}


def _kept(env: dict[str, str]) -> dict[str, str]:
    """What root's init takes of a user's environment: the rank socket it reports its end to."""
    name = env.get("TPAGENT_RANK_SOCKET", "")
    return {"TPAGENT_RANK_SOCKET": name} if name else {}
