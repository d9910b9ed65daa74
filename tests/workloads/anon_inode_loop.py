"""Test workload: a loop that holds a descriptor of a kind CRIU cannot checkpoint.

    python anon_inode_loop.py LOG KIND      KIND: io_uring (an async I/O ring), perf_event
                                            (a counter of its own CPU time, as profilers hold),
                                            mqueue (a POSIX message queue, mq_open), pdeathsig
                                            (no descriptor: SIGTERM asked for when its parent
                                            dies, PR_SET_PDEATHSIG, as vLLM's workers do),
                                            sealed-memfd (a memfd sealed against writes, mapped
                                            shared, read-only), pidfd (a pidfd of its parent),
                                            pidfd-thread (one of its own thread, PIDFD_THREAD),
                                            fifo:PATH (writes to the named pipe PATH),
                                            packet-pipe (a pipe in packet mode, O_DIRECT),
                                            stale-epoll (an epoll instance watching a pipe it
                                            closed, which a child it forked holds), or none

Writes ``tick N`` to LOG every 20 ms; exits with status 3 if the kernel gives no such descriptor.
"""

import ctypes
import fcntl
import mmap
import os
import select
import struct
import sys
import time

SYS_IO_URING_SETUP = 425  # (x86_64 and arm64 alike)
SYS_PERF_EVENT_OPEN = 298  # (x86_64)
libc = ctypes.CDLL(None, use_errno=True)
kept: list[object] = []  # (mappings, an epoll, held for the loop's whole life)


def _open(kind: str) -> int:
    if kind == "packet-pipe":
        return os.pipe2(os.O_DIRECT)[1]
    if kind == "stale-epoll":
        ep = select.epoll()
        kept.append(ep)
        r, _ = os.pipe()
        ep.register(r, select.EPOLLIN)
        if os.fork() == 0:  # (it keeps the pipe's file, and so the watch, alive)
            time.sleep(3600)
            os._exit(0)
        os.close(r)
        return ep.fileno()
    if kind == "sealed-memfd":
        fd = os.memfd_create("tpagent-sealed", os.MFD_ALLOW_SEALING)
        os.ftruncate(fd, 1 << 16)
        fcntl.fcntl(fd, 1033, 0x1 | 0x2 | 0x4 | 0x8)  # (F_ADD_SEALS: SEAL, SHRINK, GROW, WRITE)
        kept.append(mmap.mmap(fd, 1 << 16, mmap.MAP_SHARED, mmap.PROT_READ))
        return fd
    if kind == "pidfd":
        return os.pidfd_open(os.getppid())
    if kind == "pidfd-thread":
        return os.pidfd_open(os.getpid(), os.O_EXCL)  # (PIDFD_THREAD: its own main thread's)
    if kind.startswith("fifo:"):
        return os.open(kind.removeprefix("fifo:"), os.O_WRONLY)
    if kind == "pdeathsig":
        return int(libc.prctl(1, 15))  # (PR_SET_PDEATHSIG, SIGTERM: 0 on success)
    if kind == "mqueue":
        libc.mq_open.restype = ctypes.c_int
        return int(libc.mq_open(f"/tpagent-loop-{os.getpid()}".encode(), os.O_CREAT | os.O_RDWR, 0o600, None))
    if kind == "io_uring":
        params = ctypes.create_string_buffer(120)  # struct io_uring_params, zeroed
        return int(libc.syscall(SYS_IO_URING_SETUP, 8, params))
    attr = ctypes.create_string_buffer(128)  # struct perf_event_attr
    struct.pack_into("IIQ", attr, 0, 1, 128, 0)  # PERF_TYPE_SOFTWARE, its size, PERF_COUNT_SW_CPU_CLOCK
    struct.pack_into("Q", attr, 40, 1 | 1 << 5 | 1 << 6)  # disabled, exclude_kernel, exclude_hv
    return int(libc.syscall(SYS_PERF_EVENT_OPEN, attr, 0, -1, -1, 0))


def main() -> None:
    fd = _open(sys.argv[2]) if sys.argv[2] != "none" else 0
    if fd < 0:
        print(f"no {sys.argv[2]}: {os.strerror(ctypes.get_errno())}", file=sys.stderr)
        sys.exit(3)
    with open(sys.argv[1], "a", buffering=1) as log:
        n = 0
        while True:
            log.write(f"tick {n}\n")
            n += 1
            time.sleep(0.02)


if __name__ == "__main__":
    main()
