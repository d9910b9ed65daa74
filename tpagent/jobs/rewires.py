"""The rewires one agent runs (at most one per job), their journal, and finishing, after a restart,
those a previous run of the agent left half-way."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

from tpagent.jobs.api import REWIRE_FINAL, Ask, Leaving, RewireFailed, RewireRecord, StartMove
from tpagent.jobs.awaremove import AUTO, MODES, AwareRewire
from tpagent.jobs.journal import RewireJournal, Unwritten
from tpagent.jobs.rewire import Rewire
from tpagent.migration.api import AgentError, JournalError, PeerStatus, Refused, SourceState, Why
from tpagent.migration.context import Context

log = logging.getLogger(__name__)


class Rewires:
    """``ask`` reaches a rank through its agent; ``start_move`` admits one rank's migration;
    ``leaving`` the ranks here a model-aware move replaces; ``run`` runs a rewire in a thread of the agent's."""

    def __init__(
        self,
        ctx: Context,
        journal: RewireJournal,
        ask: Ask,
        start_move: StartMove,
        run: Callable[[Rewire], None],
        leaving: Leaving,
    ) -> None:
        self.ctx = ctx
        self.leaving = leaving
        self.journal = journal
        self.ask = ask
        self.start_move = start_move
        self.run = run
        self.lock = threading.Lock()
        self.running: dict[str, Rewire] = {}  # by id

    def rewiring(self, job: str, rank: int | None = None) -> bool:
        """Whether this agent is moving ranks of ``job`` now (``rank``: that one)."""
        with self.lock:
            return any(rw.job == job and (rank is None or rank in rw.moving) for rw in self.running.values())

    def start(
        self,
        job: str,
        moving: dict[int, tuple[int, str]],
        dry_run: bool,
        mode: str = AUTO,
        target_gpus: tuple[str, ...] = (),
    ) -> Rewire:
        """A rewire moving ``moving`` (rank -> (init PID here, target agent)) of ``job`` in ``mode``
        (:data:`~tpagent.jobs.awaremove.MODES`), onto ``target_gpus`` there (none: any), admitted
        (one per job at a time) unless it is a dry run; :attr:`run` it."""
        if mode not in MODES:
            raise Refused(f"{mode!r} is not a mode of moving ranks (give {', '.join(MODES)})", Why.INVALID)
        cfg = self.ctx.cfg
        log_to = Unwritten() if dry_run else self.journal
        record = RewireRecord.new(job, cfg.agent_address, moving)
        record.mode = mode
        record.gpus = list(target_gpus)
        rw = AwareRewire(
            record, self.ask, self.start_move, cfg.rewire_timeout, log_to, self._ended, dry_run, leaving=self.leaving
        )
        if not dry_run:
            self._admit(rw)
        return rw

    def _admit(self, rw: Rewire) -> None:
        with self.lock:
            if any(other.job == rw.job for other in self.running.values()):
                raise Refused(f"job {rw.job} is already being rewired here; wait for it.", Why.CONFLICT)
            self.running[rw.migration_id] = rw

    def _ended(self, rw: Rewire) -> None:
        with self.lock:
            self.running.pop(rw.migration_id, None)

    def status(self, rewire_id: str) -> PeerStatus | None:
        """Where rewire ``rewire_id`` stands: its phase once final, else "rewiring" (None: no such rewire)."""
        try:
            record = self.journal.read(rewire_id)
        except JournalError as e:  # (never "not found" of what may be under way)
            raise Refused(str(e), Why.INTERNAL) from e
        if record is None:
            return None
        state = record.phase.value if record.phase in REWIRE_FINAL else "rewiring"
        return PeerStatus(rewire_id, state, record.message, 0)

    def cancel(self, rewire_id: str) -> bool:
        """Cancel a running rewire (whether there is one by that id)."""
        with self.lock:
            rw = self.running.get(rewire_id)
        if rw is not None:
            rw.cancel("cancelled by the operator")
        return rw is not None

    def recover(self) -> None:
        """Finish each rewire a previous run of this agent left (see :mod:`tpagent.jobs.rewire`)."""
        cfg = self.ctx.cfg
        for record in self.journal.unfinished():
            rw = AwareRewire(
                record,
                self.ask,
                self.start_move,
                cfg.rewire_timeout,
                self.journal,
                self._ended,
                settled=self.settled,
                leaving=self.leaving,
            )
            try:
                self._admit(rw)
            except Refused as e:
                log.error("rewire %s cannot be finished (%s); left for an operator", record.rewire_id, e)
                continue
            log.info("rewire %s of job %s: finishing what the agent left at its restart", rw.migration_id, rw.job)
            self.run(rw)

    def settled(self, migration_id: str, target: str, timeout: float) -> int:
        """After a restart: the copy's PID on the target once migration ``migration_id`` is done,
        0 once it rolled back (its original runs here); waits for the journal to say."""
        deadline = time.monotonic() + timeout
        while True:
            try:
                r = self.ctx.journal.read(migration_id)
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
