"""The TCP transport: plain sockets with large buffers, one per stream."""

from __future__ import annotations

import socket

from transfer.api import Channel, Listener, Transport, TransferError, parse_address

BUFFER = 8 << 20


class TcpChannel(Channel):
    def __init__(self, sock: socket.socket, timeout: float) -> None:
        sock.settimeout(timeout)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        for opt in (socket.SO_SNDBUF, socket.SO_RCVBUF):
            sock.setsockopt(socket.SOL_SOCKET, opt, BUFFER)
        self.sock = sock
        self._scratch = bytearray()
        self.peer = "%s:%s" % sock.getpeername()[:2]

    def send(self, *parts: bytes | memoryview) -> None:
        try:
            if sum(map(len, parts)) < 65536:  # one segment for small frames
                self.sock.sendall(b"".join(parts))
            else:  # no copy of a large payload
                for part in parts:
                    self.sock.sendall(part)
        except OSError as e:
            raise TransferError(f"sending to {self.peer} failed: {e.strerror or e}") from e

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
        got, n = 0, len(view)
        try:
            while got < n:
                k = self.sock.recv_into(view[got:])
                if k == 0:
                    raise TransferError(f"{self.peer} closed the connection")
                got += k
        except OSError as e:
            raise TransferError(f"receiving from {self.peer} failed: {e.strerror or e}") from e

    def set_timeout(self, seconds: float | None) -> None:
        self.sock.settimeout(seconds)

    def close(self) -> None:
        try:
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self.sock.close()


class TcpListener(Listener):
    def __init__(self, address: str, io_timeout: float) -> None:
        host, port = parse_address(address)
        try:
            self.sock = socket.create_server((host, port), reuse_port=False, backlog=64)
        except OSError as e:
            raise TransferError(f"cannot listen on {address}: {e.strerror or e}") from e
        self.io_timeout = io_timeout
        self.address = "%s:%s" % self.sock.getsockname()[:2]

    def accept(self, timeout: float | None) -> Channel | None:
        self.sock.settimeout(timeout)
        try:
            conn, _ = self.sock.accept()
        except OSError:  # a timeout, or a peer that reset before we got to it
            return None
        try:
            return TcpChannel(conn, self.io_timeout)
        except OSError:
            conn.close()
            return None

    def close(self) -> None:
        self.sock.close()


class TcpTransport(Transport):
    name = "tcp"

    def __init__(self, io_timeout: float = 60.0) -> None:
        self.io_timeout = io_timeout

    def connect(self, address: str, timeout: float) -> Channel:
        host, port = parse_address(address)
        try:
            sock = socket.create_connection((host, port), timeout=timeout)
        except OSError as e:
            raise TransferError(f"cannot connect to {address}: {e.strerror or e}") from e
        return TcpChannel(sock, self.io_timeout)

    def listen(self, address: str) -> Listener:
        return TcpListener(address, self.io_timeout)
