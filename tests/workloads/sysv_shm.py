"""Test workload: two processes that count in one SysV shared memory segment.

    python sysv_shm.py LOG

The parent makes a segment (IPC_PRIVATE) and forks a child; both attach it.  Every 20 ms the
child adds one to the segment's counter; the parent reads it and writes ``tick N shared M`` to
LOG (N counts its own wake-ups by one; M the counter, which only grows).  A segment that a
restore did not bring back, or brought back empty, shows as M falling back or stuck.
"""

import ctypes
import os
import sys
import time

IPC_PRIVATE = 0
IPC_CREAT = 0o1000
libc = ctypes.CDLL(None, use_errno=True)
libc.shmat.restype = ctypes.c_void_p
libc.shmat.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_int]


def main() -> None:
    shmid = libc.shmget(IPC_PRIVATE, 4096, IPC_CREAT | 0o600)
    if shmid < 0:
        raise OSError(ctypes.get_errno(), "shmget")
    counter = ctypes.c_uint64.from_address(libc.shmat(shmid, None, 0))
    parent = os.getpid()
    if os.fork() == 0:
        while os.getppid() == parent:  # (ends with its parent: a test's kill leaves nothing behind)
            counter.value += 1
            time.sleep(0.02)
        os._exit(0)
    with open(sys.argv[1], "a", buffering=1) as log:
        log.write(f"shm {shmid}\n")  # (for the test to remove the segment once it is done)
        n = 0
        while True:
            log.write(f"tick {n} shared {counter.value}\n")
            n += 1
            time.sleep(0.02)


if __name__ == "__main__":
    main()
