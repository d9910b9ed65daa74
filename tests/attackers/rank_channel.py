"""A local user against the rank socket (the abstract unix name ranks reach their agent on).

    python rank_channel.py pose NAME        hold NAME while no agent does; to each rank that
                                            connects: welcome it, ask where it stands, print
                                            "answered <its line>"
    python rank_channel.py flood NAME N     open N connections, half of them with a hello that
                                            never ends; print "opened K" once done
    python rank_channel.py stale NAME       connect, hand the socket to a child, exit; the child
                                            prints "connected as PID P" (its parent's, which
                                            connected), then on "go" from stdin says, as the
                                            init of a launched workload would, "exit 42", and
                                            prints the agent's answer ("answer <line>"; "closed")

Each ends when its stdin closes.  Run unprivileged (the tests run it as nobody); stdlib only.
"""

from __future__ import annotations

import json
import os
import select
import socket
import sys


def pose(name: str) -> None:
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    server.bind("\0" + name)
    server.listen(16)
    print("ready", flush=True)
    while True:
        ready, _, _ = select.select([server, sys.stdin], [], [])
        if sys.stdin in ready:
            return
        conn, _ = server.accept()
        conn.settimeout(10)
        f = conn.makefile("rb")
        try:
            f.readline()  # (its hello)
            conn.sendall(b'{"op": "welcome", "node": "10.9.9.9:7400"}\n')
            conn.sendall(b'{"id": 1, "op": "where"}\n')
            print("answered " + f.readline().decode().strip(), flush=True)
        except OSError as e:
            print(f"broke {e}", flush=True)
        conn.close()


def flood(name: str, n: int) -> None:
    held = []
    for i in range(n):
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            s.connect("\0" + name)
            if i % 2:
                s.send(b'{"op": "hello", "job": "j')
        except OSError:
            s.close()
            continue
        held.append(s)
    print(f"opened {len(held)}", flush=True)
    sys.stdin.read()


def stale(name: str) -> None:
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.connect("\0" + name)
    print(f"connected as PID {os.getpid()}", flush=True)
    if sys.stdin.readline().strip() != "leave":  # (once the agent has taken the connection)
        return
    if os.fork():
        os._exit(0)  # the PID that connected is free: the kernel still names it as the peer
    if sys.stdin.readline().strip() != "go":
        return
    s.settimeout(10)
    try:
        s.sendall(json.dumps({"op": "exit", "code": 42}).encode() + b"\n")
        line = s.makefile("rb").readline()
    except OSError:
        line = b""
    print("answer " + line.decode().strip() if line else "closed", flush=True)
    sys.stdin.read()


if __name__ == "__main__":
    if sys.argv[1] == "pose":
        pose(sys.argv[2])
    elif sys.argv[1] == "flood":
        flood(sys.argv[2], int(sys.argv[3]))
    else:
        stale(sys.argv[2])
