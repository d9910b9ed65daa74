"""The source's side of the protocol, run for real (journal, sender, decisions) against an
in-memory target and a stand-in for CRIU whose "original" is a real, stopped process: no
root, no gRPC.  Each test asserts what became of the original and of the target's copy."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest

from support.protocol_fakes import FakeHeldDump, FakeTarget, sleeper, unit_context, wait
from tpagent.migration.api import JournalError, Outcome, PeerStatus, Role, SourceState, TargetState, allowed
from tpagent.migration.journal import Journal, Record
from tpagent.migration.resolve import resolve_source
from tpagent.migration.source import SourceMigration


@pytest.fixture
def original() -> Iterator[subprocess.Popen[bytes]]:
    p = sleeper()
    yield p
    p.kill()
    p.wait()


def _status(p: subprocess.Popen[bytes]) -> str:
    return "gone" if p.poll() is not None else str(psutil.Process(p.pid).status())


def _journaled(m: SourceMigration) -> list[str]:
    """Every state the migration reported, in order (each one was journaled before)."""
    out: list[str] = []
    while (e := m.events.get(timeout=10)) is not None:
        if not out or out[-1] != e.state:
            out.append(e.state)
    return out


def _run(tmp: Path, target: FakeTarget, pid: int, **timeouts: float) -> tuple[SourceMigration, list[str]]:
    ctx = unit_context(tmp, target, **timeouts)
    m = SourceMigration(ctx, pid, target.address, dry_run=False)
    m.run()
    return m, _journaled(m)


def _record_on_disk(m: SourceMigration) -> str:
    text = (m.ctx.cfg.work_dir / "migrations" / f"{m.migration_id}.json").read_text()
    return str(json.loads(text)["state"])


def test_a_migration_commits_only_once_the_copy_is_final(tmp_path: Path, original: subprocess.Popen[bytes]) -> None:
    target = FakeTarget(tmp_path)
    m, states = _run(tmp_path, target, original.pid)
    assert m.result is not None and m.result.outcome is Outcome.DONE and m.result.new_pid == 4242
    assert states == ["checking", "freezing", "held", "restoring", "committing", "done"]
    assert all(allowed(SourceState(a), SourceState(b)) for a, b in zip(states, states[1:], strict=False))
    assert target.states[m.migration_id] is TargetState.DONE
    # The copy was made final before the original was ended, and the original is gone.
    assert target.calls.index("finish-commit") < len(target.calls) and FakeHeldDump.decisions == ["commit"]
    assert wait(lambda: original.poll() is not None)
    assert _record_on_disk(m) == "done" and not m.snapshot.exists()


def test_a_target_that_refuses_first_touches_nothing(tmp_path: Path, original: subprocess.Popen[bytes]) -> None:
    target = FakeTarget(tmp_path, problems=("target has 0.01 GiB of memory free",))
    m, states = _run(tmp_path, target, original.pid)
    assert m.result is not None and m.result.outcome is Outcome.FAILED
    assert "0.01 GiB of memory free" in m.result.message
    assert states == ["checking", "failed"] and FakeHeldDump.decisions == []
    assert _status(original) != psutil.STATUS_STOPPED  # never frozen


def test_a_failed_restore_resumes_the_original_after_the_copy_is_gone(
    tmp_path: Path, original: subprocess.Popen[bytes]
) -> None:
    target = FakeTarget(tmp_path, restore_does="refuse")
    m, states = _run(tmp_path, target, original.pid)
    assert m.result is not None and m.result.outcome is Outcome.ROLLED_BACK
    assert states[-2:] == ["rolling_back", "rolled_back"] and "the target could not restore" in m.result.message
    assert target.states[m.migration_id] is TargetState.DISCARDED and FakeHeldDump.decisions == ["abort"]
    assert wait(lambda: _status(original) != psutil.STATUS_STOPPED)  # runs on where it stood
    assert not m.snapshot.exists()


@pytest.mark.parametrize("at_check, at_freeze", [(False, True), (True, False)])
def test_what_a_rollback_leaves_stopped_is_what_was_stopped_as_the_tree_was_frozen(
    tmp_path: Path, original: subprocess.Popen[bytes], at_check: bool, at_freeze: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Past the pin, a rollback resumes all but the processes stopped before the freeze: those
    the seal names (and the hook, and CRIU's rollback, spare), not those stopped as the tree was
    checked.  A process the user stopped between the two was resumed by a rollback, and one
    continued between them stayed stopped for ever (a reviewer's fault injection)."""
    monkeypatch.setattr(FakeHeldDump, "stopped_at_freeze", at_freeze)
    if at_check:
        original.send_signal(signal.SIGSTOP)
        assert wait(lambda: _status(original) == psutil.STATUS_STOPPED)
    target = FakeTarget(tmp_path, restore_does="refuse")
    m, _ = _run(tmp_path, target, original.pid)
    assert m.result is not None and m.result.outcome is Outcome.ROLLED_BACK
    record = json.loads((m.ctx.cfg.work_dir / "migrations" / f"{m.migration_id}.json").read_text())
    assert record.get("stopped", []) == ([original.pid] if at_freeze else [])


