"""What the layer needs to know about a live process tree, read from /proc and psutil."""

from __future__ import annotations

import os
import time
from collections.abc import Iterable, Sequence
from contextlib import suppress
from dataclasses import dataclass
from pathlib import Path

import psutil

from host.api import UsageError

_PF_KTHREAD = 0x00200000
_CUDA_MARKERS = ("libcuda.so",)


@dataclass(frozen=True)
class ProcInfo:
    pid: int
    ppid: int
    cmdline: tuple[str, ...]
    #: PIDs of this process from the outermost to its own PID namespace (NSpid).
    ns_pids: tuple[int, ...]
    uses_cuda: bool
    #: Its other threads' IDs (CRIU gives them back too, so they must be free on restore).
    tids: tuple[int, ...] = ()
    #: Stopped by a signal (SIGSTOP, a terminal's ^Z) when it was looked at, before any freeze:
    #: a rollback and a restore leave it stopped, never continue it.
    stopped: bool = False


def _stat_fields(pid: int) -> list[str]:
    return _stat_fields_of(f"/proc/{pid}/stat")


def _stat_fields_of(path: str) -> list[str]:
    raw = Path(path).read_text(errors="surrogateescape")  # (its name is any bytes its process chose)
    # The command name sits in parentheses and may itself contain spaces or parentheses.
    return raw[raw.rindex(")") + 2 :].split()


def start_ticks(pid: int) -> int:
    """When the process started, in clock ticks since boot (/proc/PID/stat): unlike a wall-clock
    start time, never shifted by clock adjustments, so two processes compare it exactly."""
    return int(_stat_fields(pid)[19])


def started(pid: int) -> str:
    """The process's identity over time, as stored beside its PID: ``TICKS@BOOT`` (its start in
    clock ticks since boot, and this boot's id).  psutil's ``create_time`` is no such identity: it
    adds the kernel's boot time, in whole seconds and read anew each call, which a slewed or
    stepped clock moves by a second or more between two readings of the same process.
    OSError where it is gone."""
    try:
        return f"{start_ticks(pid)}@{boot_id()}"
    except (IndexError, ValueError) as e:  # (a /proc file cut short: it ended as it was read)
        raise ProcessLookupError(f"PID {pid} ended as it was read") from e


def is_started(pid: int, token: object) -> bool:
    """Whether ``pid`` is still the process ``token`` (:func:`started`) named, in this boot: not
    one that took its PID again, nor any after a reboot.  A wall-clock start time (a float, or its
    text, as older tpagent wrote) is compared with psutil's ``create_time`` within 1.5 s (its
    boot time moves by whole seconds)."""
    try:
        if isinstance(token, str) and "@" in token:
            ticks, _, boot = token.partition("@")
            return boot == boot_id() and start_ticks(pid) == int(ticks)
        if isinstance(token, (int, float, str)) and not isinstance(token, bool):
            return abs(psutil.Process(pid).create_time() - float(token)) < 1.5
    except (OSError, ValueError, IndexError, psutil.Error):
        return False
    return False


def parent_pid(pid: int) -> int:
    """Its parent's PID (/proc/PID/stat's ppid; 0: none)."""
    return int(_stat_fields(pid)[1])


def controlling_tty(pid: int) -> int:
    """The device number of the process's controlling terminal (0: none; /proc/PID/stat's tty_nr)."""
    return int(_stat_fields(pid)[4])


def is_kernel_thread(pid: int) -> bool:
    """Whether ``pid`` is a kernel thread (PF_KTHREAD in /proc/PID/stat's flags)."""
    return bool(int(_stat_fields(pid)[6]) & _PF_KTHREAD)


#: The kernel's highest PID on 64-bit (PID_MAX_LIMIT), whatever pid_max says.
PID_MAX = 1 << 22


