"""The target's side of a migration: receive and verify the snapshot, restore it held, let
it run only when the source commits; and, after a restart, drop what never ran.

Written against :mod:`tpagent.api` only (the source is a :class:`~tpagent.api.Peer`)."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from pathlib import Path

import psutil

from snapshot import engine, proc
from snapshot.held import wait_released
from snapshot.safefs import private_dir
from tpagent import launch, metrics
from tpagent.api import JournalError, PeerUnreachable, Refused, Role, SourceState, TargetState, is_final
from tpagent.context import Context
from tpagent.journal import Record, same_process_alive, target_record
from transfer.api import TransferError, TransferStats
from transfer.receiver import Receiver

T = TargetState
#: finish(migration_id, commit, why): how a waiting copy is decided (:meth:`tpagent.node.Node.finish_target`).
Finisher = Callable[[str, bool, str], object]


class Incoming:
    """The target's side of one migration.

    Restore runs outside the lock, so that an abort arriving meanwhile is taken at once (as
    ``abort_requested``) rather than queued: the restore then kills the copy it made."""

    def __init__(self, ctx: Context, mid: str, source: str, source_agent: str = "") -> None:
        cfg = ctx.cfg
        self.ctx = ctx
        self.dir = cfg.work_dir / "incoming" / mid
        private_dir(self.dir.parent)
        self.receiver = Receiver(
            ctx.transport(),
            ctx.transfer_config,
            f"{cfg.advertised_host}:{cfg.transfer_port}",
            on_refused=lambda reason: metrics.REFUSED.labels("transfer", reason).inc(),
        )
        # The name the sender dials is the one its TLS check holds the certificate against.
        host, port = cfg.advertised_host, self.receiver.address.rpartition(":")[2]
        self.address = cfg.transfer_address or (f"[{host}]:{port}" if ":" in host else f"{host}:{port}")
        self.record = target_record(mid, peer=source, snapshot=str(self.dir), peer_agent=source_agent)
        ctx.journal.write(self.record)
        self.result: TransferStats | TransferError | None = None
        self.gpu_map: dict[str, str] = {}
        self.done = threading.Event()
        self.lock = threading.Lock()
        self.abort_requested = False
        self.restored: engine.RestoreResult | None = None
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

    def restore(self, finish: Finisher) -> engine.RestoreResult:
        """Restore the copy, held; raises Refused (the copy is gone, or never was)."""
        node, j = self.ctx.cfg.node, self.ctx.journal
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
            result = engine.restore(self.dir, self.gpu_map, self.ctx.snapshot_config, verified=True,
                                    work=restore_work(self.dir), start=False)  # fmt: skip
        except Exception as e:  # the engine leaves no copy behind on failure
            with self.lock:
                self._drop(f"restore failed: {e}")
            raise Refused(f"restoring on {node} failed: {e}") from e
        with self.lock:
            self.record.pid = result.pid
            try:
                self.record.create_time = psutil.Process(result.pid).create_time()
            except psutil.NoSuchProcess:
                self.abort_requested = True  # (the copy died as it was restored)
            if self.abort_requested:
                self._drop("the source rolled back while this copy was being restored")
                raise Refused("the source rolled back meanwhile; the copy was stopped")
            try:
                j.move(self.record, T.READY, "restored and held; it starts when the source lets go of the original")
            except Exception:
                self._drop("could not journal the restored copy")
                raise
            self.restored = result
        mid = self.record.migration_id
        self.ctx.threads.spawn("waiter", f"await-source-{mid[:8]}", await_source, self.ctx, mid, finish)
        return result

    def finish(self, commit: bool, why: str = "") -> None:
        with self.lock:
            if is_final(self.record.state):
                return
            if commit:
                if self.record.state is T.READY:  # from now on an abort changes nothing
                    self.ctx.journal.move(self.record, T.DONE, why or "running here")
                    start_copy(self.restored, self.dir, self.record.pid)
                    self.ctx.remove(self.dir)
            elif self.record.state is T.RESTORING:
                self.abort_requested = True  # restore() stops its copy as it returns
            else:
                self._drop(why or "the source rolled back")

    def _drop(self, why: str) -> None:
        self.receiver.close()
        drop_copy(self.ctx, self.record, why)


def drop_copy(ctx: Context, r: Record, why: str) -> None:
    """The one way a target lets a copy go: killed if it is still ours (before the source
    lets its original go: never two), the record DISCARDED, its files removed."""
    if same_process_alive(r):
        proc.kill_tree(r.pid)
    if not is_final(r.state):
        ctx.journal.move(r, T.DISCARDED, why)
    snap = Path(r.snapshot)
    ctx.remove(snap, restore_work(snap), *snap.parent.glob(f".{snap.name}.partial-*"))


def finish_held(ctx: Context, r: Record, commit: bool, why: str) -> None:
    """Start (commit) or drop a READY copy known only from the journal (the agent restarted
    since it was restored); anything else is decided already."""
    if r.state is not T.READY:
        return
    if commit:
        ours = same_process_alive(r)  # (a record is never trusted to name a process)
        ctx.journal.move(r, T.DONE, why)
        if ours:
            start_copy(None, Path(r.snapshot), r.pid)
        ctx.remove(r.snapshot)
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
        except PeerUnreachable as e:
            # Only a source that cannot be reached counts as lost: any answer, even a refusal
            # (a clock skewed past the signature's window), comes from an agent that is there.
            if time.monotonic() - silent_since < limit:
                continue
            ctx.log.warning("migration %s: the source agent %s has been unreachable for %.0f s (%s): starting the copy",
                            mid, r.peer_agent, limit, e)  # fmt: skip
            finish(
                mid,
                True,
                f"started without the source's word: its agent {r.peer_agent} was unreachable for {limit:.0f} s",
            )
            return
        except Refused:
            silent_since = time.monotonic()
            continue
        silent_since = time.monotonic()
        if st.state in (SourceState.ROLLED_BACK.value, SourceState.FAILED.value):  # (the protocol never gets here)
            finish(mid, False, f"the source reports {st.state}")
            return


def start_copy(result: engine.RestoreResult | None, snapshot: Path, pid: int) -> None:
    """Let a held copy run (after an agent restart, rebuilt from its snapshot and PID)."""
    if result is None:
        from snapshot.manifest import load

        result = engine.RestoreResult(pid, tuple(proc.tree_pids(pid)), load(snapshot), {})
    engine.start_restored(result)
    if result.manifest.namespace:
        launch.register(result.pid)  # a launched workload here too, under its new PID


def restore_work(snapshot: Path) -> Path:
    """Where CRIU's restore keeps its pidfile for this migration (known to a restarted agent)."""
    return snapshot.parent / f"{snapshot.name}.restore"


def recover_target(ctx: Context, r: Record, finish: Finisher) -> None:
    """A target agent that died: a copy that never ran is dropped (one that CRIU was still
    restoring is waited for, then stopped); a held one that is still there waits for the
    source's decision (or a takeover), one that is gone is recorded as dropped."""
    assert r.role is Role.TARGET
    why = "dropped after the agent restarted"
    if r.state is T.READY:
        if same_process_alive(r):
            ctx.log.warning(
                "migration %s: a restored, held copy (PID %d) waits for the source's decision", r.migration_id, r.pid
            )
            ctx.threads.spawn("waiter", f"await-source-{r.migration_id[:8]}", await_source, ctx, r.migration_id, finish)
            return
        ctx.log.warning("migration %s: the held copy (PID %d) is gone", r.migration_id, r.pid)
        why = "the held copy did not outlive a restart of this node"  # (a reboot): never start a stranger
    if r.state is T.RESTORING:
        work = restore_work(Path(r.snapshot))
        wait_released(work, None)
        copy = engine.kill_restored(work)
        if copy:
            ctx.log.warning(
                "migration %s: stopping the copy (PID %d) a restore finished while the agent was down",
                r.migration_id,
                copy,
            )
    drop_copy(ctx, r, why)
