"""A training state handed from the rank that leaves to the process that takes its place, peer
to peer over TCP (a model-aware move: :mod:`tpagent_rank.join`): no agent, no disk between them.

The leaving rank listens (on its node's address, as its agent says) and serves the state once,
to the first peer that proves the move's one-time secret; each side's agent gave it that secret
over its own authenticated channel.  The wire::

    leaver -> joiner   MAGIC NONCE                          NONCE: 32 random bytes
    joiner -> leaver   HMAC(secret, "load" NONCE)           (else the leaver closes, and waits on)
    leaver -> joiner   SIZE DATA HMAC(secret, "state" NONCE SHA256(DATA))     SIZE: 8 bytes, big-endian

The state crosses the job's network in clear, as its collectives do (its gradients and, with
FSDP, its parameters); the MACs keep any other peer from taking it or passing off another.
Standard library only.
"""

from __future__ import annotations

import contextlib
import hashlib
import hmac
import secrets
import socket
import struct
import threading
import time
from typing import Any, BinaryIO

from tpagent_rank.strangers import Strangers

MAGIC = b"tpagent-state/1\n"
NONCE = 32
MAC = 32
#: Sent and hashed a piece at a time: one side hashes a piece while the other moves the next.
PIECE = 8 << 20
#: How long one peer may take to prove the secret, in all (one who says nothing, or trickles, is cut).
PROOF_TIMEOUT = 10.0
#: Peers proving the secret at once; a newcomer past them cuts the oldest of the address holding
#: most (:mod:`tpagent_rank.strangers`): a crowd, or a trickle, never keeps the rightful one out.
PROVERS = 16
#: Connections a joiner makes at most (one cut is made again), and its pause between two.
ATTEMPTS = 5
RETRY_PAUSE = 0.1


def valid_secret(secret: str) -> bool:
    """A move's secret: 32 to 128 hex digits."""
    return 32 <= len(secret) <= 128 and all(c in "0123456789abcdef" for c in secret)


def _mac(secret: str, *parts: bytes | bytearray) -> bytes:
    return hmac.new(bytes.fromhex(secret), b"".join(parts), hashlib.sha256).digest()


def _exactly(s: socket.socket, n: int) -> bytes:
    """``n`` bytes from ``s`` (a few: the wire's heads and MACs)."""
    buf = bytearray(n)
    view = memoryview(buf)
    got = 0
    while got < n:
        k = s.recv_into(view[got:])
        if not k:
            raise ConnectionError("the peer closed the connection")
        got += k
    return bytes(buf)


def _copy(s: socket.socket, n: int, into: BinaryIO) -> bytes:
    """``n`` bytes from ``s`` written to ``into`` a piece at a time; their SHA-256."""
    digest = hashlib.sha256()
    piece = bytearray(min(n, PIECE) or 1)
    view = memoryview(piece)
    left = n
    while left:
        k = s.recv_into(view[: min(left, PIECE)])
        if not k:
            raise ConnectionError("the peer closed the connection")
        digest.update(view[:k])
        into.write(view[:k])
        left -= k
    return digest.digest()


