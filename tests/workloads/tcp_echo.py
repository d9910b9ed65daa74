"""Test workload holding an established TCP connection (both ends) that it keeps using.

    python tcp_echo.py LOG

Every 20 ms it sends N over the connection, reads it back on the other end, and logs
``tick N echo M``; M == N as long as the connection carries its bytes intact.
"""

import socket
import sys
import time

server = socket.create_server(("127.0.0.1", 0))
client = socket.create_connection(server.getsockname())
peer, _ = server.accept()
with open(sys.argv[1], "a", buffering=1) as log:
    n = 0
    while True:
        client.sendall(n.to_bytes(8, "little"))
        echo = int.from_bytes(peer.recv(8, socket.MSG_WAITALL), "little")
        log.write(f"tick {n} echo {echo}\n")
        n += 1
        time.sleep(0.02)