def test_a_broken_restore_call_asks_the_target_and_commits_a_ready_copy(
    tmp_path: Path, original: subprocess.Popen[bytes]
) -> None:
    target = FakeTarget(tmp_path, restore_does="vanish")
    m, _ = _run(tmp_path, target, original.pid)
    assert m.result is not None and m.result.outcome is Outcome.DONE
    assert "status" in target.calls and target.states[m.migration_id] is TargetState.DONE
    assert wait(lambda: original.poll() is not None)


def test_a_silent_target_keeps_the_original_frozen_until_it_answers(
    tmp_path: Path, original: subprocess.Popen[bytes]
) -> None:
    """The target goes quiet after holding a copy: nothing is resumed on a guess.  Once it
    answers that it dropped the copy, the source rolls back and the original runs again."""
    target = FakeTarget(tmp_path, restore_does="silent")
    m, _ = _run(tmp_path, target, original.pid, restore_timeout=2.0)
    assert m.result is not None and m.result.outcome is Outcome.UNRESOLVED
    assert _status(original) == psutil.STATUS_STOPPED and FakeHeldDump.decisions == []
    assert _record_on_disk(m) == "restoring" and m.snapshot.exists()
    assert m.ctx.threads.running("waiter")  # it keeps asking
    target.states[m.migration_id] = TargetState.DISCARDED  # (its copy died meanwhile)
    target.reachable.set()
    assert wait(lambda: _record_on_disk(m) == "rolled_back", 30)
    assert wait(lambda: _status(original) != psutil.STATUS_STOPPED)
    assert wait(lambda: not m.ctx.threads.running())  # the resolver ends once it has rolled back


def test_a_copy_dropped_at_the_commit_rolls_back(tmp_path: Path, original: subprocess.Popen[bytes]) -> None:
    target = FakeTarget(tmp_path)
    target.finish_answer = TargetState.DISCARDED
    m, states = _run(tmp_path, target, original.pid)
    assert m.result is not None and m.result.outcome is Outcome.ROLLED_BACK
    assert states[-1] == "rolled_back" and FakeHeldDump.decisions == ["abort"]
    assert wait(lambda: _status(original) != psutil.STATUS_STOPPED)


def test_a_cancel_before_the_pin_rolls_back_and_one_after_is_refused(
    tmp_path: Path, original: subprocess.Popen[bytes]
) -> None:
    target = FakeTarget(tmp_path)
    ctx = unit_context(tmp_path, target)
    m = SourceMigration(ctx, original.pid, target.address, dry_run=False)
    assert m.cancel("cancelled by the operator")
    m.run()
    assert (
        m.result is not None and m.result.outcome is Outcome.FAILED and "cancelled by the operator" in m.result.message
    )
    done = SourceMigration(ctx, original.pid, target.address, dry_run=False)
    done.run()
    assert done.result is not None and done.result.outcome is Outcome.DONE
    assert not done.cancel("too late")  # past the pin: the copy may be running


