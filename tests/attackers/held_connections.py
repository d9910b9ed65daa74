"""A user holding connections to the stand-in channel: opens N, asks on each one request (so that
none is a silent stranger), prints ``ready``, then holds them, saying nothing more, until its
stdin closes; then prints how many the agent cut meanwhile.  argv: socket name, N.  Stdlib only."""

import json
import select
import socket
import sys

name, n = sys.argv[1], int(sys.argv[2])
request = json.dumps({"op": "rank", "job": "x", "rank": 0, "request": {"op": "locate"}}).encode() + b"\n"
held = []
for _ in range(n):
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.connect("\0" + name)
    s.settimeout(10)
    try:
        s.sendall(request)
        s.recv(65536)
    except OSError:  # (cut already, for a newer one of its own)
        pass
    held.append(s)
print("ready", flush=True)
sys.stdin.read()
print(sum(1 for s in held if select.select([s], [], [], 0)[0] and not s.recv(1)), flush=True)
