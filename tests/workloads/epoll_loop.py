"""Test workload: an asyncio-style event loop on epoll, woken only by its file descriptors.

    python epoll_loop.py LOG [--inotify DIR]

Its only clock is a periodic timerfd (every 20 ms, CLOCK_MONOTONIC; through libc, since
``os.timerfd_*`` needs Python 3.13).  The loop waits with no timeout, as an event loop with
nothing else due does, so a timer that stops firing stops it.  Each time the timer fires it
writes ``tick N expirations E`` to LOG (N counts wake-ups by one, E the expirations read in all).
With --inotify DIR it also watches DIR and writes ``created NAME`` for each file created there.
"""

import ctypes
import os
import select
import struct
import sys

CLOCK_MONOTONIC = 1
TFD_CLOEXEC = 0o2000000
IN_CREATE = 0x100
libc = ctypes.CDLL(None, use_errno=True)


class Timespec(ctypes.Structure):
    _fields_ = [("tv_sec", ctypes.c_long), ("tv_nsec", ctypes.c_long)]


class Itimerspec(ctypes.Structure):
    _fields_ = [("it_interval", Timespec), ("it_value", Timespec)]


timer = libc.timerfd_create(CLOCK_MONOTONIC, TFD_CLOEXEC)
period = Timespec(0, 20_000_000)
assert timer >= 0 and libc.timerfd_settime(timer, 0, ctypes.byref(Itimerspec(period, period)), None) == 0
loop = select.epoll()
loop.register(timer, select.EPOLLIN)
watch = -1
if "--inotify" in sys.argv:
    watch = libc.inotify_init1(os.O_NONBLOCK | os.O_CLOEXEC)
    assert (
        watch >= 0 and libc.inotify_add_watch(watch, sys.argv[sys.argv.index("--inotify") + 1].encode(), IN_CREATE) >= 0
    )
    loop.register(watch, select.EPOLLIN)

with open(sys.argv[1], "a", buffering=1) as log:
    ticks = expirations = 0
    while True:
        for fd, _ in loop.poll():  # no timeout
            if fd == timer:
                expirations += struct.unpack("<Q", os.read(timer, 8))[0]
                log.write(f"tick {ticks} expirations {expirations}\n")
                ticks += 1
            else:
                events = os.read(watch, 65536)
                while events:  # struct inotify_event: wd, mask, cookie, len, name[len]
                    size = struct.unpack_from("<iIII", events)[3]
                    name = events[16 : 16 + size].rstrip(b"\0").decode()
                    log.write(f"created {name}\n")
                    events = events[16 + size :]