def validate_target(pid: int) -> psutil.Process:
    """The process a user asked to dump, or one sentence on why it cannot be."""
    if pid <= 1:
        raise UsageError(f"PID {pid} is the system's init (or invalid) and cannot be checkpointed.")
    if pid > PID_MAX:
        raise UsageError(f"there is no process with PID {pid}.")
    try:
        proc = psutil.Process(pid)
        kernel = is_kernel_thread(pid)
        zombie = proc.status() == psutil.STATUS_ZOMBIE
        tgid = _status_field(pid, "Tgid")
    except (psutil.NoSuchProcess, FileNotFoundError, ProcessLookupError) as e:
        raise UsageError(f"there is no process with PID {pid}.") from e
    if kernel:
        raise UsageError(f"PID {pid} is a kernel thread, not a user process; pick a user process.")
    init = namespace_init(pid)
    if init is not None:
        raise UsageError(inside_namespace(pid, init, "checkpoint"))
    if tgid is not None and tgid != pid:
        raise UsageError(f"{pid} is a thread of process {tgid}, not a process; give the process's PID ({tgid}).")
    if pid == os.getpid() or pid in {p.pid for p in psutil.Process().parents()}:
        raise UsageError(f"PID {pid} is tpagent itself or its parent; pick the workload's PID.")
    if zombie:
        raise UsageError(f"PID {pid} has already exited (it is a zombie).")
    return proc


def namespace_init(pid: int) -> int | None:
    """The PID (here) of the init of the PID namespace that the process or thread ``pid``
    lives in, when that is not our namespace and ``pid`` is not that init; else None."""
    try:
        tgid = _status_field(pid, "Tgid") or pid
        if pid_namespace(tgid) == pid_namespace(os.getpid()):
            return None
        chain = [psutil.Process(tgid), *psutil.Process(tgid).parents()]  # innermost first
        init = next((p.pid for p in chain if ns_pids(p.pid)[-1] == 1), None)
    except (OSError, psutil.Error):
        return None
    return None if init == pid else init


def inside_namespace(pid: int, init: int, verb: str) -> str:
    """The sentence for a ``pid`` given that lives inside the PID namespace of ``init``."""
    return (
        f"PID {pid} lives inside a PID namespace (a `tpagent launch` workload's); {verb} the whole namespace "
        f"by giving the PID of its init ({init})."
    )


def uses_cuda(pid: int) -> bool:
    """True if the process has the CUDA driver mapped or a /dev/nvidia* device open."""
    try:
        maps = Path(f"/proc/{pid}/maps").read_text(errors="surrogateescape")
    except OSError:
        return False
    if any(marker in maps for marker in _CUDA_MARKERS):
        return True
    try:
        fds = os.listdir(f"/proc/{pid}/fd")
    except OSError:
        return False
    for fd in fds:
        try:
            if os.readlink(f"/proc/{pid}/fd/{fd}").startswith("/dev/nvidia"):
                return True
        except OSError:
            continue
    return False


def _status_ints(status: str, key: str) -> tuple[int, ...]:
    """The numbers of one field of a /proc status file (several for the NS* fields, outermost first)."""
    for line in Path(status).read_text(errors="surrogateescape").splitlines():  # (Name: any bytes)
        if line.startswith(key + ":"):
            return tuple(int(x) for x in line.split()[1:])
    return ()


def _status_field(pid: int, key: str) -> int | None:
    """The (innermost) value of a numeric field of /proc/PID/status, or None if it has none."""
    values = _status_ints(f"/proc/{pid}/status", key)
    return values[-1] if values else None


#: The capability CRIU needs to read (and restore) the resource limits of another user's process.
CAP_SYS_RESOURCE = 24


def has_capability(cap: int) -> bool:
    """Whether this process holds capability ``cap`` in its effective set (some VMs' root lacks some)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("CapEff:"):
            return bool(int(line.split()[1], 16) >> cap & 1)
    return False


def environ_value(pid: int, name: str) -> bytes | None:
    """``name``'s value in the environment ``pid`` started with (None: not set, or no such process)."""
    try:
        environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    except OSError:
        return None
    key = name.encode() + b"="
    return next((v[len(key) :] for v in environ if v.startswith(key)), None)


