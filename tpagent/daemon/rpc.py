"""gRPC plumbing shared by the agent and its clients: the generated API, TLS, and authentication.

Every connection is mutual TLS with certificates of the cluster CA (:class:`Credentials`):
only a node with such a certificate can connect, every answer comes from the node the
client dialled (its certificate names it), and nothing crosses the network in clear.

On top, every call proves the cluster secret (a certificate from a site-wide CA alone does
not make a peer a member)::

    x-tpagent-auth  ::= "v2." TS "." NONCE "." CALL_MAC     TS: Unix milliseconds; NONCE: 24 hex
    x-tpagent-body  ::= BODY_MAC
    CALL_MAC ::= HMAC-SHA256(secret, "call" 0 METHOD 0 AUDIENCE 0 TS 0 NONCE)
    BODY_MAC ::= HMAC-SHA256(secret, "body" 0 CALL_MAC 0 SHA256(request, deterministic))

AUDIENCE is the host the client dialled, so a call signed for one node is refused by every
other.  The server checks CALL_MAC from the metadata alone, before it reads the request,
so a caller without the secret never holds one of its worker threads (the calls that never
send their request, which once stalled the whole API, are refused at once).  It then refuses
a TS more than :data:`SKEW` seconds off or older than the agent's own start (a call
captured before a restart stays dead), and a NONCE seen before; BODY_MAC binds the request.
A TS refusal names how far off the TS is and carries the agent's clock (``x-tpagent-clock``,
Unix milliseconds): the caller then signs its calls to that agent on that clock and tries once
more, so that a clock step between two nodes never stops a migration half-way
(:mod:`tpagent.common.clock`).
Each refusal is logged with the peer and counted.  Only ``grpc.health.v1.Health/Check`` is
open, and it is answered without reading its request (a probe always gets an answer).
"""

from __future__ import annotations

import collections
import contextlib
import hashlib
import hmac
import logging
import os
import threading
import time
from collections.abc import Callable, Iterator
from concurrent import futures
from typing import Any, TypeVar

import grpc

from host.api import UsageError, is_whole, unbracketed
from host.hushed import Hushed
from host.sockets import TAKEN, bind_problem
from tpagent.common import clock
from tpagent.common.config import port_of
from tpagent.common.credentials import Credentials
from tpagent.daemon.proto import agent_pb2 as pb
from tpagent.daemon.proto import agent_pb2_grpc as pb_grpc
from tpagent.migration.api import Why

AgentServicer = pb_grpc.AgentServicer
#: (The one module that imports the generated code; the rest take it from here.)
__all__ = [
    "CODES",
    "AgentServicer",
    "AuthInterceptor",
    "Credentials",
    "Health",
    "HealthOnly",
    "pb",
    "pb_grpc",
    "server",
    "sign",
    "stub",
]
log = logging.getLogger(__name__)
T = TypeVar("T")

#: How each refusal of the agent layer travels as a gRPC status (and back: tpagent/daemon/client.py).
CODES = {
    Why.INVALID: grpc.StatusCode.INVALID_ARGUMENT,
    Why.NOT_FOUND: grpc.StatusCode.NOT_FOUND,
    Why.DENIED: grpc.StatusCode.PERMISSION_DENIED,
    Why.CONFLICT: grpc.StatusCode.ALREADY_EXISTS,
    Why.PRECONDITION: grpc.StatusCode.FAILED_PRECONDITION,
    Why.UNAUTHENTICATED: grpc.StatusCode.UNAUTHENTICATED,
    Why.INTERNAL: grpc.StatusCode.INTERNAL,
}
HEADER = "x-tpagent-auth"
BODY_HEADER = "x-tpagent-body"
CLOCK_HEADER = "x-tpagent-clock"
VERSION = "v2"
SKEW = clock.WINDOW
MAX_MESSAGE = 16 << 20  # bounded inputs: no call carries more
HEALTH_CHECK = "/grpc.health.v1.Health/Check"
#: Per connection: a client multiplexes at most this many calls on one connection.
MAX_STREAMS_PER_CONNECTION = 32


def _hmac(secret: bytes, *parts: str | bytes) -> str:
    data = b"\0".join(p.encode() if isinstance(p, str) else p for p in parts)
    return hmac.new(secret, data, hashlib.sha256).hexdigest()


def _body_mac(secret: bytes, call_mac: str, request: Any) -> str:
    return _hmac(secret, "body", call_mac, hashlib.sha256(request.SerializeToString(deterministic=True)).digest())


