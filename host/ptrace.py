"""System calls made inside another process, through ptrace (x86-64).

The process is seized whole (every thread stopped, nothing else runs in it meanwhile); its main
thread is pointed at a ``syscall`` instruction already in its own code (its vDSO, else another
executable mapping: nothing is written into it), stepped over that one instruction once per call,
and put back exactly as it stood; its threads are let go with any signal that arrived meanwhile.
A thread that was blocked in a system call restarts it as it would after any stop: the injected
state has no system call to restart (``orig_rax`` -1), the restored state has its own.

CRIU's parasite does the same with code of its own; this needs nothing but root (CAP_SYS_PTRACE)
and a tracee that nothing else traces.
"""

from __future__ import annotations

import ctypes
import errno
import os
import platform
import queue
import signal
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager, suppress
from pathlib import Path
from typing import TypeVar

from host import proc
from host.api import UsageError

_PTRACE_GETREGS = 12
_PTRACE_SETREGS = 13
_PTRACE_SINGLESTEP = 9
_PTRACE_DETACH = 17
_PTRACE_SEIZE = 0x4206
_PTRACE_INTERRUPT = 0x4207
_WALL = 0x40000000
_SYSCALL = b"\x0f\x05"
#: Steps of one call before it is given up on (a signal-delivery stop can come first).
_TRIES = 8

T = TypeVar("T")

SYS_CLOSE = 3
SYS_MUNMAP = 11


_REGS = (
    *("r15", "r14", "r13", "r12", "rbp", "rbx", "r11", "r10", "r9", "r8", "rax", "rcx", "rdx", "rsi", "rdi"),
    *("orig_rax", "rip", "cs", "eflags", "rsp", "ss", "fs_base", "gs_base", "ds", "es", "fs", "gs"),
)


class _Regs(ctypes.Structure):
    """``struct user_regs_struct`` of x86-64."""

    _fields_ = [(name, ctypes.c_ulonglong) for name in _REGS]


_libc = ctypes.CDLL(None, use_errno=True)
_libc.ptrace.argtypes = [ctypes.c_long, ctypes.c_long, ctypes.c_void_p, ctypes.c_void_p]
_libc.ptrace.restype = ctypes.c_long


class PtraceError(OSError):
    """A ptrace request failed (the process exited, is traced by another, or refused a call)."""


def supported() -> bool:
    return platform.machine() == "x86_64"


def _ptrace(request: int, tid: int, addr: int = 0, data: object = None) -> int:
    ctypes.set_errno(0)
    ret = int(_libc.ptrace(request, tid, ctypes.c_void_p(addr), data))
    err = ctypes.get_errno()
    if ret == -1 and err:
        raise PtraceError(err, f"ptrace({request}) of thread {tid}: {os.strerror(err)}")
    return ret


def _wait_stop(tid: int, gave_up: threading.Event | None = None) -> int:
    """The signal of ``tid``'s next stop (SIGTRAP for a ptrace event stop); PtraceError ETIMEDOUT
    once ``gave_up`` is set first."""
    pause = 0.0005
    while True:
        got, status = os.waitpid(tid, _WALL | (os.WNOHANG if gave_up is not None else 0))
        if got == 0:  # (not stopped yet)
            assert gave_up is not None
            if gave_up.wait(pause):
                raise PtraceError(errno.ETIMEDOUT, f"thread {tid} did not stop")
            pause = min(2 * pause, 0.05)
            continue
        if os.WIFSTOPPED(status):
            return os.WSTOPSIG(status)
        if os.WIFEXITED(status) or os.WIFSIGNALED(status):
            raise PtraceError(errno.ESRCH, f"thread {tid} exited while it was being worked on")


def _tids(pid: int) -> set[int]:
    return {int(t) for t in os.listdir(f"/proc/{pid}/task")}


