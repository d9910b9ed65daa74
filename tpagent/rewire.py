"""Moving ranks of a running distributed job: every rank stops at one step boundary, all tear
their communicators down, the moving ranks migrate (the ordinary path: :mod:`tpagent.source`),
and all build new communicators under a new generation before step S+1 runs.

The agent that runs this is the moving ranks' source agent; it reaches every rank through the
rank's own agent (the ``Rank`` call; its own ranks directly), and learns where those agents are
from the job itself (each rank keeps its agent's address in the job's store).

    where   every rank: its step K, generation G, step rate
    pause   every rank stops after step S = max(K) + margin (a rank already past S: all cancel, retry)
    boundary  all parked at S (device synchronized, nothing in flight)      -- "boundary" timing
    teardown  every rank destroys its communicators; the moving ones also let go of the store
    migrate   each moving rank: freeze, stream, restore, confirm              -- "migrate" timing
    rebuild   every rank, at once, under generation G+1 (on the node each now runs on)
    resume    step S+1

Nothing is lost: before the teardown a failure cancels the pause (the job goes on untouched);
after it, a moving rank whose migration rolled back rebuilds where it was; every wait has a
deadline (``rewire_timeout``), and a rank that died is named in one sentence.
"""

from __future__ import annotations

import functools
import json
import logging
import math
import queue
import threading
import time
import uuid
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from tpagent.api import AgentError, Event, MigrationResult, Outcome
from tpagent.source import SourceMigration

log = logging.getLogger(__name__)

#: ask(agent address, job, rank, body, timeout) -> the rank's answer (raises AgentError).
Ask = Callable[[str, str, int, dict[str, Any], float], dict[str, Any]]
#: A migration of one rank's namespace (by its init PID here) to a target: the ordinary path.
StartMove = Callable[[int, str], SourceMigration]


class RewireFailed(Exception):
    pass


