"""Moving ranks of a running distributed job: every rank stops at one step boundary, all tear
their communicators down, the moving ranks migrate (the ordinary path: :mod:`tpagent.migration.source`),
and all build new communicators under a new generation before step S+1 runs.

The agent that runs this is the moving ranks' source agent; it reaches every rank through the
rank's own agent (the ``Rank`` call; its own ranks directly), and learns where those agents are
from the job itself (each rank keeps its agent's address in the job's store).

    where   every rank: its step K, generation G, step rate
    pause   every rank stops after step S = max(K) + margin (a rank already past S: all cancel, retry)
            (a job with no optimizer step yet: after the default group's S-th collective instead)
    boundary  all parked at S (device synchronized, nothing in flight)      -- "boundary" timing
    teardown  every rank destroys its communicators; the moving ones also let go of the store
    migrate   each moving rank: freeze, stream, restore, confirm              -- "migrate" timing
    rebuild   every rank, at once, under generation G+1 (on the node each now runs on)
    resume    step S+1      (a rank that cannot rebuild, e.g. dead: every other rank is told to end)

Nothing is lost: before the teardown a failure cancels the pause (the job goes on untouched);
after it, a moving rank whose migration rolled back rebuilds where it was; every wait has a
deadline (``rewire_timeout``), and a rank that died is named in one sentence.

The agent writes down where a rewire stands (:meth:`Rewire.to_json`, durably, before each phase)
so that one killed half-way finishes it when it starts again (:meth:`Rewire.recover`): before the
teardown it cancels the pause; after it, it waits for each moving rank's migration to be settled
by the journal (its original resumed here, or its copy running on the target) and rebuilds every
rank where it now runs.
"""

from __future__ import annotations

import contextlib
import functools
import json
import logging
import math
import queue
import threading
import time
import uuid
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor, as_completed
from typing import Any

from tpagent.migration.api import HOLD_MAX, AgentError, Event, MigrationResult, Outcome
from tpagent.migration.source import SourceMigration

log = logging.getLogger(__name__)

#: ask(agent address, job, rank, body, timeout) -> the rank's answer (raises AgentError).
Ask = Callable[[str, str, int, dict[str, Any], float], dict[str, Any]]
#: A migration of one rank's namespace (by its init PID here) to a target: the ordinary path.
StartMove = Callable[[int, str], SourceMigration]
#: settled(migration id, target, timeout) -> the copy's PID once that migration is done, 0 once
#: it rolled back (or never was), after a restart (raises RewireFailed if it stays unsettled).
Settled = Callable[[str, str, float], int]
#: Phases written down (see the module's text); the last three are final.
PHASES = ("checking", "pausing", "teardown", "done", "rolled_back", "failed")


class RewireFailed(Exception):
    pass