def _syscall_site(pid: int) -> int:
    """The address of a ``syscall`` instruction in the process's own executable memory."""
    spans = []
    for line in Path(f"/proc/{pid}/maps").read_text(errors="surrogateescape").splitlines():
        fields = line.split()
        if "x" not in fields[1]:
            continue
        start, end = (int(a, 16) for a in fields[0].split("-"))
        name = fields[5] if len(fields) > 5 else ""
        spans.append((name != "[vdso]", end - start, start, end))
    with open(f"/proc/{pid}/mem", "rb", buffering=0) as mem:
        for _, _, start, end in sorted(spans):  # the vDSO first, then the smallest
            with suppress(OSError):
                mem.seek(start)
                at = mem.read(min(end - start, 8 << 20)).find(_SYSCALL)
                if at >= 0:
                    return start + at
    raise PtraceError(errno.ENOEXEC, f"PID {pid} has no syscall instruction in its executable memory")


class Tracee:
    """A seized, stopped process whose main thread makes the calls; see :func:`seized`."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.saved = _Regs()
        self.site = 0
        #: A signal that stopped the main thread meanwhile: given back when it is let go.
        self.pending = 0

    def call(self, number: int, *args: int) -> int:
        """System call ``number`` with ``args`` in the process: its result (a negative errno)."""
        regs = _Regs.from_buffer_copy(self.saved)
        regs.rax = number
        regs.orig_rax = 2**64 - 1  # (no system call of its own to restart)
        for name, value in zip(("rdi", "rsi", "rdx", "r10", "r8", "r9"), args, strict=False):
            setattr(regs, name, value % 2**64)
        regs.rip = self.site
        _ptrace(_PTRACE_SETREGS, self.pid, 0, ctypes.byref(regs))
        for _ in range(_TRIES):
            _ptrace(_PTRACE_SINGLESTEP, self.pid, 0, None)
            sig = _wait_stop(self.pid)
            if sig != signal.SIGTRAP:  # (a signal arrived first: held back, given back at the end)
                self.pending = sig
            _ptrace(_PTRACE_GETREGS, self.pid, 0, ctypes.byref(regs))
            if regs.rip == self.site + len(_SYSCALL):
                return ctypes.c_longlong(regs.rax).value
        raise PtraceError(errno.EINTR, f"PID {self.pid} did not make the call in {_TRIES} steps")


@contextmanager
def seized(pid: int, gave_up: threading.Event | None = None) -> Iterator[Tracee]:
    """Every thread of ``pid`` stopped under ptrace; all put back and let go on leaving.  Once
    ``gave_up`` is set, waiting for a thread to stop ends (PtraceError ETIMEDOUT): the stopped
    ones are let go, and one seized that never stopped is let go when the calling thread ends."""
    if not supported():
        raise UsageError(f"calls inside another process are implemented for x86-64 only, not {platform.machine()}.")
    pending: dict[int, int] = {}  # thread -> a signal that stopped it first: given back at the end
    held: list[int] = []
    gone: set[int] = set()
    tracee = Tracee(pid)
    restored = False
    try:
        todo = _tids(pid)
        while todo:  # (threads started meanwhile are seized too)
            for tid in sorted(todo):
                try:
                    _ptrace(_PTRACE_SEIZE, tid, 0, None)
                except PtraceError as e:
                    if e.errno == errno.ESRCH and tid != pid:  # (a thread that just ended)
                        gone.add(tid)
                        continue
                    raise
                held.append(tid)
                _ptrace(_PTRACE_INTERRUPT, tid, 0, None)
                sig = _wait_stop(tid, gave_up)
                if sig != signal.SIGTRAP:
                    pending[tid] = sig
            todo = _tids(pid) - set(held) - gone
        _ptrace(_PTRACE_GETREGS, pid, 0, ctypes.byref(tracee.saved))
        tracee.site = _syscall_site(pid)
        yield tracee
        _ptrace(_PTRACE_SETREGS, pid, 0, ctypes.byref(tracee.saved))
        restored = True
    finally:
        if not restored and pid in held:
            with suppress(PtraceError):
                _ptrace(_PTRACE_SETREGS, pid, 0, ctypes.byref(tracee.saved))
        pending[pid] = tracee.pending or pending.get(pid, 0)
        for tid in held:
            with suppress(PtraceError):
                _ptrace(_PTRACE_DETACH, tid, 0, ctypes.c_void_p(pending.get(tid, 0)))


SYS_MMAP = 9
SYS_PRCTL = 157
_PR_GET_PDEATHSIG = 2
_PAGE = 4096
_PROT_READ_WRITE = 0x3
_MAP_PRIVATE_ANONYMOUS = 0x22
#: Seconds a read inside another process waits for it to stop; past them it is given up on, and
#: the thread making it lets the process go once it does stop (see :func:`parent_death_signal`).
READ_WITHIN = 10.0


def bounded(pid: int, work: Callable[[threading.Event], T], within: float) -> T:
    """What ``work`` returns, run in a thread of its own (the tracer: it must also detach), waited
    for ``within`` seconds.  A process that does not stop meanwhile (a thread of it in
    uninterruptible sleep, as on a hung network filesystem, or its control group frozen) is
    given up on: PtraceError ETIMEDOUT, and the event ``work`` is given is set, so that once the
    process does stop, ``work`` lets it go without acting (given to :func:`seized`, the event
    lets go at once the threads already stopped)."""
    answer: queue.Queue[tuple[T] | BaseException] = queue.Queue()
    gave_up = threading.Event()

    def run() -> None:
        try:
            answer.put((work(gave_up),))
        except BaseException as e:  # (handed to the caller)
            answer.put(e)

    threading.Thread(target=run, name=f"ptrace-{pid}", daemon=True).start()
    try:
        got = answer.get(timeout=within)
    except queue.Empty:
        gave_up.set()
        raise PtraceError(errno.ETIMEDOUT, f"PID {pid} did not stop within {within:g} s") from None
    if isinstance(got, BaseException):
        raise got
    return got[0]


def parent_death_signal(pid: int, within: float = READ_WITHIN) -> int | None:
    """The signal ``pid``'s main thread asked for when its parent dies (PR_SET_PDEATHSIG; 0:
    none), read inside it (nothing outside shows it), into a page it is made to map for the
    answer and unmap after: none of its own memory is touched.

    None where it is not asked: a thread of it in uninterruptible sleep (a vfork's parent, a
    request to a hung network or FUSE filesystem) or a frozen control group would not stop, and
    a seccomp filter could kill it for a call it does not expect.  A process that does not stop
    within ``within`` seconds is given up on too (None; see :func:`bounded`)."""
    if not _may_seize(pid):
        return None
    try:
        return bounded(pid, lambda gave_up: _read_parent_death_signal(pid, gave_up), within)
    except PtraceError as e:
        if e.errno == errno.ETIMEDOUT:
            return None
        raise


def _read_parent_death_signal(pid: int, gave_up: threading.Event) -> int:
    with seized(pid, gave_up) as tracee:
        page = tracee.call(SYS_MMAP, 0, _PAGE, _PROT_READ_WRITE, _MAP_PRIVATE_ANONYMOUS, -1, 0)
        if -_PAGE < page < 0:
            raise PtraceError(-page, f"mmap inside PID {pid} failed: {os.strerror(-page)}")
        try:
            r = tracee.call(SYS_PRCTL, _PR_GET_PDEATHSIG, page)
            with open(f"/proc/{pid}/mem", "rb", buffering=0) as mem:
                mem.seek(page)
                raw = mem.read(4)
        finally:
            tracee.call(SYS_MUNMAP, page, _PAGE)
    if r < 0:
        raise PtraceError(-r, f"prctl(PR_GET_PDEATHSIG) inside PID {pid} failed: {os.strerror(-r)}")
    return int.from_bytes(raw, "little")


def _may_seize(pid: int) -> bool:
    """Whether ``pid`` can be seized and made to call without waiting on, or killing, it."""
    with suppress(OSError, ValueError):
        status = Path(f"/proc/{pid}/status").read_text(errors="surrogateescape")
        if any(ln.split()[1:2] != ["0"] for ln in status.splitlines() if ln.startswith("Seccomp:")):
            return False
        if any(proc.thread_state(pid, tid) == "D" for tid in _tids(pid)):
            return False
        return not _frozen(pid)
    return False


def _frozen(pid: int) -> bool:
    """Whether the process's control group is frozen (cgroup v2 ``cgroup.freeze``, v1 freezer)."""
    for version, path in proc.cgroup_files(pid, "cgroup.events", "freezer", "freezer.state"):
        if not path.exists():
            continue
        said = path.read_text()
        if ("frozen 1" in said.splitlines()) if version == 2 else said.strip() != "THAWED":
            return True
    return False
