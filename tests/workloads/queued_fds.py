"""Test workload: descriptors in flight on a unix socket, as torch.multiprocessing passes tensors.

    python queued_fds.py LOG

Forks a child that sends three messages over a socketpair, each with a memfd holding its number
(SCM_RIGHTS), then sleeps; the parent writes ``tick N`` to LOG every 20 ms and, on SIGUSR1,
reads what is queued and writes ``got A:B ...`` (each message's number and its memfd's).
"""

import os
import signal
import socket
import struct
import sys
import time

ours, theirs = socket.socketpair()
if os.fork() == 0:
    ours.close()
    for i in range(3):
        fd = os.memfd_create(f"queued-{i}")
        os.write(fd, struct.pack("Q", i))
        socket.send_fds(theirs, [struct.pack("Q", i)], [fd])
        os.close(fd)
    while True:
        time.sleep(1)
theirs.close()
asked = False


def _ask(signum: int, frame: object) -> None:
    global asked
    asked = True


signal.signal(signal.SIGUSR1, _ask)
with open(sys.argv[1], "a", buffering=1) as log:
    n = 0
    while True:
        if asked:
            asked = False
            ours.setblocking(False)
            got = []
            while True:
                try:
                    msg, fds, _, _ = socket.recv_fds(ours, 8, 1)
                except BlockingIOError:
                    break
                got.append(f"{struct.unpack('Q', msg)[0]}:{struct.unpack('Q', os.pread(fds[0], 8, 0))[0]}")
                os.close(fds[0])
            log.write(f"got {' '.join(got)}\n")
        log.write(f"tick {n}\n")
        n += 1
        time.sleep(0.02)