def sign(secret: bytes, method: str, audience: str, request: Any, offset: float = 0.0) -> list[tuple[str, str]]:
    """The metadata that authenticates one call of ``method`` on the agent at ``audience``
    (whose clock is ``offset`` seconds off ours)."""
    ts = str(int((clock.now() + offset) * 1000))
    nonce = os.urandom(12).hex()
    call_mac = _hmac(secret, "call", method, audience, ts, nonce)
    return [(HEADER, f"{VERSION}.{ts}.{nonce}.{call_mac}"), (BODY_HEADER, _body_mac(secret, call_mac, request))]


def audience_of(address: str) -> str:
    """The host part of HOST:PORT (brackets of [v6] removed), lower case."""
    return unbracketed(address.rpartition(":")[0]).lower()


#: Why a call was refused: the metrics label, and what the log and the caller are told.
REASONS = {
    "no_credentials": "no credentials",
    "wrong_secret": "a wrong cluster secret, or a call signed for another node",
    "stale": "a stale timestamp (clocks apart, or a replay)",
    "before_start": "a call signed before this agent started (a replay)",
    "replay": "a replayed call",
    "wrong_body": "a request that is not the one signed",
    "streaming": "a streaming request, which no method of this API takes",
    "busy": "as many calls as this agent answers at once are under way; try again shortly",
}


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


def _on_pool(behavior: Callable[..., Any], pool: futures.ThreadPoolExecutor) -> Callable[..., Any]:
    """``behavior`` run on ``pool`` rather than the server's (grpc's per-handler pool hook)."""

    def run(*args: Any) -> Any:
        return behavior(*args)

    run.experimental_thread_pool = pool  # type: ignore[attr-defined]
    return run


#: Refusals (and the API port's health checks) under way at once.  Each is brief (the request is
#: never read), but a flood of them must not take an authenticated caller's turn: they are
#: counted apart from the API's calls.  Past this many, gRPC turns a call away by itself, at
#: once and with no thread ("Method not found"); it is still counted and logged.  But a caller
#: that proved the secret (:data:`PROVEN`) is always told why: it acts on the answer.
REFUSALS_AT_ONCE = 256
#: Refusals of a call signed with the secret: busy (tried again), a clock apart (signed again on
#: the agent's clock, which only this answer carries).
PROVEN = frozenset({"busy", "stale", "before_start"})


class Bounded(futures.ThreadPoolExecutor):
    """A pool that takes at most ``bound`` calls at once: a call is counted from :meth:`take`
    (in the interceptor, as gRPC hands it the call) until the run gRPC then submits here ends.
    gRPC submits each handler it is given at once, so a call taken is always given back."""

    def __init__(self, threads: int, bound: int, name: str) -> None:
        super().__init__(max_workers=threads, thread_name_prefix=name)
        self.bound = bound
        self.taken = 0
        self._lock = threading.Lock()

    def take(self, always: bool = False) -> bool:
        """Whether a call may be taken (``always``: taken past the bound too)."""
        with self._lock:
            if self.taken >= self.bound and not always:
                return False
            self.taken += 1
            return True

    def _given_back(self, _: futures.Future[Any]) -> None:
        with self._lock:
            self.taken -= 1

    def submit(self, fn: Callable[..., T], /, *args: Any, **kwargs: Any) -> futures.Future[T]:
        future = super().submit(fn, *args, **kwargs)
        future.add_done_callback(self._given_back)
        return future


class Health:
    """grpc.health.v1 Check, answered without reading the request: a probe that never sends
    one cannot hold a thread, and a busy API pool never delays a probe (a pool of its own)."""

    def __init__(self) -> None:
        self.serving = False
        self.pool = futures.ThreadPoolExecutor(max_workers=2, thread_name_prefix="health")

    def handler(self, pool: futures.ThreadPoolExecutor | None = None) -> Any:
        """Check's handler, run on ``pool`` (default: the health pool)."""
        from grpc_health.v1 import health_pb2

        def check(requests: Iterator[Any], context: grpc.ServicerContext) -> Any:
            status = (
                health_pb2.HealthCheckResponse.SERVING if self.serving else health_pb2.HealthCheckResponse.NOT_SERVING
            )
            return health_pb2.HealthCheckResponse(status=status)

        return grpc.stream_unary_rpc_method_handler(
            _on_pool(check, pool or self.pool), response_serializer=health_pb2.HealthCheckResponse.SerializeToString
        )


class HealthOnly(grpc.ServerInterceptor):
    """The plain-text probe port (Kubernetes' gRPC probes speak no TLS): Check and nothing else."""

    def __init__(self, health: Health) -> None:
        self.health = health

    def intercept_service(self, continuation: Callable[[Any], Any], details: Any) -> Any:
        return self.health.handler() if details.method == HEALTH_CHECK else None


