"""The UCX transport through ucxx: RDMA (InfiniBand, RoCE) where the hardware is, UCX's own
TCP elsewhere (``UCX_TLS=tcp``, how it is tested on machines without RDMA).

ucxx is asynchronous and moves whole messages, not a byte stream.  A channel here runs its
calls on one shared event loop thread, sends each ``send()`` as an 8-byte length then the
message, and serves ``recv_exact()`` from whole messages as they arrive.  Until the peer has
passed the HMAC handshake a channel takes only handshake-sized messages (``PRE_AUTH_MESSAGE``),
so a stranger cannot make it allocate more.

UCX has no TLS: a UCX stream is authenticated (the HMAC handshake, and every chunk checked
against the manifest digests of the signed header) but not encrypted, so use TCP with TLS
wherever the fabric between the nodes is not trusted.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import os
import queue
import threading
from collections.abc import Coroutine
from typing import Any

from host.sockets import TAKEN, bind_problem
from transfer.api import BadAddress, Channel, Listener, TransferError, Transport, parse_address

os.environ.setdefault("UCX_WARN_UNUSED_ENV_VARS", "n")
# UCX logs to stdout unless told: a command's --json there is its result, never a log line.
os.environ.setdefault("UCX_LOG_FILE", "stderr")
_MAX_MESSAGE = 128 << 20
#: The largest message a peer may send before it has authenticated (the handshake's are < 100 B).
PRE_AUTH_MESSAGE = 4096


class _Loop:
    """One asyncio loop in a daemon thread, where every ucxx call of this process runs."""

    _shared: _Loop | None = None
    _lock = threading.Lock()

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        threading.Thread(target=self.loop.run_forever, name="ucx-loop", daemon=True).start()

    @classmethod
    def get(cls) -> _Loop:
        with cls._lock:
            if cls._shared is None:
                cls._shared = _Loop()
            return cls._shared

    def run(self, coro: Coroutine[Any, Any, Any], timeout: float | None, what: str) -> Any:
        future = asyncio.run_coroutine_threadsafe(coro, self.loop)
        try:
            return future.result(timeout)
        except concurrent.futures.TimeoutError as e:
            future.cancel()
            raise TransferError(f"UCX {what} timed out after {timeout} s") from e
        except TransferError:
            raise
        except Exception as e:  # ucxx's UCXError family: the peer went away, a reset...
            raise TransferError(f"UCX {what} failed: {e}") from e


def _ucxx() -> Any:
    try:
        import numpy
        import ucxx
    except ImportError as e:
        raise TransferError(f"the UCX transport needs the ucxx package (pip install ucxx-cu12): {e}") from e
    return ucxx, numpy


class UcxChannel(Channel):
    def __init__(self, loop: _Loop, ep: Any, peer: str, timeout: float, done: asyncio.Event | None = None) -> None:
        self._loop = loop
        self._ep = ep
        self.peer = peer
        self._timeout = timeout
        self._done = done
        self._np = _ucxx()[1]
        self._buf = bytearray()
        self._pos = 0
        self._limit = PRE_AUTH_MESSAGE

    def send(self, *parts: bytes | memoryview) -> None:
        np = self._np
        data = b"".join(parts)
        header = np.array([len(data)], dtype=np.uint64)
        payload = np.frombuffer(data, dtype=np.uint8)

        async def go() -> None:
            await self._ep.send(header)
            await self._ep.send(payload)

        self._loop.run(go(), self._timeout, f"send to {self.peer}")

    def recv_exact(self, n: int) -> bytes | bytearray:
        np = self._np
        while len(self._buf) - self._pos < n:
            header = np.empty(1, dtype=np.uint64)

            async def go() -> Any:  # (self._loop.run below ends it, or raises, before the loop goes on)
                await self._ep.recv(header)  # noqa: B023
                size = int(header[0])  # noqa: B023
                limit = self._limit
                if size > limit:
                    before = " before authenticating" if limit < _MAX_MESSAGE else ""
                    raise TransferError(
                        f"{self.peer} sent a message of {size} bytes{before}, over the limit of {limit}"
                    )
                message = np.empty(size, dtype=np.uint8)
                await self._ep.recv(message)
                return message

            message = self._loop.run(go(), self._timeout, f"receive from {self.peer}")
            del self._buf[: self._pos]
            self._pos = 0
            self._buf += memoryview(message)
        out = self._buf[self._pos : self._pos + n]
        self._pos += n
        return out

    def authenticated(self) -> None:
        self._limit = _MAX_MESSAGE

    def set_timeout(self, seconds: float | None) -> None:
        self._timeout = seconds  # type: ignore[assignment]

    def interrupt(self) -> None:
        """Closes the endpoint without waiting for it (a receive on it then fails)."""
        asyncio.run_coroutine_threadsafe(self._ep.close(), self._loop.loop)

    def close(self) -> None:
        if self._done is not None:
            self._loop.loop.call_soon_threadsafe(self._done.set)
        with contextlib.suppress(TransferError):
            self._loop.run(self._ep.close(), 5, "close")


class UcxListener(Listener):
    def __init__(self, address: str, io_timeout: float) -> None:
        ucxx, _ = _ucxx()
        host, port = parse_address(address)
        if why := bind_problem(host, port):  # (UCX listens on every interface, whatever the host)
            raise (TransferError if why == TAKEN else BadAddress)(f"cannot listen on {address}: {why}")
        self._loop = _Loop.get()
        self._incoming: queue.Queue[UcxChannel] = queue.Queue()

        async def handler(ep: Any) -> None:
            done = asyncio.Event()  # the endpoint lives as long as this handler does
            self._incoming.put(UcxChannel(self._loop, ep, "ucx-peer", io_timeout, done))
            await done.wait()

        async def create() -> Any:
            return ucxx.create_listener(handler, port=port)

        self._listener = self._loop.run(create(), 30, f"listen on {address}")
        self.address = f"{host}:{self._listener.port}"

    def accept(self, timeout: float | None) -> Channel | None:
        try:
            return self._incoming.get(timeout=timeout)
        except queue.Empty:
            return None

    def close(self) -> None:
        self._loop.loop.call_soon_threadsafe(self._listener.close)


class UcxTransport(Transport):
    name = "ucx"

    def __init__(self, io_timeout: float = 60.0) -> None:
        _ucxx()
        self.io_timeout = io_timeout

    def connect(self, address: str, timeout: float) -> Channel:
        ucxx, _ = _ucxx()
        host, port = parse_address(address)
        loop = _Loop.get()
        ep = loop.run(ucxx.create_endpoint(host, port), timeout, f"connect to {address}")
        return UcxChannel(loop, ep, address, self.io_timeout)

    def listen(self, address: str) -> Listener:
        return UcxListener(address, self.io_timeout)
