"""The target's side of a migration: receive and verify the snapshot, restore it held, let
it run only when the source commits; and, after a restart, drop what never ran."""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING

import grpc
import psutil

from snapshot import engine, proc
from snapshot.safefs import private_dir
from tpagent import launch, metrics, peer
from tpagent.migration import FINAL, JournalError, Record, State
from tpagent.rpc import pb, stub
from transfer.api import TransferError, TransferStats
from transfer.receiver import Receiver

if TYPE_CHECKING:
    from tpagent.agent import Agent


class Incoming:
    """The target's side of one migration.

    Restore runs outside the lock, so that an abort arriving meanwhile is taken at once (as
    ``abort_requested``) rather than queued: the restore then kills the copy it made."""

    def __init__(self, agent: Agent, mid: str, source: str, source_agent: str = "") -> None:
        self.agent = agent
        self.dir = agent.cfg.work_dir / "incoming" / mid
        private_dir(self.dir.parent)
        self.receiver = Receiver(peer.transport(agent.cfg), peer.transfer_config(agent), f"{agent.cfg.advertised_host}:{agent.cfg.transfer_port}",
                                 on_refused=lambda reason: metrics.REFUSED.labels("transfer", reason).inc())  # fmt: skip
        # The name the sender dials is the one its TLS check holds the certificate against.
        host, port = agent.cfg.advertised_host, self.receiver.address.rpartition(":")[2]
        self.address = agent.cfg.transfer_address or (f"[{host}]:{port}" if ":" in host else f"{host}:{port}")
        self.record = Record(mid, "target", State.RECEIVING, peer=source, snapshot=str(self.dir), peer_agent=source_agent)
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
            try:
                self.record.create_time = psutil.Process(result.pid).create_time()
            except psutil.NoSuchProcess:
                self.abort_requested = True  # (the copy died as it was restored)
            if self.abort_requested:
                self._discard("the source rolled back while this copy was being restored")
                raise peer.Refused("the source rolled back meanwhile; the copy was stopped")
            try:
                j.move(self.record, State.READY, "restored and held; it starts when the source lets go of the original")
            except Exception:
                self._discard("could not journal the restored copy")
                raise
            self.restored = result
        threading.Thread(target=await_source, args=(self.agent, self.record.migration_id), daemon=True).start()
        return result

    def finish(self, commit: bool, why: str = "") -> None:
        with self.lock:
            if self.record.state in FINAL:
                return
            if commit:
                if self.record.state is State.READY:  # from now on an abort changes nothing
                    self.agent.journal.move(self.record, State.DONE, why or "running here")
                    start_copy(self.restored, self.dir, self.record.pid)
                    peer.remove(self.agent.cfg, self.dir)
            elif self.record.state is State.RESTORING:
                self.abort_requested = True  # restore() stops its copy as it returns
            else:
                self._discard(why or "the source rolled back")

    def _discard(self, why: str) -> None:
        self.receiver.close()
        if self.record.pid:
            proc.kill_tree(self.record.pid)  # before the source lets its original go: never two
        if self.record.state not in FINAL:
            self.record.state = State.DISCARDED
            self.record.message = why
            self.agent.journal.write(self.record)
        peer.remove(self.agent.cfg, self.dir, *self.dir.parent.glob(f".{self.dir.name}.partial-*"))


#: What a source agent that cannot be reached at all looks like.
_UNREACHABLE = {grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED}


def await_source(agent: Agent, mid: str) -> None:
    """While a restored copy waits for its source's word, keep asking the source agent.

    A source that answers decides (it may still be streaming its commit).  One that cannot be
    reached for ``takeover_after`` seconds has most likely lost its node with the frozen
    original on it: the copy then starts on its own.  That never makes two copies run: once a
    source has asked for the restore, it resumes its original only after this agent has said
    the copy is gone, and a source that comes back finds the copy DONE here and ends its
    original.  (The one case outside this: the source's CRIU dies while holding the original,
    which then runs on, *and* its agent stays down that long.)"""
    limit = agent.cfg.takeover_after
    try:
        r = agent.journal.read(mid)
    except JournalError:
        return
    if limit <= 0 or r is None or not r.peer_agent:
        return
    source = stub(r.peer_agent, agent.creds)
    silent_since = time.monotonic()
    while True:
        time.sleep(min(5.0, max(limit / 4, 0.1)))
        try:
            r = agent.journal.read(mid)
        except JournalError as e:
            agent.log.error("migration %s: %s; not starting its copy", mid, e)
            continue
        if r is None or r.state is not State.READY:
            return  # decided
        try:
            st = source.Status(pb.MigrationRef(migration_id=mid), timeout=min(10.0, limit))
        except grpc.RpcError as e:
            # Only a source that cannot be reached counts as lost: any answer, even a refusal
            # (a clock skewed past the signature's window), comes from an agent that is there.
            if e.code() not in _UNREACHABLE:
                silent_since = time.monotonic()
                continue
            if time.monotonic() - silent_since < limit:
                continue
            agent.log.warning("migration %s: the source agent %s has been unreachable for %.0f s (%s): starting the copy", mid, r.peer_agent, limit, e.code())
            agent.finish_target(mid, True, f"started without the source's word: its agent {r.peer_agent} was unreachable for {limit:.0f} s")
            return
        silent_since = time.monotonic()
        if st.state in (State.ROLLED_BACK.value, State.FAILED.value):  # (the protocol never gets here)
            agent.finish_target(mid, False, f"the source reports {st.state}")
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



def recover_target(agent: Agent, r: Record) -> None:
    """A target agent that died: a copy that never ran is dropped (one that CRIU was still
    restoring is waited for, then stopped); a held one that is still there waits for the
    source's decision (or a takeover), one that is gone is recorded as dropped."""
    why = "dropped after the agent restarted"
    if r.state is State.READY:
        if peer.same_process_alive(r):
            agent.log.warning("migration %s: a restored, held copy (PID %d) waits for the source's decision", r.migration_id, r.pid)
            threading.Thread(target=await_source, args=(agent, r.migration_id), daemon=True).start()
            return
        agent.log.warning("migration %s: the held copy (PID %d) is gone", r.migration_id, r.pid)
        why = "the held copy did not outlive a restart of this node"  # (a reboot): never start a stranger
    snap = Path(r.snapshot)
    work = restore_work(snap)
    if r.state is State.RESTORING:
        peer.wait_released(work, None)
        copy = engine.kill_restored(work)
        if copy:
            agent.log.warning("migration %s: stopping the copy (PID %d) a restore finished while the agent was down", r.migration_id, copy)
    r.state = State.DISCARDED
    r.message = why
    agent.journal.write(r)
    peer.remove(agent.cfg, snap, work, *snap.parent.glob(f".{snap.name}.partial-*"))

