"""The node agent's gRPC service: node info, migratable processes, and both ends of a migration.

The source agent runs a whole migration (``Migrate``, driven by ``tpagent migrate``:
:mod:`tpagent.source`) and calls the target agent's ``Receive`` / ``Restore`` / ``Finish``
(:mod:`tpagent.target`).  The protocol and its states are in :mod:`tpagent.migration`.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import psutil

from snapshot import gpus, proc
from snapshot.api import SnapshotConfig, SnapshotError
from snapshot.criu import Criu
from tpagent import __version__, launch, peer
from tpagent.config import AgentConfig
from tpagent.migration import Journal, JournalError, Record, State, valid_id
from tpagent.rpc import AgentServicer, pb
from tpagent.source import SourceMigration, resolve_source
from tpagent.target import Incoming, recover_target, start_copy
from transfer.api import TransferError

log = logging.getLogger(__name__)


class Agent(AgentServicer):  # type: ignore[misc]
    def __init__(self, cfg: AgentConfig, snapshot_config: SnapshotConfig = SnapshotConfig()) -> None:
        self.cfg = cfg
        self.creds = cfg.credentials()
        self.snapshot_config = snapshot_config
        self.journal = Journal(cfg.work_dir / "migrations")
        self.lock = threading.Lock()
        self.active: dict[int, str] = {}  # source: PID -> migration in progress
        self.sources: dict[str, SourceMigration] = {}
        self.receivers: dict[str, Incoming] = {}
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
        allowed = {os.path.realpath(a) for a in self.cfg.allow_executables}
        for p in psutil.process_iter(["pid", "cmdline", "memory_info", "exe", "uids"]):
            # Only what a user cannot forge: NVML's GPU users, tpagent launch's records, the
            # program the kernel runs (/proc/PID/exe); never the command line (exec -a).
            exe = p.info["exe"] or ""
            record = launch.launched(p.pid)
            why = ""
            if p.pid in gpu_pids:
                why = "gpu"
            elif record is not None:
                why = "launched"
            elif exe in allowed:  # (a full path: a user's own copy named python3 is not it)
                why = "operator"
            if why and p.pid != 1:
                rss = p.info["memory_info"].rss if p.info["memory_info"] else 0
                uid = p.info["uids"].real if p.info["uids"] else 0
                out.append(pb.Process(pid=p.pid, cmdline=p.info["cmdline"] or [], rss=rss, uses_gpu=p.pid in gpu_pids, why=why,
                                      uid=uid, owner=record.owner if record else -1))  # fmt: skip
        return out

    def ListProcesses(self, request: Any, context: grpc.ServicerContext) -> Any:
        return pb.ProcessList(processes=self.migratable())

    # ---- source -----------------------------------------------------------------------

    def Migrate(self, request: Any, context: grpc.ServicerContext) -> Iterator[Any]:
        try:
            m = self._start_migration(int(request.pid), str(request.target), bool(request.dry_run))
        except peer.Refused as e:
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

    def _start_migration(self, pid: int, target: str, dry_run: bool) -> SourceMigration:
        if pid <= 1:
            raise peer.Refused(f"PID {pid} cannot be migrated.", grpc.StatusCode.INVALID_ARGUMENT)
        if not target or len(target) > 300 or ":" not in target:
            raise peer.Refused(f"{target!r} is not an agent address (HOST:PORT).", grpc.StatusCode.INVALID_ARGUMENT)
        if not psutil.pid_exists(pid):
            raise peer.Refused(f"there is no process with PID {pid} on {self.cfg.node}.", grpc.StatusCode.NOT_FOUND)
        allowed = {p.pid for p in self.migratable()}
        if pid not in allowed:
            raise peer.Refused(
                f"PID {pid} is not a migratable process on {self.cfg.node}: it does not use a GPU, was not started with "
                "`tpagent launch`, and runs no program named in allow_executables.",
                grpc.StatusCode.PERMISSION_DENIED,
            )
        try:
            create_time = psutil.Process(pid).create_time()
        except psutil.NoSuchProcess as e:
            raise peer.Refused(f"there is no process with PID {pid} on {self.cfg.node}.", grpc.StatusCode.NOT_FOUND) from e
        tree = set(proc.tree_pids(pid))
        with self.lock:
            held = next((r for r in self.journal.unfinished() if r.role == "target" and r.pid in tree), None)
            if held is not None:  # moving it on now could leave it running twice
                raise peer.Refused(
                    f"PID {pid} is the copy that migration {held.migration_id} restored here, held until its source "
                    f"({held.peer}) commits; migrate it once it runs (`tpagent status {held.migration_id}`).",
                    grpc.StatusCode.FAILED_PRECONDITION,
                )
            busy = sorted(tree & set(self.active))
            if busy:  # the whole tree: a parent and its GPU child are one migration
                raise peer.Refused(f"PID {pid} is already being migrated (migration {self.active[busy[0]]}).", grpc.StatusCode.ALREADY_EXISTS)
            m = SourceMigration(self, pid, target, dry_run)
            m.tree_pids, m.record.create_time = sorted(tree), create_time
            for p in tree:
                self.active[p] = m.record.migration_id
            self.sources[m.record.migration_id] = m
        return m

    def Status(self, request: Any, context: grpc.ServicerContext) -> Any:
        r = self._record(request.migration_id, context)
        return peer.status_of(r)

    def Cancel(self, request: Any, context: grpc.ServicerContext) -> Any:
        r = self._record(request.migration_id, context)
        m = self.sources.get(r.migration_id)
        if m is not None:
            m.cancel("cancelled by the operator")
        return self.Status(request, context)

    def _record(self, migration_id: str, context: grpc.ServicerContext) -> Record:
        try:
            r = self.journal.read(migration_id) if valid_id(migration_id) else None
        except JournalError as e:  # never "not found": the source would take its copy for gone
            self.log.error("%s", e)
            context.abort(grpc.StatusCode.INTERNAL, str(e))
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
            source_agent = str(request.source_agent)
            if len(source_agent) > 300 or (source_agent and ":" not in source_agent):
                context.abort(grpc.StatusCode.INVALID_ARGUMENT, "source_agent is not an agent address (HOST:PORT)")
            try:
                inc = Incoming(self, mid, request.source_node, source_agent)
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
        except peer.Refused as e:
            context.abort(e.code, str(e))
        return pb.RestoreReply(pid=result.pid, timings=result.timings)

    def Finish(self, request: Any, context: grpc.ServicerContext) -> Any:
        self._record(request.migration_id, context)  # (NOT_FOUND if unknown)
        r = self.finish_target(request.migration_id, bool(request.commit), "running here" if request.commit else "decided by the source")
        return peer.status_of(r)

    def finish_target(self, mid: str, commit: bool, why: str) -> Record:
        """Start (commit) or drop the copy a migration restored and holds here; nothing once decided."""
        inc = self.receivers.get(mid)
        if inc is not None:
            inc.finish(commit, why)
            return inc.record
        with self.lock:  # this agent restarted since: only the journal knows the migration
            r = self.journal.read(mid)
            assert r is not None
            if r.state is State.READY:
                ours = peer.same_process_alive(r)  # (a record is never trusted to name a process)
                if commit:
                    self.journal.move(r, State.DONE, why)
                    if ours:
                        start_copy(None, Path(r.snapshot), r.pid)
                else:
                    if ours:
                        proc.kill_tree(r.pid)
                    self.journal.move(r, State.DISCARDED, why)
                peer.remove(self.cfg, r.snapshot)
            return r

    # ---- restart ------------------------------------------------------------------------

    def recover(self) -> None:
        """Finish or roll back what a previous run of this agent left half-way."""
        for r in self.journal.unfinished():
            if not peer.inside_work_dir(self.cfg, r.snapshot):  # (a damaged or foreign record)
                self.log.error("migration %s: its record names the snapshot %r, outside %s; left for an operator", r.migration_id, r.snapshot, self.cfg.work_dir)
                continue
            try:
                if r.role == "source":
                    with self.lock:
                        self.active[r.pid] = r.migration_id  # frozen, not to be migrated again meanwhile
                    threading.Thread(target=resolve_source, args=(self, r), daemon=True).start()
                else:
                    recover_target(self, r)
            except Exception as e:  # one bad record must not stop the agent
                self.log.error("could not recover migration %s: %s", r.migration_id, e)

