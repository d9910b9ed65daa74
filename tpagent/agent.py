"""The node agent's service: node info, migratable processes, and both ends of a migration.

The source agent runs a whole migration (``Migrate``, driven by ``tpagent migrate``) and
calls the target agent's ``Receive`` / ``Restore`` / ``Finish``.  The protocol and its
states are in :mod:`tpagent.migration`; this module carries them out.
"""

from __future__ import annotations

import logging
import os
import queue
import shutil
import signal
import socket
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import grpc
import psutil

from snapshot import engine, gpus, hook, proc
from snapshot.api import DumpMode, SnapshotConfig, SnapshotError
from snapshot.criu import Criu
from tpagent import __version__, metrics
from tpagent.config import AgentConfig
from tpagent.migration import FINAL, Journal, Record, State, valid_id
from tpagent.rpc import AgentServicer, pb, stub
from transfer.api import Compress, TransferConfig, TransferError, TransferStats, Transport
from transfer.stream import Receiver, Sender
from transfer.tcp import TcpTransport

log = logging.getLogger(__name__)

RPC_TIMEOUT = 30.0
RESTORE_TIMEOUT = 3600.0


class Refused(Exception):
    """A request this agent will not carry out; the message is for the user, as is."""

    def __init__(self, message: str, code: grpc.StatusCode = grpc.StatusCode.FAILED_PRECONDITION) -> None:
        super().__init__(message)
        self.code = code


def _transport(cfg: AgentConfig) -> Transport:
    if cfg.transport == "ucx":
        from transfer.ucx import UcxTransport

        return UcxTransport(cfg.io_timeout)
    return TcpTransport(cfg.io_timeout)


def _transfer_config(agent: Agent) -> TransferConfig:
    t = agent.cfg.io_timeout
    return TransferConfig(secret=agent.secret, compress=Compress(agent.cfg.compress), io_timeout=t, connect_timeout=min(10.0, t),
                          streams=max(1, min(64, agent.cfg.streams)))  # fmt: skip


def _is_launched(p: psutil.Process) -> bool:
    """A `tpagent launch` namespace init."""
    try:
        cmd = p.cmdline()
    except (psutil.NoSuchProcess, psutil.AccessDenied):
        return False
    return "tpagent.nsinit" in cmd


