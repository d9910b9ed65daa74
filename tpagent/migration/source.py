"""The source's side of a migration: check both ends, freeze while streaming, hold the
original until the copy runs, then commit, or roll back so the original runs on.

Written against :mod:`tpagent.migration.api` only (the target is a :class:`~tpagent.migration.api.Peer`, the
frozen original a :class:`~snapshot.held.HeldDump`); the states and why the protocol never
leaves two running copies, or none, are in :mod:`tpagent.migration.api`.
"""

from __future__ import annotations

import functools
import logging
import os
import queue
import threading
import time
import uuid
from collections.abc import Callable
from pathlib import Path

import psutil

from host import files, gpus, mounts, paths, proc, sockets
from host.safefs import private_dir
from snapshot.api import SnapshotConfig, SnapshotError
from snapshot.criu import Criu
from snapshot.held import HeldDump
from snapshot.manifest import CHUNK_SIZE, IMAGES_DIR
from tpagent import __version__
from tpagent.common import clock, metrics
from tpagent.migration import eligible
from tpagent.migration.admission import MARGIN
from tpagent.migration.api import (
    HAS_COPY,
    Acceptance,
    AgentError,
    Event,
    MigrationResult,
    Offer,
    Outcome,
    Peer,
    PeerUnreachable,
    Refused,
    SourceState,
    TargetState,
    Why,
    is_final,
)
from tpagent.migration.context import Context
from tpagent.migration.decide import (
    Stopping,
    Unresolved,
    commit,
    keep_telling,
    let_original_go,
    target_dropped_copy,
    target_state,
    tell_target_abort,
)
from tpagent.migration.journal import note_process, source_record
from tpagent.migration.resolve import resolve_source
from transfer.api import TransferError, TransferStats
from transfer.chunks import Feed
from transfer.sender import Sender

log = logging.getLogger(__name__)
S = SourceState


class _Failure(Exception):
    """Before COMMITTING: roll back (the message says why)."""


_TARGET_REFUSED = {Why.PRECONDITION, Why.NOT_FOUND, Why.INVALID}
#: A target's states in which its copy has not been let go: a cancel may have it dropped.
_DROPPABLE = {s.value for s in (TargetState.RECEIVING, TargetState.RECEIVED, TargetState.RESTORING, TargetState.READY)}


