"""The target's side of a migration: receive and verify the snapshot, restore it held, let
it run only when the source commits; and, after a restart, drop what never ran."""

from __future__ import annotations

import shutil
import threading
from pathlib import Path
from typing import TYPE_CHECKING

from snapshot import engine, proc
from tpagent import metrics, peer
from tpagent.migration import FINAL, Record, State
from transfer.api import TransferError, TransferStats
from transfer.receiver import Receiver

if TYPE_CHECKING:
    from tpagent.agent import Agent

class Incoming:
    """The target's side of one migration.

    Restore runs outside the lock, so that an abort arriving meanwhile is taken at once (as
    ``abort_requested``) rather than queued: the restore then kills the copy it made."""

    def __init__(self, agent: Agent, mid: str, source: str) -> None:
        self.agent = agent
        self.dir = agent.cfg.work_dir / "incoming" / mid
        self.dir.parent.mkdir(parents=True, exist_ok=True)
        self.receiver = Receiver(peer.transport(agent.cfg), peer.transfer_config(agent), f"{agent.cfg.advertised_host}:{agent.cfg.transfer_port}")
        self.address = agent.cfg.transfer_address or self.receiver.address
        self.record = Record(mid, "target", State.RECEIVING, peer=source, snapshot=str(self.dir))
        agent.journal.write(self.record)
        self.result: TransferStats | TransferError | None = None
        self.gpu_map: dict[str, str] = {}
        self.done = threading.Event()
        self.lock = threading.Lock()
        self.abort_requested = False
        self.restored: engine.RestoreResult | None = None
        threading.Thread(target=self._receive, name=f"receive-{mid[:8]}", daemon=True).start()

    def _receive(self) -> None:
        try:
            self.result = self.receiver.receive(self.dir, self.agent.cfg.hold_timeout)
            metrics.BYTES.labels("received").inc(self.result.bytes_wire)
        except TransferError as e:
            self.result = e
        except Exception as e:  # (the listener closed under it by a discard, ...)
            self.result = TransferError(f"receiving stopped: {e}")
        finally:
            self.receiver.close()
            self.done.set()

    def restore(self, gpu_map: dict[str, str]) -> engine.RestoreResult:
        if not self.done.wait(peer.RESTORE_TIMEOUT):
            raise peer.Refused("the snapshot did not arrive in time")
        j = self.agent.journal
        with self.lock:
            if self.abort_requested or self.record.state is not State.RECEIVING:
                raise peer.Refused(f"migration {self.record.migration_id} is {self.record.state.value} here; not restoring it")
            if isinstance(self.result, TransferError) or self.result is None:
                self._discard(f"the snapshot did not arrive intact: {self.result}")
                raise peer.Refused(f"the snapshot did not arrive intact on {self.agent.cfg.node}: {self.result}")
            j.move(self.record, State.RECEIVED)
            j.move(self.record, State.RESTORING)
        try:
            result = engine.restore(self.dir, gpu_map, self.agent.snapshot_config, verified=True, work=restore_work(self.dir), start=False)
        except Exception as e:  # the engine leaves no copy behind on failure
            with self.lock:
                self._discard(f"restore failed: {e}")
            raise peer.Refused(f"restoring on {self.agent.cfg.node} failed: {e}") from e
        with self.lock:
            self.record.pid = result.pid
            if self.abort_requested:
                self._discard("the source rolled back while this copy was being restored")
                raise peer.Refused("the source rolled back meanwhile; the copy was stopped")
            try:
                j.move(self.record, State.READY, "restored and held; it starts when the source lets go of the original")
            except Exception:
                self._discard("could not journal the restored copy")
                raise
            self.restored = result
            return result

    def finish(self, commit: bool) -> None:
        with self.lock:
            if self.record.state in FINAL:
                return
            if commit:
                if self.record.state is State.READY:  # from now on an abort changes nothing
                    self.agent.journal.move(self.record, State.DONE, "running here")
                    start_copy(self.restored, self.dir, self.record.pid)
                    shutil.rmtree(self.dir, ignore_errors=True)
            elif self.record.state is State.RESTORING:
                self.abort_requested = True  # restore() stops its copy as it returns
            else:
                self._discard("the source rolled back")

    def _discard(self, why: str) -> None:
        self.receiver.close()
        if self.record.pid:
            proc.kill_tree(self.record.pid)  # before the source lets its original go: never two
        if self.record.state not in FINAL:
            self.record.state = State.DISCARDED
            self.record.message = why
            self.agent.journal.write(self.record)
        shutil.rmtree(self.dir, ignore_errors=True)
        for stale in self.dir.parent.glob(f".{self.dir.name}.partial-*"):
            shutil.rmtree(stale, ignore_errors=True)


def start_copy(result: engine.RestoreResult | None, snapshot: Path, pid: int) -> None:
    """Let a held copy run (after an agent restart, rebuilt from its snapshot and PID)."""
    if result is None:
        from snapshot.manifest import load

        result = engine.RestoreResult(pid, tuple(proc.tree_pids(pid)), load(snapshot), {})
    engine.start_restored(result)



def restore_work(snapshot: Path) -> Path:
    """Where CRIU's restore keeps its pidfile for this migration (known to a restarted agent)."""
    return snapshot.parent / f"{snapshot.name}.restore"



def recover_target(agent: Agent, r: Record) -> None:
    """A target agent that died: a copy that never ran is dropped (one that CRIU was still
    restoring is waited for, then stopped); a running one waits for the source's decision."""
    if r.state is State.READY:
        agent.log.warning("migration %s: a restored, held copy (PID %d) waits for the source's decision", r.migration_id, r.pid)
        return
    snap = Path(r.snapshot)
    work = restore_work(snap)
    if r.state is State.RESTORING:
        peer.wait_released(work, None)
        copy = engine.kill_restored(work)
        if copy:
            agent.log.warning("migration %s: stopping the copy (PID %d) a restore finished while the agent was down", r.migration_id, copy)
    r.state = State.DISCARDED
    r.message = "dropped after the agent restarted"
    agent.journal.write(r)
    for d in [snap, work, *snap.parent.glob(f".{snap.name}.partial-*")]:
        shutil.rmtree(d, ignore_errors=True)

