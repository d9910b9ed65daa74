"""An attacker on a node: sends one request line to the agent's stand-in channel (an abstract unix
socket any local user can reach) and prints the answer line.  argv: socket name, the request (JSON)."""

import socket
import sys

name, request = sys.argv[1], sys.argv[2]
with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
    s.settimeout(60)
    s.connect("\0" + name)
    s.sendall(request.encode() + b"\n")
    data = b""
    while not data.endswith(b"\n"):
        chunk = s.recv(65536)
        if not chunk:
            break
        data += chunk
print(data.decode().strip())
