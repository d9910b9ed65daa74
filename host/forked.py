"""What a child forked (without exec) after its parent started CUDA keeps of the GPU driver, and
its removal before a checkpoint.

``fork`` copies the parent's ``/dev/nvidia*`` mappings and descriptors into the child (a
DataLoader worker, a ``multiprocessing`` fork pool): the drivers do not mark them do-not-copy.
The child has no CUDA context (the driver's checkpoint does not know it) and CRIU cannot dump a
device mapping it has no plugin for, so the whole tree could not be checkpointed.  What the child
can still legally do with them, by mapping:

* ``/dev/nvidia-uvm``: nothing; the UVM driver makes the child's copy of a range unusable (a
  touch is SIGBUS).
* ``/dev/nvidiaN``: nothing; they are the GPU's own memory and registers, driven through a context
  the child does not have (CUDA refuses to start again after a fork).
* ``/dev/nvidiactl``: the driver's own structures in host RAM (its channels, semaphores,
  notifiers), shared with the parent and meaningless without a context.  Pinned host memory is
  not among them with driver 580 (measured on an H100: ``cudaHostAlloc`` gives ordinary anonymous
  memory, which a fork copies and CRIU dumps like any other).
* the descriptors: nothing without a context; closing the child's copy leaves the parent's open.

So each such mapping and descriptor is removed inside the child (``munmap``, ``close``, made in
it through :mod:`host.ptrace`) just before the freeze, and the child runs on without them.  A child
that does not stop for it in time is let go untouched (:func:`remove`).

Whether a child used such a mapping since its fork cannot be seen from outside it: the
``Referenced:`` of its smaps counts the page's own flag, shared with the parent (an H100's
DataLoader workers that never touch CUDA memory show up to 74 MiB of it), so it is not asked.  A
child that did read one after the removal would fault.  Refused in one sentence before anything
is frozen: a process holding a descriptor of its own (not one its CUDA parent holds too: it
drives the GPU without a context, as NVML does), and one that shares its memory with a CUDA
process.
"""

from __future__ import annotations

import ctypes
import errno
import os
import re
import threading
from collections.abc import Iterable, Sequence
from contextlib import suppress
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from host import proc, ptrace

#: The device files of NVIDIA's drivers, by prefix.
DEVICES = ("/dev/nvidia",)
_HEADER = re.compile(r"^([0-9a-f]+)-([0-9a-f]+) \S+ \S+ \S+ \d+ *(.*)$")
_SYS_KCMP = 312  # x86-64
_KCMP_FILE = 0
_KCMP_VM = 1


@dataclass(frozen=True)
class DeviceMapping:
    start: int
    end: int
    path: str


@dataclass(frozen=True)
class Leftover:
    """A process of the tree without a CUDA context that holds the driver's mappings or descriptors."""

    pid: int
    name: str
    maps: tuple[DeviceMapping, ...]
    fds: tuple[tuple[int, str], ...]
    #: Its start, in clock ticks since boot: the process :func:`remove` acts on must be this one.
    started: int

    def describe(self) -> str:
        files = sorted({m.path for m in self.maps} | {p for _, p in self.fds})
        size = sum(m.end - m.start for m in self.maps)
        return (
            f"PID {self.pid} ({self.name}) has no CUDA context but {len(self.maps)} mapping(s) "
            f"({size / 2**20:.1f} MiB of address space) and {len(self.fds)} descriptor(s) of "
            f"{', '.join(files)} left from a fork: they are removed from it before the freeze"
        )

    def to_dict(self) -> dict[str, Any]:
        return {
            "pid": self.pid,
            "name": self.name,
            "mappings": [[f"{m.start:#x}", f"{m.end:#x}", m.path] for m in self.maps],
            "fds": [[fd, path] for fd, path in self.fds],
        }


def _is_device(path: str, devices: Sequence[str]) -> bool:
    return any(path.startswith(d) for d in devices)


def device_mappings(pid: int, devices: Sequence[str] = DEVICES) -> list[DeviceMapping]:
    """The process's mappings of ``devices``."""
    out = []
    for line in Path(f"/proc/{pid}/maps").read_text(errors="surrogateescape").splitlines():
        head = _HEADER.match(line)
        if head and _is_device(path := head.group(3).removesuffix(" (deleted)"), devices):
            out.append(DeviceMapping(int(head.group(1), 16), int(head.group(2), 16), path))
    return out


def device_fds(pid: int, devices: Sequence[str] = DEVICES) -> list[tuple[int, str]]:
    out = []
    for fd in sorted(int(f) for f in os.listdir(f"/proc/{pid}/fd")):
        with suppress(OSError):
            path = os.readlink(f"/proc/{pid}/fd/{fd}")
            if _is_device(path, devices):
                out.append((fd, path))
    return out


def find(pids: Iterable[int], cuda_pids: Iterable[int], devices: Sequence[str] = DEVICES) -> list[Leftover]:
    """The processes of ``pids`` outside ``cuda_pids`` that hold the driver's mappings or descriptors."""
    cuda = set(cuda_pids)
    out = []
    for pid in pids:
        if pid in cuda:
            continue
        with suppress(OSError):
            maps = device_mappings(pid, devices)
            fds = device_fds(pid, devices)
            if maps or fds:
                name = Path(f"/proc/{pid}/comm").read_text(errors="surrogateescape").strip()
                out.append(Leftover(pid, name, tuple(maps), tuple(fds), proc.start_ticks(pid)))
    return out


