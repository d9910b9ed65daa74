"""A rank stopped by one move takes what stops it, tears it down, rebuilds it or lets it go on
from that move alone (the rank's runtime, :mod:`tpagent_rank.agent`, its own requests): a second
move of the job, started on another node meanwhile, is refused and changes nothing.  (The
coordinator against such ranks: tests/rank/test_rewire_protocol.py.)"""

from __future__ import annotations

from typing import Any

import pytest

from tpagent_rank import protocol as P
from tpagent_rank.agent import Rank


@pytest.mark.parametrize(
    "request_",
    [P.Pause(at=9, by="m2"), P.Cancel(by="m2"), P.Teardown(by="m2"), P.Rebuild(gen=2, by="m2"), P.Resume(by="m2")],
)
def test_a_rank_stopped_by_one_move_refuses_another(request_: P.Request[Any]) -> None:
    rank = Rank("j", 0, 2, None, None, "tpagent-test-unused")
    assert rank._do(P.Pause(at=5, by="m1")).ok
    refused = rank._do(request_)
    assert not refused.ok and "stopped by another move of its job (m1)" in refused.error
    assert isinstance(refused, request_.ANSWER)
    assert (rank.stop_at, rank.stopped_by, rank.torn, rank.gen) == (5, "m1", False, 0)  # (nothing changed)
    assert rank._do(P.Pause(at=6, by="m1")).ok and rank.stop_at == 6  # (the same move, again: a later step)


def test_a_rank_let_go_on_by_its_move_is_any_moves_again() -> None:
    rank = Rank("j", 0, 2, None, None, "tpagent-test-unused")
    assert rank._do(P.Pause(at=5, by="m1")).ok
    assert rank._do(P.Cancel(by="m1")).ok and (rank.stop_at, rank.stopped_by) == (None, "")
    assert rank._do(P.Pause(at=7, by="m2")).ok and rank.stopped_by == "m2"
    assert rank._do(P.Resume(by="m2")).ok and (rank.stop_at, rank.stopped_by) == (None, "")


def test_a_pause_takes_the_rank_only_if_no_other_move_took_it_meanwhile() -> None:
    """Each request is answered on a thread of its own: two moves' pauses may both pass the check
    before either takes the rank.  The pause checks again as it takes it, under the same lock."""
    rank = Rank("j", 0, 2, None, None, "tpagent-test-unused")
    assert rank._do(P.Pause(at=5, by="m1")).ok
    late = rank._pause(P.Pause(at=9, by="m2"))  # (as a pause that passed the check before m1 took it)
    assert not late.ok and "stopped by another move of its job (m1)" in late.error
    assert (rank.stop_at, rank.stopped_by) == (5, "m1")
