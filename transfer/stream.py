"""Send a snapshot directory over parallel authenticated streams; receive, check, verify it.

The sender cuts the snapshot's files into chunks (:class:`~transfer.wire.Layout`), and N
data streams pull chunks from one queue, each with at most ``window`` unacknowledged: memory
stays bounded and a slow receiver slows the sender.  Each chunk is sent raw, as zeros (no
payload) or zstd-compressed, whichever is cheapest (see :class:`transfer.sender._Codec`).  The receiver
checks each chunk's CRC on arrival and NAKs a damaged one, which is sent again; a stream
that breaks reconnects, learns from HAVE what already arrived, and goes on from there.  At
the end the receiver checks the authenticated trailer and verifies the whole snapshot
against its manifest before the directory appears under its final name.

This module holds what both ends share, the mutual HMAC handshake each connection starts
with (inside TLS where the transport has it, :mod:`transfer.tls`: a certificate of the site's
CA alone does not make a peer a member, the cluster secret does); :mod:`transfer.sender` and
:mod:`transfer.receiver` are the two ends, and the format itself is :mod:`transfer.wire`.
"""

from __future__ import annotations

import hmac
import os
import struct

from transfer import wire
from transfer.api import AuthError, Channel
from transfer.wire import HELLO, Kind, Role

HANDSHAKE_TIMEOUT = 10.0


def client_handshake(ch: Channel, secret: bytes, role: Role, stream: int, session: bytes) -> None:
    nonce_c = os.urandom(wire.NONCE_LEN)
    ch.send(HELLO.pack(wire.MAGIC, wire.VERSION, role, 0, stream, session, nonce_c))
    nonce_s = ch.recv_exact(wire.NONCE_LEN)
    sid = struct.pack("<I", stream)
    ch.send(wire.mac(secret, b"client", session, sid, nonce_s, nonce_c))
    try:
        _, proof = wire.expect(ch, Kind.WELCOME, wire.MAC_LEN)
    except wire.PeerError as e:  # (said on purpose; a connection that closed or broke is tried again)
        raise AuthError(f"the receiver refused this sender ({e}); is the cluster secret the same on both nodes?") from e
    if not hmac.compare_digest(proof, wire.mac(secret, b"server", session, sid, nonce_c, nonce_s)):
        raise AuthError("the receiver could not prove it holds the cluster secret; refusing to send to it")
    ch.authenticated()


def server_handshake(ch: Channel, secret: bytes) -> tuple[Role, bytes]:
    magic, version, role, _, stream, session, nonce_c = HELLO.unpack(ch.recv_exact(HELLO.size))
    if magic != wire.MAGIC or version != wire.VERSION or role not in (0, 1):
        wire.send_frame(ch, Kind.ERROR, f"not a tpagent transfer stream of version {wire.VERSION}".encode())
        raise AuthError(f"a peer spoke something other than tpagent transfer v{wire.VERSION}")
    nonce_s = os.urandom(wire.NONCE_LEN)
    ch.send(nonce_s)
    sid = struct.pack("<I", stream)
    if not hmac.compare_digest(
        ch.recv_exact(wire.MAC_LEN), wire.mac(secret, b"client", session, sid, nonce_s, nonce_c)
    ):
        wire.send_frame(ch, Kind.ERROR, b"authentication failed")
        raise AuthError("a peer failed to prove it holds the cluster secret")
    ch.authenticated()  # before WELCOME: the sender may answer it with a large HEADER
    wire.send_frame(ch, Kind.WELCOME, wire.mac(secret, b"server", session, sid, nonce_c, nonce_s))
    return Role(role), session