class Offer:
    """``data`` (bytes, or a map of a file: closed once served) served once, from ``host``,
    until ``timeout`` passes; ``port`` is where.  Peers prove the secret in parallel (at most
    :data:`PROVERS` at once, each within :data:`PROOF_TIMEOUT` in all): a crowd of silent or
    trickling ones does not hold the rightful one back."""

    def __init__(self, data: Any, host: str, secret: str, timeout: float) -> None:
        self.data = data
        self.secret = secret
        self.deadline = time.monotonic() + timeout
        self.taken = threading.Event()
        self.sending = threading.Lock()  # (one peer at a time sends; the data is closed only after)
        self.closed = False
        self.provers = Strangers(PROVERS, PROOF_TIMEOUT)
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        self.listener = socket.socket(family, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
        try:
            self.listener.bind((host, 0))
            self.listener.listen(64)
        except OSError:
            self.listener.close()
            raise
        self.port: int = self.listener.getsockname()[1]
        threading.Thread(target=self._serve, name="tpagent-handover", daemon=True).start()

    def _serve(self) -> None:
        try:
            while not self.taken.is_set() and (left := self.deadline - time.monotonic()) > 0:
                self.provers.expire()
                try:
                    self.listener.settimeout(min(left, 0.5))  # (closed since the loop's test: served)
                    conn, peer = self.listener.accept()
                except TimeoutError:
                    continue
                except OSError:
                    return  # (the listener was closed: served, or given up)
                self.provers.admit(conn, peer[0])
                threading.Thread(target=self._prove, args=(conn,), daemon=True).start()
        finally:
            self.listener.close()
            with self.sending:  # (a state being sent is sent whole first)
                self.closed = True
                data = self.data
                self.data = b""
            if hasattr(data, "close"):
                data.close()

    def _prove(self, conn: socket.socket) -> None:
        try:
            with contextlib.suppress(OSError, ConnectionError):
                self._one(conn)
        finally:
            self.provers.leave(conn)  # (before it is closed: the crowd's cuts touch held ones only)
            conn.close()

    def _one(self, conn: socket.socket) -> None:
        conn.settimeout(PROOF_TIMEOUT)
        nonce = secrets.token_bytes(NONCE)
        conn.sendall(MAGIC + nonce)
        if not hmac.compare_digest(_exactly(conn, MAC), _mac(self.secret, b"load", nonce)):
            return
        if not self.provers.leave(conn):
            return  # (cut meanwhile: it took too long)
        if not self.sending.acquire(blocking=False):
            return  # (another peer that proved it is being sent the state)
        try:
            if self.taken.is_set() or self.closed:
                return
            conn.settimeout(max(1.0, self.deadline - time.monotonic()))
            digest = hashlib.sha256()
            with memoryview(self.data) as view:
                conn.sendall(struct.pack(">Q", len(view)))
                for at in range(0, len(view), PIECE):
                    with view[at : at + PIECE] as piece:  # (released here: the map is closed after)
                        conn.sendall(piece)
                        digest.update(piece)
            conn.sendall(_mac(self.secret, b"state", nonce, digest.digest()))
            self.taken.set()
        finally:
            self.sending.release()
        self.close()  # (served once: it listens no more)

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self.listener.shutdown(socket.SHUT_RDWR)
        self.listener.close()


def fetch(source: str, secret: str, size: int, into: BinaryIO, timeout: float) -> None:
    """The state offered at ``source`` (HOST:PORT), ``size`` bytes, written to ``into`` (from its
    start); its MAC checked (ValueError: what was written is not the state offered).  A connection
    cut (a crowd from the joiner's own address cuts its oldest, a link drops) is made again, up to
    :data:`ATTEMPTS` in all within ``timeout``; one refused means the offer is gone."""
    deadline = time.monotonic() + timeout
    for attempt in range(1, ATTEMPTS + 1):
        into.seek(0)
        into.truncate()
        try:
            return _fetch_once(source, secret, size, into, max(1.0, deadline - time.monotonic()))
        except ConnectionRefusedError:
            raise
        except ConnectionError:
            if attempt == ATTEMPTS or deadline - time.monotonic() < RETRY_PAUSE:
                raise
        time.sleep(RETRY_PAUSE)


def _fetch_once(source: str, secret: str, size: int, into: BinaryIO, timeout: float) -> None:
    host, _, port = source.rpartition(":")
    with socket.create_connection((host.strip("[]"), int(port)), timeout=timeout) as s:
        s.settimeout(timeout)
        head = _exactly(s, len(MAGIC) + NONCE)
        if not head.startswith(MAGIC):
            raise ValueError(f"{source} does not offer a training state")
        nonce = head[len(MAGIC) :]
        s.sendall(_mac(secret, b"load", nonce))
        (n,) = struct.unpack(">Q", _exactly(s, 8))
        if n != size:
            raise ValueError(f"{source} offers {n} bytes, not the {size} its agent said")
        digest = _copy(s, n, into)
        if not hmac.compare_digest(_exactly(s, MAC), _mac(secret, b"state", nonce, digest)):
            raise ValueError(f"the state from {source} is not the one offered (its MAC does not hold)")
