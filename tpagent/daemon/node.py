"""One node's agent, without its transport: what runs here (the registry of migrations, as
source and as target), what this node admits, and what it recovers after a restart.

The gRPC service (:mod:`tpagent.daemon.service`) is a thin adapter over :class:`Node`; the
protocol itself is in :mod:`tpagent.migration.source` and :mod:`tpagent.migration.target`.
"""

from __future__ import annotations

import base64
import contextlib
import functools
import json
import logging
import os
import signal
import socket
import threading
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import psutil

from host import gpus, proc, sockets
from host.safefs import private_dir
from snapshot.api import SnapshotError
from snapshot.criu import Criu
from tpagent import __version__
from tpagent.common import clock
from tpagent.jobs.ranks import OUTPUT_MAX, RUNTIME_OPS, RankGone, Ranks
from tpagent.jobs.rewire import PHASES, Rewire, RewireFailed
from tpagent.migration import target
from tpagent.migration.admission import Reservations, sized
from tpagent.migration.api import (
    HOLD_MAX,
    Acceptance,
    AgentError,
    GpuInfo,
    JournalError,
    NodeInfo,
    Offer,
    PeerStatus,
    ProcessInfo,
    Refused,
    Restored,
    Role,
    SourceState,
    TargetState,
    Why,
    is_final,
)
from tpagent.migration.context import Context
from tpagent.migration.journal import Record, valid_id, write_durably
from tpagent.migration.resolve import operator_may, resolve_source
from tpagent.migration.source import SourceMigration
from tpagent.migration.target import Incoming, finish_held, recover_target, settle
from tpagent.workload import launch
from transfer.api import TransferError

log = logging.getLogger(__name__)


def status_of(r: Record) -> PeerStatus:
    return PeerStatus(r.migration_id, r.state.value, r.message, r.pid)


def _address(text: str) -> bool:
    return 0 < len(text) <= 300 and ":" in text