class Rewire:
    """Moves ``moving`` (rank -> (init PID here, target agent)) of ``job``; quacks like a
    :class:`~tpagent.source.SourceMigration` for the service (events, cancel, run)."""

    def __init__(self, job: str, moving: dict[int, tuple[int, str]], here: str, ask: Ask, start_move: StartMove,
                 timeout: float, dry_run: bool = False) -> None:  # fmt: skip
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
        self.state = "checking"
        self.release: Callable[[], None] = lambda: None
        self.log = logging.LoggerAdapter(log, {"migration": self.migration_id})

    # ---- what the service sees ----------------------------------------------------------------

    def emit(self, message: str = "", new_pid: int = 0, problems: tuple[str, ...] = ()) -> None:
        self.events.put(Event(self.migration_id, self.state, message, time.monotonic() - self.t0,
                              dict(self.timings), problems, new_pid=new_pid))  # fmt: skip
        if message:
            self.log.info("%s: %s", self.state, message)

    def cancel(self, reason: str) -> bool:
        if self.moves:  # past the teardown, the migrations decide (they may already be pinned)
            return all(m.cancel(reason) for m in self.moves.values())
        self.cancel_reason = reason
        self.cancelled.set()
        return True

    # ---- the run ------------------------------------------------------------------------------

    def _all(self, agents: list[str], body: Callable[[int], dict[str, Any]], timeout: float) -> dict[int, Any]:
        """Ask every rank at once; rank -> its answer, or the AgentError it gave."""

        def one(r: int) -> Any:
            try:
                return self.ask(agents[r], self.job, r, body(r), timeout)
            except AgentError as e:
                return e

        with ThreadPoolExecutor(max_workers=min(64, len(agents))) as pool:
            return dict(zip(range(len(agents)), pool.map(one, range(len(agents))), strict=True))

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
            outcome, new_pid = self._run()
        except RewireFailed as e:
            self.state = "failed"
            self.emit(f"job {self.job}: {e}")
        except Exception as e:  # a bug: said, and the ranks are told to go on where they are
            self.log.exception("rewire failed unexpectedly")
            self.state = "failed"
            self.emit(f"job {self.job}: internal error: {e}")
        if self.result is None:
            self.release()
            self.result = MigrationResult(self.migration_id, outcome, "", new_pid, dict(self.timings))
            self.events.put(None)
        return self.result

    def _stage(self, name: str, t0: float) -> None:
        self.timings[name] = round(time.monotonic() - t0, 4)

    def _run(self) -> tuple[Outcome, int]:
        ranks = sorted(self.moving)
        first = ranks[0]
        agents_answer = self.ask(self.here, self.job, first, {"op": "peers"}, self.timeout)
        agents = agents_answer.get("agents")
        if not agents_answer.get("ok") or not isinstance(agents, list) or not agents:
            raise RewireFailed(f"rank {first} cannot tell where the job's other ranks run "
                               f"({agents_answer.get('error', 'no answer')})")  # fmt: skip
        missing = [r for r, a in enumerate(agents) if not isinstance(a, str) or not a]
        if missing:
            raise RewireFailed(f"rank(s) {', '.join(map(str, missing))} have not said where their agent is: "
                               "is every rank started with `tpagent rank`?")  # fmt: skip
        agents = [str(a) for a in agents]
        for r in ranks:
            if agents[r] != self.here:
                raise RewireFailed(f"rank {r} runs on {agents[r]}, not on this node: ask its agent (--from)")
        t_request = time.monotonic()
        where = self._all(agents, lambda r: {"op": "where"}, self.timeout)
        bad = self._fails(where, "say where it stands")
        if bad:
            raise RewireFailed("; ".join(bad) + "; nothing was changed")
        if self.dry_run:
            self.state = "done"
            steps = {r: a.get("step") for r, a in where.items()}
            self.emit(f"dry run: all {len(agents)} ranks of job {self.job} answer (steps {steps}); moving "
                      + ", ".join(f"rank {r} to {self.moving[r][1]}" for r in ranks))  # fmt: skip
            return Outcome.DRY_RUN, 0
        gen = max(int(a.get("gen", 0)) for a in where.values()) + 1
        step = self._boundary(agents, where)
        self._stage("boundary", t_request)
        self.state = "freezing"
        t = time.monotonic()
        torn = self._all(agents, lambda r: {"op": "teardown", "leaving": r in self.moving}, self.timeout)
        bad = self._fails(torn, "tear its communicators down")
        self._stage("teardown", t)
        if bad:
            # Those that did tear down rebuild where they are; the job reports what failed.
            self._rebuild(agents, gen, "; ".join(bad))
        self.emit(f"all {len(agents)} ranks stopped after step {step}, communicators torn down")
        t = time.monotonic()
        new_pid = 0
        for r in ranks:  # one at a time: each is the ordinary migration, nothing lost on any failure
            init, target = self.moving[r]
            m = self.start_move(init, target)
            self.moves[r] = m
            result = self._follow(m)
            if result.outcome is Outcome.DONE:
                agents[r] = target
                new_pid = result.new_pid
                self.ask(target, self.job, r, {"op": "expect", "pid": result.new_pid}, self.timeout)
                self.ask(self.here, self.job, r, {"op": "moved", "to": target}, self.timeout)
            elif result.outcome is Outcome.UNRESOLVED:
                raise RewireFailed(f"rank {r}'s migration {m.migration_id} is unresolved (its original stays "
                                   "frozen until its target answers); the job waits at its boundary")  # fmt: skip
            else:
                self.emit(f"rank {r} stays on this node: {result.message}")
        self._stage("migrate", t)
        self._rebuild(agents, gen)
        self.timings["total"] = round(time.monotonic() - t_request, 4)
        moved = [r for r in ranks if agents[r] != self.here]
        self.state = "done" if len(moved) == len(ranks) else "rolled_back"
        where_now = ", ".join(f"rank {r} on {agents[r]}" for r in ranks)
        self.emit(f"job {self.job} resumed at step {step + 1} with new communicators (generation {gen}): "
                  f"{where_now}", new_pid=new_pid)  # fmt: skip
        return (Outcome.DONE if self.state == "done" else Outcome.ROLLED_BACK), new_pid

    def _follow(self, m: SourceMigration) -> MigrationResult:
        """Run one rank's migration in this thread, passing its events on."""
        done = threading.Thread(target=m.run, name=f"migrate-{m.pid}", daemon=True)
        done.start()
        while (event := m.events.get()) is not None:
            self.state = event.state
            self.events.put(event)
        done.join()
        assert m.result is not None
        self.timings.update({f"rank{m.pid}_{k}": v for k, v in m.result.timings.items()})
        return m.result

    def _boundary(self, agents: list[str], where: dict[int, Any]) -> int:
        """Agree on a step every rank stops after, and wait until all have; that step."""
        margin = 2
        for _attempt in range(4):
            if self.cancelled.is_set():
                raise RewireFailed(f"cancelled ({self.cancel_reason}); nothing was changed")
            rate = max(float(a.get("rate") or 0.0) for a in where.values())
            # The request takes a moment to reach every rank: stop some way ahead (half a second of steps).
            step = max(int(a.get("step", 0)) for a in where.values()) + max(margin, math.ceil(rate * 0.5) + margin)
            paused = self._all(agents, functools.partial(_pause, step), self.timeout)
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
            self.emit(f"all {len(agents)} ranks of job {self.job} stop after step {step}")
            at = self._all(agents, lambda r: {"op": "boundary", "timeout": self.timeout}, self.timeout + 5)
            bad = self._fails(at, f"reach step {step}")
            if bad or self.cancelled.is_set():
                self._all(agents, lambda r: {"op": "cancel"}, self.timeout)
                why = "; ".join(bad) if bad else f"cancelled ({self.cancel_reason})"
                raise RewireFailed(f"{why}; the other ranks go on")
            return step
        raise RewireFailed("the ranks kept running past every step proposed to them; nothing was changed")

    def _rebuild(self, agents: list[str], gen: int, failed: str = "") -> None:
        self.state = "restoring" if not failed else "failed"
        t = time.monotonic()
        for r in self.moving:  # they let go of their agent to be frozen: back to the one where they run now
            try:
                self.ask(agents[r], self.job, r, {"op": "release"}, self.timeout)
            except AgentError as e:
                raise RewireFailed(f"rank {r} cannot be told to come back to {agents[r]} ({e})") from e
        built = self._all(agents, lambda r: {"op": "rebuild", "gen": gen, "timeout": self.timeout},
                          self.timeout + 5)  # fmt: skip
        bad = self._fails(built, f"build its communicators (generation {gen})")
        self._stage("rebuild", t)
        if bad:
            raise RewireFailed("; ".join([failed, *bad] if failed else bad) + "; the job cannot go on")
        resumed = self._all(agents, lambda r: {"op": "resume"}, self.timeout)
        bad = self._fails(resumed, "resume")
        if bad or failed:
            raise RewireFailed("; ".join([failed, *bad] if failed else bad))


def _pause(at: int, _rank: int) -> dict[str, Any]:
    return {"op": "pause", "at": at}


def dumps(body: dict[str, Any]) -> str:
    return json.dumps(body, separators=(",", ":"))
