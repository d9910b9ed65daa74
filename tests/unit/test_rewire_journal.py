"""A rewire's phases (tpagent/jobs/api.py) and its journal (tpagent/jobs/journal.py): the table is
checked like the migrations' own, records are written durably and read back whole, and what cannot
be read is left for an operator, never taken for a rewire that ended."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tpagent.jobs.api import REWIRE_FINAL, REWIRE_TRANSITIONS, Phase, RewireRecord, phase_allowed
from tpagent.jobs.journal import RewireJournal, Unwritten
from tpagent.migration.api import BadTransition, JournalError

RID = "ab" * 16


def _record(phase: Phase = Phase.CHECKING) -> RewireRecord:
    r = RewireRecord(RID, "job1", "10.0.0.1:7400", {1: (4242, "10.0.0.2:7400")}, phase)
    r.agents = ["10.0.0.1:7400", "10.0.0.1:7400"]
    return r


def test_the_table_covers_every_phase_and_the_final_ones_lead_nowhere() -> None:
    assert set(REWIRE_TRANSITIONS) == set(Phase)
    assert {Phase.DONE, Phase.ROLLED_BACK, Phase.FAILED} == REWIRE_FINAL
    assert phase_allowed(Phase.TEARDOWN, Phase.TEARDOWN)  # (written again as each move starts)
    assert not phase_allowed(Phase.CHECKING, Phase.DONE)  # (nothing moved before the teardown)
    assert not phase_allowed(Phase.PAUSING, Phase.CHECKING)
    for final in REWIRE_FINAL:
        assert all(not phase_allowed(final, p) for p in Phase)


def test_each_phase_is_written_before_it_takes_effect_and_read_back_whole(tmp_path: Path) -> None:
    journal = RewireJournal(tmp_path / "rewires")
    r = _record()
    journal.move(r, Phase.PAUSING)
    r.gen = 2
    r.step = 40
    r.moves = {1: "cd" * 16}
    journal.move(r, Phase.TEARDOWN, "moving rank 1")
    again = journal.read(RID)
    assert again == r and again is not r
    on_disk = json.loads((tmp_path / "rewires" / f"{RID}.json").read_text())
    assert (
        on_disk["format"] == 1
        and on_disk["phase"] == "teardown"
        and on_disk["moving"] == {"1": [4242, "10.0.0.2:7400"]}
    )
    assert (tmp_path / "rewires").stat().st_mode & 0o777 == 0o700
    assert [x.rewire_id for x in journal.unfinished()] == [RID]
    journal.move(r, Phase.DONE)
    assert journal.unfinished() == []


def test_a_model_aware_moves_joiners_and_the_ranks_it_kept_are_read_back(tmp_path: Path) -> None:
    """What a restart needs to finish one (tpagent/jobs/awaremove.py): its mode, each joiner as it
    started (written again in the same phase), the ranks whose joiners took their places."""
    journal = RewireJournal(tmp_path / "rewires")
    r = _record()
    r.mode = "aware"
    journal.move(r, Phase.PAUSING)
    r.joiners = {1: 777}
    journal.move(r, Phase.PAUSING, "rank 1 started on 10.0.0.2:7400")
    assert phase_allowed(Phase.PAUSING, Phase.PAUSING)
    journal.move(r, Phase.TEARDOWN)
    r.kept = [1]
    journal.move(r, Phase.TEARDOWN)
    again = journal.read(RID)
    assert again == r and (again.mode, again.joiners, again.kept) == ("aware", {1: 777}, [1])
    older = _record().to_json()
    for key in ("mode", "joiners", "kept"):
        older.pop(key)  # (written by a tpagent before model-aware moves: a transparent one)
    assert (RewireRecord.from_json(older).mode, RewireRecord.from_json(older).joiners) == ("transparent", {})


def test_a_move_the_table_does_not_allow_is_refused_and_nothing_changes(tmp_path: Path) -> None:
    journal = RewireJournal(tmp_path / "rewires")
    r = _record()
    with pytest.raises(BadTransition, match="checking -> done is not allowed"):
        journal.move(r, Phase.DONE, "said too soon")
    assert r.phase is Phase.CHECKING and r.message == "" and journal.read(RID) is None
    with pytest.raises(BadTransition):
        Unwritten().move(r, Phase.TEARDOWN)  # (a dry run's log checks the table too)


def test_a_damaged_record_is_an_error_never_a_rewire_that_ended(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    journal = RewireJournal(tmp_path / "rewires")
    journal.move(_record(), Phase.PAUSING)
    (tmp_path / "rewires" / f"{'ef' * 16}.json").write_text("{not json")
    (tmp_path / "rewires" / f"{'01' * 16}.json").write_text(json.dumps({"format": 1, "rewire_id": "x", "job": "j"}))
    (tmp_path / "rewires" / f"{'23' * 16}.json").write_text(json.dumps({**_record().to_json(), "format": 9}))
    with pytest.raises(JournalError, match="is damaged"):
        journal.read("ef" * 16)
    with pytest.raises(JournalError, match="is damaged"):
        journal.read("23" * 16)
    assert [r.rewire_id for r in journal.unfinished()] == [RID]
    assert sum("left for an operator" in m for m in caplog.messages) == 3
    assert journal.read("../../etc/passwd") is None  # (not an id: no path is ever made of it)


def test_a_record_that_moves_no_rank_it_knows_of_is_not_one_to_finish() -> None:
    data = _record().to_json()
    with pytest.raises(ValueError, match="not a record this agent can finish"):
        RewireRecord.from_json({**data, "agents": ["10.0.0.1:7400"]})  # (rank 1 has no agent)
    with pytest.raises(ValueError):
        RewireRecord.from_json({**data, "phase": "resting"})
    assert RewireRecord.from_json({**data, "unit": "bogus"}).unit == "step"
