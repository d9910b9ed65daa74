"""The last look an agent takes at another before that one's ranks are rebuilt elsewhere
(:func:`tpagent.daemon.node.answers`): any word within ANSWER_WITHIN s, a refusal too, is an
answer; only silence is not.  It asks how a migration of no id stands, never for the node's
description: Info reads the GPUs through NVML and runs CRIU, which on a node whose GPU is failing
may not come back in time while its ranks run on, and they would be rebuilt a second time."""

from __future__ import annotations

import pytest

from support.protocol_fakes import StatusOnly
from tpagent.daemon.node import ANSWER_WITHIN, answers
from tpagent.migration.api import PeerStatus, PeerUnreachable, Refused, Why


def _agent(says: Exception | None) -> StatusOnly:
    """An agent whose Status says ``says`` (None: a status); asked for Info, it fails the test."""

    def answer(migration_id: str) -> PeerStatus:
        if says is not None:
            raise says
        return PeerStatus(migration_id, "done")

    return StatusOnly("node-b:7400", answer)


@pytest.mark.parametrize(
    "says",
    [Refused("no migration '' on node-b", Why.NOT_FOUND), Refused("its journal cannot be read", Why.INTERNAL), None],
)
def test_an_agent_that_says_anything_answers_and_is_not_asked_for_its_gpus(says: Exception | None) -> None:
    agent = _agent(says)
    assert answers(agent) is True
    assert agent.asked == [("", ANSWER_WITHIN)]


def test_an_agent_that_says_nothing_in_time_does_not_answer() -> None:
    agent = _agent(PeerUnreachable("unreachable, no answer in time"))
    assert answers(agent) is False
    assert agent.asked == [("", ANSWER_WITHIN)]