class Rewire:
    """Moves ``moving`` (rank -> (init PID here, target agent)) of ``job``; quacks like a
    :class:`~tpagent.migration.source.SourceMigration` for the service (events, cancel, run)."""

    def __init__(
        self,
        job: str,
        moving: dict[int, tuple[int, str]],
        here: str,
        ask: Ask,
        start_move: StartMove,
        timeout: float,
        dry_run: bool = False,
    ) -> None:
        self.job, self.moving, self.here, self.ask = job, moving, here, ask
        self.start_move, self.timeout, self.dry_run = start_move, timeout, dry_run
        self.migration_id = uuid.uuid4().hex
        self.events: queue.Queue[Event | None] = queue.Queue()
        self.result: MigrationResult | None = None
        self.timings: dict[str, float] = {}
        self.t0 = time.monotonic()
        self.cancelled = threading.Event()
        self.cancel_reason = ""
        self.moves: dict[int, SourceMigration] = {}
        self.held: list[_Move] = []  # the moves started: none is left holding its copy for a word never said
        self.released: set[tuple[int, str]] = set()  # (rank, agent): told to come back there
        self.state = "checking"
        self.release: Callable[[], None] = lambda: None
        self.log = logging.LoggerAdapter(log, {"migration": self.migration_id})
        #: Where it stands, written down by ``save`` (the agent's: durably) before each phase.
        self.save: Callable[[dict[str, Any]], None] = lambda _record: None
        self.phase = "checking"
        self.agents: list[str] = []
        self.gen = 0
        self.step = 0
        self.unit = "step"  # what ``step`` counts: optimizer steps, or the default group's collectives
        self.move_ids: dict[int, str] = {}
        self.message = ""
        self.recovering: Settled | None = None
        self.last_said = ""
        self.stayed: dict[int, str] = {}  # rank -> why it did not move
        #: A dry run's check of one moving rank: the ordinary dry run of its namespace.
        self.dry_move: StartMove | None = None

    # ---- written down --------------------------------------------------------------------------

    def to_json(self) -> dict[str, Any]:
        return {
            "format": 1,
            "rewire_id": self.migration_id,
            "job": self.job,
            "here": self.here,
            "phase": self.phase,
            "message": self.message,
            "agents": self.agents,
            "gen": self.gen,
            "step": self.step,
            "unit": self.unit,
            "moving": {str(r): [i, t] for r, (i, t) in self.moving.items()},
            "moves": {str(r): m for r, m in self.move_ids.items()},
        }

    def _write(self, phase: str, message: str = "") -> None:
        self.phase, self.message = phase, message or self.message
        try:
            self.save(self.to_json())
        except OSError as e:
            raise RewireFailed(f"where the rewire stands cannot be written down ({e.strerror})") from e

    @classmethod
    def recover(
        cls, record: dict[str, Any], ask: Ask, start_move: StartMove, timeout: float, settled: Settled
    ) -> Rewire:
        """The rewire a previous run of this agent wrote down and did not finish; :meth:`run`
        finishes it (raises ValueError for a record that is not one)."""
        moving = {int(r): (int(v[0]), str(v[1])) for r, v in dict(record["moving"]).items()}
        rw = cls(str(record["job"]), moving, str(record["here"]), ask, start_move, timeout)
        rw.migration_id = str(record["rewire_id"])
        rw.log = logging.LoggerAdapter(log, {"migration": rw.migration_id})
        rw.phase, rw.message = str(record["phase"]), str(record.get("message", ""))
        rw.agents = [str(a) for a in record["agents"]]
        rw.gen, rw.step = int(record["gen"]), int(record["step"])
        rw.unit = "collective" if record.get("unit") == "collective" else "step"
        rw.move_ids = {int(r): str(m) for r, m in dict(record.get("moves", {})).items()}
        if rw.phase not in PHASES or not rw.moving or len(rw.agents) <= max(rw.moving):
            raise ValueError(f"rewire {rw.migration_id}: not a record this agent can finish")
        rw.recovering = settled
        return rw

    # ---- what the service sees ----------------------------------------------------------------

    def emit(self, message: str = "", new_pid: int = 0, problems: tuple[str, ...] = ()) -> None:
        if message:
            self.last_said = message
        self.events.put(
            Event(
                self.migration_id,
                self.state,
                message,
                time.monotonic() - self.t0,
                dict(self.timings),
                problems,
                new_pid=new_pid,
            )
        )
        if message:
            self.log.info("%s: %s", self.state, message)

    def cancel(self, reason: str) -> bool:
        self.cancel_reason = reason
        self.cancelled.set()  # (no rank that has not started moving will)
        if self.moves:  # past the teardown, the migrations decide (they may already be pinned)
            return all(m.cancel(reason) for m in self.moves.values())
        return True

    # ---- the run ------------------------------------------------------------------------------

    def _all(
        self,
        agents: list[str],
        body: Callable[[int], dict[str, Any]],
        timeout: float,
        only: list[int] | None = None,
        until_one_fails: bool = False,
    ) -> dict[int, Any]:
        """Ask every rank (or ``only`` these) at once; rank -> its answer, or the AgentError it gave.
        ``until_one_fails``: only until a rank fails (the others' answers then are not waited for)."""
        ranks = list(range(len(agents))) if only is None else only

        def one(r: int) -> Any:
            try:
                return self.ask(agents[r], self.job, r, body(r), timeout)
            except AgentError as e:
                return e

        out: dict[int, Any] = {}
        if not ranks:
            return out
        pool = ThreadPoolExecutor(max_workers=min(64, len(ranks)))
        asked = {pool.submit(one, r): r for r in ranks}
        try:
            for done in as_completed(asked):
                out[asked[done]] = answer = done.result()
                if until_one_fails and (isinstance(answer, AgentError) or not answer.get("ok")):
                    break
        finally:
            pool.shutdown(wait=not until_one_fails, cancel_futures=True)
        return out

    def _fails(self, answers: dict[int, Any], what: str) -> list[str]:
        out = []
        for r, a in sorted(answers.items()):
            if isinstance(a, AgentError):
                out.append(f"rank {r} could not {what} ({str(a).rstrip('.')})")
            elif not a.get("ok"):
                out.append(f"rank {r} could not {what} ({str(a.get('error', 'no reason given')).rstrip('.')})")
        return out

    def run(self) -> MigrationResult:
        outcome, new_pid = Outcome.FAILED, 0
        try:
            outcome, new_pid = self._run() if self.recovering is None else self._finish()
        except RewireFailed as e:
            self.state = "failed"
            self.emit(f"job {self.job}: {e}")
        except Exception as e:  # a bug: said, and the ranks are told to go on where they are
            self.log.exception("rewire failed unexpectedly")
            self.state = "failed"
            self.emit(f"job {self.job}: internal error: {e}")
        if self.result is None:
            if not self.dry_run:
                with contextlib.suppress(RewireFailed):
                    self._write(self.state if self.state in PHASES[3:] else "failed", self._last_message())
            self.release()
            self.result = MigrationResult(self.migration_id, outcome, self.message, new_pid, dict(self.timings))
            self.events.put(None)
        return self.result

    def _last_message(self) -> str:
        return self.last_said or self.message

    def _finish(self) -> tuple[Outcome, int]:
        """Finish what a previous run of this agent left (see the module's text)."""
        assert self.recovering is not None
        if self.phase in ("checking", "pausing"):  # nothing was torn down: the job just goes on
            self._all(self.agents, lambda r: {"op": "cancel"}, self.timeout)
            self.state = "rolled_back"
            self.emit(
                f"job {self.job}: the agent restarted before any rank stopped for good; the job goes on "
                "as it was, no rank moved"
            )
            return Outcome.ROLLED_BACK, 0
        agents, new_pid = list(self.agents), 0
        for r in sorted(self.moving):
            mid = self.move_ids.get(r)
            target = self.moving[r][1]
            pid = self.recovering(mid, target, self.timeout) if mid else 0
            if pid:
                self._moved(r, target, pid)
                agents[r], new_pid = target, pid
        # A rebuild under the last generation may have been under way: never the same store keys twice.
        self.gen += 1
        self._write(self.phase)
        self._rebuild(agents, self.gen)
        return self._resumed(agents, new_pid)

    def _stage(self, name: str, t0: float) -> None:
        self.timings[name] = round(time.monotonic() - t0, 4)

    def _run(self) -> tuple[Outcome, int]:
        ranks = sorted(self.moving)
        first = ranks[0]
        agents_answer = self.ask(self.here, self.job, first, {"op": "peers"}, self.timeout)
        agents = agents_answer.get("agents")
        if not agents_answer.get("ok") or not isinstance(agents, list) or not agents:
            raise RewireFailed(
                f"rank {first} cannot tell where the job's other ranks run ({agents_answer.get('error', 'no answer')})"
            )
        missing = [r for r, a in enumerate(agents) if not isinstance(a, str) or not a]
        if missing:
            raise RewireFailed(
                f"rank(s) {', '.join(map(str, missing))} have not said where their agent is: "
                "is every rank started with `tpagent rank`?"
            )
        agents = [str(a) for a in agents]
        for r in ranks:
            if agents[r] != self.here:
                raise RewireFailed(f"rank {r} runs on {agents[r]}, not on this node: ask its agent (--from)")
        t_request = time.monotonic()
        where = self._all(agents, lambda r: {"op": "where"}, self.timeout)
        bad = self._fails(where, "say where it stands")
        if bad:
            raise RewireFailed("; ".join(bad) + "; nothing was changed")
        hosting = [_hosts_store(r, where[r]["hosts_store"]) for r in ranks if where[r].get("hosts_store")]
        hosting += [
            f"rank {r} reaches the job's store at a loopback address ({where[r]['store_loopback']}), which "
            "another node would not reach: start the job with an address every node reaches"
            for r in ranks
            if where[r].get("store_loopback")
        ]
        hosting += [
            f"rank {r} runs NCCL's RAS thread (NCCL_RAS_ENABLE is on in its environment), which listens "
            "on this node's address for the life of the process, past every communicator: it cannot move "
            "(start the job without NCCL_RAS_ENABLE: tpagent rank turns RAS off where it is not set)"
            for r in ranks
            if where[r].get("nccl_ras")
        ]
        if self.dry_run:
            return self._dry_run(agents, where, hosting)
        if hosting:
            raise RewireFailed("; ".join(hosting) + "; nothing was changed")
        gen = max(int(a.get("gen", 0)) for a in where.values()) + 1
        self.agents, self.gen = agents, gen
        self._write("pausing")
        step = self._boundary(agents, where)
        self._stage("boundary", t_request)
        self.state = "freezing"
        self.step = step
        self._write("teardown")
        t = time.monotonic()
        torn = self._all(agents, lambda r: {"op": "teardown", "leaving": r in self.moving}, self.timeout)
        bad = self._fails(torn, "tear its communicators down")
        self._stage("teardown", t)
        if bad:
            # Those that did tear down rebuild where they are; the job reports what failed.
            self._rebuild(agents, gen, "; ".join(bad))
        self.emit(f"all {len(agents)} ranks stopped after {self.unit} {step}, communicators torn down")
        t = time.monotonic()
        try:
            held = self._move_all(ranks, agents)
            self._stage("migrate", t)
            new_pid = self._keep_or_drop(held, agents, gen)
        finally:
            for mv in self.held:  # (an error on the way: no copy is kept unconfirmed; their originals run on)
                mv.decide(False)
        self.timings["total"] = round(time.monotonic() - t_request, 4)
        return self._resumed(agents, new_pid)

    def _move_all(self, ranks: list[int], agents: list[str]) -> dict[int, _Move]:
        """Each moving rank in turn, by the ordinary migration (nothing lost on any failure), up to
        its copy running on its target, held there while its original stays frozen here; the
        ranks whose copies wait so for the job's new communicators."""
        held: dict[int, _Move] = {}
        for r in ranks:
            init, target = self.moving[r]
            if self.cancelled.is_set():
                self.stayed[r] = f"cancelled ({self.cancel_reason})"
                self.emit(f"rank {r} stays on this node: {self.stayed[r]}")
                continue
            m = self.start_move(init, target)
            m.hold = min(4 * self.timeout + 60, HOLD_MAX)  # (we ask all along: only our silence counts there)
            self.moves[r] = m
            self.move_ids[r] = m.migration_id
            self._write("teardown")
            mv = _Move(self, m)
            self.held.append(mv)
            if mv.wait_running():
                held[r] = mv
                continue
            result = mv.result()
            assert result is not None
            if result.outcome is Outcome.UNRESOLVED:
                raise RewireFailed(
                    f"rank {r}'s migration {m.migration_id} is unresolved (its original stays "
                    "frozen until its target answers); the job waits at its boundary"
                )
            self.stayed[r] = result.message.rstrip(".")
            self.emit(f"rank {r} stays on this node: {self.stayed[r]}")
        return held

    def _keep_or_drop(self, held: dict[int, _Move], agents: list[str], gen: int) -> int:
        """Build the new communicators with every held copy where it runs; only once they are up
        on every rank are the copies kept (their originals end).  If they cannot be built, the
        copies are dropped, their originals run on here, and every rank builds them again, under
        the next generation, where it now runs.  The PID of a copy kept (0: none)."""
        if not held:
            self._rebuild(agents, gen)
            return 0
        trial, bad = list(agents), []
        for r, mv in sorted(held.items()):
            trial[r] = self.moving[r][1]
            try:
                self.ask(trial[r], self.job, r, {"op": "expect", "pid": mv.m.new_pid}, self.timeout)
            except AgentError as e:
                bad.append(f"rank {r}'s agent on {trial[r]} would not take it ({e})")
        if not bad:  # (each copy reconnects to its new agent, and says where it stands there)
            bad = self._release(trial)
        if not bad:
            seen = self._all(trial, lambda r: {"op": "where"}, self.timeout)
            bad = self._fails(seen, "say where it stands") or _nccl_strangers(seen)
        if not bad:
            bad = self._rebuild(trial, gen, final=False)
        for mv in held.values():
            mv.decide(not bad)
        new_pid = 0
        for r, mv in sorted(held.items()):
            result = mv.result(self.timeout)
            if result is None:  # (the target does not answer: its copy may be final there, or gone)
                raise RewireFailed(
                    f"rank {r}'s target {trial[r]} does not answer, so its copy can be neither kept "
                    "nor dropped; the original stays frozen until it answers (or `tpagent resolve`), "
                    "and the job waits at its boundary"
                )
            if result.outcome is Outcome.DONE:
                agents[r], new_pid = trial[r], result.new_pid
                try:
                    self.ask(self.here, self.job, r, {"op": "moved", "to": trial[r]}, self.timeout)
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
        # Built again without the copies that were dropped, whose originals run here again (torn
        # down, reconnecting to this agent once released): a generation no rank has tried.
        self.gen = gen = gen + 1
        self._write("teardown")
        dropped = {r for r in held if agents[r] == self.here}
        torn = self._all(
            agents,
            lambda r: {"op": "teardown", "leaving": False},
            self.timeout,
            only=[r for r in range(len(agents)) if r not in dropped],
        )
        self._rebuild(agents, gen, "; ".join(self._fails(torn, "tear its communicators down")))
        return new_pid

    def _dry_run(self, agents: list[str], where: dict[int, Any], hosting: list[str]) -> tuple[Outcome, int]:
        """Every rank answered; each moving rank's own migration is checked as a dry run (its
        TCP connections aside: they are the communicators', closed before it is frozen)."""
        problems: list[str] = list(hosting)
        for r in sorted(self.moving):
            if self.dry_move is not None:
                m = self.dry_move(*self.moving[r])
                self._follow(m)
                problems += [f"rank {r}: {p}" for p in m.problems]
        steps = {r: a.get("step") for r, a in where.items()}
        self.state = "failed" if problems else "done"
        moving = ", ".join(f"rank {r} to {self.moving[r][1]}" for r in sorted(self.moving))
        verdict = "it would fail" if problems else "all checks pass"
        self.emit(
            f"dry run of job {self.job}, moving {moving}: all {len(agents)} ranks answer (steps {steps}); {verdict}",
            problems=tuple(problems),
        )
        return Outcome.DRY_RUN, 0

    def _moved(self, r: int, target: str, pid: int) -> None:
        """Rank ``r`` runs on ``target`` now (its copy: ``pid`` there): both agents are told."""
        self.ask(target, self.job, r, {"op": "expect", "pid": pid}, self.timeout)
        self.ask(self.here, self.job, r, {"op": "moved", "to": target}, self.timeout)

    def _resumed(self, agents: list[str], new_pid: int) -> tuple[Outcome, int]:
        ranks = sorted(self.moving)
        moved = [r for r in ranks if agents[r] != self.here]
        self.state = "done" if len(moved) == len(ranks) else "rolled_back"
        why = {r: f" (it stayed: {self.stayed[r]})" for r in self.stayed}
        where_now = ", ".join(f"rank {r} on {agents[r]}{why.get(r, '')}" for r in ranks)
        self.emit(
            f"job {self.job} resumed at {self.unit} {self.step + 1} with new communicators "
            f"(generation {self.gen}): {where_now}",
            new_pid=new_pid,
        )
        return (Outcome.DONE if self.state == "done" else Outcome.ROLLED_BACK), new_pid

    def _follow(self, m: SourceMigration) -> MigrationResult:
        """Run one rank's migration to its end, passing its events on."""
        result = _Move(self, m).result()
        assert result is not None
        return result

    def _boundary(self, agents: list[str], where: dict[int, Any]) -> int:
        """Agree on a step every rank stops after, and wait until all have; that step.  The unit is
        the optimizer step once any rank has taken one, else the default group's collectives (a job
        with no optimizer: every rank issues them in the same order)."""
        margin = 2
        for _attempt in range(4):
            if self.cancelled.is_set():
                raise RewireFailed(f"cancelled ({self.cancel_reason}); nothing was changed")
            self.unit = "step" if any(int(a.get("step", 0)) > 0 for a in where.values()) else "collective"
            count, per_second = ("step", "rate") if self.unit == "step" else ("collectives", "collective_rate")
            rate = max(float(a.get(per_second) or 0.0) for a in where.values())
            # The request takes a moment to reach every rank: stop some way ahead (half a second of steps).
            step = max(int(a.get(count, 0)) for a in where.values()) + max(margin, math.ceil(rate * 0.5) + margin)
            paused = self._all(agents, functools.partial(_pause, step, self.unit), self.timeout)
            late = [r for r, a in paused.items() if isinstance(a, dict) and a.get("late")]
            bad = self._fails({r: a for r, a in paused.items() if r not in late}, "pause")
            if late or bad:
                self._all(agents, lambda r: {"op": "cancel"}, self.timeout)
                if bad:
                    raise RewireFailed("; ".join(bad) + "; the job goes on as it was")
                margin *= 4
                where = self._all(agents, lambda r: {"op": "where"}, self.timeout)
                if self._fails(where, "say where it stands"):
                    raise RewireFailed("; ".join(self._fails(where, "say where it stands")))
                continue
            self.emit(f"all {len(agents)} ranks of job {self.job} stop after {self.unit} {step}")
            at = self._all(agents, lambda r: {"op": "boundary", "timeout": self.timeout}, self.timeout + 5)
            bad = self._fails(at, f"reach {self.unit} {step}")
            if bad or self.cancelled.is_set():
                self._all(agents, lambda r: {"op": "cancel"}, self.timeout)
                why = "; ".join(bad) if bad else f"cancelled ({self.cancel_reason})"
                raise RewireFailed(f"{why}; the other ranks go on")
            return step
        raise RewireFailed("the ranks kept running past every step proposed to them; nothing was changed")

    def _rebuild(self, agents: list[str], gen: int, failed: str = "", final: bool = True) -> list[str]:
        """Every rank builds its communicators under ``gen`` where ``agents`` say it runs, then
        (``final``) resumes.  Not ``final``: what failed (the ranks stay parked)."""
        self.state = "restoring" if not failed else "failed"
        t = time.monotonic()
        bad = self._release(agents)
        if not bad:
            # A rank that fails means the job cannot build them: the others (blocked until their
            # deadline, waiting for it) are not waited for.
            built = self._all(
                agents,
                lambda r: {"op": "rebuild", "gen": gen, "timeout": self.timeout},
                self.timeout + 5,
                until_one_fails=True,
            )
            bad = self._fails(built, f"build its communicators (generation {gen})")
        self._stage("rebuild", t)
        if bad and not final:
            return bad
        if bad:
            # Every rank that still answers is told, and ends now with the reason, rather than wait
            # parked for a peer that will not come (its own deadline, or the group's timeout).
            why = "; ".join([failed, *bad] if failed else bad) + "; the job cannot go on"
            self._all(agents, lambda r: {"op": "end", "why": why[:2000]}, min(self.timeout, 30))
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
                self.ask(agents[r], self.job, r, {"op": "release"}, self.timeout)
                self.released.add((r, agents[r]))
            except AgentError as e:
                bad.append(f"rank {r} cannot be told to come back to {agents[r]} ({e})")
        return bad

    def _resume(self, agents: list[str], failed: str = "") -> None:
        resumed = self._all(agents, lambda r: {"op": "resume"}, self.timeout)
        bad = self._fails(resumed, "resume")
        if bad or failed:
            raise RewireFailed("; ".join([failed, *bad] if failed else bad))


