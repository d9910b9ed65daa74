"""One node's agent, without its transport: the registry of what runs here (migrations as source
and as target, rewires of jobs' ranks) and the dispatcher of each call to the module of its
concern.  It decides nothing itself:

* a migration's source and target: :mod:`tpagent.migration.source`, :mod:`tpagent.migration.target`;
* what this node takes as a target: :mod:`tpagent.migration.admission`;
* ending migrations after a restart, or on an operator's word: :mod:`tpagent.migration.resolve`;
* the ranks of jobs, their ``Rank`` calls and rewires: :mod:`tpagent.jobs`.

The gRPC service (:mod:`tpagent.daemon.service`) is a thin adapter over :class:`Node`.
"""

from __future__ import annotations

import functools
import logging
import os
import threading
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

from host import gpus, paths, proc
from host.api import UsageError
from tpagent.daemon import doctor
from tpagent.jobs import joiners, recovery, storeserver
from tpagent.jobs.awaremove import AUTO
from tpagent.jobs.calls import RankCalls
from tpagent.jobs.journal import RewireJournal
from tpagent.jobs.local import Caller, StandInDoor, Start, socket_name
from tpagent.jobs.ranks import Ranks
from tpagent.jobs.rewire import Rewire
from tpagent.jobs.rewires import Rewires
from tpagent.jobs.standin import runtime_dir
from tpagent.migration import eligible
from tpagent.migration.api import (
    Acceptance,
    AgentError,
    JournalError,
    NodeInfo,
    Offer,
    Peer,
    PeerStatus,
    PeerUnreachable,
    ProcessInfo,
    Refused,
    Restored,
    Role,
    Why,
    gpu_uuids,
    is_agent_address,
    is_final,
)
from tpagent.migration.context import Context
from tpagent.migration.journal import Record, valid_id
from tpagent.migration.receivers import Receivers
from tpagent.migration.resolve import operator_decides, resolve_source
from tpagent.migration.source import SourceMigration
from tpagent.workload import launch
from tpagent.workload.launch import RunAs
from tpagent_rank import protocol as P

log = logging.getLogger(__name__)
A = TypeVar("A", bound=P.Answer)
#: How long an agent whose node is said to be lost is given to answer before that node's ranks are
#: rebuilt (the orchestrator's probe gave it 5 s, twice): a busy one answers well within it.
ANSWER_WITHIN = 10.0


def answers(peer: Peer) -> bool:
    """Whether the agent behind ``peer`` answers this one now (a word, even a refusal), given
    :data:`ANSWER_WITHIN` s: the last look before its ranks are rebuilt elsewhere.  It is asked
    how a migration of no id stands, which it says at once it has none of: its node's description
    (Info) would read its GPUs through NVML and run CRIU, which on a node whose GPU is failing
    may take longer than that, and a rank that runs on there would be rebuilt a second time."""
    try:
        peer.status("", ANSWER_WITHIN)
    except PeerUnreachable:
        return False
    except AgentError:
        pass
    return True


def status_of(r: Record) -> PeerStatus:
    return PeerStatus(r.migration_id, r.state.value, r.message, r.pid)


def _in_copy(r: Record, tree: list[int]) -> bool:
    """Whether a process of ``tree`` is one of the copy's (its root, or another it restored)."""
    return r.pid in tree or any(p in tree for p, _ in r.tree)