def other_users(pids: Iterable[int]) -> set[int]:
    """The UIDs (real, effective, saved) other than this process's own that ``pids`` (a
    :func:`tree_pids`) run as."""
    out: set[int] = set()
    for pid in pids:
        with suppress(psutil.Error):
            out.update(psutil.Process(pid).uids())
    return out - {os.geteuid()}


def other_groups(pids: Iterable[int]) -> set[int]:
    """The GIDs (real, effective, saved) other than this process's own that ``pids`` run as."""
    out: set[int] = set()
    for pid in pids:
        with suppress(psutil.Error):
            out.update(psutil.Process(pid).gids())
    return out - {os.getegid()}


def thread_ids(pid: int) -> tuple[int, ...]:
    """The IDs of the process's threads other than its main one."""
    try:
        return tuple(sorted(int(t) for t in os.listdir(f"/proc/{pid}/task") if int(t) != pid))
    except OSError:
        return ()


def thread_state(pid: int, tid: int) -> str | None:
    """The scheduler state letter (R, S, D, T, t...) of the process's thread ``tid``, as seen
    here or inside the process's own PID namespace; None if there is no such thread."""
    try:
        tasks = (
            [tid]
            if os.path.exists(f"/proc/{pid}/task/{tid}")
            else [int(t) for t in os.listdir(f"/proc/{pid}/task") if tid in ns_pids_of(f"/proc/{pid}/task/{t}/status")]
        )
        return _stat_fields_of(f"/proc/{pid}/task/{tasks[0]}/stat")[0] if tasks else None
    except (OSError, IndexError, ValueError):
        return None


def own_tid(pid: int, tid: int) -> int:
    """Thread ``tid`` of ``pid`` (as named here): its ID in its own PID namespace."""
    inner = ns_pids_of(f"/proc/{pid}/task/{tid}/status")
    return inner[-1] if inner else tid


def cgroup_files(pid: int, v2: str, controller: str, v1: str) -> list[tuple[int, Path]]:
    """The process's control group files: ``v2`` in its cgroup v2 group, ``v1`` in its
    ``controller`` hierarchy of cgroup v1; each with its version, as /proc/PID/cgroup lists them."""
    out = []
    for line in Path(f"/proc/{pid}/cgroup").read_text(errors="surrogateescape").splitlines():
        _, controllers, path = line.split(":", 2)
        if controllers == "":
            out.append((2, Path(f"/sys/fs/cgroup{path}/{v2}")))
        elif controller in controllers.split(","):
            out.append((1, Path(f"/sys/fs/cgroup/{controller}{path}/{v1}")))
    return out


def ns_pids(pid: int) -> tuple[int, ...]:
    return ns_pids_of(f"/proc/{pid}/status") or (pid,)


def ns_pids_of(status: str) -> tuple[int, ...]:
    """The NSpid line of a /proc status file: the ID in each PID namespace, outermost first."""
    return _status_ints(status, "NSpid")


def session_visible(pid: int) -> bool:
    """False if the process's session leader lives outside its PID namespace (its session id
    reads 0 there): CRIU cannot dump such a process, with or without ``--shell-job``."""
    return _status_field(pid, "NSsid") != 0


def pid_namespace(pid: int) -> str:
    return os.readlink(f"/proc/{pid}/ns/pid")


def tree(root: psutil.Process, cuda_pids: set[int] | None = None) -> list[ProcInfo]:
    """The root and all its descendants, root first.  ``cuda_pids``: the processes known to
    hold a CUDA context (else guessed from their mappings, see :func:`uses_cuda`)."""
    out = []
    for p in [root, *root.children(recursive=True)]:
        try:
            cuda = p.pid in cuda_pids if cuda_pids is not None else uses_cuda(p.pid)
            stopped = _stat_fields(p.pid)[0] == "T"
            out.append(ProcInfo(p.pid, p.ppid(), tuple(p.cmdline()), ns_pids(p.pid), cuda, thread_ids(p.pid), stopped))
        except (psutil.NoSuchProcess, FileNotFoundError, ProcessLookupError):
            continue
    return out


