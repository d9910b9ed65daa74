"""Moving ranks of a running distributed job: every rank stops at one step boundary, all tear their
communicators down, the moving ranks migrate (the ordinary path: :mod:`tpagent.migration.source`), and all
build new communicators under a new generation before step S+1 runs.

The moving ranks' source agent runs it; it reaches every rank through the rank's own agent (the
``Rank`` call), found in the job's store (each rank keeps its agent's address there), with the rank
protocol's requests (:mod:`tpagent_rank.protocol`; a model-aware move: :mod:`.awaremove`)::

    where     every rank: its step K, generation G, step rate
    pause     every rank stops after step S = max(K) + margin (a rank already past S: all cancel, retry)
              (a job with no optimizer step yet: after the default group's S-th collective instead)
    boundary  all parked at S (device synchronized, nothing in flight)      -- "boundary" timing
    teardown  every rank destroys its communicators; the moving ones also let go of the store
    migrate   the moving ranks at once: freeze, stream, restore, confirm      -- "migrate" timing
    rebuild   every rank, at once, under generation G+1 (on the node each now runs on)
    resume    step S+1      (a rank that cannot rebuild, e.g. dead: every other rank is told to end)

Nothing is lost: before the teardown a failure cancels the pause (the job goes on untouched); after it, a moving
rank whose migration rolled back rebuilds where it was; every wait has a deadline (``rewire_timeout``), and a rank
that died is named in one sentence.

Where a rewire stands is written down before each phase (the phases and their table: :mod:`tpagent.jobs.api`;
the journal: :mod:`tpagent.jobs.journal`), so that one killed half-way is finished when the agent starts
again (:meth:`.rewires.Rewires.recover`): before the teardown it cancels the pause; after it, it waits for
each moving rank's migration to be settled by the migrations' journal (its original resumed here, or its
copy running on the target) and rebuilds every rank where it now runs.
"""

from __future__ import annotations

import logging
import math
import queue
import threading
import time
from collections.abc import Callable

from tpagent.jobs.api import Ask, Moving, Phase, RewireFailed, RewireLog, RewireRecord, Settled, StartMove
from tpagent.jobs.moves import Asking, Move, Verdict, cannot_move, each, fails, nccl_strangers, then
from tpagent.migration.api import HOLD_MAX, AgentError, Event, JournalError, MigrationResult, Outcome, SourceState
from tpagent_rank import protocol as P

log = logging.getLogger(__name__)


#: The states a rewire's run ends in, as its events say them.
_ENDS = {SourceState.DONE.value: Phase.DONE, SourceState.ROLLED_BACK.value: Phase.ROLLED_BACK}