class Agent(AgentServicer):  # type: ignore[misc]
    def __init__(self, cfg: AgentConfig, snapshot_config: SnapshotConfig = SnapshotConfig()) -> None:
        self.cfg = cfg
        self.secret = cfg.secret()
        self.snapshot_config = snapshot_config
        self.journal = Journal(cfg.work_dir / "migrations")
        self.lock = threading.Lock()
        self.active: dict[int, str] = {}  # source: PID -> migration in progress
        self.sources: dict[str, _SourceMigration] = {}
        self.receivers: dict[str, _Incoming] = {}
        self.log = logging.LoggerAdapter(log, {"node": cfg.node})

    # ---- node -------------------------------------------------------------------------

    def node_info(self) -> Any:
        problems = []
        criu_version = ""
        try:
            criu_version = Criu(self.snapshot_config.criu).version_str
        except SnapshotError as e:
            problems.append(str(e))
        gpu_list = [
            pb.Gpu(uuid=g.uuid, name=g.name, memory_total=g.memory_total, memory_used=g.memory_used,
                   temperature_c=g.temperature_c or 0, ecc_uncorrected=g.ecc_uncorrected or 0)  # fmt: skip
            for g in gpus.inventory()
        ]
        return pb.NodeInfo(
            node=self.cfg.node, hostname=socket.gethostname(), gpus=gpu_list,
            memory_available=psutil.virtual_memory().available, agent_version=__version__,
            criu_version=criu_version, driver_version=gpus.driver_version() or "", healthy=not problems, problems=problems,
        )  # fmt: skip

    def Info(self, request: Any, context: grpc.ServicerContext) -> Any:
        return self.node_info()

    def migratable(self) -> list[Any]:
        out = []
        gpu_pids = {pid for g in gpus.inventory() for pid in g.pids}
        for p in psutil.process_iter(["pid", "cmdline", "memory_info"]):
            cmd = p.info["cmdline"] or []
            why = ""
            if p.pid in gpu_pids:
                why = "gpu"
            elif _is_launched(p):
                why = "launched"
            elif any(a in " ".join(cmd) for a in self.cfg.allow_commands):
                why = "operator"
            if why and p.pid != 1:
                rss = p.info["memory_info"].rss if p.info["memory_info"] else 0
                out.append(pb.Process(pid=p.pid, cmdline=cmd, rss=rss, uses_gpu=p.pid in gpu_pids, why=why))
        return out

    def ListProcesses(self, request: Any, context: grpc.ServicerContext) -> Any:
        return pb.ProcessList(processes=self.migratable())

    # ---- source -----------------------------------------------------------------------

    def Migrate(self, request: Any, context: grpc.ServicerContext) -> Iterator[Any]:
        try:
            m = self._start_migration(int(request.pid), str(request.target), bool(request.dry_run))
        except Refused as e:
            context.abort(e.code, str(e))
        # The CLI going away (Ctrl-C) cancels the migration, unless it is past the point of no return.
        if not context.add_callback(lambda: m.cancel("the tpagent migrate command went away (interrupted)")):
            m.cancel("the tpagent migrate command went away before it started")
        threading.Thread(target=m.run, name=f"migrate-{m.pid}", daemon=True).start()
        while True:
            event = m.events.get()
            if event is None:
                return
            yield event

    def _start_migration(self, pid: int, target: str, dry_run: bool) -> _SourceMigration:
        if pid <= 1:
            raise Refused(f"PID {pid} cannot be migrated.", grpc.StatusCode.INVALID_ARGUMENT)
        if not target or len(target) > 300 or ":" not in target:
            raise Refused(f"{target!r} is not an agent address (HOST:PORT).", grpc.StatusCode.INVALID_ARGUMENT)
        if not psutil.pid_exists(pid):
            raise Refused(f"there is no process with PID {pid} on {self.cfg.node}.", grpc.StatusCode.NOT_FOUND)
        allowed = {p.pid for p in self.migratable()}
        if pid not in allowed:
            raise Refused(
                f"PID {pid} is not a migratable process on {self.cfg.node}: it does not use a GPU, was not started with "
                "`tpagent launch`, and matches no allow_commands entry.",
                grpc.StatusCode.PERMISSION_DENIED,
            )
        try:
            create_time = psutil.Process(pid).create_time()
        except psutil.NoSuchProcess as e:
            raise Refused(f"there is no process with PID {pid} on {self.cfg.node}.", grpc.StatusCode.NOT_FOUND) from e
        tree = set(proc.tree_pids(pid))
        with self.lock:
            busy = sorted(tree & set(self.active))
            if busy:  # the whole tree: a parent and its GPU child are one migration
                raise Refused(f"PID {pid} is already being migrated (migration {self.active[busy[0]]}).", grpc.StatusCode.ALREADY_EXISTS)
            m = _SourceMigration(self, pid, target, dry_run)
            m.tree_pids, m.record.create_time = sorted(tree), create_time
            for p in tree:
                self.active[p] = m.record.migration_id
            self.sources[m.record.migration_id] = m
        return m

    def Status(self, request: Any, context: grpc.ServicerContext) -> Any:
        r = self._record(request.migration_id, context)
        return _status(r)

    def Cancel(self, request: Any, context: grpc.ServicerContext) -> Any:
        r = self._record(request.migration_id, context)
        m = self.sources.get(r.migration_id)
        if m is not None:
            m.cancel("cancelled by the operator")
        return self.Status(request, context)

    def _record(self, migration_id: str, context: grpc.ServicerContext) -> Record:
        r = self.journal.read(migration_id) if valid_id(migration_id) else None
        if r is None:
            context.abort(grpc.StatusCode.NOT_FOUND, f"no migration {migration_id!r} on {self.cfg.node}")
        assert r is not None
        return r

    # ---- target -----------------------------------------------------------------------

    def Receive(self, request: Any, context: grpc.ServicerContext) -> Any:
        mid = request.migration_id
        if not valid_id(mid):
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, "bad migration id")
        if request.source_node == self.cfg.node or mid in self.sources:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"{self.cfg.node} is the source of this migration; give another node as the target")
        problems = self.target_problems(request)
        if problems or request.dry_run:
            return pb.ReceiveReply(problems=problems)
        with self.lock:
            if mid in self.receivers or self.journal.read(mid) is not None:
                context.abort(grpc.StatusCode.ALREADY_EXISTS, f"migration {mid} is already known here")
            try:
                inc = _Incoming(self, mid, request.source_node)
            except TransferError as e:
                context.abort(grpc.StatusCode.FAILED_PRECONDITION, f"{self.cfg.node} cannot receive: {e}")
            inc.gpu_map = self.gpu_map(list(request.gpu_uuids))
            self.receivers[mid] = inc
        return pb.ReceiveReply(transfer_address=inc.address, gpu_map=inc.gpu_map)

    def target_problems(self, request: Any) -> list[str]:
        problems = []
        need = int(request.bytes_estimate)
        if self.cfg.memory_limit and need > self.cfg.memory_limit:
            problems.append(f"{self.cfg.node} accepts at most {self.cfg.memory_limit / 2**30:.2f} GiB per migration (memory_limit); this one needs {need / 2**30:.2f} GiB")
        available = psutil.virtual_memory().available
        if need * 1.1 > available:
            problems.append(f"{self.cfg.node} has {available / 2**30:.2f} GiB of memory free; this process needs about {need * 1.1 / 2**30:.2f} GiB")
        try:
            Criu(self.snapshot_config.criu).check()
        except SnapshotError as e:
            problems.append(f"{self.cfg.node}: {e}")
        ours = len(gpus.inventory())
        if len(request.gpu_uuids) > ours:
            problems.append(f"{self.cfg.node} has {ours} GPU(s); the process uses {len(request.gpu_uuids)}")
        for entry in list(request.shared_files)[:10_000]:
            path, _, size = entry.rpartition(":")
            try:
                have = Path(path).stat().st_size
            except (OSError, ValueError):
                problems.append(f"{path} (on a shared path) is missing on {self.cfg.node}")
                continue
            if str(have) != size:
                problems.append(f"{path} is {have} bytes on {self.cfg.node} but {size} on the source")
        return problems

    def gpu_map(self, uuids: list[str]) -> dict[str, str]:
        """Each source GPU onto one of ours, the emptiest first."""
        ours = sorted(gpus.inventory(), key=lambda g: g.memory_used)
        return {old: new.uuid for old, new in zip(uuids, ours)}

    def Restore(self, request: Any, context: grpc.ServicerContext) -> Any:
        inc = self.receivers.get(request.migration_id)
        if inc is None:
            context.abort(grpc.StatusCode.NOT_FOUND, f"no snapshot is being received for migration {request.migration_id!r}")
        assert inc is not None
        try:
            result = inc.restore(inc.gpu_map)
        except Refused as e:
            context.abort(e.code, str(e))
        return pb.RestoreReply(pid=result.pid, timings=result.timings)

    def Finish(self, request: Any, context: grpc.ServicerContext) -> Any:
        inc = self.receivers.get(request.migration_id)
        if inc is None:  # this agent restarted since: only the journal knows the migration
            r = self._record(request.migration_id, context)
            with self.lock:
                r = self.journal.read(r.migration_id) or r
                if r.state is State.READY:
                    if request.commit:
                        self.journal.move(r, State.DONE, "running here")
                        _start_copy(None, Path(r.snapshot), r.pid)
                    else:
                        proc.kill_tree(r.pid)
                        self.journal.move(r, State.DISCARDED, "decided by the source")
                    shutil.rmtree(r.snapshot, ignore_errors=True)
            return _status(r)
        inc.finish(bool(request.commit))
        r = inc.record
        return _status(r)

    # ---- restart ------------------------------------------------------------------------

    def recover(self) -> None:
        """Finish or roll back what a previous run of this agent left half-way."""
        for r in self.journal.unfinished():
            try:
                if r.role == "source":
                    with self.lock:
                        self.active[r.pid] = r.migration_id  # frozen, not to be migrated again meanwhile
                    threading.Thread(target=_resolve_source, args=(self, r), daemon=True).start()
                else:
                    _recover_target(self, r)
            except Exception as e:  # one bad record must not stop the agent
                self.log.error("could not recover migration %s: %s", r.migration_id, e)