class Node:
    def __init__(self, ctx: Context) -> None:
        self.ctx = ctx
        self.cfg = ctx.cfg
        self.journal = ctx.journal
        self.lock = threading.Lock()
        self.active: dict[int, str] = {}  # source: PID -> migration in progress
        self.sources: dict[str, SourceMigration] = {}
        self.receivers: dict[str, Incoming] = {}
        self.recovered: dict[str, Record] = {}  # source records a resolver took up after a restart
        #: Set at shutdown: no new migration starts, as source or target.
        self.closed = False
        self.reservations = Reservations(self.cfg.work_dir, self.cfg.max_incoming, self._receiving)
        self.ranks = Ranks(self.cfg.rank_socket, self.cfg.agent_address, ctx.threads, self.cfg.work_dir / "ranks.json")
        self.rewiring: set[str] = set()  # jobs whose ranks this agent is moving
        self.rewires: dict[str, Rewire] = {}  # by id, while they run
        #: Where rewires are written down (one file each, as the journal's records).
        self.rewire_dir = self.cfg.work_dir / "rewires"

    # ---- the node ------------------------------------------------------------------------

    def info(self) -> NodeInfo:
        problems = []
        criu_version = ""
        try:
            criu_version = Criu(self.ctx.snapshot_config.criu).version_str
        except SnapshotError as e:
            problems.append(str(e))
        gpu_list = tuple(
            GpuInfo(g.uuid, g.name, g.memory_total, g.memory_used, g.temperature_c or 0, g.ecc_uncorrected or 0)
            for g in gpus.inventory()
        )
        return NodeInfo(
            self.cfg.node,
            socket.gethostname(),
            gpu_list,
            psutil.virtual_memory().available,
            __version__,
            criu_version,
            gpus.driver_version() or "",
            tuple(problems),
            clock.now(),
        )

    def migratable(self) -> list[ProcessInfo]:
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
                out.append(
                    ProcessInfo(
                        p.pid,
                        tuple(p.info["cmdline"] or ()),
                        rss,
                        p.pid in gpu_pids,
                        why,
                        uid,
                        record.owner if record else -1,
                    )
                )
        return out

    # ---- source --------------------------------------------------------------------------

    def start_migration(
        self, pid: int, target: str, dry_run: bool, job: str = "", ranks: tuple[int, ...] = ()
    ) -> SourceMigration | Rewire:
        """Admit a migration of ``pid`` (or of ``ranks`` of ``job``) to the agent at ``target``
        (run it with :meth:`run`).  A rank of a distributed job is moved with its job rewired."""
        if self.closed:
            raise Refused(f"the agent on {self.cfg.node} is shutting down; try again once it is back", Why.PRECONDITION)
        if not _address(target):
            raise Refused(f"{target!r} is not an agent address (HOST:PORT).", Why.INVALID)
        entries = [self.ranks.entry(job, r) for r in ranks] if job else []
        if not job and pid > 1 and (found := self.ranks.of_pid(pid)) is not None:
            entries = [found]
        if not entries and job:
            raise Refused("give the ranks of the job to move (--rank).", Why.INVALID)
        if entries:
            for e in entries:
                if not e.alive() or e.moved_to or e.exit_code is not None:
                    raise Refused(f"rank {e.rank} of job {e.job} does not run on {self.cfg.node}.", Why.NOT_FOUND)
            for e in entries:  # every namespace must pass the ordinary checks before anything stops
                self._check_migratable(e.init)
            moving = {e.rank: (e.init, target) for e in entries}
            job = entries[0].job
            plain = functools.partial(self._start_plain, dry_run=False)
            rw = Rewire(job, moving, self.cfg.agent_address, self.ask, plain, self.cfg.rewire_timeout, dry_run)
            rw.dry_move = self._start_rank_dry_run
            if not dry_run:
                self._admit_rewire(rw)
            return rw
        return self._start_plain(pid, target, dry_run)

    def _admit_rewire(self, rw: Rewire) -> None:
        job = rw.job
        with self.lock:
            if job in self.rewiring:
                raise Refused(f"job {job} is already being rewired here; wait for it.", Why.CONFLICT)
            self.rewiring.add(job)
            self.rewires[rw.migration_id] = rw

        def release() -> None:
            with self.lock:
                self.rewiring.discard(job)
                self.rewires.pop(rw.migration_id, None)

        rw.release = release
        rw.save = self._save_rewire

    def _save_rewire(self, record: dict[str, Any]) -> None:
        private_dir(self.rewire_dir)
        write_durably(self.rewire_dir / f"{record['rewire_id']}.json", record)

    def _read_rewire(self, rewire_id: str) -> dict[str, Any] | None:
        if not valid_id(rewire_id):
            return None
        try:
            data = json.loads((self.rewire_dir / f"{rewire_id}.json").read_text())
        except (OSError, ValueError):
            return None
        return data if isinstance(data, dict) else None

    def _settled(self, migration_id: str, target_agent: str, timeout: float) -> int:
        """After a restart: the copy's PID on the target once migration ``migration_id`` is
        done, 0 once it rolled back (its original runs here); waits for the journal to say."""
        deadline = time.monotonic() + timeout
        while True:
            try:
                r = self.journal.read(migration_id)
            except JournalError as e:
                raise RewireFailed(str(e)) from e
            if r is None or r.state in (SourceState.ROLLED_BACK, SourceState.FAILED):
                return 0
            if r.state is SourceState.DONE:
                try:
                    return self.ctx.peer(r.peer).status(migration_id, 10).pid
                except AgentError as e:
                    raise RewireFailed(f"the target {r.peer} does not say where the moved rank runs ({e})") from e
            if time.monotonic() > deadline or self.ctx.threads.stopping.is_set():
                raise RewireFailed(
                    f"migration {migration_id} is still unresolved ({r.state.value}); its original stays frozen "
                    "until its target answers, and the job waits at its boundary"
                )
            time.sleep(0.2)

    def _recover_rewires(self) -> None:
        for path in sorted(self.rewire_dir.glob("*.json")) if self.rewire_dir.is_dir() else []:
            record = self._read_rewire(path.stem)
            if record is None or record.get("phase") in PHASES[3:]:
                continue
            try:
                plain = functools.partial(self._start_plain, dry_run=False)
                rw = Rewire.recover(record, self.ask, plain, self.cfg.rewire_timeout, self._settled)
                self._admit_rewire(rw)
            except (KeyError, TypeError, ValueError, Refused) as e:
                log.error("rewire %s cannot be finished (%s); left for an operator", path.stem, e)
                continue
            log.info("rewire %s of job %s: finishing what the agent left at its restart", rw.migration_id, rw.job)
            self.run(rw)

    def _check_migratable(self, pid: int) -> None:
        """Refused in one sentence unless ``pid`` is a process this node may migrate."""
        node = self.cfg.node
        if pid <= 1:
            raise Refused(f"PID {pid} cannot be migrated.", Why.INVALID)
        init = proc.namespace_init(pid)  # (a process inside a launched namespace, or a thread of one)
        if init is not None:
            raise Refused(proc.inside_namespace(pid, init, "migrate"), Why.INVALID)
        if not psutil.pid_exists(pid):
            raise Refused(f"there is no process with PID {pid} on {node}.", Why.NOT_FOUND)
        if pid not in {p.pid for p in self.migratable()}:
            raise Refused(
                f"PID {pid} is not a migratable process on {node}: it does not use a GPU, was not started with "
                "`tpagent launch`, and runs no program named in allow_executables.",
                Why.DENIED,
            )

    def _start_rank_dry_run(self, pid: int, target: str) -> SourceMigration:
        m = self._start_plain(pid, target, dry_run=True)
        m.communicators_rebuilt = True
        return m

    def _start_plain(self, pid: int, target: str, dry_run: bool) -> SourceMigration:
        self._check_migratable(pid)
        tree = set(proc.tree_pids(pid))
        with self.lock:
            held = next((r for r in self.journal.unfinished() if r.role is Role.TARGET and r.pid in tree), None)
            if held is not None:  # moving it on now could leave it running twice
                raise Refused(
                    f"PID {pid} is the copy that migration {held.migration_id} restored here, held until its source "
                    f"({held.peer}) commits; migrate it once it runs (`tpagent status {held.migration_id}`).",
                    Why.PRECONDITION,
                )
            busy = sorted(tree & set(self.active))
            if busy:  # the whole tree: a parent and its GPU child are one migration
                raise Refused(f"PID {pid} is already being migrated (migration {self.active[busy[0]]}).", Why.CONFLICT)
            m = SourceMigration(self.ctx, pid, target, dry_run)
            m.release = functools.partial(self._release, m.migration_id)
            m.tree_pids = sorted(tree)
            for p in tree:
                self.active[p] = m.migration_id
            self.sources[m.migration_id] = m
        return m

    def run(self, m: SourceMigration | Rewire) -> None:
        name = f"migrate-{m.pid}" if isinstance(m, SourceMigration) else f"rewire-{m.job[:20]}"
        self.ctx.threads.spawn("migration", name, m.run)

    # ---- ranks of distributed jobs ---------------------------------------------------------

    def ask(self, address: str, job: str, rank: int, body: dict[str, Any], timeout: float) -> dict[str, Any]:
        """Ask the agent at ``address`` (this one: directly) about a rank of ``job``."""
        if address == self.cfg.agent_address:
            return self.rank_request(job, rank, body, timeout)
        return self.ctx.peer(address).rank(job, rank, body, timeout)

    def rank_request(self, job: str, rank: int, body: dict[str, Any], timeout: float) -> dict[str, Any]:
        """One ``Rank`` call: passed on to the rank's runtime, or answered here."""
        op = body.get("op")
        if op in RUNTIME_OPS:
            try:
                return self.ranks.call(job, rank, body, timeout)
            except RankGone as e:
                raise Refused(str(e), Why.NOT_FOUND) from e
        if op == "expect":
            pid = body.get("pid")
            if not isinstance(pid, int):
                raise Refused("expect needs the PID of the rank's namespace init.", Why.INVALID)
            self.ranks.expect(job, rank, pid)
            return {"ok": True}
        if op == "moved":
            to = body.get("to")
            if not isinstance(to, str) or not _address(to):
                raise Refused("moved needs the agent the rank went to.", Why.INVALID)
            self.ranks.moved(job, rank, to)
            return {"ok": True}
        if op == "release":
            self.ranks.release(job, rank)
            return {"ok": True}
        if op == "locate":
            where = self.ranks.locate(job, rank)
            if where["state"] == "gone" and job in self.rewiring:  # (ended here, not yet known there)
                where["state"] = "moving"
            return {"ok": True, **where}
        if op == "signal":
            signum = body.get("signum")
            if signum not in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGKILL):
                raise Refused(f"signal {signum!r} is not passed on to a rank.", Why.INVALID)
            entry = self.ranks.entry(job, rank)
            if not entry.alive() or entry.moved_to:
                return {"ok": False, "error": f"rank {rank} of job {job} does not run on {self.cfg.node}"}
            if signum == signal.SIGKILL:
                proc.kill_tree(entry.init)
            else:
                os.kill(entry.init, int(signum))  # (its init passes it on to the rank)
            return {"ok": True}
        if op == "output":  # (for a stand-in: what its rank wrote, wherever it runs)
            which, offset, size = body.get("fd"), body.get("offset"), body.get("max", OUTPUT_MAX)
            if which not in (1, 2) or not isinstance(offset, int) or not isinstance(size, int) or offset < 0:
                raise Refused("output needs fd 1 or 2 and an offset of at least 0.", Why.INVALID)
            data, size_now = self.ranks.output(job, rank, which, offset, max(1, size))
            return {"ok": True, "data": base64.b64encode(data).decode(), "size": size_now}
        if op == "jobs":  # (with each connected rank's step and generation now)
            ranks = self.ranks.jobs()
            for r in ranks:
                if r["connected"]:
                    with contextlib.suppress(AgentError):
                        now = self.ranks.call(r["job"], r["rank"], {"op": "where"}, 2)
                        r.update(
                            step=now.get("step", r["step"]),
                            gen=now.get("gen", r["gen"]),
                            collectives=now.get("collectives", 0),
                            state=now.get("state", ""),
                        )
            return {"ok": True, "ranks": ranks}
        raise Refused(f"{op!r} is not a rank request.", Why.INVALID)

    def _release(self, mid: str) -> None:
        with self.lock:
            for pid, active in list(self.active.items()):
                if active == mid:
                    self.active.pop(pid, None)

    def status(self, migration_id: str) -> PeerStatus:
        rw = self._read_rewire(migration_id)
        if rw is not None:  # (a rewire: its state, once final; else the phase it is in)
            phase = str(rw.get("phase", ""))
            return PeerStatus(migration_id, phase if phase in PHASES[3:] else "rewiring", str(rw.get("message", "")), 0)
        return status_of(self._record(migration_id))

    def cancel(self, migration_id: str) -> PeerStatus:
        with self.lock:
            rewire = self.rewires.get(migration_id)
        if rewire is not None:
            rewire.cancel("cancelled by the operator")
            return self.status(migration_id)
        r = self._record(migration_id)
        m = self.sources.get(r.migration_id)
        if m is not None:
            m.cancel("cancelled by the operator")
        return self.status(migration_id)

    def resolve(self, migration_id: str, commit: bool) -> PeerStatus:
        """An operator's decision on a migration its peer gives no answer about (``tpagent
        resolve``): refused whenever the peer answers, or the decision could leave two copies
        running, or none, that the protocol itself would not."""
        r = self._record(migration_id)
        mid, how = r.migration_id, "--commit" if commit else "--discard"
        if r.role is Role.TARGET:
            why = target.operator_may(self.ctx, r, commit)
            if why:
                raise Refused(f"{how} refused: {why}", Why.CONFLICT)
            self.finish_target(
                mid, commit, f"resolved by the operator ({how}), the source agent {r.peer_agent} giving no answer"
            )
            return self.status(mid)
        m = self.sources.get(mid)
        live = m.record if m is not None and m.result is not None else self.recovered.get(mid)
        if live is None:
            if m is not None and not is_final(m.record.state):
                raise Refused(
                    f"{how} refused: migration {mid} is still running; `tpagent cancel` it, or wait", Why.CONFLICT
                )
            live = r
        why = operator_may(self.ctx, live, commit)
        if why:
            raise Refused(f"{how} refused: {why}", Why.CONFLICT)
        live.operator = "commit" if commit else "discard"
        self.journal.write(live)  # (the resolver takes it up within seconds)
        return status_of(live)

    def _record(self, migration_id: str) -> Record:
        try:
            r = self.journal.read(migration_id) if valid_id(migration_id) else None
        except JournalError as e:  # never "not found": the source would take its copy for gone
            log.error("%s", e)
            raise Refused(str(e), Why.INTERNAL) from e
        if r is None:
            raise Refused(f"no migration {migration_id!r} on {self.cfg.node}", Why.NOT_FOUND)
        return r

    # ---- target --------------------------------------------------------------------------

    def receive(self, offer: Offer) -> Acceptance:
        mid, node = offer.migration_id, self.cfg.node
        if not valid_id(mid):
            raise Refused("bad migration id", Why.INVALID)
        if not 0 <= offer.hold <= HOLD_MAX:  # (NaN too)
            raise Refused(f"hold must be between 0 and {HOLD_MAX:.0f} s", Why.INVALID)
        if offer.source_node == node or mid in self.sources:
            raise Refused(f"{node} is the source of this migration; give another node as the target", Why.INVALID)
        with self.reservations.lock:  # checked and reserved at once: two offers never share the room
            problems = self.problems(offer)
            more, reservation, reserved = self.reservations.check(
                node, offer.bytes_estimate, sized(offer.carried_files)
            )
            problems += more
            if problems or offer.dry_run:
                return Acceptance(problems=tuple(problems), reserved=reserved, clock=clock.now())
            if self.closed:
                raise Refused(f"the agent on {node} is shutting down", Why.PRECONDITION)
            with self.lock:
                if mid in self.receivers or self.journal.read(mid) is not None:
                    raise Refused(f"migration {mid} is already known here", Why.CONFLICT)
                if offer.source_agent and not _address(offer.source_agent):
                    raise Refused("source_agent is not an agent address (HOST:PORT)", Why.INVALID)
                try:
                    inc = Incoming(self.ctx, mid, offer.source_node, self.settle_target, offer.source_agent, offer.hold)
                except TransferError as e:
                    raise Refused(f"{node} cannot receive: {e}", Why.PRECONDITION) from e
                inc.gpu_map = self.gpu_map(list(offer.gpu_uuids), list(offer.gpu_bus_ids))
                self.receivers[mid] = inc
            names = frozenset(offer.abstract_sockets)
            self.reservations.reserve(mid, replace(reservation, snapshot=inc.dir, abstract=names))
        return Acceptance(inc.address, dict(inc.gpu_map), reserved=reserved, clock=clock.now())

    def _receiving(self, mid: str) -> bool:
        """Whether migration ``mid`` still holds its reservation here: received or being
        received, not yet restored (a copy that runs uses its memory already), nor dropped."""
        inc = self.receivers.get(mid)
        if inc is None or inc.record.state not in (TargetState.RECEIVING, TargetState.RECEIVED, TargetState.RESTORING):
            return False
        return not (inc.done.is_set() and isinstance(inc.result, TransferError))

    def problems(self, offer: Offer) -> list[str]:
        """What would keep this node from taking the migration (empty: nothing)."""
        node, problems = self.cfg.node, []
        need = offer.bytes_estimate
        if self.cfg.memory_limit and need > self.cfg.memory_limit:
            problems.append(
                f"{node} accepts at most {self.cfg.memory_limit / 2**30:.2f} GiB per migration (memory_limit); "
                f"this one needs {need / 2**30:.2f} GiB"
            )
        try:
            Criu(self.ctx.snapshot_config.criu).check()
        except SnapshotError as e:
            problems.append(f"{node}: {e}")
        ours = len(gpus.inventory())
        if len(offer.gpu_uuids) > ours:
            problems.append(f"{node} has {ours} GPU(s); the process uses {len(offer.gpu_uuids)}")
        for entry in list(offer.shared_files)[:10_000]:
            path, _, size = entry.rpartition(":")
            try:
                have = Path(path).stat().st_size
            except (OSError, ValueError):
                problems.append(f"{path} (on a shared path) is missing on {node}")
                continue
            # (a file the process writes grows as it runs: its size at the check says nothing;
            # CRIU holds it against the size at the freeze when it restores)
            if size != "*" and str(have) != size:
                problems.append(f"{path} is {have} bytes on {node} but {size} on the source")
        problems += sockets.unusable_here(node, list(offer.tcp)[:10_000])
        # (a name is "@" and at most 107 bytes, escaped where not UTF-8; each NUL of it printed as "@")
        names = {n for n in offer.abstract_sockets if n.startswith("@") and len(n) <= 4 * 107 + 1}
        coming = {n for r in self.reservations.in_flight().values() for n in r.abstract}  # (its lock is held)
        taken = set(sockets.abstract_taken(names))
        for name in sorted(taken | (names & coming)):
            why = (
                " (the CUDA driver's, named after the process's PID namespace and PID: a CUDA process moved "
                "there from another node may hold the same)"
                if name.startswith("@cuda-uvmfd-")
                else ""
            )
            held = f"is bound on {node} already" if name in taken else f"is to be bound on {node} by a copy it receives"
            problems.append(
                f"the abstract unix socket {ascii(name)[1:-1]} {held}{why}, so the copy could not bind it there: "
                "pick another node, or end what holds it there"
            )
        return problems

    def gpu_map(self, uuids: list[str], buses: list[str]) -> dict[str, str]:
        """Each source GPU onto one of ours: the one at its PCI bus id if any, else the emptiest."""
        return gpus.pair(list(zip(uuids, [*buses, *[""] * len(uuids)], strict=False)), gpus.inventory())

    def restore(self, migration_id: str) -> Restored:
        inc = self.receivers.get(migration_id)
        if inc is None:
            raise Refused(f"no snapshot is being received for migration {migration_id!r}", Why.NOT_FOUND)
        result = inc.restore(self.finish_target)
        return Restored(result.pid, dict(result.timings))

    def finish(self, migration_id: str, commit: bool, confirmed: bool = False) -> PeerStatus:
        self._record(migration_id)  # (NOT_FOUND if unknown)
        why = (
            ("running here, confirmed by the source" if confirmed else "running here")
            if commit
            else "decided by the source"
        )
        return status_of(self.finish_target(migration_id, commit, why, confirmed))

    def finish_target(self, mid: str, commit: bool, why: str, confirmed: bool = False) -> Record:
        """Start (commit) or drop the copy a migration restored and holds here, or confirm a held
        one that runs (``confirmed``); nothing once decided."""
        inc = self.receivers.get(mid)
        if inc is not None:
            inc.finish(commit, why, confirmed)
            return inc.record
        with self.lock:  # this agent restarted since: only the journal knows the migration
            r = self.journal.read(mid)
            assert r is not None
            finish_held(self.ctx, r, commit, why, self.settle_target, confirmed)
            return r

    def settle_target(self, mid: str, ran: bool, why: str) -> None:
        """End the confirmation of a started copy (:func:`tpagent.migration.target.watch_copy`)."""
        inc = self.receivers.get(mid)
        with inc.lock if inc is not None else self.lock:
            r = inc.record if inc is not None else self.journal.read(mid)
            if r is not None:
                settle(self.ctx, r, ran, why)

    # ---- what an operator watches (metrics) ------------------------------------------------

    def frozen_seconds(self) -> float:
        """How long the longest-frozen original this node holds for a migration has been frozen
        (0: none).  Past CHECKING and until a final state, a source's original is frozen."""
        since = [
            self._frozen_since(r)
            for r in self.journal.unfinished()
            if r.role is Role.SOURCE and r.state is not SourceState.CHECKING
        ]
        return max((time.time() - t for t in since if t), default=0.0)

    def _frozen_since(self, r: Record) -> float:
        m = self.sources.get(r.migration_id)
        if m is not None and m.freeze_t0:
            return time.time() - (time.monotonic() - m.freeze_t0)
        # An earlier run of the agent froze it: counted from when its snapshot was sealed.
        return self.ctx.held.attach(Path(r.snapshot)).sealed_at() or 0.0

    def unresolved(self) -> int:
        """Unfinished migrations that wait on the peer: as source, those no migrate call drives
        any more (a resolver asks the target); as target, held copies awaiting the source's word."""
        n = 0
        for r in self.journal.unfinished():
            if r.role is Role.TARGET:
                n += r.state is TargetState.READY
            else:
                m = self.sources.get(r.migration_id)
                n += m is None or m.result is not None
        return n

    # ---- restart -------------------------------------------------------------------------

    def recover(self) -> None:
        """Finish or roll back what a previous run of this agent left half-way."""
        for r in self.journal.unfinished():
            if not self.ctx.inside_work_dir(r.snapshot):  # (a damaged or foreign record)
                log.error(
                    "migration %s: its record names the snapshot %r, outside %s; left for an operator",
                    r.migration_id,
                    r.snapshot,
                    self.cfg.work_dir,
                )
                continue
            try:
                if r.role is Role.SOURCE:
                    with self.lock:
                        self.active[r.pid] = r.migration_id  # frozen, not to be migrated again meanwhile
                        self.recovered[r.migration_id] = r
                    release = functools.partial(self._release, r.migration_id)
                    self.ctx.threads.spawn(
                        "waiter", f"resolve-{r.migration_id[:8]}", resolve_source, self.ctx, r, release
                    )
                else:
                    recover_target(self.ctx, r, self.finish_target, self.settle_target)
            except Exception as e:  # one bad record must not stop the agent
                log.error("could not recover migration %s: %s", r.migration_id, e)
        self._recover_rewires()
