"""A held copy (tpagent/migration/target.py) against an in-memory source: a copy restored for
its source's word waits for it (and starts once the source is unreachable for takeover_after),
and a started copy that its source holds (Offer.hold, a rank's move) is final only on the
source's word, or after hold.  Real processes stand for the copies, and the waits take seconds:
so this is no unit test (tests/unit/test_agent_contract.py holds the contract itself)."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from dataclasses import replace
from pathlib import Path

import psutil
import pytest

from support.protocol_fakes import StatusOnly, sleeper, unit_context, wait
from tpagent.migration import target
from tpagent.migration.api import (
    JournalError,
    PeerStatus,
    PeerUnreachable,
    Refused,
    Role,
    TargetState,
    Why,
)
from tpagent.migration.context import Context
from tpagent.migration.journal import Record, note_process, note_tree
from tpagent.migration.target import await_source, confirm_held, finish_held, settle, watch_copy

T = TargetState


class _Source(StatusOnly):
    """A source agent in memory, for a held copy that asks it: reachable or not."""

    def __init__(self) -> None:
        super().__init__("source.test:7400", self._says)
        self.answer_is: str | None = "committing"  # None: unreachable; "refuse": answers no

    def _says(self, migration_id: str) -> PeerStatus:
        if self.answer_is is None:
            raise PeerUnreachable("unavailable")
        if self.answer_is == "refuse":
            raise Refused("refused the call: a stale timestamp", Why.UNAUTHENTICATED)
        return PeerStatus(migration_id, self.answer_is)


def _held(tmp_path: Path, source: _Source) -> tuple[object, list[tuple[str, bool, str]], threading.Thread]:
    ctx = unit_context(tmp_path, source, rpc_timeout=0.1, takeover_after=1.0)
    mid = "a" * 32
    ctx.journal.write(Record(mid, Role.TARGET, T.READY, pid=1, peer="source", peer_agent=source.address))
    decided: list[tuple[str, bool, str]] = []
    t = threading.Thread(target=await_source, args=(ctx, mid, lambda *a: decided.append(a)), daemon=True)
    t.start()
    return ctx, decided, t


def test_a_held_copy_waits_for_a_source_that_answers(tmp_path: Path) -> None:
    source = _Source()
    source.answer_is = "refuse"  # an answer, even a refusal, comes from an agent that is there
    ctx, decided, t = _held(tmp_path, source)
    assert wait(lambda: len(source.asked) >= 8, 10) and not decided
    ctx.threads.stopping.set()  # (an agent shutting down: the waiter returns, the journal keeps READY)
    t.join(5)
    assert not t.is_alive() and not decided


def test_a_held_copy_starts_once_its_source_is_unreachable_for_takeover_after(tmp_path: Path) -> None:
    source = _Source()
    source.answer_is = None
    _, decided, t = _held(tmp_path, source)
    t.join(10)
    assert decided and decided[0][:2] == ("a" * 32, True) and "unreachable for 1 s" in decided[0][2]


def _running_held(tmp_path: Path, hold: float) -> tuple[Context, Record, subprocess.Popen[bytes], threading.Thread]:
    """A started copy (a real process) that its source holds for its word (Offer.hold), watched."""
    ctx = unit_context(tmp_path, _Source(), confirm_period=0.2)
    copy = sleeper()
    mid = "b" * 32
    r = Record(mid, Role.TARGET, T.CONFIRMING, peer="source", snapshot=str(ctx.cfg.work_dir / mid), hold=hold)
    note_process(r, copy.pid)
    ctx.journal.write(r)

    def settled(mid: str, ran: bool, why: str) -> None:
        now = ctx.journal.read(mid)
        assert now is not None
        settle(ctx, now, ran, why)

    t = threading.Thread(target=watch_copy, args=(ctx, replace(r), settled), daemon=True)
    t.start()
    return ctx, r, copy, t


def _state(ctx: Context, mid: str) -> T:
    r = ctx.journal.read(mid)
    assert r is not None and isinstance(r.state, T)
    return r.state


def test_a_held_copy_is_final_only_once_its_source_confirms_it(tmp_path: Path) -> None:
    """A rank's copy outlives the confirmation period unconfirmed (its job's communicators are
    still being built): it stays CONFIRMING, then DONE on the source's word, and runs on."""
    ctx, r, copy, t = _running_held(tmp_path, hold=60)
    try:
        time.sleep(1.0)  # five confirmation periods
        assert _state(ctx, r.migration_id) is T.CONFIRMING
        now = ctx.journal.read(r.migration_id)
        assert now is not None
        confirm_held(ctx, now, "confirmed by the source")
        assert _state(ctx, r.migration_id) is T.DONE and copy.poll() is None
        t.join(5)
        assert not t.is_alive(), "the watcher goes once the source decided"
    finally:
        copy.kill()
        copy.wait()


