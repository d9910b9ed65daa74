"""A node that has missed its reports is taken as lost early only where its host takes no
connection (:func:`tpagent.orchestrator.lost._host_answers`): a host whose agent listens, or is
down (the connection refused at once), runs, and its ranks may run on.  The host that does not
answer (a link down) is the cluster test's (``tests/orchestrator/test_recover_lost.py``, (j)).
Nor is a silent node taken as lost while a job of its ranks goes on without it
(:class:`tpagent.orchestrator.steps.Steps`, from the reports of its ranks elsewhere)."""

from __future__ import annotations

import dataclasses
import socket
import time
from pathlib import Path

import pytest

from tpagent.orchestrator.api import NodeSeen, RankSeen, View
from tpagent.orchestrator.config import OrchestratorConfig
from tpagent.orchestrator.lost import LostNodes, _host_answers
from tpagent.orchestrator.steps import Steps

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


def test_a_step_seen_to_fall_takes_back_none_seen_before_it() -> None:
    """Its agent restarted (it says 0 until the rank connects again): the steps seen went on."""
    steps = Steps(horizon=30.0)
    for at, step in ((1.0, 1000), (2.0, 1001), (3.0, 1003), (4.0, 0)):
        steps.note(_seen(at, {0: step}))
    assert steps.went_on("j", [0], since=1.5) == "rank 0 of job j went on from step 1001 to 1003"


def _lost_nodes(unreachable_after: float = 30.0) -> LostNodes:
    cfg = OrchestratorConfig(Path("/nonexistent"), report_period=1.0, unreachable_after=unreachable_after)
    return LostNodes(cfg, None, lambda *a, **k: None, lambda job, lost: None)  # type: ignore[arg-type]


def test_a_silent_node_of_a_slow_job_is_taken_as_running_until_two_of_its_steps_have_passed() -> None:
    """Its job stepped every 16 s before C fell silent: C's ranks are taken as lost only once the
    job has stood still for two of its steps (and the reports that carry them), not after 30 s."""
    nodes = _lost_nodes()
    now = time.monotonic()
    for k in range(5):  # (B's rank 1 steps every 16 s until C's last report)
        nodes.steps.note(_seen(now - 80 + 16 * k, {1: k}))
    c = NodeSeen("C", "10.0.0.3:7400", now - 30, ranks=(RankSeen("j", 2, 3, 4),))
    b = NodeSeen("B", "10.0.0.2:7400", now, ranks=(RankSeen("j", 1, 3, 4),))
    view = View({"B": b, "C": c})
    got = nodes.running(view, "C")
    assert got is not None and got[0] == "job j steps every 16.0 s: too few of its steps have passed", got
    assert got[1] == pytest.approx(now - 30 + 1 + 2 * 16 + 2)  # (look again then)
    view = View({"B": b, "C": dataclasses.replace(c, seen=now - 40)})
    assert nodes.running(view, "C") is None  # (35 s after its last moment, twice 16 s and two reports)


def test_a_silent_node_whose_job_went_on_is_taken_as_running_and_lost_once_its_job_stands_still() -> None:
    nodes = _lost_nodes(unreachable_after=10.0)
    now = time.monotonic()
    c = NodeSeen("C", "10.0.0.3:7400", now - 60, ranks=(RankSeen("j", 2, 3, 0),))
    b = NodeSeen("B", "10.0.0.2:7400", now, ranks=(RankSeen("j", 1, 3, 0),))
    for k in range(30):  # (B's rank 1 stepped on for 30 s after C fell silent, then stopped)
        nodes.steps.note(_seen(now - 59 + k, {1: 100 + k}))
    view = View({"B": b, "C": c})
    assert nodes.running(view, "C") is None  # (stood still for the last 29 s: longer than 10 s)
    nodes.steps.note(_seen(now - 1, {1: 140}))
    nodes.steps.note(_seen(now, {1: 142}))
    got = nodes.running(view, "C")
    assert got is not None and got[0] == "rank 1 of job j went on from step 140 to 142", got
