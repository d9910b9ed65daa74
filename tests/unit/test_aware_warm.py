"""A model-aware move waits for its new process to warm up (tpagent.jobs.awaremove.AwareRewire._warmed):
one not yet connected to its agent (importing its libraries on a busy node) is waited for while
its agent says it runs, not given up after one unanswered question; one its agent says is gone
ends the move at once.  The agent is a stand-in answering Where and Locate alone (a real one's
answers are the cluster tier's, tests/agent/test_aware_rewire.py)."""

from __future__ import annotations

import threading
import time
from types import SimpleNamespace
from typing import Any

import pytest

from tpagent.jobs.api import RewireFailed
from tpagent.jobs.awaremove import AwareRewire
from tpagent.migration.api import Refused, Why
from tpagent_rank import protocol as P

JOINER = 4242


def _move(ask: Any) -> Any:
    move = SimpleNamespace(
        cancelled=threading.Event(),
        cancel_reason="",
        moving={1: (JOINER, "10.0.0.2:7400")},
        ask=ask,
        job="job",
        record=SimpleNamespace(joiners={1: JOINER}, key="k" * 16),
        t0=time.monotonic(),
    )
    move._runs_there = lambda r: AwareRewire._runs_there(move, r)  # type: ignore[arg-type]
    return move


def _agent(unconnected: int, here: str = P.Whereabouts.HERE.value) -> Any:
    """Its rank's process answers Where only after ``unconnected`` questions; Locate: ``here``."""
    asked = {"where": 0}

    def ask(agent: str, job: str, rank: int, request: Any, timeout: float, key: str = "") -> Any:
        if isinstance(request, P.Locate):
            return P.Located(state=here, pid=JOINER)
        asked["where"] += 1
        if asked["where"] <= unconnected:
            raise Refused(f"rank {rank} of job {job} did not connect to this agent within 10 s", Why.NOT_FOUND)
        return P.Standing(state=P.RankState.WAITING.value)

    ask.asked = asked  # type: ignore[attr-defined]
    return ask


def test_a_new_process_slow_to_connect_is_waited_for_while_its_agent_says_it_runs() -> None:
    ask = _agent(unconnected=3)
    AwareRewire._warmed(_move(ask), 1, time.monotonic() + 30)  # type: ignore[arg-type]
    assert ask.asked["where"] == 4


def test_a_new_process_its_agent_says_is_gone_ends_the_move_at_once() -> None:
    ask = _agent(unconnected=100, here=P.Whereabouts.GONE.value)
    with pytest.raises(RewireFailed, match="ended or stopped answering as it warmed up"):
        AwareRewire._warmed(_move(ask), 1, time.monotonic() + 30)  # type: ignore[arg-type]
    assert ask.asked["where"] == 1
