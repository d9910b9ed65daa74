"""A parent and a worker of Python's multiprocessing (the start method given: spawn, forkserver
or fork) passing numbers through a Queue, in lockstep through a BoundedSemaphore(1): the
worker takes it before each number, the parent gives it back once it has read it.  Both are
POSIX semaphores in /dev/shm, which spawn and forkserver open by name in the worker: should
the parent's and the worker's copies ever be two files, the worker waits for good or the
parent's release raises (released too many times), and the ticks stop.

    python mp_sync.py LOG METHOD [--relink DIR [--kept-in DIR2]]

Logs ``tick N`` for each number N read, in order from 0.  With ``--relink``, the parent also
holds DIR/opened open under a name it then removes, the file keeping its other name DIR/kept
(or DIR2/kept), and writes each N at its start: the other name shows the parent's last N as
long as both are one file.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import sys
import time
from multiprocessing.queues import Queue
from multiprocessing.synchronize import BoundedSemaphore


def worker(numbers: Queue[int], turn: BoundedSemaphore) -> None:
    n = 0
    while True:
        turn.acquire()
        numbers.put(n)
        n += 1


def main() -> None:
    log, method = sys.argv[1], sys.argv[2]
    ctx = mp.get_context(method)
    numbers: Queue[int] = ctx.Queue()
    turn = ctx.BoundedSemaphore(1)
    ctx.Process(target=worker, args=(numbers, turn), daemon=True).start()
    fd = -1
    if "--relink" in sys.argv:
        d = sys.argv[sys.argv.index("--relink") + 1]
        kept = sys.argv[sys.argv.index("--kept-in") + 1] if "--kept-in" in sys.argv else d
        fd = os.open(os.path.join(d, "opened"), os.O_RDWR | os.O_CREAT, 0o644)
        os.link(os.path.join(d, "opened"), os.path.join(kept, "kept"))
        os.unlink(os.path.join(d, "opened"))
    with open(log, "a", buffering=1) as out:
        expected = 0
        while True:
            n = numbers.get(timeout=120)
            if n != expected:
                raise SystemExit(f"read {n}, expected {expected}")
            if fd >= 0:
                os.pwrite(fd, f"{n:12d}".encode(), 0)
            out.write(f"tick {n}\n")
            expected += 1
            turn.release()
            time.sleep(0.01)


if __name__ == "__main__":
    main()
