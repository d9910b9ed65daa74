"""The TCP transport: plain sockets with large buffers, one per stream, optionally in mutual TLS
(:mod:`transfer.tls`)."""

from __future__ import annotations

import contextlib
import errno
import select
import socket
import ssl
import threading
import time
from collections.abc import Callable
from typing import TypeVar

from transfer import tls as _tls  # (TcpTransport's parameter is named tls)
from transfer.api import BadAddress, Channel, Listener, TlsFiles, TransferError, Transport, parse_address

BUFFER = 8 << 20
_SMALL = 65536  # parts below this are joined into one send; larger ones go as they are
T = TypeVar("T")


class TcpChannel(Channel):
    def __init__(self, sock: socket.socket, timeout: float) -> None:
        sock.settimeout(timeout)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        for opt in (socket.SO_SNDBUF, socket.SO_RCVBUF):
            sock.setsockopt(socket.SOL_SOCKET, opt, BUFFER)
        # A peer that vanished (its node lost, no FIN, no RST) is noticed within ``timeout``
        # even on a stream that waits for good (the control stream, for the trailer): its
        # kernel stops answering keepalives.  A live peer's kernel answers however idle it is.
        secs = max(1, int(timeout // 3))
        for opt, value in ((socket.TCP_KEEPIDLE, secs), (socket.TCP_KEEPINTVL, secs), (socket.TCP_KEEPCNT, 2)):
            sock.setsockopt(socket.IPPROTO_TCP, opt, value)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
        self.sock = sock
        self._scratch = bytearray()
        self.peer = "{}:{}".format(*sock.getpeername()[:2])
        self._closing = threading.Lock()  # interrupt() never reaches a descriptor close() has freed
        self._closed = False

    def send(self, *parts: bytes | memoryview) -> None:
        try:
            if sum(map(len, parts)) < _SMALL:  # one segment for small frames
                self._sendall(b"".join(parts))
                return
            small: list[bytes | memoryview] = []  # a frame's headers go together, its payload uncopied
            for part in parts:
                if len(part) < _SMALL:
                    small.append(part)
                    continue
                if small:
                    self._sendall(b"".join(small))
                    small = []
                self._sendall(part)
            if small:
                self._sendall(b"".join(small))
        except OSError as e:
            raise self._failed("sending to", e) from e

    def recv_exact(self, n: int) -> bytes | bytearray:
        buf = bytearray(n)
        self._fill(memoryview(buf))
        return buf  # no copy: callers only read it

    def recv_scratch(self, n: int) -> memoryview:
        if len(self._scratch) < n:
            self._scratch = bytearray(n)
        view = memoryview(self._scratch)[:n]
        self._fill(view)
        return view

    def _fill(self, view: memoryview) -> None:
        got = 0
        n = len(view)
        try:
            while got < n:
                k = self._recv_into(view[got:])
                if k == 0:
                    raise TransferError(f"{self.peer} closed the connection")
                got += k
        except OSError as e:
            raise self._failed("receiving from", e) from e

    def _sendall(self, data: bytes | memoryview) -> None:
        self.sock.sendall(data)

    def _recv_into(self, view: memoryview) -> int:
        return self.sock.recv_into(view)

    def _failed(self, what: str, e: OSError) -> TransferError:
        return TransferError(f"{what} {self.peer} failed: {e.strerror or e}")

    def set_timeout(self, seconds: float | None) -> None:
        self.sock.settimeout(seconds)

    def interrupt(self) -> None:
        with self._closing:
            if not self._closed:
                self._shutdown()

    def _shutdown(self) -> None:
        # the plain socket's shutdown: an SSLSocket's would drop its TLS state under a thread still in it
        with contextlib.suppress(OSError):
            socket.socket.shutdown(self.sock, socket.SHUT_RDWR)

    def close(self) -> None:
        with self._closing:
            if self._closed:
                return
            self._closed = True
            self._shutdown()  # wakes a thread blocked on it (closing alone would not)
            self.sock.close()


class TlsChannel(TcpChannel):
    """A :class:`TcpChannel` in TLS.

    OpenSSL forbids two threads in one SSL object at once, and a sender reads ACKs on one
    thread while it sends chunks on another.  So the socket is non-blocking, each SSL call
    holds a lock and returns at once (or says it wants the socket readable or writable), and
    the waiting (``poll``) happens outside the lock.  Payloads are still encrypted from the
    caller's buffers and decrypted into them, as plain TCP does without TLS."""

    def __init__(self, sock: ssl.SSLSocket, timeout: float) -> None:
        super().__init__(sock, timeout)
        self.tls = sock
        self._timeout: float | None = timeout
        self._ssl = threading.Lock()
        sock.setblocking(False)

    def handshake(self, timeout: float | None) -> None:
        """The TLS handshake, within ``timeout``; raises ssl.SSLError or OSError."""
        saved = self._timeout
        self._timeout = timeout
        try:
            self._call(self.tls.do_handshake)
        finally:
            self._timeout = saved

    def establish(self) -> None:
        try:
            self.handshake(self._timeout)
        except ssl.SSLError as e:
            self._linger()
            raise _tls.server_failure(e) from e
        except OSError as e:
            raise TransferError(f"the TLS handshake with {self.peer} failed: {e.strerror or e}") from e

    def _linger(self, seconds: float = 1.0) -> None:
        """After a refused handshake, let the alert that says why reach the peer: closing with
        its bytes unread would send a reset, which can destroy the alert before it is read
        (in TLS 1.3 the sender learns of a refused certificate only after its handshake, when
        it has sent more).  So: end our side, then drop what arrives until the peer closes."""
        deadline = time.monotonic() + seconds
        try:
            socket.socket.shutdown(self.sock, socket.SHUT_WR)
            poller = select.poll()
            poller.register(self.sock.fileno(), select.POLLIN)
            while (left := deadline - time.monotonic()) > 0 and poller.poll(max(1, int(left * 1000))):
                if not socket.socket.recv(self.sock, 65536):  # the raw bytes: TLS has failed anyway
                    return
        except OSError:
            pass

    def _call(self, op: Callable[[], T]) -> T:
        deadline = None if self._timeout is None else time.monotonic() + self._timeout
        while True:
            with self._ssl:
                if self._closed:
                    raise OSError(errno.EBADF, "the connection was closed")
                try:
                    return op()
                except ssl.SSLWantReadError:
                    events = select.POLLIN
                except ssl.SSLWantWriteError:
                    events = select.POLLOUT
                fd = self.sock.fileno()
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                raise TimeoutError(errno.ETIMEDOUT, "timed out")
            poller = select.poll()
            poller.register(fd, events)
            poller.poll(None if left is None else max(1, int(left * 1000)))

    def _sendall(self, data: bytes | memoryview) -> None:
        view = memoryview(data)
        sent = 0
        while sent < len(view):
            part = view[sent:]  # after WANT_WRITE, OpenSSL wants the same buffer again: this one
            sent += self._call(lambda: self.tls.send(part))  # noqa: B023 (_call runs it before the loop goes on)

    def _recv_into(self, view: memoryview) -> int:
        return self._call(lambda: self._records_into(view))

    def _records_into(self, view: memoryview) -> int:
        """One SSL read yields at most one TLS record (16 KiB): read on while records are
        already here, so a large receive costs one call (and one lock) per wait, not per record."""
        got = self.tls.recv_into(view)
        while 0 < got < len(view):
            try:
                k = self.tls.recv_into(view[got:])
            except (ssl.SSLWantReadError, ssl.SSLWantWriteError):
                break
            if k == 0:
                break
            got += k
        return got

    def _failed(self, what: str, e: OSError) -> TransferError:
        return _tls.refused_by_peer(e) or super()._failed(what, e)

    def set_timeout(self, seconds: float | None) -> None:
        self._timeout = seconds  # the socket itself stays non-blocking

    def close(self) -> None:
        self.interrupt()  # a thread waiting in poll() wakes, then finds the channel closed
        with self._ssl:  # no SSL call is using the descriptor while it is freed
            super().close()


class TcpListener(Listener):
    def __init__(self, address: str, io_timeout: float, tls_context: ssl.SSLContext | None = None) -> None:
        host, port = parse_address(address)
        try:
            self.sock = socket.create_server((host, port), reuse_port=False, backlog=64)
        except OSError as e:  # (an address that is none of this node's: the request as given)
            mistaken = e.errno == errno.EADDRNOTAVAIL or (e.errno or 0) < 0  # (< 0: getaddrinfo's, rewrapped)
            raise (BadAddress if mistaken else TransferError)(f"cannot listen on {address}: {e.strerror or e}") from e
        self.io_timeout = io_timeout
        self.tls = tls_context
        self.address = "{}:{}".format(*self.sock.getsockname()[:2])

    def accept(self, timeout: float | None) -> Channel | None:
        """The next connection; with TLS, its handshake is left to :meth:`Channel.establish`."""
        self.sock.settimeout(timeout)
        try:
            conn, _ = self.sock.accept()
        except OSError:  # a timeout, or a peer that reset before we got to it
            return None
        try:
            if self.tls is None:
                return TcpChannel(conn, self.io_timeout)
            return TlsChannel(
                self.tls.wrap_socket(conn, server_side=True, do_handshake_on_connect=False), self.io_timeout
            )
        except OSError:
            conn.close()
            return None

    def close(self) -> None:
        self.sock.close()


class TcpTransport(Transport):
    """TCP, in mutual TLS when given the node's certificate files (``tls``).  Files that
    cannot be used raise :class:`~host.api.UsageError` here, in one sentence."""

    name = "tcp"

    def __init__(self, io_timeout: float = 60.0, tls: TlsFiles | None = None) -> None:
        self.io_timeout = io_timeout
        self._client: ssl.SSLContext | None = None
        self._server: ssl.SSLContext | None = None
        if tls is not None:
            self._client = _tls.client_context(tls)
            self._server = _tls.server_context(tls)

    def connect(self, address: str, timeout: float) -> Channel:
        host, port = parse_address(address)
        try:
            sock = socket.create_connection((host, port), timeout=timeout)
        except OSError as e:
            raise TransferError(f"cannot connect to {address}: {e.strerror or e}") from e
        if self._client is None:
            return TcpChannel(sock, self.io_timeout)
        try:
            ch = TlsChannel(
                self._client.wrap_socket(sock, server_hostname=host, do_handshake_on_connect=False), self.io_timeout
            )
        except OSError as e:
            sock.close()
            raise TransferError(f"cannot connect to {address}: {e.strerror or e}") from e
        try:
            ch.handshake(timeout)
        except ssl.SSLError as e:
            ch.close()
            raise _tls.client_failure(e, address, handshake=True) from e
        except OSError as e:
            ch.close()
            raise TransferError(f"the TLS handshake with {address} failed: {e.strerror or e}") from e
        return ch

    def listen(self, address: str) -> Listener:
        return TcpListener(address, self.io_timeout, self._server)