class _Incoming:
    """The target's side of one migration.

    Restore runs outside the lock, so that an abort arriving meanwhile is taken at once (as
    ``abort_requested``) rather than queued: the restore then kills the copy it made."""

    def __init__(self, agent: Agent, mid: str, source: str) -> None:
        self.agent = agent
        self.dir = agent.cfg.work_dir / "incoming" / mid
        self.dir.parent.mkdir(parents=True, exist_ok=True)
        self.receiver = Receiver(_transport(agent.cfg), _transfer_config(agent), f"{agent.cfg.advertised_host}:{agent.cfg.transfer_port}")
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
        if not self.done.wait(RESTORE_TIMEOUT):
            raise Refused("the snapshot did not arrive in time")
        j = self.agent.journal
        with self.lock:
            if self.abort_requested or self.record.state is not State.RECEIVING:
                raise Refused(f"migration {self.record.migration_id} is {self.record.state.value} here; not restoring it")
            if isinstance(self.result, TransferError) or self.result is None:
                self._discard(f"the snapshot did not arrive intact: {self.result}")
                raise Refused(f"the snapshot did not arrive intact on {self.agent.cfg.node}: {self.result}")
            j.move(self.record, State.RECEIVED)
            j.move(self.record, State.RESTORING)
        try:
            result = engine.restore(self.dir, gpu_map, self.agent.snapshot_config, verified=True, work=restore_work(self.dir), start=False)
        except Exception as e:  # the engine leaves no copy behind on failure
            with self.lock:
                self._discard(f"restore failed: {e}")
            raise Refused(f"restoring on {self.agent.cfg.node} failed: {e}") from e
        with self.lock:
            self.record.pid = result.pid
            if self.abort_requested:
                self._discard("the source rolled back while this copy was being restored")
                raise Refused("the source rolled back meanwhile; the copy was stopped")
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
                    _start_copy(self.restored, self.dir, self.record.pid)
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


