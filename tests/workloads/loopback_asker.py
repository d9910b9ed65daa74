"""Test workload that needs a service on its node's loopback, outside its own tree.

    python loopback_asker.py LOG PORT

Every 20 ms it asks 127.0.0.1:PORT (UDP) for N and logs ``tick N`` once the answer came.
Moved to a node where nothing answers there, its next question fails (the port is
unreachable) and it dies: as a job does whose peer, or sidecar, stayed behind.

It may be frozen between a question and its answer.  The answer then stays on the old node,
and a freeze longer than the wait makes the wait run out at once when it resumes, wherever it
runs.  So, as a UDP client must, it asks again when a wait runs out: at the old node it gets
its answer and goes on; at the new one the question fails, and it dies within about a second,
well inside the target's confirmation period (3 s).
"""

import socket
import sys
import time


def ask(port: int, n: int) -> None:
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.settimeout(1)
        s.connect(("127.0.0.1", port))
        while True:
            s.send(n.to_bytes(8, "little"))
            try:
                answer = s.recv(8)  # (refused: there is no one to ask)
            except TimeoutError:
                continue
            assert int.from_bytes(answer, "little") == n
            return


port = int(sys.argv[2])
with open(sys.argv[1], "a", buffering=1) as log:
    n = 0
    while True:
        ask(port, n)
        log.write(f"tick {n}\n")
        n += 1
        time.sleep(0.02)