class _Move:
    """One rank's migration, run in a thread of its own, its events passed on to the rewire's.
    Once its copy runs on the target (held there for our word), :meth:`decide` keeps or drops it."""

    def __init__(self, rw: Rewire, m: SourceMigration) -> None:
        self.rw, self.m = rw, m
        self.keep: bool | None = None
        m.verdict = lambda: self.keep
        self.ran = threading.Thread(target=m.run, name=f"migrate-{m.pid}", daemon=True)
        self.passed = threading.Thread(target=self._pass_on, name=f"events-{m.pid}", daemon=True)
        self.ran.start()
        self.passed.start()

    def _pass_on(self) -> None:
        while (event := self.m.events.get()) is not None:
            self.rw.state = event.state
            self.rw.events.put(event)

    def wait_running(self) -> bool:
        """Wait until the copy runs on the target (True), or the migration ended without (False)."""
        while not self.m.copy_runs.wait(0.1):
            if not self.ran.is_alive():
                return self.m.copy_runs.is_set()
        return True

    def decide(self, keep: bool) -> None:
        if self.keep is None:
            self.keep = keep

    def result(self, timeout: float | None = None) -> MigrationResult | None:
        """How it ended (None: it has not, ``timeout`` seconds on)."""
        self.ran.join(timeout)
        if self.ran.is_alive():
            return None
        self.passed.join()
        assert self.m.result is not None
        self.rw.timings.update({f"rank{self.m.pid}_{k}": v for k, v in self.m.result.timings.items()})
        return self.m.result


