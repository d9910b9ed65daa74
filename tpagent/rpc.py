"""gRPC plumbing shared by the agent and its clients: the generated API, and authentication.

Every call carries ``x-tpagent-auth: TS.NONCE.MAC`` with MAC = HMAC-SHA256(secret, METHOD
TS NONCE SHA256(request)), the request serialised deterministically.  The server refuses a
call whose MAC is wrong, whose TS is more than :data:`SKEW` seconds off, or whose NONCE it
has seen in that window (a replay); it logs each refusal.  Only grpc.health.v1 is open.
"""

from __future__ import annotations

import collections
import hashlib
import hmac
import logging
import os
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import grpc

from tpagent.proto import load

pb, pb_grpc = load()
AgentServicer: Any = pb_grpc.AgentServicer
log = logging.getLogger(__name__)

HEADER = "x-tpagent-auth"
SKEW = 60.0
MAX_MESSAGE = 16 << 20  # bounded inputs: no call carries more


def _mac(secret: bytes, method: str, ts: str, nonce: str, request: Any) -> str:
    body = hashlib.sha256(request.SerializeToString(deterministic=True)).digest()
    return hmac.new(secret, b"\0".join([method.encode(), ts.encode(), nonce.encode(), body]), hashlib.sha256).hexdigest()


def token(secret: bytes, method: str, request: Any) -> str:
    ts, nonce = str(int(time.time() * 1000)), os.urandom(12).hex()  # milliseconds
    return f"{ts}.{nonce}.{_mac(secret, method, ts, nonce, request)}"


class _Replays:
    """Nonces seen within the clock window (bounded: the oldest go first)."""

    def __init__(self, limit: int = 100_000) -> None:
        self.seen: collections.OrderedDict[str, float] = collections.OrderedDict()
        self.lock = threading.Lock()
        self.limit = limit

    def fresh(self, nonce: str, now: float) -> bool:
        with self.lock:
            while self.seen and (len(self.seen) >= self.limit or next(iter(self.seen.values())) < now - 2 * SKEW):
                self.seen.popitem(last=False)
            if nonce in self.seen:
                return False
            self.seen[nonce] = now
            return True


class AuthInterceptor(grpc.ServerInterceptor):  # type: ignore[misc]
    def __init__(self, secret: bytes) -> None:
        self.secret = secret
        self.replays = _Replays()

    def check(self, method: str, request: Any, context: grpc.ServicerContext) -> None:
        value = dict(context.invocation_metadata()).get(HEADER, "")
        peer = context.peer()
        parts = str(value).split(".")
        ts, nonce, mac = parts if len(parts) == 3 and parts[0].isdigit() else ("0", "", "")
        now = time.time()
        reason = None
        if not mac:
            reason = "no credentials"
        elif not hmac.compare_digest(mac, _mac(self.secret, method, ts, nonce, request)):
            reason = "a wrong cluster secret"
        elif abs(now - int(ts) / 1000) > SKEW:
            reason = "a stale timestamp (clocks apart, or a replay)"
        elif not self.replays.fresh(nonce, now):
            reason = "a replayed call"
        if reason is not None:
            log.warning("refused %s from %s: %s", method, peer, reason)
            context.abort(grpc.StatusCode.UNAUTHENTICATED, f"tpagent refused the call: {reason}")

    def intercept_service(self, continuation: Callable[[Any], Any], details: Any) -> Any:
        handler = continuation(details)
        if handler is None or details.method.startswith("/grpc.health.v1."):
            return handler
        method = details.method
        if handler.unary_unary is not None:
            inner_uu = handler.unary_unary

            def uu(request: Any, context: grpc.ServicerContext) -> Any:
                self.check(method, request, context)
                return inner_uu(request, context)

            return handler._replace(unary_unary=uu)
        if handler.unary_stream is not None:
            inner_us = handler.unary_stream

            def us(request: Any, context: grpc.ServicerContext) -> Iterator[Any]:
                self.check(method, request, context)
                yield from inner_us(request, context)

            return handler._replace(unary_stream=us)
        return handler


class _ClientAuth(grpc.UnaryUnaryClientInterceptor, grpc.UnaryStreamClientInterceptor):  # type: ignore[misc]
    def __init__(self, secret: bytes) -> None:
        self.secret = secret

    def _details(self, details: Any, request: Any) -> Any:
        metadata = [*(details.metadata or []), (HEADER, token(self.secret, details.method, request))]
        return _Details(details.method, details.timeout, metadata, details.credentials, details.wait_for_ready, details.compression)

    def intercept_unary_unary(self, continuation: Any, details: Any, request: Any) -> Any:
        return continuation(self._details(details, request), request)

    def intercept_unary_stream(self, continuation: Any, details: Any, request: Any) -> Any:
        return continuation(self._details(details, request), request)


class _Details(collections.namedtuple("_Details", "method timeout metadata credentials wait_for_ready compression"), grpc.ClientCallDetails):  # type: ignore[misc]
    pass


def channel(address: str, secret: bytes) -> grpc.Channel:
    """An authenticated channel to an agent (plain TCP: the cluster network; every call signed)."""
    options = [("grpc.max_receive_message_length", MAX_MESSAGE), ("grpc.max_send_message_length", MAX_MESSAGE)]
    return grpc.intercept_channel(grpc.insecure_channel(address, options=options), _ClientAuth(secret))


def stub(address: str, secret: bytes) -> Any:
    return pb_grpc.AgentStub(channel(address, secret))
