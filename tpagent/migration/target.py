"""The target's side of a migration: receive and verify the snapshot, restore it held, let
it run only when the source commits; and, after a restart, drop what never ran.

Written against :mod:`tpagent.migration.api` only (the source is a :class:`~tpagent.migration.api.Peer`)."""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

from host import paths, proc, signals
from host.paths import created_note, restore_work
from host.safefs import private_dir
from host.sockets import endpoint
from snapshot import criu
from snapshot.held import wait_released
from snapshot.putback import take_back_created
from snapshot.restore import RestoreResult, kill_restored, start_restored
from snapshot.restore import restore as restore_copy
from tpagent.common import metrics
from tpagent.migration.api import JournalError, PeerUnreachable, Refused, Role, SourceState, TargetState, Why, is_final
from tpagent.migration.context import Context
from tpagent.migration.journal import Record, note_process, note_tree, same_process_alive, target_record
from tpagent.workload import launch
from transfer.api import TransferError, TransferStats
from transfer.receiver import Receiver

T = TargetState
#: finish(migration_id, commit, why): how a waiting copy is decided (:meth:`.receivers.Receivers.finish`).
Finisher = Callable[[str, bool, str], object]
#: settle(migration_id, ran, why): how a confirmation ends (:meth:`.receivers.Receivers.settle`).
Settler = Callable[[str, bool, str], object]
#: How much of a copy's wait for a CPU is taken off its confirmation period, in periods: a copy on
#: a node whose CPUs stay taken is confirmed after ten periods at most.
STARVED_MOST = 9.0