def test_a_restarted_source_finishes_a_commit_from_its_journal(
    tmp_path: Path, original: subprocess.Popen[bytes]
) -> None:
    """The journal says COMMITTING and the target holds the copy READY: resolving makes the
    copy final, then ends the original; nothing is asked twice of a final target."""
    target = FakeTarget(tmp_path)
    ctx = unit_context(tmp_path, target)
    mid = "a" * 32
    target.states[mid] = TargetState.READY
    r = Record(
        mid,
        Role.SOURCE,
        SourceState.COMMITTING,
        pid=original.pid,
        peer=target.address,
        restore_sent=True,
        snapshot=str(ctx.cfg.work_dir / "outgoing" / mid),
        create_time=psutil.Process(original.pid).create_time(),
    )
    ctx.journal.write(r)
    released: list[bool] = []
    resolve_source(ctx, r, lambda: released.append(True))
    assert Journal(ctx.cfg.work_dir / "migrations").read(mid).state is SourceState.DONE  # type: ignore[union-attr]
    assert target.states[mid] is TargetState.DONE and released == [True]
    assert wait(lambda: original.poll() is not None)  # ended here (CRIU was gone: the agent did it)


def test_a_copy_that_dies_in_its_confirmation_period_leaves_the_original_running(
    tmp_path: Path, original: subprocess.Popen[bytes]
) -> None:
    """The target started its copy, which died before it ran ``confirm_period``: the source
    had kept its original frozen, and now lets it run on (nothing is lost)."""
    target = FakeTarget(tmp_path)
    target.confirm_does = "die"
    m, states = _run(tmp_path, target, original.pid)
    assert m.result is not None and m.result.outcome is Outcome.ROLLED_BACK
    assert states[-2:] == ["committing", "rolled_back"] and "resumed where it stood" in m.result.message
    assert [s for mid, s in target.history][-3:] == [
        TargetState.STARTING,
        TargetState.CONFIRMING,
        TargetState.DISCARDED,
    ]
    assert FakeHeldDump.decisions == ["abort"]  # never "commit": the original was not ended
    assert wait(lambda: _status(original) not in (psutil.STATUS_STOPPED, "gone"))


@pytest.mark.parametrize("keep", [True, False], ids=["kept", "dropped"])
def test_a_held_copy_is_kept_or_dropped_on_the_sources_word(
    tmp_path: Path, original: subprocess.Popen[bytes], keep: bool
) -> None:
    """A rank's move (tpagent/jobs/rewire.py): the target holds the started copy (Offer.hold) while
    the original stays frozen, for as long as the verdict is not given; then the copy is final
    and the original ends, or the copy is dropped and the original runs on."""
    target = FakeTarget(tmp_path)
    target.confirm_does = "hold"
    m = SourceMigration(unit_context(tmp_path, target), original.pid, target.address, dry_run=False)
    verdict: list[bool | None] = [None]
    m.hold = 30.0
    m.verdict = lambda: verdict[0]
    t = threading.Thread(target=m.run, daemon=True)
    t.start()
    assert m.copy_runs.wait(10) and m.new_pid == 4242
    assert target.offers[m.migration_id].hold == 30.0
    time.sleep(1.0)  # (five of its polls)
    assert target.states[m.migration_id] is TargetState.CONFIRMING and _status(original) == psutil.STATUS_STOPPED
    assert FakeHeldDump.decisions == []
    verdict[0] = keep
    t.join(10)
    assert m.result is not None and m.result.outcome is (Outcome.DONE if keep else Outcome.ROLLED_BACK)
    assert target.states[m.migration_id] is (TargetState.DONE if keep else TargetState.DISCARDED)
    assert FakeHeldDump.decisions == (["commit"] if keep else ["abort"])
    if keep:
        assert wait(lambda: original.poll() is not None)
    else:
        assert wait(lambda: _status(original) not in (psutil.STATUS_STOPPED, "gone"))


def _committing(tmp_path: Path, target: FakeTarget, pid: int, target_state: TargetState) -> tuple[Record, object]:
    ctx = unit_context(tmp_path, target)
    mid = "b" * 32
    target.states[mid] = target_state
    r = Record(
        mid,
        Role.SOURCE,
        SourceState.COMMITTING,
        pid=pid,
        peer=target.address,
        restore_sent=True,
        snapshot=str(ctx.cfg.work_dir / "outgoing" / mid),
        create_time=psutil.Process(pid).create_time(),
    )
    ctx.journal.write(r)
    return r, ctx


