"""A node that has missed its reports is taken as lost early only where its host takes no
connection (:func:`tpagent.orchestrator.lost._host_answers`): a host whose agent listens, or is
down (the connection refused at once), runs, and its ranks may run on.  The host that does not
answer (a link down) is the cluster test's (``tests/orchestrator/test_recover_lost.py``, (j)).
Nor is a silent node taken as lost while a job of its ranks goes on without it
(:class:`tpagent.orchestrator.lost.Steps`, from the reports of its ranks elsewhere)."""

from __future__ import annotations

import socket

import pytest

from tpagent.orchestrator.api import NodeSeen, RankSeen
from tpagent.orchestrator.lost import Steps, _host_answers

pytestmark = pytest.mark.unit


def test_a_host_whose_agent_listens_answers() -> None:
    with socket.create_server(("127.0.0.1", 0)) as s:
        assert _host_answers(f"127.0.0.1:{s.getsockname()[1]}")


def test_a_host_whose_agent_is_down_answers_by_refusing() -> None:
    with socket.create_server(("127.0.0.1", 0)) as s:
        port = s.getsockname()[1]
    assert _host_answers(f"127.0.0.1:{port}")


def _seen(at: float, steps: dict[int, int], job: str = "j") -> NodeSeen:
    return NodeSeen("B", "10.0.0.2:7400", at, ranks=tuple(RankSeen(job, r, 3, step) for r, step in steps.items()))


def test_a_job_that_went_on_two_steps_past_a_nodes_last_moment_shows_its_ranks_run() -> None:
    """Rank 1 of the job, elsewhere, reports steps 10, 11 (at 5.0, past the moment 4.5 by which the
    silent node's ranks could last have died), then 12, 13: two steps after 11 cannot have been
    made without them.  One step after it can (a rank in no collective with them finishing)."""
    steps = Steps(horizon=30.0)
    for at, step in ((4.0, 10), (5.0, 11), (6.0, 12)):
        steps.note(_seen(at, {1: step}))
    assert steps.went_on("j", [1], since=4.5) is None
    steps.note(_seen(7.0, {1: 13}))
    assert steps.went_on("j", [1], since=4.5) == "rank 1 of job j went on from step 11 to 13"
    assert steps.went_on("j", [1], since=5.0) is None  # (11 was seen at 5.0: not after it)
    assert steps.went_on("j", [2], since=4.5) is None and steps.went_on("other", [1], since=4.5) is None


def test_a_job_that_steps_faster_than_its_reports_counts_every_step_between_them() -> None:
    steps = Steps(horizon=30.0)
    steps.note(_seen(1.0, {0: 100}))  # (before the moment: the steps made until then prove nothing)
    steps.note(_seen(2.0, {0: 140}))
    assert steps.went_on("j", [0], since=1.5) is None
    steps.note(_seen(3.0, {0: 141}))
    assert steps.went_on("j", [0], since=1.5) is None
    steps.note(_seen(3.5, {0: 142}))
    assert steps.went_on("j", [0], since=1.5) == "rank 0 of job j went on from step 140 to 142"


def test_a_rank_restarted_from_an_earlier_step_is_not_taken_as_going_on() -> None:
    steps = Steps(horizon=30.0)
    for at, step in ((1.0, 50), (2.0, 51), (3.0, 40), (4.0, 41)):
        steps.note(_seen(at, {0: step}))
    assert steps.went_on("j", [0], since=1.5) is None


def test_the_pace_is_the_slowest_ranks_and_only_what_was_seen_until_then() -> None:
    steps = Steps(horizon=60.0)
    for at in range(6):
        steps.note(_seen(float(at), {0: 10 * at, 1: at // 2}))
    assert steps.pace("j", [0], before=5.0) == pytest.approx(0.1)
    assert steps.pace("j", [0, 1], before=5.0) == pytest.approx(2.0)  # (rank 1: steps 0, 1, 2 seen at 0, 2, 4 s)
    assert steps.pace("j", [1], before=1.0) is None  # (not seen to step by then)
    assert steps.pace("j", [7], before=5.0) is None


def test_only_the_horizon_and_the_change_before_it_are_kept_and_ranks_no_longer_heard_of_are_forgotten() -> None:
    steps = Steps(horizon=10.0)
    for at in range(0, 31):
        steps.note(_seen(float(at), {0: at}, job="long"))
    assert steps.changes[("long", 0)][0] == (19.0, 19)  # (the newest before 30 - 10, then each since)
    assert len(steps.changes[("long", 0)]) == 12
    steps.note(_seen(5.0, {1: 1}, job="short"))  # (a rank last heard of long ago ...)
    steps.heard[("short", 1)] = 5.0
    steps.note(_seen(41.0, {0: 41}, job="long"))  # (... is forgotten by the next report past the horizon)
    assert ("short", 1) not in steps.changes and ("long", 0) in steps.changes