def holds_inet_sockets(pids: list[int]) -> bool:
    """True if any of the processes has a TCP/UDP socket (CRIU then needs the network lock)."""
    for pid in pids:
        try:
            if psutil.Process(pid).net_connections(kind="inet"):
                return True
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
    return False


def file_locks(pids: Sequence[int]) -> list[tuple[int, str, str]]:
    """The file locks the processes hold through their descriptors, as (PID, kind, path): kind
    ``FLOCK``, ``POSIX`` (fcntl, lockf) or ``OFDLCK``; each file once."""
    out: dict[str, tuple[int, str, str]] = {}
    for pid in pids:
        for fd, path in fd_links(pid):
            if path.startswith("/") and path not in out and (held := fd_locks(pid, fd)):
                out[path] = (pid, held[0].split()[0], path)
    return list(out.values())


def fd_locks(pid: int, fd: str) -> list[str]:
    """The locks ``pid`` holds on the file of its descriptor ``fd``, each ``KIND MODE START END``
    (``FLOCK WRITE 0 EOF``, ``POSIX READ 0 99``: END inclusive, or EOF), as its fdinfo says them;
    none if it cannot be read.  Kinds FLOCK, POSIX (fcntl, lockf) and OFDLCK only (not a lease,
    nor a waiter's)."""
    out = []
    with suppress(OSError), open(f"/proc/{pid}/fdinfo/{fd}") as f:
        for ln in f:
            # lock:\t1: FLOCK  ADVISORY  WRITE 1234 08:01:5678 0 EOF  (a waiter's: "1: -> FLOCK ...")
            fields = ln.split()
            if fields[:1] == ["lock:"] and len(fields) == 9 and fields[2] in ("FLOCK", "POSIX", "OFDLCK"):
                out.append(" ".join((fields[2], fields[4], fields[7], fields[8])))
    return out


def fd_links(pid: int) -> list[tuple[str, str]]:
    """Each descriptor of ``pid`` (in order) and what it names (``/proc/PID/fd/N``'s link: a
    path, ``socket:[INODE]``, ``anon_inode:KIND``...); those that close as they are read, or a
    process that is gone, are left out."""
    try:
        fds = sorted(os.listdir(f"/proc/{pid}/fd"), key=int)
    except OSError:
        return []
    out = []
    for fd in fds:
        with suppress(OSError):
            out.append((fd, os.readlink(f"/proc/{pid}/fd/{fd}")))
    return out


def fdinfo_int(pid: int, fd: str, key: str, base: int = 10) -> int | None:
    """A number of ``/proc/PID/fdinfo/FD`` (``flags`` in octal, ``mnt_id``, ``tty-index``...);
    None if the descriptor, or that line, is not there to read."""
    try:
        with open(f"/proc/{pid}/fdinfo/{fd}") as f:
            return next(int(ln.split()[1], base) for ln in f if ln.startswith(f"{key}:"))
    except (OSError, StopIteration, ValueError, IndexError):
        return None


def dump_size_estimate(pids: Sequence[int]) -> int:
    """About how many bytes CRIU writes for these processes: their resident anonymous and
    shared memory (file-backed pages it does not copy)."""
    total = 0
    for pid in pids:
        with suppress(OSError, ValueError):
            for line in Path(f"/proc/{pid}/status").read_text(errors="surrogateescape").splitlines():
                if line.startswith(("RssAnon:", "RssShmem:")):
                    total += int(line.split()[1]) << 10  # (in kB)
    return total