class Rewire:
    """Moves ``record.moving`` (rank -> (init PID here, target agent)) of ``record.job``; quacks like a
    :class:`~tpagent.migration.source.SourceMigration` for the service (events, cancel, run).  ``journal``
    writes down where it stands; ``on_end`` is called once it has ended; with ``settled`` it finishes
    what a previous run of this agent left (:meth:`.rewires.Rewires.recover`)."""

    def __init__(
        self,
        record: RewireRecord,
        ask: Ask,
        start_move: StartMove,
        timeout: float,
        journal: RewireLog,
        on_end: Callable[[Rewire], None] = lambda _rw: None,
        dry_run: bool = False,
        settled: Settled | None = None,
    ) -> None:
        self.record = record
        self.ask = ask
        self.start_move = start_move
        self.timeout = timeout
        self.journal = journal
        self.on_end = on_end
        self.dry_run = dry_run
        self.settled = settled
        self.events: queue.Queue[Event | None] = queue.Queue()
        self.result: MigrationResult | None = None
        self.timings: dict[str, float] = {}
        self.t0 = time.monotonic()
        self.cancelled = threading.Event()
        self.cancel_reason = ""
        self.moves: dict[int, Moving] = {}
        self.held: list[Move] = []  # the moves started: none is left holding its copy for a word never said
        self.released: set[tuple[int, str]] = set()  # (rank, agent): told to come back there
        self.state = SourceState.CHECKING.value  # what the events say: a migration's states (SourceState)
        self.log = logging.LoggerAdapter(log, {"migration": record.rewire_id})
        self.last_said = ""
        self.stayed: dict[int, str] = {}  # rank -> why it did not move
        self.ranks = Asking(record.job, ask, timeout, record.key, record.rewire_id)

    @property
    def migration_id(self) -> str:
        return self.record.rewire_id

    @property
    def job(self) -> str:
        return self.record.job

    @property
    def moving(self) -> dict[int, tuple[int, str]]:
        return self.record.moving

    def _write(self, phase: Phase, message: str = "") -> None:
        try:
            self.journal.move(self.record, phase, message)
        except JournalError as e:
            cause = e.__cause__
            why = cause.strerror if isinstance(cause, OSError) and cause.strerror else str(e)
            raise RewireFailed(f"where the rewire stands cannot be written down ({why})") from e

    # ---- what the service sees ----------------------------------------------------------------

    def emit(self, message: str = "", new_pid: int = 0, problems: tuple[str, ...] = ()) -> None:
        if message:
            self.last_said = message
        seconds = time.monotonic() - self.t0
        event = Event(self.migration_id, self.state, message, seconds, dict(self.timings), problems, new_pid=new_pid)
        self.events.put(event)
        if message:
            self.log.info("%s: %s", self.state, message)

    def cancel(self, reason: str) -> bool:
        self.cancel_reason = reason
        self.cancelled.set()  # (no rank that has not started moving will)
        # Past the teardown the migrations decide (they may already be pinned): every one is asked
        # (a list, not a generator: whatever the first says), and none started means taken.
        return all([m.cancel(reason) for m in self.moves.values()])

    # ---- the run ------------------------------------------------------------------------------

    def run(self) -> MigrationResult:
        outcome = Outcome.FAILED
        new_pid = 0
        try:
            outcome, new_pid = self._run() if self.settled is None else self._finish()
        except RewireFailed as e:
            self.state = SourceState.FAILED.value
            self.emit(f"job {self.job}: {e}")
        except Exception as e:  # a bug: said, and the ranks are told to go on where they are
            self.log.exception("rewire failed unexpectedly")
            self.state = SourceState.FAILED.value
            self.emit(f"job {self.job}: internal error: {e}")
        if self.result is None:
            message = self.record.message if self.dry_run else self.last_said or self.record.message
            try:
                if not self.dry_run:
                    self._write(_ENDS.get(self.state, Phase.FAILED), message)
            except (RewireFailed, AgentError) as e:  # (said; the rewire has ended all the same)
                self.log.error("the end of the rewire cannot be written down: %s", e)
            finally:
                self.on_end(self)
                self.result = MigrationResult(self.migration_id, outcome, message, new_pid, dict(self.timings))
                self.events.put(None)
        return self.result

    def _finish(self) -> tuple[Outcome, int]:
        """Finish what a previous run of this agent left (see the module's text)."""
        assert self.settled is not None
        r = self.record
        if not r.key:  # (journaled by a tpagent before jobs had keys: the job's, from the first rank that says)
            self._learn_key(r.agents)
        if r.phase in (Phase.CHECKING, Phase.PAUSING):  # nothing was torn down: the job just goes on
            self.ranks.all(r.agents, each(P.Cancel()), self.timeout)
            self.state = SourceState.ROLLED_BACK.value
            self.emit(
                f"job {self.job}: the agent restarted before any rank stopped for good; the job goes on "
                "as it was, no rank moved"
            )
            return Outcome.ROLLED_BACK, 0
        agents = list(r.agents)
        new_pid = 0
        for rank in sorted(self.moving):
            mid = r.moves.get(rank)
            target = self.moving[rank][1]
            pid = self.settled(mid, target, self.timeout) if mid else 0
            if pid:
                self._moved(rank, target, pid)
                agents[rank] = target
                new_pid = pid
        # A rebuild under the last generation may have been under way: never the same store keys twice.
        r.gen += 1
        self._write(r.phase)
        self._rebuild(agents, r.gen)
        return self._resumed(agents, new_pid)

    def _learn_key(self, agents: list[str]) -> None:
        for rank, agent in enumerate(agents):
            try:
                self.record.key = self.ranks.key = self.ask(agent, self.job, rank, P.Peers(), self.timeout).key
                return
            except AgentError:
                continue

    def _stage(self, name: str, t0: float) -> None:
        self.timings[name] = round(time.monotonic() - t0, 4)

    def _agents(self) -> list[str]:
        """Where every rank's agent is, as the job's store says (asked of the first moving rank), and
        which job this is (its identity, as this agent vouches for it), which every rank asked
        after must confirm: what the store says is anyone's word who can reach it."""
        first = min(self.moving)
        answer = self.ask(self.record.here, self.job, first, P.Peers(), self.timeout)
        if not answer.ok or not answer.agents:
            raise RewireFailed(
                f"rank {first} cannot tell where the job's other ranks run ({answer.error or 'no answer'})"
            )
        missing = [r for r, a in enumerate(answer.agents) if not a]
        if missing:
            raise RewireFailed(
                f"rank(s) {', '.join(map(str, missing))} have not said where their agent is: "
                "is every rank started with `tpagent rank`?"
            )
        agents = list(answer.agents)
        self.record.key = self.ranks.key = answer.key
        for r in sorted(self.moving):
            if agents[r] != self.record.here:
                raise RewireFailed(f"rank {r} runs on {agents[r]}, not on this node: ask its agent (--from)")
        return agents

    def _run(self) -> tuple[Outcome, int]:
        agents = self._agents()
        t_request = time.monotonic()
        return self._move_images(agents, self.ranks.where(agents, "; nothing was changed"), t_request)

    def _move_images(self, agents: list[str], where: dict[int, P.Standing], t_request: float) -> tuple[Outcome, int]:
        ranks = sorted(self.moving)
        problems = cannot_move(ranks, where)
        if self.dry_run:
            return self._dry_run(agents, where, problems)
        if problems:
            raise RewireFailed("; ".join(problems) + "; nothing was changed")
        gen = max(a.gen for a in where.values()) + 1
        self.record.agents = agents
        self.record.gen = gen
        self._write(Phase.PAUSING)
        step = self._boundary(agents, where)
        self._stage("boundary", t_request)
        self.state = SourceState.FREEZING.value
        self.record.step = step
        self._write(Phase.TEARDOWN)
        self._teardown(agents, gen)
        self.emit(f"all {len(agents)} ranks stopped after {self.record.unit} {step}, communicators torn down")
        t = time.monotonic()
        try:
            held = self._move_all(ranks)
            self._stage("migrate", t)
            new_pid = self._keep_or_drop(held, agents, gen)
        finally:
            for mv in self.held:  # (an error on the way: no copy is kept unconfirmed; their originals run on)
                mv.decide(False)
        self.timings["total"] = round(time.monotonic() - t_request, 4)
        return self._resumed(agents, new_pid)

    def _teardown(self, agents: list[str], gen: int) -> None:
        """Every rank tears its communicators down; the moving ones also let go of the store."""
        t = time.monotonic()
        leaving = set(self.moving) if self.record.mode != "aware" else set()  # (aware: none is frozen)
        torn = self.ranks.all(agents, lambda r: P.Teardown(leaving=r in leaving), self.timeout)
        bad = fails(torn, "tear its communicators down")
        self._stage("teardown", t)
        if bad:
            # Those that did tear down rebuild where they are; the job reports what failed.
            self._rebuild(agents, gen, "; ".join(bad))

    def _move_all(self, ranks: list[int]) -> dict[int, Move]:
        """Every moving rank at once by the ordinary migration (nothing lost on any failure), in
        parallel (CUDA checkpoints of different GPUs too), up to its copy running on its target,
        held there while its original stays frozen here; those whose copies wait so."""
        started: dict[int, Move] = {}
        for r in ranks:
            init, target = self.moving[r]
            if self.cancelled.is_set():
                self.stayed[r] = f"cancelled ({self.cancel_reason})"
                self.emit(f"rank {r} stays on this node: {self.stayed[r]}")
                continue
            verdict = Verdict()
            hold = min(4 * self.timeout + 60, HOLD_MAX)  # (we ask all along: only our silence counts there)
            m = self.start_move(init, target, hold=hold, verdict=verdict, target_gpus=tuple(self.record.gpus))
            self.moves[r] = m
            self.record.moves[r] = m.migration_id
            self._write(Phase.TEARDOWN)
            started[r] = Move(m, verdict, self._pass_on)
            self.held.append(started[r])
        held = {r: mv for r, mv in started.items() if mv.wait_running()}  # (all waited for: none left in flight)
        unresolved = []
        for r, mv in ((r, mv) for r, mv in started.items() if r not in held):
            result = self._result(mv)
            assert result is not None
            if result.outcome is Outcome.UNRESOLVED:
                unresolved.append(f"rank {r}'s migration {mv.m.migration_id}")
            else:
                self.stayed[r] = result.message.rstrip(".")
                self.emit(f"rank {r} stays on this node: {self.stayed[r]}")
        if unresolved:
            raise RewireFailed(
                f"{', '.join(unresolved)} is unresolved (its original stays frozen until its target "
                "answers); the job waits at its boundary"
            )
        return held

    def _pass_on(self, event: Event) -> None:
        self.state = event.state
        self.events.put(event)

    def _result(self, mv: Move, timeout: float | None = None) -> MigrationResult | None:
        """How a move ended (None: not yet), its timings added to the rewire's."""
        result = mv.result(timeout)
        if result is not None:
            self.timings.update({f"rank{mv.m.pid}_{k}": v for k, v in result.timings.items()})
        return result

    def _trial(self, held: dict[int, Move], trial: list[str], gen: int) -> list[str]:
        """Build the new communicators with every held copy where it runs (``trial``); what failed."""
        bad = []
        for r, mv in sorted(held.items()):
            try:
                self.ask(trial[r], self.job, r, P.Expect(pid=mv.m.new_pid), self.timeout)
            except AgentError as e:
                bad.append(f"rank {r}'s agent on {trial[r]} would not take it ({e})")
        if not bad:  # (each copy reconnects to its new agent, and says where it stands there)
            bad = self._release(trial)
        if not bad:
            seen = self.ranks.all(trial, each(P.Where()), self.timeout)
            bad = fails(seen, "say where it stands") or nccl_strangers(seen)
        if not bad:
            bad = self._rebuild(trial, gen, final=False)
        return bad

    def _keep_or_drop(self, held: dict[int, Move], agents: list[str], gen: int) -> int:
        """Build the new communicators with every held copy where it runs; only once they are up
        on every rank are the copies kept (their originals end).  If they cannot be built, the
        copies are dropped, their originals run on here, and every rank builds them again, under
        the next generation, where it now runs.  The PID of a copy kept (0: none)."""
        if not held:
            self._rebuild(agents, gen)
            return 0
        trial = list(agents)
        for r in held:
            trial[r] = self.moving[r][1]
        bad = self._trial(held, trial, gen)
        for mv in held.values():
            mv.decide(not bad)
        new_pid = 0
        for r, mv in sorted(held.items()):
            result = self._result(mv, self.timeout)
            if result is None:  # (the target does not answer: its copy may be final there, or gone)
                raise RewireFailed(
                    f"rank {r}'s target {trial[r]} does not answer, so its copy can be neither kept "
                    "nor dropped; the original stays frozen until it answers (or `tpagent resolve`), "
                    "and the job waits at its boundary"
                )
            if result.outcome is Outcome.DONE:
                agents[r] = trial[r]
                new_pid = result.new_pid
                try:
                    self.ask(self.record.here, self.job, r, P.Moved(to=trial[r]), self.timeout)
                except AgentError as e:  # (this agent's own registry: its stand-in may not follow it)
                    self.log.warning("rank %d moved to %s, but this agent could not note it: %s", r, trial[r], e)
            elif result.outcome is Outcome.UNRESOLVED:
                raise RewireFailed(
                    f"rank {r}'s migration {mv.m.migration_id} is unresolved (its original stays "
                    "frozen until its target answers); the job waits at its boundary"
                )
            else:
                why = "; ".join(bad) if bad else result.message.rstrip(".")
                self.stayed[r] = f"the job's communicators could not be built with it on {trial[r]} ({why})"
                self.emit(f"rank {r} stays on this node: {self.stayed[r]}")
        if agents == trial and not bad:
            self._resume(agents)
            return new_pid
        self._rebuild_without(held, agents, gen + 1)
        return new_pid

    def _rebuild_without(self, held: dict[int, Move], agents: list[str], gen: int) -> None:
        """Build again without the copies that were dropped, whose originals run here again (torn
        down, reconnecting to this agent once released): a generation no rank has tried."""
        self.record.gen = gen
        self._write(Phase.TEARDOWN)
        dropped = {r for r in held if agents[r] == self.record.here}
        others = [r for r in range(len(agents)) if r not in dropped]
        torn = self.ranks.all(agents, each(P.Teardown(leaving=False)), self.timeout, only=others)
        self._rebuild(agents, gen, "; ".join(fails(torn, "tear its communicators down")))

    def _dry_run(self, agents: list[str], where: dict[int, P.Standing], problems: list[str]) -> tuple[Outcome, int]:
        """Every rank answered; each moving rank's own migration is checked as a dry run (its
        TCP connections aside: they are the communicators', closed before it is frozen)."""
        problems = list(problems)
        for r in sorted(self.moving):
            init, target = self.moving[r]
            m = self.start_move(init, target, dry_run=True, target_gpus=tuple(self.record.gpus))
            mv = Move(m, Verdict(), self._pass_on)
            self._result(mv)
            problems += [f"rank {r}: {p}" for p in m.problems]
        steps = {r: a.step for r, a in where.items()}
        self.state = SourceState.FAILED.value if problems else SourceState.DONE.value
        moving = ", ".join(f"rank {r} to {self.moving[r][1]}" for r in sorted(self.moving))
        verdict = "it would fail" if problems else "all checks pass"
        self.emit(
            f"dry run of job {self.job}, moving {moving}: all {len(agents)} ranks answer (steps {steps}); {verdict}",
            problems=tuple(problems),
        )
        return Outcome.DRY_RUN, 0

    def _moved(self, r: int, target: str, pid: int) -> None:
        """Rank ``r`` runs on ``target`` now (its copy: ``pid`` there): both agents are told."""
        self.ask(target, self.job, r, P.Expect(pid=pid), self.timeout)
        self.ask(self.record.here, self.job, r, P.Moved(to=target), self.timeout)

    def _resumed(self, agents: list[str], new_pid: int) -> tuple[Outcome, int]:
        ranks = sorted(self.moving)
        moved = [r for r in ranks if agents[r] != self.record.here]
        self.state = SourceState.DONE.value if len(moved) == len(ranks) else SourceState.ROLLED_BACK.value
        why = {r: f" (it stayed: {self.stayed[r]})" for r in self.stayed}
        where_now = ", ".join(f"rank {r} on {agents[r]}{why.get(r, '')}" for r in ranks)
        self.emit(
            f"job {self.job} resumed at {self.record.unit} {self.record.step + 1} with new communicators "
            f"(generation {self.record.gen}): {where_now}",
            new_pid=new_pid,
        )
        return (Outcome.DONE if self.state == SourceState.DONE.value else Outcome.ROLLED_BACK), new_pid

    def _boundary(self, agents: list[str], where: dict[int, P.Standing]) -> int:
        """Agree on a step every rank stops after, and wait until all have; that step.  The unit is
        the optimizer step once any rank has taken one, else the default group's collectives (a job
        with no optimizer: every rank issues them in the same order)."""
        margin = 2
        for _attempt in range(4):
            if self.cancelled.is_set():
                raise RewireFailed(f"cancelled ({self.cancel_reason}); nothing was changed")
            by_step = any(a.step > 0 for a in where.values())
            unit = P.Unit.STEP.value if by_step else P.Unit.COLLECTIVE.value
            self.record.unit = unit
            rate = max((a.rate if by_step else a.collective_rate) for a in where.values())
            # The request takes a moment to reach every rank: stop some way ahead (half a second of steps).
            ahead = max(margin, math.ceil(rate * 0.5) + margin)
            step = max((a.step if by_step else a.collectives) for a in where.values()) + ahead
            paused = self.ranks.all(agents, each(P.Pause(at=step, unit=unit)), self.timeout)
            late = [r for r, a in paused.items() if isinstance(a, P.Paused) and a.late]
            bad = fails({r: a for r, a in paused.items() if r not in late}, "pause")
            if late or bad:
                self.ranks.all(agents, each(P.Cancel()), self.timeout)
                if bad:
                    raise RewireFailed("; ".join(bad) + "; " + then(paused, "the job goes on as it was"))
                margin *= 4
                where = self.ranks.where(agents)
                continue
            self.emit(f"all {len(agents)} ranks of job {self.job} stop after {unit} {step}")
            at = self.ranks.all(agents, each(P.Boundary(timeout=self.timeout)), self.timeout + 5)
            bad = fails(at, f"reach {unit} {step}")
            if bad or self.cancelled.is_set():
                self.ranks.all(agents, each(P.Cancel()), self.timeout)
                why = "; ".join(bad) if bad else f"cancelled ({self.cancel_reason})"
                raise RewireFailed(f"{why}; " + then(at, "the other ranks go on"))
            return step
        raise RewireFailed("the ranks kept running past every step proposed to them; nothing was changed")

    def _rebuild(self, agents: list[str], gen: int, failed: str = "", final: bool = True) -> list[str]:
        """Every rank builds its communicators under ``gen`` where ``agents`` say it runs, then
        (``final``) resumes.  Not ``final``: what failed (the ranks stay parked)."""
        self.state = SourceState.RESTORING.value if not failed else SourceState.FAILED.value
        t = time.monotonic()
        bad = self._release(agents)
        if not bad:
            # A rank that fails means the job cannot build them: the others (blocked until their
            # deadline, waiting for it) are not waited for.
            built = self.ranks.all(
                agents, each(P.Rebuild(gen=gen, timeout=self.timeout)), self.timeout + 5, until_one_fails=True
            )
            bad = fails(built, f"build its communicators (generation {gen})")
        self._stage("rebuild", t)
        if bad and not final:
            return bad
        if bad:
            # Every rank that still answers is told, and ends now with the reason, rather than wait
            # parked for a peer that will not come (its own deadline, or the group's timeout).
            why = "; ".join([failed, *bad] if failed else bad) + "; the job cannot go on"
            self.ranks.end(agents, why[:2000], min(self.timeout, 30))
            raise RewireFailed(why)
        if final:
            self._resume(agents, failed)
        return []

    def _release(self, agents: list[str]) -> list[str]:
        """The moving ranks let go of their agent to be frozen: each is told to come back, to the
        agent where it runs now (once: a word it does not take stays for its next freeze); what failed."""
        bad = []
        for r in self.moving:
            if (r, agents[r]) in self.released:
                continue
            try:
                self.ask(agents[r], self.job, r, P.Release(), self.timeout, self.record.key)
                self.released.add((r, agents[r]))
            except AgentError as e:
                bad.append(f"rank {r} cannot be told to come back to {agents[r]} ({e})")
        return bad

    def _resume(self, agents: list[str], failed: str = "") -> None:
        resumed = self.ranks.all(agents, each(P.Resume()), self.timeout)
        bad = fails(resumed, "resume")
        if bad or failed:
            raise RewireFailed("; ".join([failed, *bad] if failed else bad))
