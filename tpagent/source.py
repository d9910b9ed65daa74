"""The source's side of a migration: check both ends, freeze while streaming, hold the
original until the copy runs, then commit, or roll back so the original runs on.

The protocol and its states are in :mod:`tpagent.migration`; the order and why it never
leaves two running copies, or none, is in the README ("Migrating").
"""

from __future__ import annotations

import logging
import queue
import signal
import threading
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import grpc
import psutil

from snapshot import criu, engine, gpus, hook, proc
from snapshot.api import DumpMode, SnapshotConfig, SnapshotError
from snapshot.criu import Criu
from snapshot.safefs import private_dir
from tpagent import __version__, metrics, peer
from tpagent.migration import FINAL, Record, State
from tpagent.rpc import pb, stub
from transfer.api import TransferError, TransferStats
from transfer.sender import Sender

if TYPE_CHECKING:
    from tpagent.agent import Agent

log = logging.getLogger(__name__)


class _Failure(Exception):
    pass


class SourceMigration:
    def __init__(self, agent: Agent, pid: int, target: str, dry_run: bool) -> None:
        self.agent, self.pid, self.target, self.dry_run = agent, pid, target, dry_run
        mid = uuid.uuid4().hex
        self.record = Record(mid, "source", State.CHECKING, pid=pid, peer=target,
                             snapshot=str(agent.cfg.work_dir / "outgoing" / mid))  # fmt: skip
        self.events: queue.Queue[Any] = queue.Queue()
        self.t0 = time.monotonic()
        self.timings: dict[str, float] = {}
        self.cancelled = threading.Event()
        self.cancel_reason = ""
        self.cancel_lock = threading.Lock()
        self.pinned = False  # past this, a cancel is refused: a copy may be starting
        self.tree_pids: list[int] = [pid]
        self.dump_thread: threading.Thread | None = None
        self.dump_error: BaseException | None = None
        self.target_told = False
        self.problems: list[str] = []  # a dry run's findings
        self.carry: list[Path] = []
        self.freeze_t0 = 0.0
        self.log = logging.LoggerAdapter(log, {"node": agent.cfg.node, "migration": mid})
        if not dry_run:
            agent.journal.write(self.record)

    @property
    def snapshot(self) -> Path:
        return Path(self.record.snapshot)

    def emit(self, message: str = "", **kw: Any) -> None:
        self.events.put(pb.MigrationEvent(
            migration_id=self.record.migration_id, state=self.record.state.value, message=message,
            seconds=time.monotonic() - self.t0, timings=self.timings, problems=self.problems, **kw))  # fmt: skip
        if message:
            self.log.info("%s: %s", self.record.state.value, message)

    def move(self, to: State, message: str = "") -> None:
        if not self.dry_run:
            self.agent.journal.move(self.record, to, message)
        else:
            self.record.state = to
        self.emit(message)

    def cancel(self, reason: str) -> None:
        with self.cancel_lock:
            if not self.pinned and self.record.state not in FINAL and not self.cancelled.is_set():
                self.cancel_reason = reason
                self.cancelled.set()

    def _check_cancel(self) -> None:
        if self.cancelled.is_set():
            raise _Failure(self.cancel_reason)

    def _stage(self, name: str, t0: float) -> None:
        self.timings[name] = round(time.monotonic() - t0, 4)
        metrics.STAGE.labels(name).observe(self.timings[name])

    def run(self) -> None:
        target = stub(self.target, self.agent.creds)
        outcome = "failed"
        try:
            self.emit("checking both nodes")
            reply = self._check(target)
            if self.dry_run:
                self.move(State.DONE if not reply.problems else State.FAILED, "dry run: " + ("all checks pass" if not reply.problems else "it would fail"))
                outcome = "dry_run"
                return
            self.move(State.FREEZING, f"freezing PID {self.pid} and streaming it to {self.target}")
            stats = self._freeze_and_send(reply.transfer_address)
            self.move(State.HELD, f"{stats.bytes_raw / 2**20:.1f} MiB arrived verified; the original is frozen, resumable")
            with self.cancel_lock:  # the last moment a cancel is taken
                self._check_cancel()
                self.pinned = True
            dump = self.dump_thread
            if not hook.pin(self.snapshot, lambda: dump is not None and dump.is_alive()):
                raise _Failure(f"the frozen original was let go before its copy could start: {self.dump_error}")
            self.record.restore_sent = True
            self.move(State.RESTORING, "restoring on the target")
            t = time.monotonic()
            restored_pid, target_timings = self._restore(target)
            self._stage("restore", t)
            self.timings.update({f"target_{k}": v for k, v in target_timings.items()})
            self.move(State.COMMITTING, f"PID {restored_pid} is restored and held on the target; starting it, ending the original")

            def started() -> None:
                self.timings["downtime"] = round(time.monotonic() - self.freeze_t0, 4)  # frozen here -> running there

            outcome = _commit(self.agent, self.record, target, self.dump_thread, started)
            if outcome == "done":  # (_commit journaled DONE)
                self.emit(f"migrated: PID {self.pid} now runs on {self.target} as PID {restored_pid}")
                self.events.put(pb.MigrationEvent(migration_id=self.record.migration_id, state=State.DONE.value,
                                                  new_pid=restored_pid, timings=self.timings, seconds=time.monotonic() - self.t0))  # fmt: skip
            else:
                self.emit(self.record.message)
        except _Failure as e:
            outcome = self._roll_back(target, str(e))
        except _Unresolved as e:
            outcome = "unresolved"
            self.emit(f"{e}; the original stays frozen and the agent keeps asking the target")
            threading.Thread(target=resolve_source, args=(self.agent, self.record), daemon=True).start()
        except Exception as e:  # a bug must still leave the workload running
            self.log.exception("migration failed unexpectedly")
            if self.record.state in (State.COMMITTING, State.DONE):
                outcome = "unresolved"
                threading.Thread(target=resolve_source, args=(self.agent, self.record), daemon=True).start()
            else:
                outcome = self._roll_back(target, f"internal error: {e}")
        finally:
            metrics.MIGRATIONS.labels(outcome).inc()
            if outcome != "unresolved":
                with self.agent.lock:
                    for p in self.tree_pids:
                        self.agent.active.pop(p, None)
            self.events.put(None)

    def _check(self, target: Any) -> Any:
        try:
            root = proc.validate_target(self.pid)
            tree = [root, *root.children(recursive=True)]
            need = sum(p.memory_info().rss for p in tree)
        except (SnapshotError, psutil.Error) as e:
            raise _Failure(str(e)) from e
        pids = {p.pid for p in tree}
        used = [g for g in gpus.inventory() if pids & set(g.pids)]
        self.record.cuda_pids = sorted(pids & {pid for g in used for pid in g.pids})  # to give back on a restart
        need += sum(g.memory_used for g in used)
        open_files = self._open_files(tree)
        shared = [f"{f}:{Path(f).stat().st_size}" for f in open_files if self._is_shared(f)]
        self.carry = sorted(Path(f) for f in open_files if not self._is_shared(f))  # node-local: they travel
        request = pb.ReceiveRequest(migration_id=self.record.migration_id, source_node=self.agent.cfg.node, source_agent=self.agent.cfg.agent_address,
                                    bytes_estimate=need, gpu_uuids=[g.uuid for g in used], shared_files=shared,
                                    dry_run=self.dry_run)  # fmt: skip
        self.target_told = not self.dry_run  # an abort is harmless if the request never arrived
        try:
            reply = target.Receive(request, timeout=peer.RPC_TIMEOUT)
        except grpc.RpcError as e:
            raise _Failure(f"the target agent {self.target} cannot be used: {_rpc_text(e)}") from e
        self.gpu_map = dict(reply.gpu_map)
        if self.dry_run:
            problems = list(reply.problems)
            try:
                info = target.Info(pb.Empty(), timeout=peer.RPC_TIMEOUT)
                mine = Criu(self.agent.snapshot_config.criu).version_str
                if info.criu_version != mine:
                    problems.append(f"CRIU differs: {mine} here, {info.criu_version or 'none'} on the target")
                if info.agent_version != __version__:
                    problems.append(f"tpagent differs: {__version__} here, {info.agent_version} on the target")
            except (grpc.RpcError, SnapshotError) as e:
                problems.append(str(e))
            self.problems = problems
            reply.problems[:] = problems
        elif reply.problems:
            raise _Failure("the target refused: " + "; ".join(reply.problems))
        self._check_cancel()
        return reply

    @staticmethod
    def _open_files(tree: list[psutil.Process]) -> set[str]:
        out: set[str] = set()
        for p in tree:
            try:
                out.update(f.path for f in p.open_files())
            except psutil.Error:
                continue
        return out

    def _is_shared(self, path: str) -> bool:
        return any(path == s or path.startswith(s.rstrip("/") + "/") for s in self.agent.cfg.shared_paths)

    def _freeze_and_send(self, address: str) -> TransferStats:
        cfg = self.agent.cfg
        config = SnapshotConfig(criu=self.agent.snapshot_config.criu, timeouts=self.agent.snapshot_config.timeouts,
                                hold=cfg.hold_timeout, ghost_limit=cfg.ghost_limit_mib << 20)  # fmt: skip
        private_dir(self.snapshot.parent)
        held = self.snapshot / "log" / hook.HELD_FILE
        t0 = self.freeze_t0 = time.monotonic()

        def dump() -> None:
            try:
                engine.checkpoint(self.pid, self.snapshot, DumpMode.KILL, config, carry=self.carry)
            except BaseException as e:  # handed to the migration's thread
                self.dump_error = e

        def sealed() -> bool:
            if self.dump_error is not None:
                raise _Failure(f"the dump failed: {self.dump_error}")
            self._check_cancel()
            if held.exists():
                self._stage("freeze", t0)
                return True
            return False

        def progress(done: int, wire_bytes: int, total: int) -> None:
            self.emit(bytes_done=done, bytes_total=total)

        self.dump_thread = threading.Thread(target=dump, name=f"dump-{self.pid}", daemon=True)
        self.dump_thread.start()
        try:
            stats = Sender(peer.transport(cfg), peer.transfer_config(self.agent), progress).send(self.snapshot, address, sealed=sealed)
        except TransferError as e:
            raise _Failure(f"the transfer to {address} failed: {e}") from e
        self._stage("freeze_and_send", t0)
        metrics.BYTES.labels("sent").inc(stats.bytes_wire)
        self._check_cancel()
        return stats

    def _restore(self, target: Any) -> tuple[int, dict[str, float]]:
        """The copy's PID once it runs on the target; _Failure if the target says it is gone,
        _Unresolved if the target cannot say."""
        try:
            r = target.Restore(pb.RestoreRequest(migration_id=self.record.migration_id), timeout=peer.RESTORE_TIMEOUT)
            return int(r.pid), dict(r.timings)
        except grpc.RpcError as e:
            why = _rpc_text(e)
            if e.code() in _TARGET_REFUSED:  # its own answer: it kept no copy
                raise _Failure(f"the target could not restore: {why}") from e
        # The call broke: did the copy start before the target went quiet?  Ask it.
        state, pid = _target_state(target, self.record.migration_id, peer.RESTORE_TIMEOUT)
        if state in (State.READY.value, State.DONE.value):
            return pid, {}
        if state is None:
            raise _Unresolved(f"the target stopped answering while restoring ({why})")
        raise _Failure(f"the target could not restore ({why}); it reports {state}")

    def _roll_back(self, target: Any, why: str) -> str:
        """Before RESTORING no copy ever ran: the original goes on at once.  After it, only
        once the target has said its copy is gone."""
        if self.dry_run or self.record.state is State.CHECKING:
            _journal_best_effort(self.agent, self.record, None if self.dry_run else State.FAILED, why)
            if self.target_told:
                _tell_target_abort(target, self.record.migration_id)
            self.emit(why)
            return "failed"
        _journal_best_effort(self.agent, self.record, State.ROLLING_BACK, why)
        self.emit(why)
        if self.record.restore_sent:
            if not _target_dropped_copy(target, self.record.migration_id, 60.0):
                raise_unresolved = f"{why}; the target does not confirm its copy is gone"
                self.emit(f"{raise_unresolved}: the original stays frozen and the agent keeps asking")
                self.log.error(raise_unresolved)
                threading.Thread(target=resolve_source, args=(self.agent, self.record), daemon=True).start()
                return "unresolved"
        elif not _tell_target_abort(target, self.record.migration_id):
            # Its copy never ran; it drops what it received once it hears from us again.
            threading.Thread(target=_keep_telling_abort, args=(target, self.record.migration_id, self.agent.cfg.hold_timeout), daemon=True).start()
        _let_original_go(self.snapshot, self.dump_thread)
        resumed = proc.alive(self.pid)
        peer.remove(self.agent.cfg, self.snapshot)
        _journal_best_effort(self.agent, self.record, State.ROLLED_BACK, f"{why}; " + ("the original was resumed where it stood" if resumed else "the original is gone"))
        self.emit(self.record.message)
        return "rolled_back"


