"""An attacker on the cluster network: holds raw TCP connections open to an agent's port
and opens gRPC calls that never send their request, then reports what became of the calls.

    python stall.py HOST:PORT CERT_DIR TCP_CONNECTIONS CALLS

CERT_DIR holds a certificate of the cluster CA (a site-wide CA may have issued one to
anybody) but the attacker has no cluster secret.  Prints one JSON line with the calls'
status codes, then keeps the TCP connections open until its stdin closes.
"""

from __future__ import annotations

import json
import socket
import sys
import threading
from pathlib import Path

import grpc

address = sys.argv[1]
cert_dir = Path(sys.argv[2])
n_tcp = int(sys.argv[3])
n_calls = int(sys.argv[4])
host, _, port = address.rpartition(":")
held = []
for _ in range(n_tcp):
    s = socket.create_connection((host, int(port)))
    s.sendall(b"\x16\x03\x01")  # the first bytes of a TLS record, and nothing more
    held.append(s)
creds = grpc.ssl_channel_credentials(
    (cert_dir / "ca.crt").read_bytes(), (cert_dir / "tls.key").read_bytes(), (cert_dir / "tls.crt").read_bytes()
)
# 16 calls a connection (an agent takes 32 at most on one), each channel its own connection
channels = [
    grpc.secure_channel(address, creds, options=[("grpc.use_local_subchannel_pool", 1)])
    for _ in range(-(-n_calls // 16))
]
never = threading.Event()


def no_request():  # type: ignore[no-untyped-def]
    never.wait()  # the request never comes
    yield b""


futures = [
    channels[i // 16].stream_unary("/tpagent.v1.Agent/Info").future(no_request(), timeout=20) for i in range(n_calls)
]
codes = []
for f in futures:
    try:
        f.result()
        codes.append("OK")
    except grpc.RpcError as e:
        codes.append(e.code().name + (": " + str(e.details()) if e.code().name != "UNAUTHENTICATED" else ""))
print(json.dumps(codes), flush=True)
sys.stdin.read()
never.set()
