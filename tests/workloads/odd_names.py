"""A process whose names are bytes of no encoding, as any process may choose them: its own name
and a thread's (prctl, pthread_setname_np), a file it maps and one it holds open.  Each 0.1 s it
counts one up in the mapped file and logs ``tick N FILE`` (N: the count, FILE: the mapped file's
first eight bytes as a number, the same).  argv: the log file."""

import ctypes
import mmap
import os
import sys
import threading
import time

PR_SET_NAME = 15
log = open(sys.argv[1], "a", buffering=1)  # noqa: SIM115 (open for the life of the process)
here = os.path.dirname(os.fsencode(os.path.abspath(sys.argv[1])))
name = os.path.join(here, b"mapped-\xff\xfe")
with open(name, "wb") as f:
    f.write(bytes(4096))
held = open(os.path.join(here, b"held-\xc3("), "ab")  # noqa: SIM115 (held open, as a job holds its files)
mapped = mmap.mmap(os.open(name, os.O_RDWR), 4096)
libc = ctypes.CDLL(None)
libc.prctl(PR_SET_NAME, b"odd-\xff", 0, 0, 0)


def named() -> None:
    libc.prctl(PR_SET_NAME, b"thread-\xfe", 0, 0, 0)
    while True:
        time.sleep(1)


threading.Thread(target=named, daemon=True).start()
n = 0
while True:
    mapped[:8] = n.to_bytes(8, "little")
    print(f"tick {n} {int.from_bytes(mapped[:8], 'little')}", file=log)
    n += 1
    time.sleep(0.1)