#: The plain-text probe port's bounds: a prober asks one Check at a time.  Streams a client opens
#: and never ends (each ~15 bytes on the wire) each held memory in gRPC's core, unbounded:
#: 400 000 of them in 15 s took an agent from 52 MB to 539 MB.
PROBE_OPTIONS = (
    ("grpc.so_reuseport", 0),  # (see server)
    ("grpc.max_allowed_incoming_connections", 1024),  # (see MAX_CONNECTIONS; each idle one cut at 30 s)
    ("grpc.max_concurrent_streams", 4),  # per connection
    ("grpc.max_connection_idle_ms", 30_000),
    ("grpc.max_connection_age_ms", 120_000),
    ("grpc.max_connection_age_grace_ms", 5_000),
    ("grpc.max_receive_message_length", 1024),
)
PROBES_AT_ONCE = 8


def probe_server(health: Health) -> grpc.Server:
    """The plain-text probe port's server (Kubernetes' gRPC probes speak no TLS): Check and
    nothing else, its streams and calls bounded (past :data:`PROBES_AT_ONCE` a call is refused,
    never queued), on the health pool of its own."""
    return grpc.server(
        health.pool,
        interceptors=[HealthOnly(health)],
        options=PROBE_OPTIONS,
        maximum_concurrent_rpcs=PROBES_AT_ONCE,
    )


class AuthInterceptor(grpc.ServerInterceptor):
    """See the module docstring.  ``audiences``: the names this agent answers to;
    ``refused(reason)`` is called for each refusal (metrics).  At most ``workers`` calls run at
    once (:attr:`calls`, the server's pool); one more is refused at once (RESOURCE_EXHAUSTED),
    never queued.  Refusals run on a pool of their own (:attr:`refusals`, bounded apart): they
    never wait for a busy API, nor take an authenticated caller's turn."""

    def __init__(
        self,
        secret: bytes,
        audiences: set[str],
        health: Health,
        refused: Callable[[str], None] = lambda reason: None,
        workers: int = 32,
    ) -> None:
        self.secret = secret
        self.audiences = {a.lower() for a in audiences if a}
        self.health = health
        self.refused = refused
        self.replays = _Replays()
        self.started = time.monotonic()  # (read on the wall clock at each check: a step moves it too)
        self.said = Hushed(log)  # (a flood is counted in full, but logged at most once a second)
        self.calls = Bounded(workers, workers, "rpc")
        self.refusals = Bounded(2, REFUSALS_AT_ONCE, "rpc-refuse")

    def _check_call(self, method: str, metadata: dict[str, str]) -> tuple[str, str] | None:
        """Why the call is refused, and the sentence saying so; None if it is not."""
        parts = str(metadata.get(HEADER, "")).split(".")
        if len(parts) != 4 or parts[0] != VERSION or not is_whole(parts[1]):
            return "no_credentials", REASONS["no_credentials"]
        _, ts, nonce, mac = parts
        if not any(hmac.compare_digest(mac, _hmac(self.secret, "call", method, a, ts, nonce)) for a in self.audiences):
            return "wrong_secret", REASONS["wrong_secret"]
        now = clock.now()
        off = int(ts) / 1000 - now
        if abs(off) > SKEW:
            return "stale", (
                f"its timestamp is {clock.apart(off)} this agent's clock, outside the {SKEW:.0f} s window: "
                "the two nodes' clocks are apart (keep them in sync: NTP), or the call is a replay"
            )
        if int(ts) < int((now - (time.monotonic() - self.started)) * 1000):  # (the start, on the clock as it reads now)
            return "before_start", REASONS["before_start"]
        if not self.replays.fresh(nonce, now):
            return "replay", REASONS["replay"]
        return None

    def _refuse(self, method: str, reason: str, context: grpc.ServicerContext, sentence: str = "") -> None:
        self.said.warning("refused %s from %s: %s", method, context.peer(), sentence or REASONS[reason])
        self.refused(reason)
        if reason in ("stale", "before_start"):  # (the caller then signs on this clock: tpagent/common/clock.py)
            context.set_trailing_metadata(((CLOCK_HEADER, str(int(clock.now() * 1000))),))
        code = grpc.StatusCode.RESOURCE_EXHAUSTED if reason == "busy" else grpc.StatusCode.UNAUTHENTICATED
        context.abort(code, f"refused the call: {sentence or REASONS[reason]}")

    def _reject(self, method: str, reason: str, sentence: str) -> Any:
        """A handler that refuses at once, never reading the request (which may never come);
        None (gRPC's own refusal, with no thread) past :data:`REFUSALS_AT_ONCE` under way."""

        def reject(requests: Iterator[Any], context: grpc.ServicerContext) -> Any:
            self._refuse(method, reason, context, sentence)

        if self.refusals.take(always=reason in PROVEN):
            return grpc.stream_unary_rpc_method_handler(_on_pool(reject, self.refusals))
        self.said.warning("refused %s: %s (%d refusals under way)", method, sentence, REFUSALS_AT_ONCE)
        self.refused(reason)
        return None

    def _check_body(self, method: str, request: Any, context: grpc.ServicerContext) -> None:
        md = dict(context.invocation_metadata())
        call_mac = str(md.get(HEADER, "")).rpartition(".")[2]
        if not hmac.compare_digest(str(md.get(BODY_HEADER, "")), _body_mac(self.secret, call_mac, request)):
            self._refuse(method, "wrong_body", context)

    def intercept_service(self, continuation: Callable[[Any], Any], details: Any) -> Any:
        method = details.method
        if method == HEALTH_CHECK:  # (brief, its request never read: bounded as refusals are)
            return self.health.handler(self.refusals) if self.refusals.take() else None
        refusal = self._check_call(method, dict(details.invocation_metadata or ()))
        if refusal is not None:
            return self._reject(method, *refusal)
        handler = continuation(details)
        if handler is None:
            return None
        if handler.request_streaming:
            return self._reject(method, "streaming", REASONS["streaming"])  # default: deny
        if not self.calls.take():
            return self._reject(method, "busy", REASONS["busy"])
        if handler.unary_unary is not None:
            inner_uu = handler.unary_unary

            def uu(request: Any, context: grpc.ServicerContext) -> Any:
                self._check_body(method, request, context)
                return inner_uu(request, context)

            return handler._replace(unary_unary=_on_pool(uu, self.calls))
        inner_us = handler.unary_stream

        def us(request: Any, context: grpc.ServicerContext) -> Iterator[Any]:
            self._check_body(method, request, context)
            yield from inner_us(request, context)

        return handler._replace(unary_stream=_on_pool(us, self.calls))