class _Unresolved(Exception):
    pass


#: Answers in which the target says it keeps no copy for this migration.
_TARGET_REFUSED = {grpc.StatusCode.FAILED_PRECONDITION, grpc.StatusCode.NOT_FOUND, grpc.StatusCode.INVALID_ARGUMENT}


def _journal_best_effort(agent: Agent, r: Record, to: State | None, message: str) -> None:
    """A rollback goes on even if the journal cannot be written (a full disk)."""
    if to is None:
        return
    try:
        agent.journal.move(r, to, message)
    except Exception as e:
        log.error("migration %s: could not journal %s: %s", r.migration_id, to.value, e)
        r.state, r.message = to, message


def _target_state(target: Any, mid: str, seconds: float) -> tuple[str | None, int]:
    """The target's state for ``mid`` once it is settled (not ``restoring``), or None if it
    does not answer within ``seconds``.  NOT_FOUND counts as discarded."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        try:
            st = target.Status(pb.MigrationRef(migration_id=mid), timeout=5)
            if st.state != State.RESTORING.value:
                return str(st.state), int(st.pid)
        except grpc.RpcError as e:
            if e.code() is grpc.StatusCode.NOT_FOUND:
                return State.DISCARDED.value, 0
        time.sleep(0.5)
    return None, 0


def _target_dropped_copy(target: Any, mid: str, seconds: float) -> bool:
    """Ask the target to drop its copy; True once it says the copy is gone (or never was)."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        _tell_target_abort(target, mid)
        state, _ = _target_state(target, mid, min(10.0, max(0.1, deadline - time.monotonic())))
        # Only a copy the target itself calls gone counts: one still RECEIVING may yet be
        # restored by a Restore call that is on its way there.
        if state in (State.DISCARDED.value, State.FAILED.value):
            return True
        if state == State.DONE.value:  # it made the copy final: only committing is right now
            return False
    return False


