"""Test workload that needs a service on its node's loopback, outside its own tree.

    python loopback_asker.py LOG PORT

Every 20 ms it asks 127.0.0.1:PORT (UDP) for N and logs ``tick N`` once the answer came.
Moved to a node where nothing answers there, its next question fails (the port is
unreachable) and it dies: as a job does whose peer, or sidecar, stayed behind.
"""

import socket
import sys
import time

port = int(sys.argv[2])
with open(sys.argv[1], "a", buffering=1) as log:
    n = 0
    while True:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.settimeout(5)
            s.connect(("127.0.0.1", port))
            s.send(n.to_bytes(8, "little"))
            assert int.from_bytes(s.recv(8), "little") == n  # (refused: there is no one to ask)
        log.write(f"tick {n}\n")
        n += 1
        time.sleep(0.02)