class SourceMigration:
    """One migration run by this agent as its source; :meth:`run` in a thread of its own,
    reporting :class:`~tpagent.migration.api.Event` s on ``events`` (None ends them)."""

    def __init__(
        self,
        ctx: Context,
        pid: int,
        target: str,
        dry_run: bool,
        release: Callable[[str], None] = lambda _mid: None,
        hold: float = 0.0,
        verdict: Callable[[], bool | None] | None = None,
        communicators_rebuilt: bool = False,
        target_gpus: tuple[str, ...] = (),
    ) -> None:
        """``release(migration_id)`` once it has ended (or is left to a resolver).  A rank moved by a
        rewire: its target holds the started copy for our word (``hold``, seconds: ``Offer.hold``),
        kept once ``verdict`` says True, dropped if False (None: not yet decided); ``communicators_rebuilt``
        (a rank's dry run): its TCP connections are its communicators' and its store's, closed before
        the freeze (tpagent/jobs/rewire.py): not judged here; ``target_gpus``: :attr:`Offer.target_gpus`."""
        self.ctx = ctx
        self.pid = pid
        self.target = target
        self.dry_run = dry_run
        self.release = release
        self.hold = hold
        self.verdict = verdict
        self.communicators_rebuilt = communicators_rebuilt
        self.target_gpus = target_gpus
        mid = uuid.uuid4().hex
        self.record = source_record(mid, peer=target, snapshot=str(paths.WorkDir(ctx.cfg.work_dir).outgoing(mid)))
        note_process(self.record, pid)  # (by PID and start, never by PID alone; a gone one: _check refuses it)
        self.events: queue.Queue[Event | None] = queue.Queue()
        self.result: MigrationResult | None = None
        self.t0 = time.monotonic()
        self.timings: dict[str, float] = {}
        self.cancelled = threading.Event()
        self.cancel_reason = ""
        self.cancel_lock = threading.Lock()
        self.pinned = False  # past this, a cancel must also make the target drop what it restores
        self.committing = False  # past this, a cancel is refused: the copy starts
        self.dump: HeldDump | None = None
        self.target_told = False
        self.copy_gone = False  # the target said, answering the restore, that it has no copy
        self.problems: list[str] = []  # a dry run's findings
        self.copy_runs = threading.Event()  # the copy runs there, its original still frozen here
        self.new_pid = 0
        self.carry: list[Path] = []
        self.skip_mounts: list[str] = []  # of the tree's namespace, lacking on the target (host.mounts)
        self.carry_most = 0  # the most bytes its carried files may hold once frozen (_check)
        self.freeze_t0 = 0.0
        self.log = logging.LoggerAdapter(log, {"node": ctx.cfg.node, "migration": mid})
        if not dry_run:
            ctx.journal.write(self.record)

    @property
    def migration_id(self) -> str:
        return self.record.migration_id

    @property
    def snapshot(self) -> Path:
        return Path(self.record.snapshot)

    def emit(self, message: str = "", bytes_done: int = 0, bytes_total: int = 0, new_pid: int = 0) -> None:
        self.events.put(
            Event(
                self.migration_id,
                self.record.state.value,
                message,
                time.monotonic() - self.t0,
                dict(self.timings),
                tuple(self.problems),
                bytes_done,
                bytes_total,
                new_pid,
            )
        )
        if message:
            self.log.info("%s: %s", self.record.state.value, message)

    def move(self, to: SourceState, message: str = "") -> None:
        if not self.dry_run:
            self.ctx.journal.move(self.record, to, message)
        else:
            self.record.state = to
        self.emit(message)

    def cancel(self, reason: str) -> bool:
        """Cancel unless past the point of no return (the copy starting); whether it was taken.
        While the target restores, it is told to stop that restore (a CRIU blocked behind a
        lock, say, is killed there), and the migration rolls back once it confirms."""
        with self.cancel_lock:
            if not self.committing and not is_final(self.record.state) and not self.cancelled.is_set():
                self.cancel_reason = reason
                self.cancelled.set()
                if self.pinned:
                    name = f"cancel-{self.migration_id[:8]}"
                    self.ctx.threads.spawn("waiter", name, self._drop_held, self.ctx.peer(self.target))
            return self.cancelled.is_set()

    def _drop_held(self, target: Peer) -> None:
        """(A cancel's.)  Tell the target to drop its copy, but only one not yet let go (still
        arriving, being restored, or held): a copy that took over on its own runs on."""
        try:
            state = target.status(self.migration_id, self.ctx.timeouts.rpc).state
        except AgentError:
            return  # (the run asks again, and decides)
        if state in _DROPPABLE:
            tell_target_abort(target, self.migration_id)

    def _check_cancel(self) -> None:
        if self.cancelled.is_set():
            raise _Failure(self.cancel_reason)
        if self.ctx.threads.stopping.is_set():
            raise _Failure("the agent is shutting down")

    def _stage(self, name: str, t0: float) -> None:
        self.timings[name] = round(time.monotonic() - t0, 4)
        metrics.STAGE.labels(name).observe(self.timings[name])

    def run(self) -> MigrationResult:
        target = self.ctx.peer(self.target)
        outcome = Outcome.FAILED
        new_pid = 0
        try:
            self.emit("checking both nodes")
            acceptance = self._check(target)
            if self.dry_run:
                ok = not self.problems
                self.move(S.DONE if ok else S.FAILED, "dry run: " + ("all checks pass" if ok else "it would fail"))
                outcome = Outcome.DRY_RUN
                return self._end(outcome)
            self.move(S.FREEZING, f"freezing PID {self.pid} and streaming it to {self.target}")
            stats = self._freeze_and_send(acceptance)
            sealed = self.dump.stopped() if self.dump is not None else None  # (as sealed: CRIU keeps them so)
            self.record.stopped = self.record.stopped if sealed is None else sealed
            self.move(S.HELD, f"{stats.bytes_raw / 2**20:.1f} MiB arrived verified; the original is frozen, resumable")
            with self.cancel_lock:  # the last moment a cancel is taken
                self._check_cancel()
                self.pinned = True
            assert self.dump is not None
            if not self.dump.pin():
                raise _Failure(f"the frozen original was let go before its copy could start: {self.dump.error}")
            self.record.restore_sent = True
            self.move(S.RESTORING, "restoring on the target")
            t = time.monotonic()
            new_pid, target_timings = self._restore(target)
            with self.cancel_lock:  # (a cancel now: the copy held there is dropped, the original resumed)
                if self.cancelled.is_set() and not self.committing:
                    raise _Failure(self.cancel_reason)
                self.committing = True
            self.new_pid = new_pid
            self._stage("restore", t)
            self.timings.update({f"target_{k}": v for k, v in target_timings.items()})
            self.move(
                S.COMMITTING,
                f"PID {new_pid} is restored and held on the target; starting it (the original ends once "
                + ("its job's communicators are rebuilt with it)" if self.hold else "it runs)"),
            )

            def started() -> None:
                self.timings["downtime"] = round(time.monotonic() - self.freeze_t0, 4)  # frozen here -> running there
                self.copy_runs.set()

            outcome = commit(self.ctx, self.record, target, self.dump, started, self.verdict)
            if outcome is Outcome.DONE:
                self.emit(f"migrated: PID {self.pid} now runs on {self.target} as PID {new_pid}")
                self.emit(new_pid=new_pid)
            else:
                self.emit(self.record.message)
        except _Failure as e:
            outcome = self._roll_back(target, str(e))
        except (Unresolved, Stopping) as e:
            outcome = Outcome.UNRESOLVED
            self.emit(f"{e}; the original stays frozen and the agent keeps asking the target")
            self._keep_resolving()
        except Exception as e:  # a bug must still leave the workload running (an AgentError says its own sentence)
            self.log.exception("migration failed unexpectedly")
            if self.record.state in (S.COMMITTING, S.DONE):
                outcome = Outcome.UNRESOLVED
                self._keep_resolving()
            else:
                outcome = self._roll_back(target, str(e) if isinstance(e, AgentError) else f"internal error: {e}")
        return self._end(outcome, new_pid)

    def _end(self, outcome: Outcome, new_pid: int = 0) -> MigrationResult:
        if self.result is None:
            metrics.MIGRATIONS.labels(outcome.value).inc()
            if outcome is not Outcome.UNRESOLVED:
                self.release(self.migration_id)
            self.result = MigrationResult(self.migration_id, outcome, self.record.message, new_pid, dict(self.timings))
            self.events.put(None)
        return self.result

    def _keep_resolving(self) -> None:
        t = self.ctx.threads
        release = functools.partial(self.release, self.migration_id)
        t.spawn("waiter", f"resolve-{self.migration_id[:8]}", resolve_source, self.ctx, self.record, release)

    def _check(self, target: Peer) -> Acceptance:
        try:
            return self._checks(target)
        except (FileNotFoundError, ProcessLookupError, psutil.NoSuchProcess) as e:  # (no "internal error")
            raise (e if proc.alive(self.pid) else _Failure(f"PID {self.pid} ended as it was checked")) from None

    def _checks(self, target: Peer) -> Acceptance:
        try:
            root = proc.validate_target(self.pid)
            tree = [root, *root.children(recursive=True)]
            need = sum(p.memory_info().rss for p in tree)
        except (SnapshotError, psutil.Error) as e:
            raise _Failure(str(e)) from e
        pids = {p.pid for p in tree}
        self.record.stopped = sorted(p.pid for p in tree if proc.thread_state(p.pid, p.pid) == "T")  # (kept so)
        for warning in eligible.warnings(sorted(pids)):
            self.emit(f"warning: {warning}")
        used = [g for g in gpus.inventory() if pids & set(g.pids)]
        self.record.cuda_pids = sorted(pids & {pid for g in used for pid in g.pids})  # to give back on a restart
        need += sum(g.memory_used for g in used)
        # (refused now, not once frozen)
        shared, self.carry, uncarriable = files.survey(tree, self.ctx.cfg.shared_paths)
        sizes = {str(f): files.size(str(f)) for f in self.carry}
        carried = tuple(f"{f}:{n}" for f, n in sizes.items())
        self.carry_most = sum(sizes.values()) + int(MARGIN * (need + sum(sizes.values())))  # (the target's room)
        tcp = [] if self.communicators_rebuilt else sockets.tree_tcp(sorted(pids))
        stay = eligible.stays(
            self.ctx.cfg, sorted(pids), tcp, self.carry, self.record.cuda_pids, self.communicators_rebuilt
        )
        mounted = mounts.points(root.pid) if proc.pid_namespace(root.pid) != proc.pid_namespace(os.getpid()) else []
        mounted = [m for m in mounted if files.utf8(m)]  # (one whose name is not is left unchecked)
        if (uncarriable or stay) and not self.dry_run:
            raise _Failure("; ".join([*uncarriable, *stay]))
        cfg = self.ctx.cfg
        offer = Offer(
            self.migration_id,
            cfg.node,
            cfg.agent_address,
            need,
            tuple(g.uuid for g in used),
            shared,
            self.dry_run,
            carried,
            sockets.offered(tcp),
            self.hold,
            tuple(g.pci_bus_id for g in used),
            tuple(sockets.abstract_bound(sorted(pids))),
            tuple(mounted),
            self.target_gpus,
        )
        self.target_told = not self.dry_run  # an abort is harmless if the request never arrived
        asked = clock.now()
        try:
            acceptance = target.receive(offer, self.ctx.timeouts.rpc)
        except AgentError as e:
            raise _Failure(f"the target agent {self.target} cannot be used: {e}") from e
        held = mounts.used(sorted(pids))
        missing = acceptance.missing_mounts
        self.skip_mounts, stuck, said = mounts.for_node(mounted, missing, held, map(str, self.carry), "the target")
        self.problems = [*uncarriable, *stay, *acceptance.problems, *stuck]
        if said:
            self.emit(said)
        if self.dry_run and acceptance.reserved:
            self.emit(acceptance.reserved)
        skew = acceptance.clock - (asked + clock.now()) / 2 if acceptance.clock else 0.0
        if abs(skew) > clock.START_LIMIT:  # (a step later on is survived: tpagent/common/clock.py)
            apart = (
                f"the clock of {self.target} is {clock.apart(skew)} this node's, more than the "
                f"{clock.START_LIMIT:.0f} s a migration starts with: keep the nodes' clocks in sync (NTP)"
            )
            if not self.dry_run:
                raise _Failure(apart)
            self.problems.append(apart)
        if self.dry_run:
            self.problems += self._versions_differ(target)
        elif self.problems:
            raise _Failure(("" if stuck else "the target refused: ") + "; ".join(self.problems))
        self._check_cancel()
        return acceptance

    def _versions_differ(self, target: Peer) -> list[str]:
        """(A dry run's.)  How CRIU and tpagent differ between the nodes, one sentence each."""
        try:
            versions = target.versions(self.ctx.timeouts.rpc)
            mine = Criu(self.ctx.snapshot_config.criu).version_str
        except (AgentError, SnapshotError) as e:
            return [str(e)]
        pairs = [("CRIU", mine, versions.criu or "none"), ("tpagent", __version__, versions.agent)]
        return [f"{what} differs: {here} here, {there} on the target" for what, here, there in pairs if here != there]

    def _freeze_and_send(self, acceptance: Acceptance) -> TransferStats:
        cfg = self.ctx.cfg
        ctx = self.ctx
        # CRIU's images go straight to the transfer (snapshot.streamer), never into files here
        # (the transfer's chunks must be the seal's for that)
        streams = cfg.stream_buffer_mib > 0 and ctx.transfer_config.chunk_size == CHUNK_SIZE
        feed = Feed(CHUNK_SIZE, cfg.stream_buffer_mib << 20) if streams else None
        config = SnapshotConfig(
            criu=ctx.snapshot_config.criu,
            timeouts=ctx.snapshot_config.timeouts,
            ghost_limit=cfg.ghost_limit_mib << 20,
            stream=feed.put if feed is not None else None,
            carry_opened=tuple(cfg.shared_paths),
            skip_mounts=tuple(self.skip_mounts),
            carry_most=self.carry_most,
        )
        private_dir(self.snapshot.parent)
        t0 = self.freeze_t0 = time.monotonic()
        # (the process checked, by its start: a PID reused since is refused while frozen)
        dump = self.dump = ctx.held.start(
            self.pid, self.snapshot, config, ctx.timeouts.hold, self.carry, self.record.started()
        )

        def sealed() -> bool:  # the sender ends once the snapshot is whole
            if dump.error is not None:
                raise _Failure(f"the dump failed: {dump.error}")
            self._check_cancel()
            if dump.sealed():
                self._stage("freeze", t0)
                return True
            return False

        def progress(done: int, wire_bytes: int, total: int) -> None:
            self.emit(bytes_done=done, bytes_total=total)

        address = acceptance.transfer_address
        try:
            sender = Sender(ctx.transport(), ctx.transfer_config, progress)
            stats = sender.send(self.snapshot, address, sealed=sealed, feed=feed)
        except TransferError as e:
            # A dump that fails takes its files back first: the sender may find them gone before
            # the dump says why.  Its reason is the one to give.
            failed = dump.failure(within=30.0 if feed is not None or not (self.snapshot / IMAGES_DIR).is_dir() else 0.0)
            if failed is not None:
                raise _Failure(f"the dump failed: {failed}") from e
            raise _Failure(f"the transfer to {address} failed: {e}") from e
        finally:
            if feed is not None:  # (never a CRIU left waiting on a transfer that is not there)
                feed.fail("the transfer ended before the dump did")
        self._stage("freeze_and_send", t0)
        if feed is not None and feed.fed:
            self.log.info("%.0f MiB of images went from CRIU straight to the transfer", feed.fed / 2**20)
        metrics.BYTES.labels("sent").inc(stats.bytes_wire)
        self.timings["sent_bytes"] = float(stats.bytes_wire)  # (not a time: what crossed the network)
        self.timings["image_bytes"] = float(stats.bytes_raw)
        self._check_cancel()
        return stats

    def _restore(self, target: Peer) -> tuple[int, dict[str, float]]:
        """The copy's PID once it is restored (held) on the target; _Failure if the target
        says it is gone, Unresolved if the target cannot say."""
        try:
            restored = target.restore(self.migration_id, self.ctx.timeouts.restore)
            return restored.pid, dict(restored.timings)
        except Refused as e:
            why = str(e)
            self.copy_gone = e.why in _TARGET_REFUSED  # its own answer: it kept no copy (nothing to confirm)
            if self.cancelled.is_set():
                raise _Failure(self.cancel_reason) from e
            if self.copy_gone:
                raise _Failure(f"the target could not restore: {why}") from e
        except PeerUnreachable as e:
            why = str(e)
            self.log.warning("the target stopped answering its restore call (%s); asking how the restore stands", why)
            self.emit("the target stopped answering its restore call; asking it how the restore stands")
        # The call broke: did the copy start before the target went quiet?  Ask it.
        state, pid = target_state(self.ctx, target, self.migration_id, self.ctx.timeouts.restore)
        if state in HAS_COPY:  # (held, or already let go: it took over, or its agent restarted)
            if state != TargetState.READY.value:
                with self.cancel_lock:  # (it runs there: only committing is right now, cancel or not)
                    self.committing = True
            return pid, {}
        if self.cancelled.is_set():
            raise _Failure(self.cancel_reason)
        if state is None:
            raise Unresolved(f"the target stopped answering while restoring ({why})")
        raise _Failure(f"the target could not restore ({why}); it reports {state}")

    def _roll_back(self, target: Peer, why: str) -> Outcome:
        """Before RESTORING no copy ever ran: the original goes on at once.  After it, only
        once the target has said its copy is gone."""
        ctx = self.ctx
        if self.dry_run or self.record.state is S.CHECKING:
            if not self.dry_run:
                ctx.journal.settle(self.record, S.FAILED, why)
            if self.target_told:
                tell_target_abort(target, self.migration_id)
            self.emit(why)
            return Outcome.FAILED
        ctx.journal.settle(self.record, S.ROLLING_BACK, why)
        self.emit(why)
        if self.record.restore_sent and not self.copy_gone:
            if not target_dropped_copy(ctx, target, self.migration_id, ctx.timeouts.abort_confirm):
                unresolved = f"{why}; the target does not confirm its copy is gone"
                self.emit(f"{unresolved}: the original stays frozen and the agent keeps asking")
                self.log.error(unresolved)
                self._keep_resolving()
                return Outcome.UNRESOLVED
        elif not tell_target_abort(target, self.migration_id):
            # Its copy never ran; it drops what it received once it hears from us again.
            name = f"abort-{self.migration_id[:8]}"
            ctx.threads.spawn("waiter", name, keep_telling, ctx, target, self.migration_id, False)
        if self.dump is not None and self.pinned:  # (the hook may have queued a stop it did not take back)
            let_original_go(self.record, self.dump)
        elif self.dump is not None:
            self.dump.let_go()
        resumed = proc.alive(self.pid)
        ctx.remove(self.snapshot)
        how = "the original was resumed where it stood" if resumed else "the original is gone"
        ctx.journal.settle(self.record, S.ROLLED_BACK, f"{why}; {how}")
        self.emit(self.record.message)
        return Outcome.ROLLED_BACK