class Incoming:
    """The target's side of one migration.

    Restore runs outside the lock, so that an abort arriving meanwhile is taken at once (as
    ``abort_requested``) rather than queued: the restore then kills the copy it made."""

    def __init__(
        self, ctx: Context, mid: str, source: str, settle: Settler, source_agent: str = "", hold: float = 0.0
    ) -> None:
        cfg = ctx.cfg
        self.ctx = ctx
        self.settle = settle
        self.dir = paths.WorkDir(cfg.work_dir).incoming(mid)
        private_dir(self.dir.parent)
        self.receiver = Receiver(
            ctx.transport(),
            ctx.transfer_config,
            f"{cfg.advertised_host}:{cfg.transfer_port}",
            on_refused=lambda reason: metrics.REFUSED.labels("transfer", reason).inc(),
        )
        # The name the sender dials is the one its TLS check holds the certificate against.
        host = cfg.advertised_host
        port = self.receiver.address.rpartition(":")[2]
        self.address = cfg.transfer_address or endpoint(host, port)  # (an IPv6 host is bracketed once)
        self.record = target_record(mid, peer=source, snapshot=str(self.dir), peer_agent=source_agent, hold=hold)
        ctx.journal.write(self.record)
        self.result: TransferStats | TransferError | None = None
        self.gpu_map: dict[str, str] = {}
        self.done = threading.Event()
        self.lock = threading.Lock()
        self.abort_requested = False
        self.abort_why = ""
        self.restored: RestoreResult | None = None
        ctx.threads.spawn("waiter", f"receive-{mid[:8]}", self._receive)

    def _receive(self) -> None:
        try:
            self.result = self.receiver.receive(self.dir, self.ctx.timeouts.hold)
            metrics.BYTES.labels("received").inc(self.result.bytes_wire)
        except TransferError as e:
            self.result = e
        except Exception as e:  # (the listener closed under it by a discard, ...)
            self.result = TransferError(f"receiving stopped: {e}")
        finally:
            self.receiver.close()
            self.done.set()

    def restore(self, finish: Finisher) -> RestoreResult:
        """Restore the copy, held; raises Refused (the copy is gone, or never was)."""
        node = self.ctx.cfg.node
        j = self.ctx.journal
        if not self.done.wait(self.ctx.timeouts.restore):
            raise Refused("the snapshot did not arrive in time")
        with self.lock:
            if self.abort_requested or self.record.state is not T.RECEIVING:
                raise Refused(
                    f"migration {self.record.migration_id} is {self.record.state.value} here; not restoring it"
                )
            if isinstance(self.result, TransferError) or self.result is None:
                self._drop(f"the snapshot did not arrive intact: {self.result}")
                raise Refused(f"the snapshot did not arrive intact on {node}: {self.result}")
            j.move(self.record, T.RECEIVED)
            j.move(self.record, T.RESTORING)
        try:
            result = restore_copy(
                self.dir,
                self.gpu_map,
                self.ctx.snapshot_config,
                verified=True,
                work=restore_work(self.dir),
                start=False,
                created_note=created_note(self.dir),
            )
        except Exception as e:  # the engine leaves no copy behind on failure
            with self.lock:
                why = f"the restore was stopped: {self.abort_why}" if self.abort_requested else f"restore failed: {e}"
                self._drop(why)
            raise Refused(f"restoring on {node} failed: {e}" if not self.abort_requested else why) from e
        with self.lock:
            alive = note_process(self.record, result.pid)
            note_tree(self.record, result.pids)
            if not alive:
                self.abort_requested = True  # (the copy died as it was restored)
            if self.abort_requested:
                self._drop("the source rolled back while this copy was being restored")
                raise Refused("the source rolled back meanwhile; the copy was stopped")
            try:
                j.move(self.record, T.READY, "restored and held; it starts when the source lets go of the original")
            except Exception:
                self._drop("could not journal the restored copy")
                raise
            self.ctx.remove(restore_work(self.dir))  # (its restore.pid named the copy until the journal did)
            self.restored = result
        mid = self.record.migration_id
        self.ctx.threads.spawn("waiter", f"await-source-{mid[:8]}", await_source, self.ctx, mid, finish)
        return result

    def finish(self, commit: bool, why: str = "", confirmed: bool = False) -> None:
        with self.lock:
            if is_final(self.record.state):
                return
            heard(self.record)
            if commit:
                if self.record.state in (T.READY, T.STARTING):
                    start_held(self.ctx, self.record, self.restored, why or "started", self.settle)
                elif confirmed:
                    confirm_held(self.ctx, self.record, why)
            elif self.record.state is T.RESTORING:
                self.abort_requested = True  # restore() stops its copy as it returns,
                self.abort_why = why or "the source rolled back"
                name = f"stop-restore-{self.record.migration_id[:8]}"  # (which it may never do: CRIU blocked on a lock)
                self.ctx.threads.spawn("waiter", name, self._stop_restore, why)
            else:
                self._drop(why or "the source rolled back")

    def _stop_restore(self, why: str) -> None:
        """Stop this copy's CRIU restore, once it has started (it may be about to), while the
        copy is still being restored."""
        while self.record.state is T.RESTORING and not self.ctx.threads.stopping.is_set():
            if criu.stop_in(restore_work(self.dir)):
                self.ctx.log.warning("migration %s: its restore was stopped (%s)", self.record.migration_id, why)
                return
            time.sleep(0.1)

    def _drop(self, why: str) -> None:
        self.receiver.close()
        drop_copy(self.ctx, self.record, why)


def drop_copy(ctx: Context, r: Record, why: str) -> None:
    """The one way a target lets a copy go: killed if it is still ours (before the source
    lets its original go: never two), with any process of it its root left running, the
    record DISCARDED, its files removed: the snapshot, and what its restore made on this node
    (the copy's own files, sockets and directories: left, they would stand in the way of the
    next migration here)."""
    if same_process_alive(r):
        signals.kill_tree(r.pid, r.start_ticks or None)
    for pid, ticks in r.tree if not r.rebooted() else ():  # (its root ended first: what it left running)
        signals.kill_tree(pid, ticks)
    snap = Path(r.snapshot)
    if ctx.inside_work_dir(snap):  # (before the source hears of the drop: then this node is as it was)
        for path in take_back_created(created_note(snap)):
            ctx.log.info("migration %s: removed %s, which the dropped copy's restore had made", r.migration_id, path)
    if not is_final(r.state):
        ctx.journal.settle(r, T.DISCARDED, why)  # (the copy is gone: a restart drops it again)
    ctx.remove(snap, restore_work(snap), created_note(snap), *snap.parent.glob(f".{snap.name}.partial-*"))


