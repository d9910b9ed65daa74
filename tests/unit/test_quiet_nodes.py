"""A node that has missed its reports is taken as lost early only where its host takes no
connection (:func:`tpagent.orchestrator.lost._host_answers`): a host whose agent listens, or is
down (the connection refused at once), runs, and its ranks may run on.  The host that does not
answer (a link down) is the cluster test's (``tests/orchestrator/test_recover_lost.py``, (j))."""

from __future__ import annotations

import socket

import pytest

from tpagent.orchestrator.lost import _host_answers

pytestmark = pytest.mark.unit


def test_a_host_whose_agent_listens_answers() -> None:
    with socket.create_server(("127.0.0.1", 0)) as s:
        assert _host_answers(f"127.0.0.1:{s.getsockname()[1]}")


def test_a_host_whose_agent_is_down_answers_by_refusing() -> None:
    with socket.create_server(("127.0.0.1", 0)) as s:
        port = s.getsockname()[1]
    assert _host_answers(f"127.0.0.1:{port}")