class Node:
    def __init__(self, ctx: Context) -> None:
        self.ctx = ctx
        self.cfg = ctx.cfg
        self.journal = ctx.journal
        self.lock = threading.Lock()
        self.active: dict[int, str] = {}  # source: PID -> migration in progress
        self.sources: dict[str, SourceMigration] = {}
        self.recovered: dict[str, Record] = {}  # source records a resolver took up after a restart
        #: Set at shutdown: no new migration starts, as source or target.
        self.closed = False
        self.targets = Receivers(ctx, lambda mid: mid in self.sources, lambda: self.closed)
        work = paths.WorkDir(self.cfg.work_dir)
        self.ranks = Ranks(self.cfg.rank_socket, self.cfg.agent_address, ctx.threads, work.ranks)
        self.ranks.hold_deaths = bool(self.cfg.orchestrator)
        self.stores = work.stores  # (the jobs' stores this node serves anew: storeserver.Kept)
        storeserver.adopt(self.stores, joiners.Leaving(self.ranks).here)
        journal = RewireJournal(work.rewires)
        self.rewires = Rewires(ctx, journal, self.ask, self._start_rank, self.run, joiners.Leaving(self.ranks))
        self.rank_calls = RankCalls(
            self.ranks, self.cfg.node, self.rewires.rewiring, self._answers, self.start_joiner, self.rebuild_lost
        )
        self.stand_ins = StandInDoor(
            socket_name(self.cfg.rank_socket),
            ctx.threads,
            self.start_for,
            self.ranks.owner_of,
            lambda via, job, rank, req, timeout, key: self.ask(
                via or self.cfg.agent_address, job, rank, req, timeout, key
            ),
        )

    # ---- the node ------------------------------------------------------------------------

    def info(self) -> NodeInfo:
        return doctor.node_info(self.cfg.node, self.ctx.snapshot_config.criu)

    def migratable(self) -> list[ProcessInfo]:
        return eligible.migratable(self.cfg)

    # ---- source --------------------------------------------------------------------------

    def start_migration(
        self,
        pid: int,
        target: str,
        dry_run: bool,
        job: str = "",
        ranks: tuple[int, ...] = (),
        mode: str = "",
        identity: str = "",
        target_gpus: tuple[str, ...] = (),
    ) -> SourceMigration | Rewire:
        """Admit a migration of ``pid`` (or of ``ranks`` of ``job``) to the agent at ``target``
        (run it with :meth:`run`).  A rank of a distributed job is moved with its job rewired, in
        ``mode`` ("transparent", "aware"; "": aware where every moving rank registered its state).
        ``identity``: which job of that name (:func:`~tpagent.jobs.ranks.digest_of`; "": any);
        ``target_gpus``: the target's GPUs the copies may be placed on (none: any)."""
        if self.closed:
            raise Refused(f"the agent on {self.cfg.node} is shutting down; try again once it is back", Why.PRECONDITION)
        if not is_agent_address(target):
            raise Refused(f"{target!r} is not an agent address (HOST:PORT).", Why.INVALID)
        target_gpus = gpu_uuids(target_gpus)
        entries = [self.ranks.entry(job, r) for r in ranks] if job else []
        if not job and pid > 1 and (found := self.ranks.of_pid(pid)) is not None:
            entries = [found]
        if not entries and job:
            raise Refused("give the ranks of the job to move (--rank).", Why.INVALID)
        if not entries and mode == "aware":
            raise Refused("only ranks of a job (--job, --rank) move in aware mode.", Why.INVALID)
        if not entries:
            return self._start_plain(pid, target, dry_run, target_gpus=target_gpus)
        for e in entries:
            if not e.alive() or e.moved_to or e.exit_code is not None:
                raise Refused(f"rank {e.rank} of job {e.job} does not run on {self.cfg.node}.", Why.NOT_FOUND)
        digests = self.ranks.digests()
        if identity and (other := [e.rank for e in entries if digests.get((e.job, e.rank)) != identity]):
            text = f"rank {other[0]} of job {job} on {self.cfg.node} is of another job of that name (or not yet known)."
            raise Refused(text, Why.NOT_FOUND)
        for e in entries if mode != "aware" else ():  # every namespace must pass the ordinary checks first
            eligible.check_migratable(self.cfg, e.init)
        used = gpus.gpus_of({p for e in entries for p in proc.tree_pids(e.init)}) if target_gpus else []
        if len(used) > len(target_gpus):  # (each rank's copy alone would fit: together they would share one)
            text = f"the moving ranks use {len(used)} GPUs; name as many of the target's (--to-gpu), or none."
            raise Refused(text, Why.INVALID)
        moving = {e.rank: (e.init, target) for e in entries}
        return self.rewires.start(entries[0].job, moving, dry_run, mode or AUTO, target_gpus)

    def _start_rank(
        self,
        pid: int,
        target: str,
        *,
        dry_run: bool = False,
        hold: float = 0.0,
        verdict: Callable[[], bool | None] | None = None,
        target_gpus: tuple[str, ...] = (),
    ) -> SourceMigration:
        """A rank's migration (:class:`tpagent.jobs.api.StartMove`); its dry run leaves its TCP
        connections aside (its communicators' and store's, closed before it is frozen)."""
        return self._start_plain(
            pid, target, dry_run, hold, verdict, communicators_rebuilt=dry_run, target_gpus=target_gpus
        )

    def _start_plain(
        self,
        pid: int,
        target: str,
        dry_run: bool,
        hold: float = 0.0,
        verdict: Callable[[], bool | None] | None = None,
        communicators_rebuilt: bool = False,
        target_gpus: tuple[str, ...] = (),
    ) -> SourceMigration:
        eligible.check_migratable(self.cfg, pid)
        tree = sorted(proc.tree_pids(pid))
        with self.lock:
            held = next((r for r in self.journal.unfinished() if r.role is Role.TARGET and _in_copy(r, tree)), None)
            if held is not None:  # moving it on now could leave it running twice
                raise Refused(
                    f"PID {pid} belongs to the copy that migration {held.migration_id} restored here, held until its "
                    f"source ({held.peer}) commits; migrate it once it runs (`tpagent status {held.migration_id}`).",
                    Why.PRECONDITION,
                )
            busy = sorted(set(tree) & set(self.active))
            if busy:  # the whole tree: a parent and its GPU child are one migration
                raise Refused(f"PID {pid} is already being migrated (migration {self.active[busy[0]]}).", Why.CONFLICT)
            m = SourceMigration(
                self.ctx, pid, target, dry_run, self._release, hold, verdict, communicators_rebuilt, target_gpus
            )
            for p in tree:
                self.active[p] = m.migration_id
            self.sources[m.migration_id] = m
        return m

    def run(self, m: SourceMigration | Rewire) -> None:
        name = f"migrate-{m.pid}" if isinstance(m, SourceMigration) else f"rewire-{m.job[:20]}"
        self.ctx.threads.spawn("migration", name, m.run)

    def _release(self, mid: str) -> None:
        with self.lock:
            for pid, active in list(self.active.items()):
                if active == mid:
                    self.active.pop(pid, None)

    # ---- ranks of distributed jobs ---------------------------------------------------------

    def _answers(self, agent: str) -> bool:
        return answers(self.ctx.peer(agent))

    def rebuild_lost(self, job: str, rank: int, request: P.Recover) -> P.Recovered:
        """Rebuild the lost ranks of ``job`` (whose rank ``rank`` runs here) from their replicas."""
        here = self.cfg.agent_address
        return recovery.recover(job, rank, request, self.ask, here, joiners.Leaving(self.ranks), self.stores)

    def ask(self, agent: str, job: str, rank: int, request: P.Request[A], timeout: float, key: str = "") -> A:
        """Ask the agent at ``agent`` (this one: directly) about a rank of ``job`` (``key``: its identity)."""
        if agent == self.cfg.agent_address:
            return self.rank_request(job, rank, request, timeout, key)
        return self.ctx.peer(agent).rank(job, rank, request, timeout, key)

    def rank_request(self, job: str, rank: int, request: P.Request[A], timeout: float, key: str = "") -> A:
        """One ``Rank`` call: passed on to the rank's runtime, or answered here."""
        return self.rank_calls(job, rank, request, timeout, key)

    def open_sockets(self) -> None:
        """The ranks' socket and the stand-ins' (UsageError if another agent holds either)."""
        self.ranks.start()
        try:
            self.stand_ins.start()
        except UsageError:
            self.ranks.close()
            raise

    def close_sockets(self) -> None:
        self.ranks.close()
        self.stand_ins.close()

    def start_for(self, s: Start, caller: Caller) -> int:
        """Rank ``s.rank`` of ``s.job`` started for an unprivileged stand-in, as its user
        (:mod:`tpagent.jobs.local`): its init's PID, registered as that rank's."""
        env = dict(s.env)
        env["PYTHONPATH"] = os.pathsep.join(p for p in (str(runtime_dir()), env.get("PYTHONPATH", "")) if p)
        env["TPAGENT_RANK_SOCKET"] = self.cfg.rank_socket
        who = RunAs(caller.uid, caller.gid, caller.groups, s.cwd, env, caller.cgroups)
        init, holder = launch.start(list(s.cmd), Path(s.stdout), Path(s.stderr), umask=s.umask, run_as=who)
        self.ctx.threads.spawn("stand-ins", f"holder-{init}", holder.wait)  # (reaped: its status is the init's)
        self.ranks.expect(s.job, s.rank, init, owner=caller.uid)
        return init

    def start_joiner(self, job: str, rank: int, request: P.Join) -> int:
        """A fresh process of rank ``rank`` of ``job``'s command, to take its state (a model-aware
        move's ``join``): its namespace init's PID, registered as that rank's."""
        if self.closed:
            raise Refused(f"the agent on {self.cfg.node} is shutting down", Why.PRECONDITION)
        return joiners.start(self.ranks, self.ctx.threads, self.cfg.rank_socket, job, rank, request)

    # ---- a migration's status, an operator's word -------------------------------------------

    def status(self, migration_id: str) -> PeerStatus:
        return self.rewires.status(migration_id) or status_of(self._record(migration_id))

    def cancel(self, migration_id: str) -> PeerStatus:
        if not self.rewires.cancel(migration_id):
            m = self.sources.get(self._record(migration_id).migration_id)
            if m is not None:
                m.cancel("cancelled by the operator")
        return self.status(migration_id)

    def resolve(self, migration_id: str, commit: bool) -> PeerStatus:
        """An operator's decision on a migration its peer gives no answer about (``tpagent resolve``)."""
        r = self._record(migration_id)
        m = self.sources.get(r.migration_id)
        live = m.record if m is not None and m.result is not None else self.recovered.get(r.migration_id)
        running = m is not None and not is_final(m.record.state)
        return status_of(operator_decides(self.ctx, r, commit, live, running, self.targets.finish))

    def _record(self, migration_id: str) -> Record:
        try:
            r = self.journal.read(migration_id) if valid_id(migration_id) else None
        except JournalError as e:  # never "not found": the source would take its copy for gone
            log.error("%s", e)
            raise Refused(str(e), Why.INTERNAL) from e
        if r is None:
            raise Refused(f"no migration {migration_id[:64]!r} on {self.cfg.node}", Why.NOT_FOUND)
        return r

    # ---- target (:class:`tpagent.migration.receivers.Receivers`) ---------------------------

    def receive(self, offer: Offer) -> Acceptance:
        return self.targets.receive(offer)

    def restore(self, migration_id: str) -> Restored:
        return self.targets.restore(migration_id)

    def finish(self, migration_id: str, commit: bool, confirmed: bool = False) -> PeerStatus:
        self._record(migration_id)  # (NOT_FOUND if unknown)
        why = "decided by the source"
        if commit:
            why = "running here, confirmed by the source" if confirmed else "running here"
        return status_of(self.targets.finish(migration_id, commit, why, confirmed))

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
                    name = f"resolve-{r.migration_id[:8]}"
                    self.ctx.threads.spawn("waiter", name, resolve_source, self.ctx, r, release)
                else:
                    self.targets.recover(r)
            except Exception as e:  # one bad record must not stop the agent
                log.error("could not recover migration %s: %s", r.migration_id, e)
        self.rewires.recover()