class _ClientAuth(grpc.UnaryUnaryClientInterceptor, grpc.UnaryStreamClientInterceptor):
    def __init__(self, secret: bytes, audience: str) -> None:
        self.secret = secret
        self.audience = audience
        self.offset = 0.0  # the agent's clock minus ours, once it said so

    def _details(self, details: Any, request: Any) -> Any:
        metadata = [*(details.metadata or []), *sign(self.secret, details.method, self.audience, request, self.offset)]
        return _Details(
            details.method, details.timeout, metadata, details.credentials, details.wait_for_ready, details.compression
        )

    def intercept_unary_unary(self, continuation: Any, details: Any, request: Any) -> Any:
        call = continuation(self._details(details, request), request)
        if call.code() is grpc.StatusCode.UNAUTHENTICATED and self._learn_clock(call):
            call = continuation(self._details(details, request), request)  # (the refused call never ran)
        return call

    def _learn_clock(self, call: Any) -> bool:
        """Whether the agent refused the call for its timestamp and said what its clock reads."""
        theirs = str(dict(call.trailing_metadata() or ()).get(CLOCK_HEADER, ""))
        if not is_whole(theirs):
            return False
        self.offset = int(theirs) / 1000 - clock.now()
        log.warning(
            "the clock of the agent at %s is %s this node's; signing calls to it on its clock "
            "(keep the nodes' clocks in sync: NTP)",
            self.audience,
            clock.apart(self.offset),
        )
        return True

    def intercept_unary_stream(self, continuation: Any, details: Any, request: Any) -> Any:
        return continuation(self._details(details, request), request)


class _Details(
    collections.namedtuple("_Details", "method timeout metadata credentials wait_for_ready compression"),
    grpc.ClientCallDetails,
):
    pass


def _options() -> list[tuple[str, int]]:
    return [("grpc.max_receive_message_length", MAX_MESSAGE), ("grpc.max_send_message_length", MAX_MESSAGE)]


#: A call in flight pings its agent this often, and a peer that does not answer a ping this long
#: (a node gone, a partition) ends the call at once, not at its deadline (a restore's: an hour).
KEEPALIVE_MS = 10_000
#: A channel to an agent that was down tries again within this long (gRPC's own: up to 120 s).
RECONNECT_MAX_MS = 5_000