@pytest.mark.parametrize("answer", ["running", "silent again"])
def test_an_operators_discard_given_while_the_target_was_silent_is_dropped_once_its_copy_runs(
    tmp_path: Path, original: subprocess.Popen[bytes], answer: str
) -> None:
    """`tpagent resolve --discard` found the target silent, while the source's call asking it to
    start its copy was under way: that call came back with the copy running.  The discard was
    carried out all the same (the original resumed beside the copy); now it is dropped, and the
    migration ends as the target says, whether or not it answers again at once."""
    target = FakeTarget(tmp_path)
    target.confirm_does = "wait"
    r, ctx = _committing(tmp_path, target, original.pid, TargetState.READY)
    finish = target.finish
    calls = 0

    def finish_racing_the_operator(mid: str, commit: bool, timeout: float, confirmed: bool = False) -> PeerStatus:
        nonlocal calls
        calls += 1
        if calls == 1:
            status = finish(mid, commit, timeout, confirmed)  # (its answer: the copy runs)
            if answer == "running":  # meanwhile the operator, finding the target silent, said discard
                r.operator = "discard"  # type: ignore[attr-defined]
            else:  # it goes silent once more, and the operator says discard then
                target.reachable.clear()
                threading.Timer(3.0, target.reachable.set).start()  # (longer than the source asks: rpc_timeout 1 s)
            return status
        if calls == 2 and answer == "silent again":
            r.operator = "discard"  # type: ignore[attr-defined]
        target.states[mid] = TargetState.DONE  # (its confirmation period over)
        return finish(mid, commit, timeout, confirmed)

    target.finish = finish_racing_the_operator  # type: ignore[method-assign]
    resolve_source(ctx, r)  # type: ignore[arg-type]
    assert r.state is SourceState.DONE and target.states[r.migration_id] is TargetState.DONE  # type: ignore[attr-defined]
    assert FakeHeldDump.decisions == ["commit"]  # never "abort": the original was not resumed beside its copy
    assert wait(lambda: original.poll() is not None)
    on_disk = Journal(ctx.cfg.work_dir / "migrations").read(r.migration_id)  # type: ignore[attr-defined]
    assert on_disk is not None and on_disk.operator == "" and on_disk.state is SourceState.DONE


@pytest.mark.parametrize("copy", [TargetState.READY, TargetState.CONFIRMING])
def test_crius_death_while_holding_drops_the_copy_that_is_not_final(
    tmp_path: Path, original: subprocess.Popen[bytes], copy: TargetState
) -> None:
    """CRIU, holding the frozen original, dies without a decision: the original runs again.
    Its copy (held, or started but not yet confirmed) is dropped: never both running."""
    target = FakeTarget(tmp_path)
    target.confirm_does = "wait"
    r, ctx = _committing(tmp_path, target, original.pid, copy)
    FakeHeldDump.lost = True  # (and the original runs: as when CRIU is killed)
    resolve_source(ctx, r)  # type: ignore[arg-type]
    assert target.states[r.migration_id] is TargetState.DISCARDED
    assert "finish-commit" not in target.calls  # a held copy was never started
    assert r.state is SourceState.ROLLED_BACK and "ended without a decision" in r.message
    assert original.poll() is None  # the original was not ended


def test_crius_death_after_the_copy_is_final_ends_the_original(
    tmp_path: Path, original: subprocess.Popen[bytes]
) -> None:
    target = FakeTarget(tmp_path)
    r, ctx = _committing(tmp_path, target, original.pid, TargetState.DONE)
    FakeHeldDump.lost = True
    resolve_source(ctx, r)  # type: ignore[arg-type]
    assert r.state is SourceState.DONE and target.states[r.migration_id] is TargetState.DONE
    assert wait(lambda: original.poll() is not None)  # the copy is the one that goes on


def test_crius_death_with_the_original_gone_lets_the_copy_go_on(
    tmp_path: Path, original: subprocess.Popen[bytes]
) -> None:
    target = FakeTarget(tmp_path)
    r, ctx = _committing(tmp_path, target, original.pid, TargetState.READY)
    FakeHeldDump.lost = True
    original.kill()
    original.wait()
    resolve_source(ctx, r)  # type: ignore[arg-type]
    assert r.state is SourceState.DONE and target.states[r.migration_id] is TargetState.DONE


