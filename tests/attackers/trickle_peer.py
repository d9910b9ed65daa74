"""A stranger that holds connections to a receiver without ever finishing a handshake.

    python trickle_peer.py HOST PORT INTERVAL PER_SOURCE SOURCE_ADDR...

Opens PER_SOURCE connections from each source address (loopback addresses other than
127.0.0.1 stand for other hosts), sends on each the header of a large TLS handshake record,
then one byte every INTERVAL seconds: the TLS or HMAC handshake it started never completes.
A connection the receiver closes is opened again (one each INTERVAL).  Prints ``ready`` once
all were opened; ends when its stdin closes.  Run unprivileged (the tests run it as nobody);
stdlib only.
"""

from __future__ import annotations

import select
import socket
import sys
import time

RECORD_HEADER = b"\x16\x03\x01\x40\x00"  # a TLS handshake record of 16 KiB: its body never comes


def main() -> None:
    host = sys.argv[1]
    port = int(sys.argv[2])
    interval = float(sys.argv[3])
    per_source = int(sys.argv[4])
    sources = sys.argv[5:]
    conns: dict[socket.socket, str] = {}
    closed: list[str] = []

    def open_from(source: str) -> None:
        s = socket.socket()
        try:
            s.bind((source, 0))
            s.settimeout(5)
            s.connect((host, port))
            s.sendall(RECORD_HEADER)
            s.setblocking(False)
        except OSError:
            s.close()
            closed.append(source)
            return
        conns[s] = source

    for source in sources:
        for _ in range(per_source):
            open_from(source)
    print("ready", flush=True)
    next_round = time.monotonic() + interval
    while True:
        ready, _, _ = select.select([sys.stdin, *conns], [], [], max(0.0, next_round - time.monotonic()))
        if sys.stdin in ready and not sys.stdin.buffer.read1(1):
            return
        for s in ready:
            if s is sys.stdin:
                continue
            try:
                gone = not s.recv(4096)  # the receiver's answer (an alert), or its close
            except BlockingIOError:
                gone = False
            except OSError:
                gone = True
            if gone:
                closed.append(conns.pop(s))
                s.close()
        if time.monotonic() >= next_round:
            next_round += interval
            for s in list(conns):
                try:
                    s.send(b"\0")
                except BlockingIOError:
                    pass
                except OSError:
                    closed.append(conns.pop(s))
                    s.close()
            for source in closed[:]:
                closed.remove(source)
                open_from(source)


if __name__ == "__main__":
    main()