def _let_original_go(snapshot: Path, dump_thread: threading.Thread | None) -> None:
    """Abort the hold: CRIU rolls the dump back and the original runs on where it stood."""
    while dump_thread is not None and dump_thread.is_alive():
        # The dump may not have reached its hook yet: the decision waits for it there.
        if snapshot.joinpath("log").is_dir() and not snapshot.joinpath("log", hook.DECISION_FILE).exists():
            hook.decide(snapshot, commit=False)
        dump_thread.join(0.05)


def _commit(agent: Agent, r: Record, target: Any, dump_thread: threading.Thread | None, started: Callable[[], None] = lambda: None) -> str:
    """COMMITTING (journaled): the target makes its copy final, then the original ends.
    Returns "done", or "rolled_back" if the target says its copy is gone after all."""
    snap = Path(r.snapshot)
    delay = 0.5
    while True:
        try:
            st = target.Finish(pb.FinishRequest(migration_id=r.migration_id, commit=True), timeout=peer.RPC_TIMEOUT)
            if st.state == State.DONE.value:
                started()  # the copy runs now; the original is still frozen
                break
            if st.state in (State.DISCARDED.value, State.FAILED.value):
                agent.journal.move(r, State.ROLLING_BACK, "the target dropped its copy before it was made final")
                _let_original_go(snap, dump_thread)
                if dump_thread is None:
                    hook.decide(snap, commit=False)
                    peer.wait_released(snap / engine.LOG_DIR)
                agent.journal.move(r, State.ROLLED_BACK, "the target dropped its copy; the original was resumed")
                peer.remove(agent.cfg, snap)
                return "rolled_back"
        except grpc.RpcError as e:
            log.warning("migration %s: making the target's copy final failed (%s); trying again", r.migration_id, _rpc_text(e))
        time.sleep(delay)
        delay = min(delay * 2, 10.0)
    if snap.joinpath("log").is_dir():
        hook.decide(snap, commit=True)
    if dump_thread is not None:
        dump_thread.join()
    else:
        peer.wait_released(snap / engine.LOG_DIR, None)
    if peer.same_process_alive(r):  # CRIU could not end it (it died): end it here
        proc.kill_tree(r.pid)
    # The copy runs elsewhere: the lock CRIU left here on its TCP connections would drop
    # their packets if the workload ever came back to this node.
    criu.drop_network_lock(snap / engine.LOG_DIR)
    peer.remove(agent.cfg, snap)
    if r.state is not State.DONE:
        agent.journal.move(r, State.DONE, f"migrated to {r.peer}")
    return "done"


