"""A stranger on the plain-text probe port: opens CONNS HTTP/2 connections and on each opens
Health/Check streams, a few bytes each, that it never ends, never reading what comes back,
for SECONDS at most RATE bytes a second; then prints ``sent BYTES STREAMS`` and holds the
connections until its stdin closes.  argv: host, port, conns, seconds, rate.  Stdlib only."""

import socket
import struct
import sys
import time

host, port, conns, seconds, rate = (
    sys.argv[1],
    int(sys.argv[2]),
    int(sys.argv[3]),
    float(sys.argv[4]),
    float(sys.argv[5]),
)


def frame(kind: int, flags: int, stream: int, payload: bytes) -> bytes:
    return struct.pack(">I", len(payload))[1:] + bytes([kind, flags]) + struct.pack(">I", stream) + payload


def literal(name: bytes, value: bytes) -> bytes:  # (HPACK: literal with incremental indexing, new name)
    return b"\x40" + bytes([len(name)]) + name + bytes([len(value)]) + value


HEADERS, END_HEADERS = 1, 4
first = b"\x83\x86" + literal(b":path", b"/grpc.health.v1.Health/Check") + literal(b":authority", b"x")
first += literal(b"content-type", b"application/grpc") + literal(b"te", b"trailers")
again = b"\x83\x86" + bytes([0x80 | 65, 0x80 | 64, 0x80 | 63, 0x80 | 62])  # (the four, as indexed above)
held = []
for _ in range(conns):
    s = socket.create_connection((host, port))
    s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    s.sendall(b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + frame(4, 0, 0, b"") + frame(HEADERS, END_HEADERS, 1, first))
    held.append([s, 3])
began = time.monotonic()
sent = streams = 0
while time.monotonic() - began < seconds:
    for h in held:
        burst = b"".join(frame(HEADERS, END_HEADERS, h[1] + 2 * k, again) for k in range(200))
        h[1] += 400
        try:
            h[0].sendall(burst)
        except OSError:
            continue  # (closed by the server: its own bound)
        sent += len(burst)
        streams += 200
    while sent > rate * (time.monotonic() - began):
        time.sleep(0.01)
print(f"sent {sent} {streams}", flush=True)
sys.stdin.read()
