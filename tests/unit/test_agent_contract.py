"""The agent layer's contract (tpagent/migration/api.py, tpagent/migration/journal.py), without root: the two
transition tables, the journal's format and its refusals, the timeouts' invariants.  (The held
copy's wait for its source, which takes seconds and real processes: tests/agent/test_held_copy.py.)"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from host.api import UsageError
from tpagent.common.config import TIMEOUT_KEYS, Timeouts, load
from tpagent.migration.api import (
    SOURCE_FINAL,
    SOURCE_TRANSITIONS,
    TARGET_FINAL,
    TARGET_TRANSITIONS,
    BadTransition,
    JournalError,
    Role,
    SourceState,
    TargetState,
)
from tpagent.migration.journal import FORMAT, Journal, Record

S = SourceState
T = TargetState


def _reachable(table: dict, start: object) -> set[object]:  # type: ignore[type-arg]
    seen = {start}
    todo = [start]
    while todo:
        for nxt in table[todo.pop()]:
            if nxt not in seen:
                seen.add(nxt)
                todo.append(nxt)
    return seen


def _preds(table: dict, state: object) -> set[object]:  # type: ignore[type-arg]
    return {s for s, nxt in table.items() if state in nxt}


def test_every_state_has_a_row_and_is_reachable_from_the_start() -> None:
    assert set(SOURCE_TRANSITIONS) == set(SourceState) and set(TARGET_TRANSITIONS) == set(TargetState)
    assert _reachable(dict(SOURCE_TRANSITIONS), S.CHECKING) == set(SourceState)
    assert _reachable(dict(TARGET_TRANSITIONS), T.RECEIVING) == set(TargetState)


def test_final_states_end_and_every_other_state_can_reach_one() -> None:
    assert {S.DONE, S.ROLLED_BACK, S.FAILED} == SOURCE_FINAL and {T.DONE, T.DISCARDED} == TARGET_FINAL
    for table, finals in ((dict(SOURCE_TRANSITIONS), SOURCE_FINAL), (dict(TARGET_TRANSITIONS), TARGET_FINAL)):
        for state in table:
            assert _reachable(table, state) & finals, f"{state} can never end"


def test_the_safety_edges_of_the_source() -> None:
    """The original ends (DONE) only through COMMITTING; it runs again (ROLLED_BACK) only
    through ROLLING_BACK; once anything is frozen, FAILED is no longer a way out; a dry run's
    DONE comes straight from CHECKING, before anything is touched."""
    assert _preds(dict(SOURCE_TRANSITIONS), S.DONE) == {S.CHECKING, S.COMMITTING}
    assert _preds(dict(SOURCE_TRANSITIONS), S.ROLLED_BACK) == {S.ROLLING_BACK}
    assert _preds(dict(SOURCE_TRANSITIONS), S.FAILED) == {S.CHECKING}
    assert S.ROLLING_BACK in SOURCE_TRANSITIONS[S.COMMITTING]  # only on the target's word: its copy is gone
    assert S.COMMITTING in SOURCE_TRANSITIONS[S.ROLLING_BACK]  # only if the target's copy is final


def test_the_safety_edges_of_the_target() -> None:
    """A copy starts only from READY, and is final (DONE) only after it ran through the
    confirmation (CONFIRMING); every unfinished state can drop its copy."""
    table = dict(TARGET_TRANSITIONS)
    assert _preds(table, T.STARTING) == {T.READY} and _preds(table, T.CONFIRMING) == {T.STARTING}
    assert _preds(table, T.DONE) == {T.CONFIRMING}
    assert {s for s in TargetState if s not in TARGET_FINAL} == _preds(dict(TARGET_TRANSITIONS), T.DISCARDED)


def test_the_journal_refuses_what_the_table_does_not_allow(tmp_path: Path) -> None:
    j = Journal(tmp_path / "migrations")
    r = Record("a" * 32, Role.SOURCE, S.CHECKING)
    j.write(r)
    with pytest.raises(BadTransition):
        j.move(r, S.COMMITTING)
    with pytest.raises(BadTransition):
        j.move(r, T.RECEIVED)  # another role's state
    assert j.read(r.migration_id).state is S.CHECKING  # type: ignore[union-attr]
    for to in (S.FREEZING, S.ROLLING_BACK, S.ROLLED_BACK):
        j.move(r, to)
    assert j.read(r.migration_id).state is S.ROLLED_BACK and not j.unfinished()  # type: ignore[union-attr]


def test_a_step_settled_on_a_full_disk_is_what_the_journal_says_and_is_written_once_it_can_be(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A target drops its copy with its disk full: the copy is gone, but the journal, read by the
    agent's Status, said READY for ever (its source kept its original frozen, and no operator
    could step in: the target answered).  It reads DISCARDED now, and is written once it can be."""
    j = Journal(tmp_path / "migrations")
    r = Record("a" * 32, Role.TARGET, T.READY, pid=7, peer="a:1", snapshot="/x")
    j.write(r)
    write = j.files.write

    def full(record_id: str, data: dict[str, object]) -> None:
        raise JournalError(f"the journal of migration {record_id} cannot be written: No space left on device")

    monkeypatch.setattr(j.files, "write", full)
    j.settle(r, T.DISCARDED, "the source rolled back")
    assert r.state is T.DISCARDED and j.read(r.migration_id).state is T.DISCARDED  # type: ignore[union-attr]
    assert json.loads(j.path(r.migration_id).read_text())["state"] == "ready"  # (not yet on disk)
    monkeypatch.setattr(j.files, "write", write)  # (room again)
    assert j.read(r.migration_id) == r and json.loads(j.path(r.migration_id).read_text())["state"] == "discarded"
    assert not j.unwritten


