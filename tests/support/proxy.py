"""A real TCP proxy for fault injection between a sender and a receiver (loopback only)."""

from __future__ import annotations

import contextlib
import socket
import threading
from collections.abc import Callable
from dataclasses import dataclass, field


@dataclass
class Proxy:
    target: tuple[str, int]
    #: Flip one byte at this offset of the client->server bytes of connection number ``on``.
    flip_at: int | None = None
    #: Cut connection number ``on`` after this many client->server bytes.
    cut_at: int | None = None
    #: Which accepted connection (0 = control, 1.. = data streams in connect order) to harm.
    on: int = 1
    #: Refuse every connection after the first harm (the path is gone for good).
    dead_after_cut: bool = False
    recorded: list[bytes] = field(default_factory=list)
    #: Where to listen (a port of our own choosing: 0).
    listen: tuple[str, int] = ("127.0.0.1", 0)
    connections: int = 0
    flipped: int = 0
    #: Client->server bytes forwarded so far, over all connections.
    forwarded: int = 0
    #: While this says so, server->client bytes are swallowed (a reply that never arrives).
    swallow_replies: Callable[[], bool] = lambda: False
    swallowed: int = 0
    #: Each connection's client->server bytes are recorded up to this many (the tests' snapshots
    #: are a few MiB: all of a stream, whichever chunks it happened to carry).
    record_limit: int = 16 << 20

    def __post_init__(self) -> None:
        self.server = socket.create_server(self.listen)
        host, port = self.server.getsockname()[:2]
        self.address = f"{host}:{port:d}"
        self.dead = False
        threading.Thread(target=self._accept, daemon=True).start()

    def close(self) -> None:
        # (shut down first: closing alone leaves the accepting thread's socket bound to the address)
        with contextlib.suppress(OSError):
            self.server.shutdown(socket.SHUT_RDWR)
        self.server.close()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self.server.accept()
            except OSError:
                return
            n = self.connections
            self.connections += 1
            if self.dead:
                client.close()
                continue
            try:
                upstream = socket.create_connection(self.target)
            except OSError:  # the receiver is gone: so is this connection
                client.close()
                continue
            threading.Thread(target=self._pipe, args=(client, upstream, n == self.on, True), daemon=True).start()
            threading.Thread(target=self._pipe, args=(upstream, client, False, False), daemon=True).start()

    def _pipe(self, src: socket.socket, dst: socket.socket, harm: bool, record: bool) -> None:
        seen = 0
        log = bytearray()
        try:
            while True:
                data = bytearray(src.recv(1 << 16))
                if not data:
                    break
                if harm and self.flip_at is not None and seen <= self.flip_at < seen + len(data):
                    data[self.flip_at - seen] ^= 0xFF
                    self.flipped += 1
                if harm and self.cut_at is not None and seen + len(data) > self.cut_at:
                    dst.sendall(data[: self.cut_at - seen])
                    self.dead = self.dead_after_cut
                    break
                if record and len(log) < self.record_limit:
                    log += data
                if not record and self.swallow_replies():
                    self.swallowed += len(data)
                    continue
                dst.sendall(data)
                seen += len(data)
                if record:
                    self.forwarded += len(data)
        except OSError:
            pass
        finally:
            if record:
                self.recorded.append(bytes(log))
            for s in (src, dst):
                with contextlib.suppress(OSError):
                    s.shutdown(socket.SHUT_RDWR)
            src.close()  # each socket is the source of exactly one pipe