def _client_options() -> list[tuple[str, int]]:
    return [
        *_options(),
        ("grpc.keepalive_time_ms", KEEPALIVE_MS),
        ("grpc.keepalive_timeout_ms", KEEPALIVE_MS),
        ("grpc.http2.max_pings_without_data", 0),  # (a long call sends nothing while it waits)
        ("grpc.initial_reconnect_backoff_ms", 500),
        ("grpc.min_reconnect_backoff_ms", 500),
        ("grpc.max_reconnect_backoff_ms", RECONNECT_MAX_MS),
    ]


def channel(address: str, creds: Credentials) -> grpc.Channel:
    """A mutual-TLS channel to an agent, every call signed for that agent; UsageError if
    ``address`` is no HOST:PORT (gRPC would take a port over 65535 wrapped, none as 443)."""
    if not audience_of(address) or port_of(address, at_least=1) is None or not _text(address):
        raise UsageError(f"{address!r} is not HOST:PORT.")
    tls = grpc.ssl_channel_credentials(root_certificates=creds.ca, private_key=creds.key, certificate_chain=creds.cert)
    return grpc.intercept_channel(
        grpc.secure_channel(address, tls, options=_client_options()), _ClientAuth(creds.secret, audience_of(address))
    )


def stub(address: str, creds: Credentials) -> Any:
    return pb_grpc.AgentStub(channel(address, creds))


def _text(address: str) -> bool:
    """Whether ``address`` is text (not bytes of no encoding, as a mistyped argument can be)."""
    try:
        address.encode()
    except UnicodeEncodeError:
        return False
    return True


def listen(srv: grpc.Server, address: str, tls: grpc.ServerCredentials | None, what: str, who: str) -> None:
    """Have ``srv`` listen on ``address``, HOST:PORT (with ``tls``; None: plain text), or raise UsageError
    "cannot ``what`` on ADDRESS" and why ("is another ``who`` running there?" for a port taken).  The host
    is tried first, so that gRPC logs no line of its own; gRPC says no by 0 or, in later releases, by
    RuntimeError, and takes a port over 65535 as that number wrapped."""
    port = port_of(address)
    why = "give HOST:PORT, the port 1 to 65535" if port is None else bind_problem(address.rpartition(":")[0], port)
    with contextlib.suppress(RuntimeError):
        if why is None and (srv.add_secure_port(address, tls) if tls else srv.add_insecure_port(address)):
            return
    if why is None or why == TAKEN:  # (taken since it was tried, if gRPC alone says no)
        raise UsageError(f"cannot {what} on {address}; is another {who} running there?")
    raise UsageError(f"cannot {what} on {address}: {why}.")


#: The connections an agent's API holds at once, TLS handshakes under way too: past it gRPC closes
#: a new one at once.  Unbounded, 15 000 connections that never sent a byte (anyone on the network
#: may open them) took an agent from 69 MB to 617 MB while they lasted (10 s each) and to 858 MB
#: after; an agent's callers are its CLI, the orchestrator and the agents of its jobs' ranks.
MAX_CONNECTIONS = 4096


def server(
    creds: Credentials, interceptor: AuthInterceptor, connections: int = 0
) -> tuple[grpc.Server, grpc.ServerCredentials]:
    """The agent's gRPC server (not started) and its TLS credentials (client certificates
    of the cluster CA required).  The interceptor bounds the calls under way (see
    :class:`AuthInterceptor`); at most ``connections`` connections are held (0: :data:`MAX_CONNECTIONS`)."""
    srv = grpc.server(
        interceptor.calls,
        interceptors=[interceptor],
        # A connection that has not finished its TLS handshake in 10 s is closed.
        options=[
            *_options(),
            # gRPC binds with SO_REUSEPORT unless told: a second agent, or the orchestrator, on a port
            # an agent serves started beside it, and took half its connections.
            ("grpc.so_reuseport", 0),
            ("grpc.max_concurrent_streams", MAX_STREAMS_PER_CONNECTION),
            ("grpc.server_handshake_timeout_ms", 10_000),
            ("grpc.max_allowed_incoming_connections", connections or MAX_CONNECTIONS),
            # Callers ping while a call waits (KEEPALIVE_MS): allowed, not counted as abuse.
            ("grpc.http2.min_ping_interval_without_data_ms", KEEPALIVE_MS // 2),
        ],
        # (no maximum_concurrent_rpcs: it would count refusals with the calls; the interceptor bounds each)
    )
    tls = grpc.ssl_server_credentials([(creds.key, creds.cert)], root_certificates=creds.ca, require_client_auth=True)
    return srv, tls
