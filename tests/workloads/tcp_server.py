"""Test workload: a server listening on a TCP port of loopback, as set up with no SO_REUSEADDR
(``socket.socket()``, not ``create_server``), that a client of its own connects to.

    python tcp_server.py LOG WHO    WHO: "server" or "client", which side closes each
                                    connection first (and so holds it in TIME_WAIT after)

Every 20 ms it connects, accepts, sends N over the connection and logs ``tick N port P echo M``
(M == N while the listener takes and carries connections).
"""

import socket
import sys
import time

server = socket.socket()
server.bind(("127.0.0.1", 0))
server.listen()
port = server.getsockname()[1]
with open(sys.argv[1], "a", buffering=1) as log:
    n = 0
    while True:
        client = socket.create_connection(("127.0.0.1", port))
        peer, _ = server.accept()
        client.sendall(n.to_bytes(8, "little"))
        echo = int.from_bytes(peer.recv(8, socket.MSG_WAITALL), "little")
        first, then = (peer, client) if sys.argv[2] == "server" else (client, peer)
        first.close()
        then.close()
        log.write(f"tick {n} port {port} echo {echo}\n")
        n += 1
        time.sleep(0.02)
