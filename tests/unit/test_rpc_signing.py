"""tpagent.daemon.rpc: calls signed with the cluster secret, checked by the server's AuthInterceptor.

No server runs: the interceptor is given a call as grpc would (its method and metadata) and a
real grpc handler behind it; the handler it returns is called as grpc would call it."""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any, NamedTuple

import grpc
import pytest
from grpc_health.v1 import health_pb2

from tpagent.daemon import rpc
from tpagent.daemon.rpc import pb

SECRET = b"c" * 32
STATUS = "/tpagent.v1.Agent/Status"
CANCEL = "/tpagent.v1.Agent/Cancel"


class Details(NamedTuple):
    """What grpc hands ``intercept_service`` (grpc.HandlerCallDetails)."""

    method: str
    invocation_metadata: tuple[tuple[str, str], ...]


class Aborted(Exception):
    pass


class Context:
    """The few parts of grpc.ServicerContext the interceptor uses; ``abort`` raises, as grpc's does."""

    def __init__(self, metadata: Sequence[tuple[str, str]]) -> None:
        self.metadata = tuple(metadata)
        self.trailing: tuple[tuple[str, str], ...] = ()

    def set_trailing_metadata(self, metadata: tuple[tuple[str, str], ...]) -> None:
        self.trailing = metadata

    def invocation_metadata(self) -> tuple[tuple[str, str], ...]:
        return self.metadata

    def peer(self) -> str:
        return "ipv4:10.0.0.9:50000"

    def abort(self, code: grpc.StatusCode, details: str) -> None:
        raise Aborted(code, details)


class Server:
    """An AuthInterceptor answering to ``node-a``, in front of a method that echoes the request."""

    def __init__(self) -> None:
        self.health = rpc.Health()
        self.refusals: list[str] = []
        self.trailing: dict[str, str] = {}
        self.interceptor = rpc.AuthInterceptor(SECRET, {"Node-A"}, self.health, refused=self.refusals.append)

    def call(self, method: str, metadata: Sequence[tuple[str, str]], request: Any, streaming: bool = False) -> Any:
        """The answer, or the refusal's words."""

        def echo(request: Any, context: Any) -> Any:
            return ("answered", request)

        def behind(details: Any) -> grpc.RpcMethodHandler:
            return (
                grpc.stream_stream_rpc_method_handler(echo) if streaming else grpc.unary_unary_rpc_method_handler(echo)
            )

        handler = self.interceptor.intercept_service(behind, Details(method, tuple(metadata)))
        context = Context(metadata)
        try:
            if handler.unary_unary is not None:
                return handler.unary_unary(request, context)
            return handler.stream_unary(iter([request]), context)
        except Aborted as e:
            code, words = e.args
            assert code is grpc.StatusCode.UNAUTHENTICATED
            self.trailing = dict(context.trailing)
            return words


@pytest.fixture
def server() -> Server:
    return Server()


def _ref(migration_id: str = "m-1") -> Any:
    return pb.MigrationRef(migration_id=migration_id)


def test_a_signed_call_is_answered(server: Server) -> None:
    request = _ref()
    assert server.call(STATUS, rpc.sign(SECRET, STATUS, "node-a", request), request) == ("answered", request)
    assert server.refusals == []


def test_the_signature_is_versioned_and_has_a_fresh_nonce() -> None:
    first = rpc.sign(SECRET, STATUS, "node-a", _ref())
    second = rpc.sign(SECRET, STATUS, "node-a", _ref())
    assert [k for k, _ in first] == [rpc.HEADER, rpc.BODY_HEADER]
    version, ts, nonce, mac = first[0][1].split(".")
    assert (version, len(nonce), len(mac)) == ("v2", 24, 64)
    assert abs(int(ts) / 1000 - time.time()) < 5
    assert first[0][1].split(".")[2] != second[0][1].split(".")[2]


def test_the_body_signature_binds_the_request(server: Server) -> None:
    metadata = rpc.sign(SECRET, STATUS, "node-a", _ref("m-1"))
    assert server.call(STATUS, metadata, _ref("m-2")) == "refused the call: a request that is not the one signed"
    assert server.refusals == ["wrong_body"]


@pytest.mark.parametrize(
    ("secret", "method", "audience"),
    [(b"d" * 32, STATUS, "node-a"), (SECRET, CANCEL, "node-a"), (SECRET, STATUS, "node-b")],
    ids=["another secret", "another method", "another node"],
)
def test_a_call_signed_otherwise_is_refused(server: Server, secret: bytes, method: str, audience: str) -> None:
    request = _ref()
    answer = server.call(STATUS, rpc.sign(secret, method, audience, request), request)
    assert answer == f"refused the call: {rpc.REASONS['wrong_secret']}"
    assert server.refusals == ["wrong_secret"]


@pytest.mark.parametrize("header", [None, "", "v1.1.aa.bb", "v2.now.aa.bb", "v2.1.aa", "v2.1.aa.bb.cc"])
def test_missing_or_malformed_credentials_are_refused(server: Server, header: str | None) -> None:
    metadata = [] if header is None else [(rpc.HEADER, header)]
    assert server.call(STATUS, metadata, _ref()) == "refused the call: no credentials"
    assert server.refusals == ["no_credentials"]