def _hosts_store(rank: int, address: object) -> str:
    return (
        f"rank {rank} serves the job's store ({address}) itself, and its peers reach it at this node's "
        "address: it cannot move (its stand-in serves the store in its place where it can: MASTER_ADDR "
        "and MASTER_PORT in its environment, and a Python command; what it said as it started tells why "
        "not)"
    )


def _nccl_strangers(seen: dict[int, Any]) -> list[str]:
    """Ranks whose NCCL holds one host identity (read once per process: NVIDIA/nccl issue 2348)
    but that run on different hosts now: NCCL would take them for neighbours, and join them
    through shared memory or GPU peer access, which cannot reach across hosts."""
    hosts: dict[str, dict[str, list[int]]] = {}  # NCCL's identity -> the host now -> ranks
    for r, a in sorted(seen.items()):
        if isinstance(a, dict) and a.get("nccl_host"):
            hosts.setdefault(str(a["nccl_host"]), {}).setdefault(str(a.get("host")), []).append(r)
    out = []
    for split in hosts.values():
        if len(split) > 1:
            where = "; ".join(f"rank(s) {', '.join(map(str, rs))} on host {h.split('|')[0]}" for h, rs in split.items())
            out.append(
                f"NCCL in {where} holds one host identity (read once per process: NVIDIA/nccl issue "
                "2348) and would take them for neighbours across hosts: move such ranks together"
            )
    return out


def _pause(at: int, unit: str, _rank: int) -> dict[str, Any]:
    return {"op": "pause", "at": at, "unit": unit}


def dumps(body: dict[str, Any]) -> str:
    return json.dumps(body, separators=(",", ":"))