def waited_to_run(pid: int) -> float:
    """Seconds ``pid``'s main thread has spent ready to run but waiting for a CPU (the kernel's
    schedstat); 0.0 where it cannot be read."""
    try:
        return int(Path(f"/proc/{pid}/schedstat").read_text().split()[1]) / 1e9
    except (OSError, ValueError, IndexError):
        return 0.0


def is_session_leader(pid: int) -> bool:
    return os.getsid(pid) == pid


def alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def stopped(pid: int) -> bool:
    """Whether ``pid`` is stopped (SIGSTOP: its state T), not traced."""
    try:
        return psutil.Process(pid).status() == psutil.STATUS_STOPPED
    except psutil.Error:
        return False


def tree_pids(pid: int) -> list[int]:
    """``pid`` and all its descendants, root first; empty if it is gone."""
    try:
        root = psutil.Process(pid)
        return [pid, *(c.pid for c in root.children(recursive=True))]
    except psutil.NoSuchProcess:
        return []


def _group_and_session_ids() -> dict[int, str]:
    """Every process group and session id in use here -> a process that uses it (one pass over /proc)."""
    out: dict[int, str] = {}
    with os.scandir("/proc") as entries:
        for entry in entries:
            if not entry.name.isdigit():
                continue
            try:
                fields = _stat_fields(int(entry.name))
            except (OSError, ValueError):
                continue
            for held in (int(fields[2]), int(fields[3])):
                out.setdefault(
                    held, f"process {entry.name} (state {fields[0]}), which uses it as its group or session id"
                )
    return out


def pid_holder(pid: int, groups: dict[int, str] | None = None) -> str | None:
    """Who holds ``pid`` on this machine: as a process or thread, or as the session/group id of another.

    A killed process's orphaned children can linger as zombies that still carry its PID as
    their session id, which makes CRIU's restore fail with ``Can't fork for PID``.
    ``groups``: :func:`_group_and_session_ids`, when many IDs are asked about at once.
    """
    if Path(f"/proc/{pid}").exists():  # (a thread's ID is there too, unlisted)
        try:
            tgid = _status_field(pid, "Tgid")
            name = psutil.Process(pid).name()
            if tgid is not None and tgid != pid:
                return f"a thread ({name}) of process {tgid}"
            if _stat_fields(pid)[0] == "Z" and _status_field(pid, "Threads") == 1:  # (ended, not reaped: its PID kept)
                return f"process {pid} ({name}), ended but not yet reaped by its parent, PID {parent_pid(pid)}"
            return f"process {pid} ({name})"
        except (psutil.NoSuchProcess, OSError):
            pass
    return (groups if groups is not None else _group_and_session_ids()).get(pid)


def wait_pids_free(pids: list[int], timeout: float, tids: Sequence[int] = ()) -> None:
    """Wait up to ``timeout`` s for every PID and thread ID to be free; raise naming the holder otherwise."""
    deadline = time.monotonic() + timeout
    wanted = [(pid, "PID") for pid in pids] + [(tid, "thread ID") for tid in tids]
    while True:
        groups = _group_and_session_ids()
        held = [(pid, kind, who) for pid, kind in wanted if (who := pid_holder(pid, groups)) is not None]
        if not held:
            return
        if time.monotonic() >= deadline:
            pid, kind, who = held[0]
            if stopped(pid):  # (a restore cut short, SIGKILLed, leaves its copy so: the one to keep)
                raise UsageError(
                    f"{kind} {pid}, which the snapshot must get back, is held by {who}, stopped: if it is a copy "
                    f"of this snapshot whose restore was cut short, keep it (kill -CONT {pid} lets it run); "
                    "else stop that process and retry."
                )
            raise UsageError(
                f"{kind} {pid}, which the snapshot must get back, is held by {who}; "
                "stop that process (or launch workloads with `tpagent launch` so they get "
                "their own PID namespace) and retry."
            )
        time.sleep(0.1)


def boot_id() -> str:
    """This boot of the node (the kernel's boot id; "" where it cannot be read)."""
    try:
        return Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        return ""
