"""A rank that died on a node whose agent lives (issue 27, item 3: its process is gone): which
ends are held from its stand-in for its job to rebuild it, and what the stand-in is told while
the orchestrator decides, once it was rebuilt elsewhere, and once it could not be
(:mod:`tpagent.jobs.ranks`; the whole path: tests/orchestrator/test_recover_lost.py, (f))."""

from __future__ import annotations

import signal
import time

import pytest

from tpagent.common.threads import Threads
from tpagent.jobs.rankentry import RankEntry, died
from tpagent.jobs.ranks import DIED_HOLD, Ranks
from tpagent.migration.api import Refused
from tpagent_rank import protocol as P


def test_only_a_rank_killed_outright_in_a_job_of_several_died() -> None:
    for sig in (signal.SIGKILL, signal.SIGSEGV, signal.SIGBUS, signal.SIGABRT):
        assert died(-int(sig), 4), sig
    assert not died(-int(signal.SIGKILL), 1)  # (a job of one: nothing to rebuild it from)
    for code in (0, 1, 2, 137, -int(signal.SIGTERM), -int(signal.SIGINT), -int(signal.SIGHUP)):
        assert not died(code, 4), code  # (its script's end, or its launcher's)


def _ranks(code: int, held: bool) -> Ranks:
    ranks = Ranks("tpagent-test-died", "10.0.0.1:7400", Threads())
    e = RankEntry("job1", 2, init=1 << 22, init_start=1, world=4, exit_code=code)
    e.held_until = time.monotonic() + DIED_HOLD if held else 0.0
    ranks.entries[("job1", 2)] = e
    return ranks


def test_a_died_ranks_end_is_held_from_its_stand_in_until_it_was_rebuilt_and_it_follows_it_there() -> None:
    ranks = _ranks(-int(signal.SIGKILL), held=True)
    assert ranks.locate("job1", 2).state == P.Whereabouts.MOVING.value
    assert [(e.job, e.rank) for e in ranks.died()] == [("job1", 2)]  # (reported to the orchestrator)
    ranks.rebuilt("job1", 2, "", 960.0)  # (its rebuild runs)
    assert ranks.locate("job1", 2).state == P.Whereabouts.MOVING.value
    ranks.rebuilt("job1", 2, "10.0.0.9:7400", 0.0)
    assert ranks.locate("job1", 2) == P.Located(state=P.Whereabouts.MOVED.value, node="10.0.0.9:7400", anew=True)
    assert ranks.died() == []
    with pytest.raises(Refused, match="did not die on this node"):  # (said again: nothing changes)
        ranks.rebuilt("job1", 2, "10.0.0.8:7400", 0.0)


def test_a_died_rank_that_could_not_be_rebuilt_ends_as_it_died() -> None:
    ranks = _ranks(-int(signal.SIGKILL), held=True)
    ranks.rebuilt("job1", 2, "", 0.0)
    assert ranks.locate("job1", 2) == P.Located(state=P.Whereabouts.EXITED.value, code=-int(signal.SIGKILL))
    assert ranks.died() == []
    ended = _ranks(1, held=False)  # (not held: its end is said at once, as ever)
    assert ended.locate("job1", 2) == P.Located(state=P.Whereabouts.EXITED.value, code=1)
    with pytest.raises(Refused):
        _ranks(0, held=False).rebuilt("job1", 9, "10.0.0.9:7400", 0.0)  # (no such rank here)