def test_a_target_that_no_longer_knows_the_migration_at_the_commit_rolls_back(
    tmp_path: Path, original: subprocess.Popen[bytes]
) -> None:
    """The target lost its journal with its disk: NOT_FOUND is "no copy here", not a reason to
    ask forever with the original frozen."""
    target = FakeTarget(tmp_path)
    r, ctx = _committing(tmp_path, target, original.pid, TargetState.READY)
    del target.states[r.migration_id]
    resolve_source(ctx, r)  # type: ignore[arg-type]
    assert r.state is SourceState.ROLLED_BACK and FakeHeldDump.decisions == ["abort"]


def _full_disk(monkeypatch: pytest.MonkeyPatch, ctx: object, writes_refused: int | None = None) -> list[str]:
    """The journal's disk is full: every write fails (or the first ``writes_refused``), as
    write_durably's would with ENOSPC.  The ids of the writes refused."""
    files = ctx.journal.files  # type: ignore[attr-defined]
    real = files.write
    refused: list[str] = []

    def write(record_id: str, data: dict[str, object]) -> None:
        if writes_refused is None or len(refused) < writes_refused:
            refused.append(record_id)
            raise JournalError(f"the journal of migration {record_id} cannot be written: No space left on device")
        real(record_id, data)

    monkeypatch.setattr(files, "write", write)
    return refused


def test_a_full_disk_does_not_keep_the_original_frozen_once_its_copy_is_gone(
    tmp_path: Path, original: subprocess.Popen[bytes], monkeypatch: pytest.MonkeyPatch
) -> None:
    """COMMITTING, and the target's copy died in its confirmation period (DISCARDED, final):
    with the journal's disk full, the original was kept frozen for good (the resolver's
    thread died on the journal's error, and nothing asked again once the disk had room).
    Now the original runs on; only the journal is left behind, which a restart settles the
    same way (the target says DISCARDED again)."""
    target = FakeTarget(tmp_path)
    r, ctx = _committing(tmp_path, target, original.pid, TargetState.DISCARDED)
    os.kill(original.pid, signal.SIGSTOP)  # (frozen, as CRIU holds it)
    refused = _full_disk(monkeypatch, ctx)
    released: list[bool] = []
    resolve_source(ctx, r, lambda: released.append(True))  # type: ignore[arg-type]
    assert r.state is SourceState.ROLLED_BACK and FakeHeldDump.decisions == ["abort"] and released == [True]
    assert wait(lambda: _status(original) not in (psutil.STATUS_STOPPED, "gone"))
    assert refused and Journal(ctx.cfg.work_dir / "migrations").read(r.migration_id).state is SourceState.COMMITTING  # type: ignore[attr-defined,union-attr]


def test_a_step_the_journal_must_keep_waits_for_room_and_is_taken_then(
    tmp_path: Path, original: subprocess.Popen[bytes], monkeypatch: pytest.MonkeyPatch
) -> None:
    """RESTORING after a restart, the target's copy READY: COMMITTING must be journaled before
    the original is ended.  The disk full at first, the resolver asks again (it died on the
    first refusal before) and commits once the journal can be written."""
    target = FakeTarget(tmp_path)
    r, ctx = _committing(tmp_path, target, original.pid, TargetState.READY)
    r.state = SourceState.RESTORING  # type: ignore[attr-defined]
    ctx.journal.write(r)  # type: ignore[attr-defined]
    refused = _full_disk(monkeypatch, ctx, writes_refused=2)
    resolve_source(ctx, r)  # type: ignore[arg-type]
    assert len(refused) == 2 and r.state is SourceState.DONE  # type: ignore[attr-defined]
    assert target.states[r.migration_id] is TargetState.DONE  # type: ignore[attr-defined]
    assert Journal(ctx.cfg.work_dir / "migrations").read(r.migration_id).state is SourceState.DONE  # type: ignore[attr-defined,union-attr]
    assert wait(lambda: original.poll() is not None)  # ended only once its copy was final


