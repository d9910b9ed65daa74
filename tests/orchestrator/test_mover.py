"""tpagent.orchestrator.mover against a source agent that is a real gRPC server (mutual TLS, signed
calls, the agent's own interceptor) whose Migrate answers as the test says: only the agent's
decisions are stand-ins."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest

from support.certs import node_certs
from tpagent.common.credentials import Credentials
from tpagent.daemon import rpc
from tpagent.daemon.proto import agent_pb2_grpc as pb_grpc
from tpagent.daemon.rpc import pb
from tpagent.orchestrator import mover
from tpagent.orchestrator.api import Move, MoveKind, MoveState

SECRET = b"unit-tier-secret-0123456789-abcdef"


class Source(pb_grpc.AgentServicer):  # type: ignore[misc]
    """A dry run passes; the move itself is refused as ``refusal`` says (code, words)."""

    def __init__(self, refusal: tuple[grpc.StatusCode, str]) -> None:
        self.refusal = refusal
        self.asked: list[Any] = []

    def Migrate(self, request: Any, context: grpc.ServicerContext) -> Iterator[Any]:  # noqa: N802 (gRPC's name)
        self.asked.append(request)
        if request.dry_run:
            yield pb.MigrationEvent(migration_id="m1", state="done", message="would move")
            return
        context.abort(*self.refusal)


@pytest.fixture
def creds(tmp_path: Path) -> Credentials:
    secret = tmp_path / "secret"
    secret.write_bytes(SECRET)
    secret.chmod(0o600)
    return Credentials.load(secret, node_certs(tmp_path, "node-a"))


def _move(creds: Credentials, refusal: tuple[grpc.StatusCode, str], source: Source | None = None) -> mover.Outcome:
    srv, tls = rpc.server(creds, rpc.AuthInterceptor(SECRET, {"127.0.0.1"}, rpc.Health()))
    pb_grpc.add_AgentServicer_to_server(source or Source(refusal), srv)
    port = srv.add_secure_port("127.0.0.1:0", tls)
    srv.start()
    try:
        m = Move(1, "job1", (1,), "b", "d", MoveKind.AWAY, MoveState.RUNNING, 1)
        return mover.run(m, f"127.0.0.1:{port}", "127.0.0.1:1", creds, 30, ("GPU-d2", "GPU-d0"), lambda mid: None)
    finally:
        srv.stop(None)


def test_a_move_refused_because_another_moves_the_job_now_is_cancelled_not_failed(creds: Credentials) -> None:
    """An operator's `tpagent migrate` of the job began between the orchestrator's dry run and its
    move: the move was recorded failed, against the spare (tried elsewhere, counted in its
    retries), though the spare was not at fault.  Now cancelled: planned again once that ends."""
    said = "job job1 is already being rewired here; wait for it."
    outcome = _move(creds, (grpc.StatusCode.ALREADY_EXISTS, said))
    assert outcome.state is MoveState.CANCELLED, outcome
    assert said in outcome.message and "planned again once that has ended" in outcome.message


def test_a_move_the_source_refuses_otherwise_failed(creds: Credentials) -> None:
    outcome = _move(creds, (grpc.StatusCode.FAILED_PRECONDITION, "the target has no room"))
    assert outcome.state is MoveState.FAILED and "the target has no room" in outcome.message, outcome


def test_the_gpus_chosen_on_the_target_are_named_to_the_source_agent(creds: Credentials) -> None:
    """(Its target agent places the copies on them alone: tests/unit/test_gpu_placement.py.)"""
    source = Source((grpc.StatusCode.FAILED_PRECONDITION, "no"))
    _move(creds, (grpc.StatusCode.FAILED_PRECONDITION, "no"), source)
    assert [(r.dry_run, list(r.target_gpus)) for r in source.asked] == [
        (True, ["GPU-d2", "GPU-d0"]),
        (False, ["GPU-d2", "GPU-d0"]),
    ]