def _start_copy(result: engine.RestoreResult | None, snapshot: Path, pid: int) -> None:
    """Let a held copy run (after an agent restart, rebuilt from its snapshot and PID)."""
    if result is None:
        from snapshot.manifest import load

        result = engine.RestoreResult(pid, tuple(proc.tree_pids(pid)), load(snapshot), {})
    engine.start_restored(result)


def _status(r: Record) -> Any:
    return pb.MigrationStatus(migration_id=r.migration_id, state=r.state.value, message=r.message, pid=r.pid)


def restore_work(snapshot: Path) -> Path:
    """Where CRIU's restore keeps its pidfile for this migration (known to a restarted agent)."""
    return snapshot.parent / f"{snapshot.name}.restore"


class _Failure(Exception):
    pass


class _SourceMigration:
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
        target = stub(self.target, self.agent.secret)
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
            threading.Thread(target=_resolve_source, args=(self.agent, self.record), daemon=True).start()
        except Exception as e:  # a bug must still leave the workload running
            self.log.exception("migration failed unexpectedly")
            if self.record.state in (State.COMMITTING, State.DONE):
                outcome = "unresolved"
                threading.Thread(target=_resolve_source, args=(self.agent, self.record), daemon=True).start()
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
        request = pb.ReceiveRequest(migration_id=self.record.migration_id, source_node=self.agent.cfg.node,
                                    bytes_estimate=need, gpu_uuids=[g.uuid for g in used], shared_files=shared,
                                    dry_run=self.dry_run)  # fmt: skip
        self.target_told = not self.dry_run  # an abort is harmless if the request never arrived
        try:
            reply = target.Receive(request, timeout=RPC_TIMEOUT)
        except grpc.RpcError as e:
            raise _Failure(f"the target agent {self.target} cannot be used: {_rpc_text(e)}") from e
        self.gpu_map = dict(reply.gpu_map)
        if self.dry_run:
            problems = list(reply.problems)
            try:
                info = target.Info(pb.Empty(), timeout=RPC_TIMEOUT)
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
                                hold=cfg.hold_timeout)  # fmt: skip
        self.snapshot.parent.mkdir(parents=True, exist_ok=True)
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
            stats = Sender(_transport(cfg), _transfer_config(self.agent), progress).send(self.snapshot, address, sealed=sealed)
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
            r = target.Restore(pb.RestoreRequest(migration_id=self.record.migration_id), timeout=RESTORE_TIMEOUT)
            return int(r.pid), dict(r.timings)
        except grpc.RpcError as e:
            why = _rpc_text(e)
            if e.code() in _TARGET_REFUSED:  # its own answer: it kept no copy
                raise _Failure(f"the target could not restore: {why}") from e
        # The call broke: did the copy start before the target went quiet?  Ask it.
        state, pid = _target_state(target, self.record.migration_id, RESTORE_TIMEOUT)
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
                threading.Thread(target=_resolve_source, args=(self.agent, self.record), daemon=True).start()
                return "unresolved"
        elif not _tell_target_abort(target, self.record.migration_id):
            # Its copy never ran; it drops what it received once it hears from us again.
            threading.Thread(target=_keep_telling_abort, args=(target, self.record.migration_id, self.agent.cfg.hold_timeout), daemon=True).start()
        _let_original_go(self.snapshot, self.dump_thread)
        resumed = proc.alive(self.pid)
        shutil.rmtree(self.snapshot, ignore_errors=True)
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
        if state in (State.DISCARDED.value, State.RECEIVING.value, State.RECEIVED.value, State.FAILED.value):
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
            st = target.Finish(pb.FinishRequest(migration_id=r.migration_id, commit=True), timeout=RPC_TIMEOUT)
            if st.state == State.DONE.value:
                started()  # the copy runs now; the original is still frozen
                break
            if st.state in (State.DISCARDED.value, State.FAILED.value):
                agent.journal.move(r, State.ROLLING_BACK, "the target dropped its copy before it was made final")
                _let_original_go(snap, dump_thread)
                if dump_thread is None:
                    hook.decide(snap, commit=False)
                    _wait_released(snap)
                agent.journal.move(r, State.ROLLED_BACK, "the target dropped its copy; the original was resumed")
                shutil.rmtree(snap, ignore_errors=True)
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
        _wait_released(snap, None)
    if _same_process_alive(r):  # CRIU could not end it (it died): end it here
        proc.kill_tree(r.pid)
    shutil.rmtree(snap, ignore_errors=True)
    if r.state is not State.DONE:
        agent.journal.move(r, State.DONE, f"migrated to {r.peer}")
    return "done"


