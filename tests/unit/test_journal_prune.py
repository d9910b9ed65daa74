"""The node's records forget what is over, never what goes on: a migration's or a rewire's
journal keeps 30 days and the newest 1000 that ended, while every unfinished or unreadable one
stays; the notes of restored copies last as long as their copies run."""

from __future__ import annotations

import json
import os
import platform
import subprocess
import time
import uuid
from pathlib import Path
from types import SimpleNamespace

import pytest

from tpagent.migration import journal
from tpagent.migration.api import SourceState, TargetState
from tpagent.migration.journal import Journal, source_record, target_record


def _record(j: Journal, state: SourceState, age_days: float = 0.0) -> str:
    r = source_record(uuid.uuid4().hex, peer="10.0.0.2:7400")
    r.state = state
    j.write(r)
    then = time.time() - age_days * 86400
    os.utime(j.path(r.migration_id), (then, then))
    return r.migration_id


def test_ended_records_past_the_count_or_the_age_go_and_the_rest_stay(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(journal, "KEEP_FINAL", 5)
    j = Journal(tmp_path / "migrations")
    old_done = _record(j, SourceState.DONE, age_days=31)
    old_unfinished = _record(j, SourceState.HELD, age_days=60)  # (frozen there: an operator's to settle)
    ended = [_record(j, SourceState.ROLLED_BACK, age_days=10 - i) for i in range(7)]  # newest last
    damaged = j.path(uuid.uuid4().hex)
    damaged.write_text("{not json")
    os.utime(damaged, (0, 0))

    last = source_record(uuid.uuid4().hex, peer="10.0.0.2:7400")
    j.write(last)
    j.move(last, SourceState.FAILED, "it failed")  # (a move to a final state prunes)

    left = {p.stem for p in j.directory.glob("*.json")}
    kept = {*ended[-4:], last.migration_id}  # the newest 5 that ended
    assert left == {*kept, old_unfinished, damaged.stem}, left
    assert old_done not in left
    assert j.read(old_unfinished) is not None and [r.migration_id for r in j.unfinished()] == [old_unfinished]


def test_a_targets_record_of_a_copy_made_final_is_kept_past_the_count(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A source agent stopped while it committed (CRIU holding its original frozen) asks its
    target when it starts again.  Once the target had ended KEEP_FINAL migrations since, its
    record of the copy was gone, and "unknown" was taken for "no copy": the original resumed
    beside its running copy.  A final copy's record now goes only with its age."""
    monkeypatch.setattr(journal, "KEEP_FINAL", 2)
    j = Journal(tmp_path / "migrations")
    copy = target_record(uuid.uuid4().hex, peer="10.0.0.1:7400")
    copy.state = TargetState.CONFIRMING
    j.write(copy)
    j.move(copy, TargetState.DONE)
    os.utime(j.path(copy.migration_id), (time.time() - 20 * 86400,) * 2)
    dropped = target_record(uuid.uuid4().hex, peer="10.0.0.1:7400")
    j.write(dropped)
    j.move(dropped, TargetState.DISCARDED)
    os.utime(j.path(dropped.migration_id), (time.time() - 19 * 86400,) * 2)
    newer = [_record(j, SourceState.ROLLED_BACK, age_days=1 - i / 10) for i in range(3)]
    _record(j, SourceState.FAILED)
    last = source_record(uuid.uuid4().hex, peer="10.0.0.2:7400")
    j.write(last)
    j.move(last, SourceState.FAILED, "it failed")  # (a move to a final state prunes)
    left = {p.stem for p in j.directory.glob("*.json")}
    assert copy.migration_id in left and dropped.migration_id not in left and newer[0] not in left
    os.utime(j.path(copy.migration_id), (time.time() - 31 * 86400,) * 2)
    again = source_record(uuid.uuid4().hex, peer="10.0.0.2:7400")
    j.write(again)
    j.move(again, SourceState.FAILED, "it failed")
    assert not j.path(copy.migration_id).exists()  # (past its age)


def test_the_notes_of_restored_copies_that_ended_go_as_another_is_noted(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """/run/tpagent/restored keeps a note per snapshot restored here, which counts only while
    its copy runs: the notes of copies that ended (or left) go as the next copy is noted."""
    from typing import cast

    from snapshot import copies
    from snapshot.manifest import Manifest

    monkeypatch.setattr(copies, "RESTORED", tmp_path / "restored")
    ended = subprocess.Popen(["true"])
    ended.wait()
    running = subprocess.Popen(["sleep", "60"])
    try:
        (tmp_path / "restored").mkdir(mode=0o700)
        (tmp_path / "restored" / "ab.json").write_text(  # (noted as it was restored; it has ended since)
            json.dumps([{"pid": ended.pid, "create_time": 1.0, "host": platform.node()}])
        )
        copies.note_copy(cast(Manifest, SimpleNamespace(snapshot_id="cd")), running.pid)
        assert sorted(p.name for p in (tmp_path / "restored").iterdir()) == ["cd.json"]
        assert copies.still_running(cast(Manifest, SimpleNamespace(snapshot_id="cd"))) == running.pid
    finally:
        running.kill()
        running.wait()