def _held_before_a_reboot(tmp_path: Path, target: FakeTarget, state: SourceState) -> tuple[Record, object]:
    """A record written in an earlier boot of this node (its boot id differs), whose original
    died with that boot; the target received the whole snapshot (it is RECEIVING until asked)."""
    ctx = unit_context(tmp_path, target)
    mid = "c" * 32
    gone = subprocess.Popen(["true"])
    gone.wait()
    done = threading.Thread(target=lambda: None)
    done.start()
    target.states[mid] = TargetState.RECEIVING
    target._received[mid] = done
    target._results[mid] = object()
    r = Record(
        mid,
        Role.SOURCE,
        state,
        pid=gone.pid,
        peer=target.address,
        create_time=1.0,
        boot_id="an-earlier-boot",
        snapshot=str(ctx.cfg.work_dir / "outgoing" / mid),
        restore_sent=state is SourceState.RESTORING,  # (journaled before the Restore call, which died here)
    )
    ctx.journal.write(r)
    return r, ctx


@pytest.mark.parametrize("state", [SourceState.FREEZING, SourceState.HELD, SourceState.RESTORING])
def test_after_a_reboot_the_targets_whole_snapshot_goes_on(tmp_path: Path, state: SourceState) -> None:
    """This node rebooted with the original frozen (it died with the boot): the target holds
    the whole snapshot, so the job goes on there instead of being rolled back to nothing.
    RESTORING: the node went down after journaling it, before its Restore call reached the
    target (the target dropped its snapshot, and nothing ran)."""
    target = FakeTarget(tmp_path)
    r, ctx = _held_before_a_reboot(tmp_path, target, state)
    resolve_source(ctx, r)  # type: ignore[arg-type]
    assert r.state is SourceState.DONE and target.states[r.migration_id] is TargetState.DONE
    assert target.calls.index("restore") < target.calls.index("finish-commit")


def test_after_a_reboot_with_no_whole_copy_anywhere_it_is_said(tmp_path: Path) -> None:
    target = FakeTarget(tmp_path, restore_does="refuse")
    r, ctx = _held_before_a_reboot(tmp_path, target, SourceState.HELD)
    resolve_source(ctx, r)  # type: ignore[arg-type]
    assert r.state is SourceState.ROLLED_BACK and "did not survive" in r.message


def test_a_copy_dying_when_the_original_is_gone_too_is_said_not_hidden(
    tmp_path: Path, original: subprocess.Popen[bytes]
) -> None:
    """The copy dies in its confirmation period, and the original is gone as well (its node
    restarted): the record says so, never "resumed where it stood"."""
    target = FakeTarget(tmp_path)
    target.confirm_does = "die"
    r, ctx = _committing(tmp_path, target, original.pid, TargetState.READY)
    original.kill()
    original.wait()
    resolve_source(ctx, r)  # type: ignore[arg-type]
    assert r.state is SourceState.ROLLED_BACK and "did not survive" in r.message and "resumed" not in r.message


def test_a_process_is_known_by_its_start_in_ticks_not_by_the_wall_clock(original: subprocess.Popen[bytes]) -> None:
    """A stepped wall clock moves a process's create_time (psutil derives it from the boot
    time): the journal names processes by start ticks, within the boot the record was made."""
    from tpagent.migration.journal import note_process, same_process_alive

    r = Record("d" * 32, Role.SOURCE, SourceState.FREEZING)
    assert note_process(r, original.pid) and r.start_ticks > 0
    r.create_time += 3600.0  # (as a clock step would make it read)
    assert same_process_alive(r)
    r.start_ticks += 1
    assert not same_process_alive(r)
    r.start_ticks -= 1
    r.boot_id = "another-boot"
    assert not same_process_alive(r)
    # an earlier tpagent's record (no ticks) by the wall clock, which a step moves by a second
    legacy = Record("e" * 32, Role.SOURCE, SourceState.FREEZING, pid=original.pid)
    legacy.create_time = psutil.Process(original.pid).create_time() + 1.0
    assert same_process_alive(legacy)
    legacy.create_time += 4.0
    assert not same_process_alive(legacy)
