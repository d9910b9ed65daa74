"""Periodic timerfds that CRIU brings back disarmed, and how a restore arms them again.

A periodic timerfd that expires while nobody reads it stops its kernel timer until the next
read; /proc's fdinfo then shows no time left (``it_value: (0, 0)``) and ``ticks`` > 0.  That
is what every such timer looks like once its tree has been frozen longer than one period,
and CRIU (issue 3162) restores it as it reads it: with no time left, i.e. disarmed.  An
event loop whose clock it is (asyncio-style, on epoll) then never wakes again.

The post-dump hook notes these timers (:func:`expired`, while the tree is frozen) in the
manifest; after ``criu restore``, :func:`rearm` arms each one again, one period from then,
through a duplicate of the restored process's own descriptor (``pidfd_getfd``, Linux 5.6+):
nothing is injected into the process, and a timer the program itself had disarmed (no
ticks pending) is never noted, so never touched.
"""

from __future__ import annotations

import ctypes
import os
from collections.abc import Sequence
from dataclasses import dataclass

from host.proc import fd_links

_SYS_PIDFD_GETFD = 438  # (x86_64 and arm64 alike: the generic syscall table)
_libc = ctypes.CDLL(None, use_errno=True)


class _Timespec(ctypes.Structure):
    _fields_ = [("tv_sec", ctypes.c_long), ("tv_nsec", ctypes.c_long)]


class _Itimerspec(ctypes.Structure):
    _fields_ = [("it_interval", _Timespec), ("it_value", _Timespec)]


@dataclass(frozen=True)
class Timer:
    """A periodic timerfd: its process (as dumped), its descriptor and its period."""

    pid: int
    fd: int
    interval_ns: int


def _pair(text: str) -> int:
    """Nanoseconds of an fdinfo ``(SEC, NSEC)``."""
    sec, nsec = text.strip().strip("()").split(",")
    return int(sec) * 1_000_000_000 + int(nsec)


def expired(pids: Sequence[int]) -> list[Timer]:
    """The periodic timerfds of these processes that have expired unread: those CRIU restores disarmed."""
    found = []
    for pid in pids:
        for name, link in fd_links(pid):
            if link != "anon_inode:[timerfd]":
                continue
            try:
                with open(f"/proc/{pid}/fdinfo/{name}") as f:
                    info = dict(line.split(":", 1) for line in f.read().splitlines() if ":" in line)
                value = _pair(info["it_value"])
                interval = _pair(info["it_interval"])
                ticks = int(info["ticks"])
            except (OSError, KeyError, ValueError):
                continue
            if value == 0 and interval > 0 and ticks > 0:
                found.append(Timer(pid, int(name), interval))
    return found


def _check(result: int, what: str) -> int:
    if result < 0:
        code = ctypes.get_errno()
        raise OSError(code, f"{what}: {os.strerror(code)}")
    return result


def rearm(pid: int, timer: Timer) -> bool:
    """Arm the timer ``timer.fd`` of process ``pid`` again, one period from now, if it is
    disarmed (no time left and not expired: it would never fire); True if it was.  Raises
    OSError if the process's descriptor cannot be reached."""
    pidfd = os.pidfd_open(pid)
    try:
        fd = _check(_libc.syscall(_SYS_PIDFD_GETFD, pidfd, timer.fd, 0), "pidfd_getfd")
    finally:
        os.close(pidfd)
    try:
        now = _Itimerspec()
        _check(_libc.timerfd_gettime(fd, ctypes.byref(now)), "timerfd_gettime")  # (forwards one merely expired)
        if now.it_value.tv_sec or now.it_value.tv_nsec or not (now.it_interval.tv_sec or now.it_interval.tv_nsec):
            return False
        period = _Timespec(*divmod(timer.interval_ns, 1_000_000_000))
        _check(_libc.timerfd_settime(fd, 0, ctypes.byref(_Itimerspec(period, period)), None), "timerfd_settime")
        return True
    finally:
        os.close(fd)