def test_a_replayed_call_is_refused(server: Server) -> None:
    request = _ref()
    metadata = rpc.sign(SECRET, STATUS, "node-a", request)
    assert server.call(STATUS, metadata, request) == ("answered", request)
    assert server.call(STATUS, metadata, request) == "refused the call: a replayed call"
    assert server.refusals == ["replay"]


def test_a_call_signed_too_long_ago_or_before_the_server_started_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    request = _ref()
    now = time.time()
    with monkeypatch.context() as m:
        m.setattr(time, "time", lambda: now - rpc.SKEW - 5)
        stale = rpc.sign(SECRET, STATUS, "node-a", request)
        m.setattr(time, "time", lambda: now - 5)
        earlier = rpc.sign(SECRET, STATUS, "node-a", request)
    server = Server()
    answer = server.call(STATUS, stale, request)
    assert answer.startswith("refused the call: its timestamp is 65.") and "s behind this agent's clock" in answer
    assert abs(int(server.trailing[rpc.CLOCK_HEADER]) / 1000 - time.time()) < 5  # (the caller may sign on it)
    assert server.call(STATUS, earlier, request) == f"refused the call: {rpc.REASONS['before_start']}"
    assert server.refusals == ["stale", "before_start"]


class _Outcome:
    """What a blocking unary call's continuation returns (grpc.Call): its code and trailing metadata."""

    def __init__(self, code: grpc.StatusCode, trailing: tuple[tuple[str, str], ...] = ()) -> None:
        self._code = code
        self._trailing = trailing

    def code(self) -> grpc.StatusCode:
        return self._code

    def trailing_metadata(self) -> tuple[tuple[str, str], ...]:
        return self._trailing


@pytest.mark.parametrize("ahead", [+600.0, -600.0])
def test_a_caller_refused_for_its_clock_signs_on_the_agents_clock_and_tries_once_more(ahead: float) -> None:
    """A clock step between two nodes past the window: the first call is refused (it never ran),
    the agent's clock comes with the refusal, and that call and the later ones are signed on it."""
    server_clock = time.time() + ahead
    signed_at: list[float] = []

    def continuation(details: Any, request: Any) -> _Outcome:
        ts = int(dict(details.metadata)[rpc.HEADER].split(".")[1]) / 1000
        signed_at.append(ts)
        if abs(ts - server_clock) > rpc.SKEW:
            return _Outcome(grpc.StatusCode.UNAUTHENTICATED, ((rpc.CLOCK_HEADER, str(int(server_clock * 1000))),))
        return _Outcome(grpc.StatusCode.OK)

    auth = rpc._ClientAuth(SECRET, "node-a")
    details = rpc._Details(STATUS, 5.0, [], None, None, None)
    assert auth.intercept_unary_unary(continuation, details, _ref()).code() is grpc.StatusCode.OK
    assert auth.intercept_unary_unary(continuation, details, _ref()).code() is grpc.StatusCode.OK
    assert len(signed_at) == 3  # refused once, then answered twice
    assert abs(signed_at[1] - server_clock) < 5 and abs(signed_at[2] - server_clock) < 5


def test_a_refusal_without_the_agents_clock_is_not_tried_again() -> None:
    calls: list[object] = []

    def continuation(details: Any, request: Any) -> _Outcome:
        calls.append(details)
        return _Outcome(grpc.StatusCode.UNAUTHENTICATED)  # (a wrong secret: no clock comes with it)

    auth = rpc._ClientAuth(SECRET, "node-a")
    details = rpc._Details(STATUS, 5.0, [], None, None, None)
    assert auth.intercept_unary_unary(continuation, details, _ref()).code() is grpc.StatusCode.UNAUTHENTICATED
    assert len(calls) == 1 and auth.offset == 0.0


def test_a_streaming_method_is_refused_even_when_signed(server: Server) -> None:
    request = _ref()
    answer = server.call(STATUS, rpc.sign(SECRET, STATUS, "node-a", request), request, streaming=True)
    assert answer == f"refused the call: {rpc.REASONS['streaming']}"


def test_the_health_check_needs_no_credentials(server: Server) -> None:
    handler = server.interceptor.intercept_service(lambda details: None, Details(rpc.HEALTH_CHECK, ()))
    answer = handler.stream_unary(iter(()), Context(()))
    assert answer.status == health_pb2.HealthCheckResponse.NOT_SERVING
    server.health.serving = True
    assert handler.stream_unary(iter(()), Context(())).status == health_pb2.HealthCheckResponse.SERVING
    assert server.refusals == []


@pytest.mark.parametrize(
    ("address", "audience"),
    [("Node-A:7400", "node-a"), ("10.0.0.17:7400", "10.0.0.17"), ("[FE80::1]:7400", "fe80::1"), ("node-a", "")],
)
def test_audience_of(address: str, audience: str) -> None:
    assert rpc.audience_of(address) == audience