def finish_held(ctx: Context, r: Record, commit: bool, why: str, settle: Settler, confirmed: bool = False) -> None:
    """Start (commit) or drop a copy known only from the journal (the agent restarted since
    it was restored).  A held copy that is gone cannot be started: it is dropped, and the
    source's original runs on."""
    heard(r)
    if commit and r.state in (T.READY, T.STARTING):
        if _runs(r):
            start_held(ctx, r, None, why, settle)
        else:
            drop_copy(ctx, r, "the held copy is gone (its node restarted?); the original runs on at the source")
    elif commit and confirmed:
        confirm_held(ctx, r, why)
    elif not commit and r.state in (T.READY, T.STARTING, T.CONFIRMING):
        drop_copy(ctx, r, why)


def operator_may(ctx: Context, r: Record, commit: bool) -> str:
    """Why an operator may not decide this held copy (``tpagent resolve``), or "": only a
    READY copy, and only when its source agent gives no answer (else the source decides)."""
    if r.state is not T.READY:
        return f"migration {r.migration_id} is {r.state.value} here: only a held copy waiting for its source is"
    if r.peer_agent:
        try:
            st = ctx.peer(r.peer_agent).status(r.migration_id, ctx.timeouts.rpc)
            return f"the source agent {r.peer_agent} answers (the migration is {st.state} there): it decides"
        except Refused as e:
            if e.why is not Why.NOT_FOUND:
                return f"the source agent {r.peer_agent} answers ({e}): it decides"
        except PeerUnreachable:
            pass
    return ""


def start_held(ctx: Context, r: Record, result: RestoreResult | None, why: str, settle: Settler) -> None:
    """READY -> STARTING, journaled first: from now on the copy is let go (again, after a
    restart of this agent or a start that failed half-way: letting go is idempotent), then
    watched for the confirmation period (:func:`watch_copy`).  A copy that cannot be let go
    and no longer runs is dropped (the source's original runs on)."""
    if r.state is T.READY:
        ctx.journal.move(r, T.STARTING, why)
    try:
        _let_run(ctx, r, result, settle)
    except Exception as e:
        if not _runs(r):
            drop_copy(ctx, r, f"the copy could not be started ({e}) and is gone; the original runs on at the source")
            return
        raise  # (STARTING: the source's next word lets it go again)


#: When each held copy's source last asked about it (migration id -> monotonic time): a source
#: that keeps asking is still deciding (its job's communicators are being built), not lost.
_HEARD: dict[str, float] = {}


def heard(r: Record) -> None:
    if r.hold and not is_final(r.state):  # (only a held copy's silence counts; watch_copy forgets it)
        _HEARD[r.migration_id] = time.monotonic()


def confirm_held(ctx: Context, r: Record, why: str) -> None:
    """The source has seen a copy it holds (``Offer.hold``) work: DONE, if it still runs."""
    if r.state is T.CONFIRMING and r.hold:
        settle(ctx, r, _runs(r), why if _runs(r) else f"the copy (PID {r.pid}) ended before the source confirmed it")


def _let_run(ctx: Context, r: Record, result: RestoreResult | None, settle: Settler) -> None:
    start_copy(result, Path(r.snapshot), r.pid)
    period = ctx.timeouts.confirm
    ctx.journal.move(
        r,
        T.CONFIRMING,
        f"running; held until the source confirms it (at most {r.hold:g} s)"
        if r.hold
        else f"running; the source ends its original once it ran {period:g} s",
    )
    mid = r.migration_id
    ctx.threads.spawn("waiter", f"confirm-{mid[:8]}", watch_copy, ctx, replace(r), settle)


def _runs(r: Record) -> bool:
    """The record's process is ours and still runs (not a zombie)."""
    return same_process_alive(r) and proc.alive(r.pid)


