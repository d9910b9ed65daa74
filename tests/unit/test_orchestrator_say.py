"""The orchestrator's word to an agent about a rebuild or a lost node
(:meth:`tpagent.orchestrator.lost.LostNodes._say`) is said again while the agent turned it away
unheard (too busy, or not reached), and never after an answer that may have been heard: a word
lost so leaves a rebuilt rank's stand-in not following it, or a rank not told its peer is gone.
The agent is a stand-in for its gRPC stub's Rank call alone (a real one's answers are the
cluster tier's)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import grpc
import pytest

from tpagent.orchestrator import lost
from tpagent.orchestrator.config import OrchestratorConfig
from tpagent_rank import protocol as P


class _Failed(grpc.RpcError):
    def __init__(self, code: grpc.StatusCode) -> None:
        self._code = code

    def code(self) -> grpc.StatusCode:
        return self._code

    def details(self) -> str:
        return f"the stand-in's {self._code.name}"


class _Agent:
    """Answers each Rank call with the next of ``answers`` (a code: that failure; None: heard)."""

    def __init__(self, *answers: grpc.StatusCode | None) -> None:
        self.answers = list(answers)
        self.asked = 0

    def Rank(self, message: Any, timeout: float) -> Any:  # noqa: N802 (the gRPC method's name)
        self.asked += 1
        code = self.answers.pop(0)
        if code is not None:
            raise _Failed(code)
        return None


def _said(monkeypatch: pytest.MonkeyPatch, agent: _Agent) -> int:
    monkeypatch.setattr(lost, "stub", lambda address, creds: agent)
    monkeypatch.setattr(lost.time, "sleep", lambda seconds: None)
    nodes = lost.LostNodes(OrchestratorConfig(Path("/nonexistent")), None, lambda *a, **k: None, lambda job, node: None)  # type: ignore[arg-type]
    nodes._say("10.0.0.2:7400", "job#" + "0" * 16, 1, P.Rebuilt(to="10.0.0.3:7400"))
    return agent.asked


def test_a_word_turned_away_unheard_is_said_again_until_heard(monkeypatch: pytest.MonkeyPatch) -> None:
    busy, down = grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.UNAVAILABLE
    assert _said(monkeypatch, _Agent(busy, down, None)) == 3


def test_a_word_is_said_no_more_than_so_many_times(monkeypatch: pytest.MonkeyPatch) -> None:
    assert _said(monkeypatch, _Agent(*[grpc.StatusCode.UNAVAILABLE] * 10)) == lost.SAY_TRIES


@pytest.mark.parametrize("code", [grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.PERMISSION_DENIED])
def test_a_word_that_may_have_been_heard_or_was_refused_is_said_once(
    monkeypatch: pytest.MonkeyPatch, code: grpc.StatusCode
) -> None:
    assert _said(monkeypatch, _Agent(code, None)) == 1