_libc = ctypes.CDLL(None, use_errno=True)


def _kcmp(pid1: int, pid2: int, kind: int, idx1: int = 0, idx2: int = 0) -> int:
    return int(_libc.syscall(_SYS_KCMP, pid1, pid2, kind, idx1, idx2))


def refusals(
    leftovers: Sequence[Leftover], cuda_pids: Sequence[int], devices: Sequence[str] = DEVICES, own_fds: bool = True
) -> list[str]:
    """One sentence for each leftover that cannot simply be removed (see the module's docstring).
    ``own_fds`` False: descriptors are not checked (once the CUDA processes were checkpointed
    they hold none to compare with)."""
    if leftovers and not ptrace.supported():
        return [
            f"{leftovers[0].describe()}; removing them is implemented for x86-64 only, so it cannot be checkpointed."
        ]
    theirs = [(c, fd) for c in cuda_pids for fd, _ in _quiet_fds(c, devices)]
    out = []
    for left in leftovers:
        shared = next((c for c in cuda_pids if _kcmp(left.pid, c, _KCMP_VM) == 0), None)
        if shared is not None:
            out.append(
                f"PID {left.pid} ({left.name}) shares its memory with CUDA process {shared} without being one of "
                "its threads, which cannot be checkpointed."
            )
            continue
        own = [
            (fd, p) for fd, p in left.fds if own_fds and not any(same_file(left.pid, fd, c, cfd) for c, cfd in theirs)
        ]
        if own:
            out.append(
                f"PID {left.pid} ({left.name}) has {own[0][1]} open (fd {own[0][0]}) by itself, not from its CUDA "
                "parent: it drives the GPU without a CUDA context (as NVML does), which cannot be checkpointed."
            )
    return out


def same_file(pid: int, fd: int | str, other: int, other_fd: int | str) -> bool:
    """Whether the two descriptors are one open file (``fork`` shares them; an ``open`` does not)."""
    return _kcmp(pid, other, _KCMP_FILE, int(fd), int(other_fd)) == 0


def _quiet_fds(pid: int, devices: Sequence[str]) -> list[tuple[int, str]]:
    with suppress(OSError):
        return device_fds(pid, devices)
    return []


#: Seconds a child is waited for to stop before what it kept of the driver is removed inside it.
STOP_WITHIN = 10.0


def remove(left: Leftover, within: float = STOP_WITHIN) -> int:
    """Unmap and close, inside ``left.pid``, the driver's mappings and descriptors ``left`` found
    (just now: :func:`find`); the bytes of address space given up.  Once it is stopped, each is
    looked at again: only the very process examined (not one that took its PID since), and only
    what it still maps and holds as found, are acted on (0: it is gone).  A child that does not
    stop within ``within`` seconds is given up on (PtraceError ETIMEDOUT) and let go untouched
    (:func:`host.ptrace.bounded`)."""
    try:
        maps, results, todo = ptrace.bounded(left.pid, lambda gave_up: _remove(left, gave_up), within)
    except ptrace.PtraceError as e:
        if e.errno == errno.ESRCH and not proc.alive(left.pid):  # (it ended first)
            return 0
        raise
    failed = [(call, r) for call, r in zip(todo, results, strict=True) if r < 0]
    if failed:
        (number, args), r = failed[0]
        what = "munmap" if number == ptrace.SYS_MUNMAP else "close"
        raise ptrace.PtraceError(-r, f"{what}{args} inside PID {left.pid} failed: {os.strerror(-r)}")
    return sum(m.end - m.start for m in maps)


def remove_all(leftovers: Sequence[Leftover], within: float = STOP_WITHIN) -> str | None:
    """Each of ``leftovers`` removed (:func:`remove`) in turn; the sentence of the first that could not be
    (one that ended meanwhile has nothing left to remove), or None."""
    for left in leftovers:
        try:
            remove(left, within)
        except OSError as e:
            if e.errno == errno.ETIMEDOUT:
                return (
                    f"PID {left.pid} ({left.name}), forked after CUDA started, did not stop within {within:g} s "
                    "for what it kept of the GPU driver to be removed inside it (a thread of it in uninterruptible "
                    "sleep, as on a hung network filesystem, or its control group frozen)"
                )
            if proc.alive(left.pid):
                return f"the GPU driver's leftovers in PID {left.pid} could not be removed: {e}"
    return None


_Calls = list[tuple[int, tuple[int, ...]]]


def _remove(left: Leftover, gave_up: threading.Event) -> tuple[list[DeviceMapping], list[int], _Calls]:
    """:func:`remove`'s calls, in the thread that seizes the child: what was unmapped, each call's
    result, the calls."""
    with ptrace.seized(left.pid, gave_up) as tracee:
        if gave_up.is_set() or proc.start_ticks(left.pid) != left.started:  # (too late, or another process)
            return [], [], []
        still = set(device_mappings(left.pid, sorted({m.path for m in left.maps})))
        maps = [m for m in left.maps if m in still]
        held = set(device_fds(left.pid, sorted({path for _, path in left.fds})))
        fds = [fd for fd in left.fds if fd in held]
        todo: _Calls = [(ptrace.SYS_MUNMAP, (m.start, m.end - m.start)) for m in maps]
        todo += [(ptrace.SYS_CLOSE, (fd,)) for fd, _ in fds]
        return maps, [tracee.call(number, *args) for number, args in todo], todo