def watch_copy(ctx: Context, probe: Record, settle: Settler) -> None:
    """CONFIRMING: the copy must run ``confirm_period`` seconds.  Once it has, the migration
    is DONE; if it ends sooner (a peer it needed stayed behind, a device is missing here ...),
    it is dropped and the source's original, frozen all along, runs on.  Time its main thread
    spent waiting for a CPU (a node whose CPUs are all taken) does not count, up to
    :data:`STARVED_MOST` times the period: it must have run.  A held copy (``Offer.hold``)
    waits for the source's confirmation instead, ``hold`` seconds at most."""
    period = probe.hold or ctx.timeouts.confirm
    t0 = time.monotonic()
    try:
        _watch(ctx, probe, settle, period, t0)
    finally:
        _HEARD.pop(probe.migration_id, None)


def _watch(ctx: Context, probe: Record, settle: Settler, period: float, t0: float) -> None:
    mid = probe.migration_id
    pid = probe.pid
    looked = t0
    waited = proc.waited_to_run(pid)
    while True:
        elapsed = time.monotonic() - t0
        if probe.hold:
            silent = time.monotonic() - max(t0, _HEARD.get(mid, t0))
        else:  # (how long it ran: its wait for a CPU taken off, once the period is over)
            starved = proc.waited_to_run(pid) - waited if elapsed >= period else 0.0
            silent = max(elapsed - starved, elapsed - STARVED_MOST * period)
        if not _runs(probe):
            when = "before the source confirmed it" if probe.hold else f"inside the {period:g} s confirmation period"
            settle(
                mid,
                False,
                f"the copy (PID {pid}) ended {elapsed:.1f} s after it started, {when}; the original "
                "runs on at the source",
            )
            return
        if silent >= period:
            settle(
                mid,
                True,
                f"running here (no word from the source for {period:g} s)"
                if probe.hold
                else f"running here (for {period:g} s and on)",
            )
            return
        if probe.hold and time.monotonic() - looked > 1.0:  # (confirmed or dropped by the source meanwhile?)
            looked = time.monotonic()
            with contextlib.suppress(JournalError):
                now = ctx.journal.read(mid)
                if now is None or now.state is not T.CONFIRMING:
                    return
        if ctx.threads.sleep(min(0.1, period)):
            return  # (stopping: the journal says CONFIRMING, the next start watches it again)


def settle(ctx: Context, r: Record, ran: bool, why: str) -> None:
    """End a confirmation: DONE (the copy ran long enough) or dropped (it did not)."""
    if r.state is not T.CONFIRMING:
        return  # decided meanwhile (the source asked to drop it)
    if ran:
        ctx.journal.move(r, T.DONE, why)
        ctx.remove(r.snapshot, created_note(Path(r.snapshot)))
    else:
        drop_copy(ctx, r, why)


def await_source(ctx: Context, mid: str, finish: Finisher) -> None:
    """While a restored copy waits for its source's word, keep asking the source agent.

    A source that answers decides (it may still be streaming its commit).  One that cannot be
    reached for ``takeover_after`` seconds has most likely lost its node with the frozen
    original on it: the copy then starts on its own.  That never makes two copies run: once a
    source has asked for the restore, it resumes its original only after this agent has said
    the copy is gone, and a source that comes back finds the copy DONE here and ends its
    original.  (The one case outside this: the source's CRIU dies while holding the original,
    which then runs on, *and* its agent stays down that long.)"""
    limit = ctx.timeouts.takeover_after
    try:
        r = ctx.journal.read(mid)
    except JournalError:
        return
    if limit <= 0 or r is None or not r.peer_agent:
        return
    source = ctx.peer(r.peer_agent)
    silent_since = time.monotonic()
    while not ctx.threads.sleep(min(5.0, max(limit / 4, 0.1))):
        try:
            r = ctx.journal.read(mid)
        except JournalError as e:
            ctx.log.error("migration %s: %s; not starting its copy", mid, e)
            continue
        if r is None or r.state is not T.READY:
            return  # decided
        try:
            st = source.status(mid, min(10.0, limit))
        except (PeerUnreachable, Refused) as e:
            # A source that cannot be reached, or that no longer knows the migration (its
            # journal lost), counts as lost; any other answer, even a refusal (a clock skewed
            # past the signature's window), comes from an agent that is there and decides.
            if isinstance(e, Refused) and e.why is not Why.NOT_FOUND:
                silent_since = time.monotonic()
                continue
            if time.monotonic() - silent_since < limit:
                continue
            lost = "unreachable" if isinstance(e, PeerUnreachable) else "without a record of it"
            ctx.log.warning(
                "migration %s: the source agent %s has been %s for %.0f s (%s): starting the copy",
                mid,
                r.peer_agent,
                lost,
                limit,
                e,
            )
            finish(
                mid, True, f"started without the source's word: its agent {r.peer_agent} was {lost} for {limit:.0f} s"
            )
            return
        silent_since = time.monotonic()
        if st.state in (SourceState.ROLLED_BACK.value, SourceState.FAILED.value):  # (the protocol never gets here)
            finish(mid, False, f"the source reports {st.state}")
            return
        if st.state == SourceState.DONE.value:  # its original was ended (an operator's decision there)
            finish(mid, True, f"the source reports {st.state}: {st.message}")
            return


