"""A `tpagent migrate` whose source agent stopped answering mid-migration waits for it to come
back and settle the migration from its journal; when it gives up, its one sentence says which
way: the agent never answered again, or it answers but has not settled the migration yet
(cli.following.source_lost, with its two waits cut short).

The agent that never answers is a real gRPC channel to a port nobody listens on; the one that
answers without settling is a stand-in with the agent's Status call alone (a real agent's
journal settling takes the cluster tier's tests, which follow it to its end)."""

from __future__ import annotations

import json
import socket
from typing import Any

import grpc
import pytest
import typer

from cli import following
from tpagent.daemon.proto import agent_pb2 as pb
from tpagent.daemon.proto import agent_pb2_grpc as pb_grpc

MID = "a" * 32
LAST = pb.MigrationEvent(migration_id=MID, state="restoring")


class _Settling:
    """An agent that answers, and says the migration is still being settled."""

    asked = 0

    def Status(self, ref: Any, timeout: float) -> Any:  # noqa: N802 (the gRPC method's name)
        self.asked += 1
        return pb.MigrationStatus(migration_id=ref.migration_id, state="committing")


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])  # (closed again as this returns: nothing listens there)


def _gives_up(agent: Any, capsys: pytest.CaptureFixture[str]) -> dict[str, Any]:
    """The CLI's JSON error once it gives up on the source agent (its sentence on stderr, alone)."""
    with pytest.raises(typer.Exit) as ended:
        following.source_lost(agent, pb, "node-a:7070", LAST, MID, as_json=True)
    assert ended.value.exit_code == following.EXIT_FAILED
    said = capsys.readouterr()
    error = json.loads(said.out)
    assert said.err.count("\n") == 1 and said.err == f"tpagent: {error['error']}\n"  # (one sentence)
    return error


def test_an_agent_that_never_answers_again_is_said_to_be_silent(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(following, "SOURCE_BACK_WITHIN", 0.2)
    with grpc.insecure_channel(f"127.0.0.1:{_closed_port()}") as channel:
        error = _gives_up(pb_grpc.AgentStub(channel), capsys)
    sentence = error["error"]
    assert "did not answer again within 0 s" in sentence and "answers again" not in sentence
    assert f"tpagent status {MID} --agent node-a:7070" in sentence and "(restoring)" in sentence
    assert error["rolled_back"] is False


def test_an_agent_that_answers_but_has_not_settled_is_said_to_go_on(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(following, "SOURCE_BACK_WITHIN", 60.0)  # (it answers at once: not this wait)
    monkeypatch.setattr(following, "SETTLED_WITHIN", 0.3)
    agent = _Settling()
    sentence = _gives_up(agent, capsys)["error"]
    assert agent.asked >= 2  # (followed, not asked once)
    assert "answers again but has not settled it within 0 s; it goes on" in sentence
    assert "did not answer" not in sentence and f"tpagent status {MID} --agent node-a:7070" in sentence


class _Refusing:
    """An agent that answers each Status with an error of its own (too busy for another call)."""

    class Busy(grpc.RpcError):
        def code(self) -> grpc.StatusCode:
            return grpc.StatusCode.RESOURCE_EXHAUSTED

    def Status(self, ref: Any, timeout: float) -> Any:  # noqa: N802 (the gRPC method's name)
        raise self.Busy()


def test_an_agent_that_answers_with_an_error_is_no_silent_one(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(following, "SOURCE_BACK_WITHIN", 0.2)
    monkeypatch.setattr(following, "SETTLED_WITHIN", 1.0)
    sentence = _gives_up(_Refusing(), capsys)["error"]
    assert "answers again but has not settled it within 1 s" in sentence and "did not answer" not in sentence


class _NotKnowing:
    """An agent back without the migration (its journal lost with its disk): it says so."""

    class Unknown(grpc.RpcError):
        def code(self) -> grpc.StatusCode:
            return grpc.StatusCode.NOT_FOUND

        def details(self) -> str:
            return f"no migration {MID} here."

    asked = 0

    def Status(self, ref: Any, timeout: float) -> Any:  # noqa: N802 (the gRPC method's name)
        self.asked += 1
        raise self.Unknown()


def test_an_agent_that_answers_it_knows_no_such_migration_is_not_waited_for(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(following, "SETTLED_WITHIN", 600.0)  # (not waited for at all: its word stands)
    agent = _NotKnowing()
    sentence = _gives_up(agent, capsys)["error"]
    assert agent.asked == 1
    assert f"answers again, but not about it: no migration {MID} here; see tpagent status {MID}" in sentence