def test_a_held_copy_the_source_drops_is_killed_and_one_it_never_confirms_is_final_after_hold(tmp_path: Path) -> None:
    ctx, r, copy, _ = _running_held(tmp_path, hold=60)
    now = ctx.journal.read(r.migration_id)
    assert now is not None
    finish_held(ctx, now, False, "the job's communicators could not be built with it", lambda *a: None)
    assert _state(ctx, r.migration_id) is T.DISCARDED
    assert copy.wait(5) is not None, "a dropped copy must not run on"
    (tmp_path / "2").mkdir()
    ctx, r, copy, t = _running_held(tmp_path / "2", hold=1.0)
    try:
        t.join(10)
        assert _state(ctx, r.migration_id) is T.DONE and copy.poll() is None
        assert "no word from the source for 1 s" in (ctx.journal.read(r.migration_id) or r).message
    finally:
        copy.kill()
        copy.wait()


def test_a_copy_dropped_with_the_journals_disk_full_is_said_to_be_gone(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The source drops its held copy and the target's journal cannot be written (a full
    disk): the copy is killed, and the record says DISCARDED, which the source asks for (it
    stayed READY in memory, so the source kept its original frozen for an hour, then for good)."""
    ctx, r, copy, _ = _running_held(tmp_path, hold=60)
    now = ctx.journal.read(r.migration_id)
    assert now is not None

    def full(record_id: str, data: dict[str, object]) -> None:
        raise JournalError(f"the journal of migration {record_id} cannot be written: No space left on device")

    monkeypatch.setattr(ctx.journal.files, "write", full)
    finish_held(ctx, now, False, "the source rolled back", lambda *a: None)
    assert now.state is T.DISCARDED
    assert copy.wait(5) is not None, "a dropped copy must not run on"


def test_a_copy_whose_root_ends_in_its_confirmation_period_leaves_none_of_its_processes(tmp_path: Path) -> None:
    """A copy of a tree in the node's own PID namespace (no `tpagent launch`): its root ends
    while it is confirmed, and its child runs on, reparented.  The copy was dropped (the
    source resumes its whole original) with that child left running: two of it.  Now the
    drop ends it too, and a process that has its PID but another start is not touched."""
    ctx = unit_context(tmp_path, _Source())
    root = subprocess.Popen(["sh", "-c", "sleep 600 & echo $!; wait"], stdout=subprocess.PIPE, start_new_session=True)
    assert root.stdout is not None
    child = int(root.stdout.readline())
    r = Record("d" * 32, Role.TARGET, T.CONFIRMING, peer="source", snapshot=str(ctx.cfg.work_dir / "d"))
    note_process(r, root.pid)
    note_tree(r, [root.pid, child, 1])
    assert [pid for pid, _ in r.tree] == [child, 1]
    r.tree[1][1] += 1  # (PID 1 as a copy's process that ended, its PID taken by another since)
    ctx.journal.write(r)
    root.kill()
    root.wait()
    root.stdout.close()
    stored = ctx.journal.read(r.migration_id)
    assert stored is not None and stored.tree == r.tree
    settle(ctx, stored, False, "the copy ended inside the confirmation period")
    assert _state(ctx, r.migration_id) is T.DISCARDED
    assert wait(lambda: not psutil.pid_exists(child) or psutil.Process(child).status() == psutil.STATUS_ZOMBIE)
    assert psutil.Process(1).is_running()


def _spinner() -> subprocess.Popen[bytes]:
    """A process always ready to run, on the first CPU only."""
    code = "import os\nos.sched_setaffinity(0, {min(os.sched_getaffinity(0))})\nwhile True:\n    pass\n"
    return subprocess.Popen([sys.executable, "-c", code], start_new_session=True)


def _ran(pid: int) -> float:
    """The CPU seconds ``pid`` has had (user and system)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def test_a_copy_is_confirmed_once_it_has_run_for_the_period_not_waited_for_a_cpu(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A copy on a node whose CPUs are taken (here: two other processes always ready to run on
    its one CPU) must have run for the confirmation period before its original is ended: time
    spent waiting for a CPU gave it no chance to fail (a copy that fails soon after it starts)."""
    monkeypatch.setattr(target, "STARVED_MOST", 1000.0, raising=False)  # (however busy the machine: never cut short)
    period = 0.5
    ctx = unit_context(tmp_path, _Source(), confirm_period=period)
    rivals = [_spinner() for _ in range(2)]
    copy = _spinner()
    mid = "c" * 32
    r = Record(mid, Role.TARGET, T.CONFIRMING, peer="source", snapshot=str(ctx.cfg.work_dir / mid))
    note_process(r, copy.pid)
    ctx.journal.write(r)
    ran_by: list[float] = []

    def settled(mid: str, ran: bool, why: str) -> None:
        ran_by.append(_ran(copy.pid))
        now = ctx.journal.read(mid)
        assert now is not None
        settle(ctx, now, ran, why)

    try:
        t0 = time.monotonic()
        watch_copy(ctx, replace(r), settled)
        assert _state(ctx, mid) is T.DONE and copy.poll() is None
        assert ran_by[0] >= 0.8 * period, (ran_by, time.monotonic() - t0)  # (its ticks: 10 ms each)
    finally:
        for p in (copy, *rivals):
            p.kill()
            p.wait()