def _tell_target_abort(target: Any, mid: str) -> bool:
    for _ in range(3):
        try:
            target.Finish(pb.FinishRequest(migration_id=mid, commit=False), timeout=5)
            return True
        except grpc.RpcError as e:
            if e.code() in (grpc.StatusCode.NOT_FOUND, grpc.StatusCode.UNAUTHENTICATED):
                return False
            time.sleep(0.5)
    return False


def _keep_telling_abort(target: Any, mid: str, seconds: float) -> None:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline and not _tell_target_abort(target, mid):
        time.sleep(2)


def _rpc_text(e: grpc.RpcError) -> str:
    details = e.details() if hasattr(e, "details") else ""
    return str(details or e.code().name.lower())


def resolve_source(agent: Agent, r: Record) -> None:
    """Bring a source migration to an end (after a restart, or when the target went quiet):
    commit if the copy runs and was meant to, else roll back once no copy can run.  Waits as
    long as it must: the original stays frozen meanwhile, never resumed on a guess."""
    target = stub(r.peer, agent.creds)
    snap = Path(r.snapshot)
    delay = 1.0
    while r.state not in FINAL:
        if r.state is State.COMMITTING:
            _commit(agent, r, target, None)
            break
        if r.state is State.RESTORING:
            state, _ = _target_state(target, r.migration_id, 30.0)
            if state in (State.READY.value, State.DONE.value):
                agent.journal.move(r, State.COMMITTING, "the copy is restored on the target")
                continue
            if state is not None:
                agent.journal.move(r, State.ROLLING_BACK, f"the target reports {state}")
                continue
        elif r.state is State.CHECKING:
            agent.journal.move(r, State.FAILED, "the agent restarted before anything was frozen")
            break
        elif r.state is State.ROLLING_BACK and r.restore_sent and _target_state(target, r.migration_id, 30.0)[0] == State.DONE.value:
            # The target made its copy final (it took over while this agent could not be
            # reached): the only way left is forward, ending the original.
            agent.journal.move(r, State.COMMITTING, "the target's copy runs: ending the original instead")
            continue
        elif not r.restore_sent or _target_dropped_copy(target, r.migration_id, 30.0):
            if r.state in (State.FREEZING, State.HELD):
                agent.journal.move(r, State.ROLLING_BACK, "the agent restarted mid-migration")
            _tell_target_abort(target, r.migration_id)
            if snap.joinpath("log").is_dir():
                hook.decide(snap, commit=False)  # the hook still holds the tree: CRIU rolls it back
            peer.wait_released(snap / engine.LOG_DIR, None)
            _resume_leftovers(r)
            peer.remove(agent.cfg, snap)
            agent.journal.move(r, State.ROLLED_BACK, "rolled back after the agent restarted; the original runs where it stood")
            break
        time.sleep(delay)
        delay = min(delay * 2, 30.0)
    with agent.lock:
        for pid, mid in list(agent.active.items()):
            if mid == r.migration_id:
                agent.active.pop(pid, None)
    agent.log.info("migration %s resolved: %s", r.migration_id, r.state.value)


def _resume_leftovers(r: Record) -> None:
    """What a dead CRIU may have left stopped runs again; the GPU side is given back."""
    if not peer.same_process_alive(r):
        return  # gone (or its PID now someone else's): nothing of ours to resume
    pids = proc.tree_pids(r.pid)
    if not pids:
        return
    proc.signal_tree(pids, signal.SIGCONT)
    if r.cuda_pids:  # CRIU gave back the CPU side; the GPU side waits in host memory
        from snapshot.cuda import CudaDriver

        engine.resume([], [p for p in r.cuda_pids if proc.alive(p)], CudaDriver())