def test_the_journal_format_is_versioned(tmp_path: Path) -> None:
    j = Journal(tmp_path / "migrations")
    r = Record("b" * 32, Role.TARGET, T.READY, pid=7, create_time=1.5, peer="a:1", snapshot="/x")
    j.write(r)
    doc = json.loads(j.path(r.migration_id).read_text())
    # (the oldest format that holds the record: 2, unless it holds a copy for its source's word, 3,
    # or names processes stopped before its freeze, 4, or a copy's other processes, 5)
    assert doc["format"] == 2 and doc["role"] == "target" and doc["state"] == "ready"
    assert j.read(r.migration_id) == r
    held = Record("a" * 32, Role.TARGET, T.READY, pid=7, peer="a:1", snapshot="/x", hold=30.0)
    j2 = Journal(tmp_path / "held")
    j2.write(held)
    assert json.loads(j2.path(held.migration_id).read_text())["format"] == 3
    assert j2.read(held.migration_id) == held
    stopped = Record("f" * 32, Role.SOURCE, S.FREEZING, pid=7, peer="b:1", stopped=[8, 9])
    j2.write(stopped)  # (a source whose tree had processes stopped before its freeze: kept so)
    assert json.loads(j2.path(stopped.migration_id).read_text())["format"] == 4
    assert j2.read(stopped.migration_id) == stopped
    tree = Record("9" * 32, Role.TARGET, T.CONFIRMING, pid=7, peer="a:1", tree=[[8, 1234], [9, 1240]])
    j2.write(tree)  # (a copy's processes other than its root, for a drop to end them all)
    assert json.loads(j2.path(tree.migration_id).read_text())["format"] == FORMAT == 5
    assert j2.read(tree.migration_id) == tree
    # A record of tpagent 0.1 (no format field) is still read ...
    del doc["format"]
    j.path("c" * 32).write_text(json.dumps({**doc, "migration_id": "c" * 32}))
    assert j.read("c" * 32) == Record("c" * 32, Role.TARGET, T.READY, pid=7, create_time=1.5, peer="a:1", snapshot="/x")
    # ... one of a newer format, one with another role's state, or a damaged one is never
    # taken for "no such migration" (that would let a source resume next to a running copy).
    bad = {"d" * 32: {**doc, "format": FORMAT + 1}, "e" * 32: {**doc, "state": "committing"}}
    for mid, body in bad.items():
        j.path(mid).write_text(json.dumps({**body, "migration_id": mid}))
        with pytest.raises(JournalError):
            j.read(mid)
    j.path("f" * 32).write_text("{not json")
    with pytest.raises(JournalError, match="damaged"):
        j.read("f" * 32)
    assert [x.migration_id for x in j.unfinished()] == ["b" * 32, "c" * 32]


def test_the_default_timeouts_fit_together() -> None:
    t = Timeouts()
    assert t.rpc < t.restore and t.io < t.hold and t.abort_confirm >= t.rpc
    assert set(TIMEOUT_KEYS) == {f for f in Timeouts.__dataclass_fields__}


@pytest.mark.parametrize(
    ("changes", "named"),
    [
        ({"rpc": 60.0, "restore": 30.0}, ["rpc_timeout", "restore_timeout"]),
        ({"io": 120.0, "hold": 60.0}, ["io_timeout", "hold_timeout"]),
        ({"abort_confirm": 5.0}, ["abort_confirm_timeout", "rpc_timeout"]),
        ({"hold": 0.0}, ["hold_timeout"]),
        ({"io": float("nan")}, ["io_timeout"]),
        ({"shutdown_grace": -1.0}, ["shutdown_grace"]),
    ],
)
def test_timeouts_that_do_not_fit_are_refused_naming_the_settings(changes: dict[str, float], named: list[str]) -> None:
    with pytest.raises(ValueError) as e:
        Timeouts(**changes)
    for key in named:
        assert key in str(e.value)


def test_the_configuration_checks_its_timeouts_at_load(tmp_path: Path) -> None:
    assert load(env={"TPAGENT_SECRET_FILE": "/s", "TPAGENT_TAKEOVER_AFTER": "0"}).timeouts.takeover_after == 0
    with pytest.raises(UsageError, match="io_timeout .* must be shorter than hold_timeout"):
        load(env={"TPAGENT_SECRET_FILE": "/s", "TPAGENT_IO_TIMEOUT": "90", "TPAGENT_HOLD_TIMEOUT": "60"})