def _same_process_alive(r: Record) -> bool:
    try:
        return psutil.Process(r.pid).create_time() == r.create_time if r.create_time else proc.alive(r.pid)
    except psutil.NoSuchProcess:
        return False


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


def _resolve_source(agent: Agent, r: Record) -> None:
    """Bring a source migration to an end (after a restart, or when the target went quiet):
    commit if the copy runs and was meant to, else roll back once no copy can run.  Waits as
    long as it must: the original stays frozen meanwhile, never resumed on a guess."""
    target = stub(r.peer, agent.secret)
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
        elif not r.restore_sent or _target_dropped_copy(target, r.migration_id, 30.0):
            if r.state in (State.FREEZING, State.HELD):
                agent.journal.move(r, State.ROLLING_BACK, "the agent restarted mid-migration")
            _tell_target_abort(target, r.migration_id)
            if snap.joinpath("log").is_dir():
                hook.decide(snap, commit=False)  # the hook still holds the tree: CRIU rolls it back
            _wait_released(snap, None)
            _resume_leftovers(r)
            shutil.rmtree(snap, ignore_errors=True)
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
    pids = proc.tree_pids(r.pid)
    if not pids:
        return
    proc.signal_tree(pids, signal.SIGCONT)
    if r.cuda_pids:  # CRIU gave back the CPU side; the GPU side waits in host memory
        from snapshot.cuda import CudaDriver

        engine.resume([], [p for p in r.cuda_pids if proc.alive(p)], CudaDriver())


def _wait_released(snap: Path, seconds: float | None = 30.0) -> None:
    """Until no CRIU works on ``snap`` any more (its hook took the decision)."""
    deadline = None if seconds is None else time.monotonic() + seconds
    while deadline is None or time.monotonic() < deadline:
        if not _criu_running_on(str(snap)):
            return
        time.sleep(0.1)


def _criu_running_on(path: str) -> bool:
    """Whether a CRIU (or whatever wraps it) still runs with ``path`` in its arguments."""
    me = os.getpid()
    for p in psutil.process_iter(["pid", "cmdline"]):
        cmd = p.info["cmdline"] or []
        if p.info["pid"] != me and any(path in c for c in cmd[1:]):
            return True
    return False


def _recover_target(agent: Agent, r: Record) -> None:
    """A target agent that died: a copy that never ran is dropped (one that CRIU was still
    restoring is waited for, then stopped); a running one waits for the source's decision."""
    if r.state is State.READY:
        agent.log.warning("migration %s: a restored, held copy (PID %d) waits for the source's decision", r.migration_id, r.pid)
        return
    snap = Path(r.snapshot)
    work = restore_work(snap)
    if r.state is State.RESTORING:
        _wait_released(work, None)
        copy = engine.kill_restored(work)
        if copy:
            agent.log.warning("migration %s: stopping the copy (PID %d) a restore finished while the agent was down", r.migration_id, copy)
    r.state = State.DISCARDED
    r.message = "dropped after the agent restarted"
    agent.journal.write(r)
    for d in [snap, work, *snap.parent.glob(f".{snap.name}.partial-*")]:
        shutil.rmtree(d, ignore_errors=True)