def start_copy(result: RestoreResult | None, snapshot: Path, pid: int) -> None:
    """Let a held copy run (after an agent restart, rebuilt from its snapshot and PID)."""
    if result is None:
        from snapshot.manifest import load

        result = RestoreResult(pid, tuple(proc.tree_pids(pid)), load(snapshot), {})
    start_restored(result)
    if result.manifest.namespace:
        launch.register(result.pid)  # a launched workload here too, under its new PID


def recover_target(ctx: Context, r: Record, finish: Finisher, settle: Settler) -> None:
    """A target agent that died: a copy that never ran is dropped (one that CRIU was still
    restoring is waited for, then stopped); a held one that is still there waits for the
    source's decision (or a takeover); a started one is let go again and watched; one that
    is gone (a reboot) is recorded as dropped, so that the source's original runs on."""
    assert r.role is Role.TARGET
    why = "dropped after the agent restarted"
    if r.state in (T.STARTING, T.CONFIRMING):
        if _runs(r):
            ctx.log.warning(
                "migration %s: the copy (PID %d) is %s: watching it again", r.migration_id, r.pid, r.state.value
            )
            if r.state is T.STARTING:
                _let_run(ctx, r, None, settle)
            else:
                mid = r.migration_id
                ctx.threads.spawn("waiter", f"confirm-{mid[:8]}", watch_copy, ctx, replace(r), settle)
            return
        why = "the started copy did not outlive a restart of this node; the original runs on at the source"
    if r.state is T.READY:
        if _runs(r):
            ctx.log.warning(
                "migration %s: a restored, held copy (PID %d) waits for the source's decision", r.migration_id, r.pid
            )
            ctx.threads.spawn("waiter", f"await-source-{r.migration_id[:8]}", await_source, ctx, r.migration_id, finish)
            return
        ctx.log.warning("migration %s: the held copy (PID %d) is gone", r.migration_id, r.pid)
        why = "the held copy did not outlive a restart of this node"  # (a reboot): never start a stranger
    if r.state is T.RESTORING:  # (in a thread: the agent serves meanwhile, answering "restoring")
        ctx.threads.spawn("waiter", f"end-restore-{r.migration_id[:8]}", _end_restore, ctx, r, why)
        return
    drop_copy(ctx, r, why)


def _end_restore(ctx: Context, r: Record, why: str) -> None:
    """The restore a previous run of the agent started: waited for (no longer than a restore
    may take: a CRIU blocked for ever, behind a lock, is killed then), its copy stopped, dropped."""
    work = restore_work(Path(r.snapshot))
    wait_released(work, ctx.timeouts.restore)
    if criu.stop_in(work):
        ctx.log.warning(
            "migration %s: the restore still ran %.0f s after the agent restarted; its CRIU was stopped",
            r.migration_id,
            ctx.timeouts.restore,
        )
        wait_released(work, 30.0)
    copy = kill_restored(work)
    if copy:
        ctx.log.warning(
            "migration %s: stopping the copy (PID %d) a restore finished while the agent was down", r.migration_id, copy
        )
    drop_copy(ctx, r, why)
