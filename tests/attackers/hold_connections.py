"""An attacker on the cluster network: opens TCP connections to a TLS port and sends the first
bytes of a TLS record on each, and nothing more; after a second, prints one JSON line saying how
many the server closed, then holds the rest until its stdin closes.

    python hold_connections.py HOST:PORT CONNECTIONS
"""

from __future__ import annotations

import json
import select
import socket
import sys
import time

host, _, port = sys.argv[1].rpartition(":")
held = []
for _ in range(int(sys.argv[2])):
    s = socket.create_connection((host, int(port)))
    s.sendall(b"\x16\x03\x01")
    held.append(s)
time.sleep(1.0)
closed = 0
for s in held:
    if select.select([s], [], [], 0)[0]:
        try:
            closed += s.recv(1) == b""
        except OSError:  # (reset)
            closed += 1
print(json.dumps({"closed": closed}), flush=True)
sys.stdin.read()
