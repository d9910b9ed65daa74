"""Test workloads holding TCP sockets whose other end (if any) is outside their own tree.

    python tcp_peer.py server HOST PORT_FILE     an echo server: writes its port to PORT_FILE
    python tcp_peer.py client LOG CONNECT LISTEN  CONNECT: HOST:PORT of an echo server, or "-";
                                                  LISTEN: HOST:PORT to listen on (kept), or "-"

The client logs ``tick N echo M`` every 20 ms: M is N sent to the server and read back (M == N
while the connection carries its bytes intact; without a server M is N).
"""

import os
import socket
import sys
import threading
import time


def serve(host: str, port_file: str) -> None:
    srv = socket.create_server((host, 0))

    def echo(conn: socket.socket) -> None:
        while data := conn.recv(8):
            conn.sendall(data)

    with open(port_file + ".tmp", "w") as f:
        f.write(str(srv.getsockname()[1]))
    os.rename(port_file + ".tmp", port_file)
    while True:
        conn, _ = srv.accept()
        threading.Thread(target=echo, args=(conn,), daemon=True).start()


def client(log_path: str, connect: str, listen: str) -> None:
    conn = None
    if connect != "-":
        host, _, port = connect.rpartition(":")
        conn = socket.create_connection((host, int(port)))
    if listen != "-":
        host, _, port = listen.rpartition(":")
        listener = socket.create_server((host, int(port)))  # noqa: F841  (held open while it runs)
    with open(log_path, "a", buffering=1) as log:
        n = 0
        while True:
            echo = n
            if conn is not None:
                conn.sendall(n.to_bytes(8, "little"))
                echo = int.from_bytes(conn.recv(8, socket.MSG_WAITALL), "little")
            log.write(f"tick {n} echo {echo}\n")
            n += 1
            time.sleep(0.02)


if sys.argv[1] == "server":
    serve(sys.argv[2], sys.argv[3])
else:
    client(sys.argv[2], sys.argv[3], sys.argv[4])
