"""A model-aware move of ranks (issue 27, item 2): each moving rank's registered training state
goes to a fresh process of its command on the target, in place of its process image.  The
rewire around it is :mod:`tpagent.jobs.rewire`'s, in the same phases and journal::

    where     every rank; each moving one registered its state (tpagent_rank.register)
    join      the target agent starts the rank's command as the rank runs here (tpagent.jobs.joiners);
              it warms up on its own while the job runs on                      -- "warmup" timing
    pause, boundary   as a transparent move
    teardown  every rank, none leaving: the moving ones stay connected to this agent
    save      each moving rank offers its state once, rank to rank, under a fresh secret
    load      its joiner fetches it and stands as the rank stood                -- "handover" timing
    rebuild   every rank where it now runs (the joiner in the moving rank's place)
    moved     this agent's registry follows the rank to the target (its stand-in with it)
    retire    the moving rank runs the rest of its step, then ends
    resume    step S+1

Nothing is lost: until the joiners are in (their communicators built with every other rank's),
a failure drops them and the moving ranks, parked where they were, rebuild there.  Once they
are in, the moving ranks are retired (written down first, so that a restart finishes it).
"""

from __future__ import annotations

import secrets
import signal
import time
from typing import Any

from tpagent.jobs.api import Leaving, Phase, RewireFailed
from tpagent.jobs.moves import cannot_move, each, fails
from tpagent.jobs.rewire import Rewire
from tpagent.migration.api import AgentError, Outcome, SourceState
from tpagent_rank import protocol as P

#: The mode that picks aware where every moving rank registered its state, else transparent.
AUTO = "auto"
MODES = ("transparent", "aware", AUTO)
#: The slowest rate a state is assumed to cross the network at, for the load's deadline.
SLOWEST_RATE = 20e6


class AwareRewire(Rewire):
    """A rewire in the mode of ``record.mode``: "aware" as this module says, "transparent" as
    :class:`Rewire`, :data:`AUTO` one of them by what the ranks registered."""

    def __init__(self, *args: Any, leaving: Leaving, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.leaving = leaving

    @property
    def aware(self) -> bool:
        return self.record.mode == "aware"

    def _release(self, agents: list[str]) -> list[str]:
        return [] if self.aware else super()._release(agents)  # (none let go of its agent)

    def _teardown(self, agents: list[str], gen: int) -> None:
        try:
            super()._teardown(agents, gen)
        except RewireFailed:
            self._drop_joiners()
            raise

    def _run(self) -> tuple[Outcome, int]:
        agents = self._agents()
        t_request = time.monotonic()
        where = self.ranks.where(agents, "; nothing was changed")
        if self.record.mode == AUTO:  # (GPUs named on the target: only a process image is placed on them)
            aware = all(where[r].aware for r in self.moving) and not self.record.gpus
            self.record.mode = "aware" if aware else "transparent"
        if not self.aware:
            return self._move_images(agents, where, t_request)  # (the ranks asked once, whichever mode)
        return self._run_aware(agents, where, t_request)

    def _problems(self, where: dict[int, P.Standing]) -> tuple[list[str], dict[int, P.Join]]:
        ranks = sorted(self.moving)
        problems = [
            f"rank {r}{_unmovable(where[r])}, so only its process image can move (--mode transparent)"
            for r in ranks
            if not where[r].aware
        ]
        problems += cannot_move(ranks, where, image=False)
        if self.record.gpus:
            problems.append(
                "a model-aware move cannot choose the target's GPUs (the new process picks its own device there): "
                "move the ranks as their process images (--mode transparent), or name no GPU"
            )
        specs = {}
        for r in ranks:
            try:
                specs[r] = self.leaving.spec(self.job, r)
            except AgentError as e:
                problems.append(f"rank {r} cannot be started elsewhere: {str(e).rstrip('.')}")
        return problems, specs

    def _run_aware(self, agents: list[str], where: dict[int, P.Standing], t_request: float) -> tuple[Outcome, int]:
        ranks = sorted(self.moving)
        problems, specs = self._problems(where)
        if self.dry_run:
            return self._dry_run_aware(agents, where, problems)
        if problems:
            raise RewireFailed("; ".join(problems) + "; nothing was changed")
        gen = max(a.gen for a in where.values()) + 1
        self.record.agents = agents
        self.record.gen = gen
        self._write(Phase.PAUSING)
        try:
            self._start_joiners(specs)
            self._stage("warmup", t_request)
            step = self._boundary(agents, where)
        except Exception:  # (whatever it is, no joiner is left waiting for a state)
            self._drop_joiners()
            raise
        self._stage("boundary", t_request)
        self.state = SourceState.FREEZING.value
        self.record.step = step
        self._write(Phase.TEARDOWN)
        self._teardown(agents, gen)
        self.emit(f"all {len(agents)} ranks stopped after step {step}, communicators torn down")
        trial = list(agents)
        for r in ranks:
            trial[r] = self.moving[r][1]
        t = time.monotonic()
        try:
            bad = self._hand_over(agents, trial, step)
            self._stage("handover", t)
            if not bad:
                bad = self._rebuild(trial, gen, final=False)
        except Exception as e:  # (a bug: the ranks are parked, torn down; they rebuild where they stood)
            self.log.exception("the hand-over failed unexpectedly")
            bad = [f"internal error: {e}"]
        if bad:
            return self._stay(agents, gen, bad)
        self.record.kept = ranks
        self._write(Phase.TEARDOWN)
        self._retire(trial)
        t = time.monotonic()
        self._resume(trial)
        self._stage("resume", t)
        self.timings["total"] = round(time.monotonic() - t_request, 4)
        return self._resumed(trial, self.record.joiners[ranks[-1]])

    def _start_joiners(self, specs: dict[int, P.Join]) -> None:
        """Each moving rank's command started on its target; waited for until each waits for a state."""
        for r, spec in sorted(specs.items()):
            target = self.moving[r][1]
            try:
                started = self.ask(target, self.job, r, spec, self.timeout)
            except AgentError as e:
                raise RewireFailed(
                    f"rank {r} could not be started on {target} ({str(e).rstrip('.')}); nothing was changed"
                ) from e
            self.record.joiners[r] = started.pid
            self._write(Phase.PAUSING)
            self.emit(f"rank {r} started on {target} (PID {started.pid}) to take its state; it warms up meanwhile")
        deadline = time.monotonic() + max(self.timeout, 120.0)
        for r in sorted(specs):
            self._warmed(r, deadline)

    def _warmed(self, r: int, deadline: float) -> None:
        target = self.moving[r][1]
        while True:
            if self.cancelled.is_set():
                raise RewireFailed(f"cancelled ({self.cancel_reason}); nothing was changed")
            left = deadline - time.monotonic()
            try:
                seen = self.ask(target, self.job, r, P.Where(), max(1.0, min(10.0, left)), self.record.key)
            except AgentError as e:
                if left > 0 and self._runs_there(r):  # (not connected to its agent yet: importing its libraries)
                    time.sleep(0.2)
                    continue
                raise RewireFailed(
                    f"rank {r}'s new process on {target} ended or stopped answering as it warmed up "
                    f"({str(e).rstrip('.')}); nothing was changed"
                ) from e
            if seen.state == P.RankState.WAITING.value:
                return
            if left <= 0:
                raise RewireFailed(
                    f"rank {r}'s new process on {target} did not warm up within {deadline - self.t0:.0f} s "
                    f"(it stands at {seen.state}); nothing was changed"
                )
            time.sleep(0.2)

    def _runs_there(self, r: int) -> bool:
        """Whether rank ``r``'s new process runs still, as its agent says (not its runtime)."""
        try:
            seen = self.ask(self.moving[r][1], self.job, r, P.Locate(), 10.0, self.record.key)
        except AgentError:
            return False
        return seen.state == P.Whereabouts.HERE.value and seen.pid == self.record.joiners.get(r)

    def _hand_over(self, agents: list[str], trial: list[str], step: int) -> list[str]:
        """Each moving rank's state, offered here, fetched by its joiner there; what failed."""
        host = self.record.here.rsplit(":", 1)[0]
        loads: dict[int, P.Load] = {}
        bad = []
        for r in sorted(self.moving):
            secret = secrets.token_hex(32)
            try:
                saved = self.ask(
                    agents[r], self.job, r, P.Save(host, secret, self.timeout), self.timeout, self.record.key
                )
            except AgentError as e:
                saved = P.Saved(ok=False, error=str(e))
            if not saved.ok or saved.step != step:
                why = (saved.error or f"it stands at step {saved.step}").rstrip(".")
                bad.append(f"rank {r} could not give its state ({why})")
                continue
            source = f"{host}:{saved.port}"
            loads[r] = P.Load(saved.size, saved.step, saved.collectives, source, secret, saved.groups)
            self.timings[f"rank{r}_state_bytes"] = float(saved.size)
        if bad:
            return bad
        size = max(load.size for load in loads.values())
        timeout = self.timeout + size / SLOWEST_RATE
        loaded = self.ranks.all(trial, lambda r: loads[r], timeout, only=sorted(loads))
        return fails(loaded, "take its state in its new process")

    def _stay(self, agents: list[str], gen: int, bad: list[str]) -> tuple[Outcome, int]:
        """The joiners are dropped; every rank builds its communicators again where it ran, under
        a generation no rank has tried."""
        self._drop_joiners()
        why = "; ".join(bad)
        for r in self.moving:
            self.stayed[r] = f"its state could not be handed over ({why})"
            self.emit(f"rank {r} stays on this node: {self.stayed[r]}")
        self.record.gen = gen + 1
        self._write(Phase.TEARDOWN)
        others = [r for r in range(len(agents)) if r not in self.moving]
        torn = self.ranks.all(agents, each(P.Teardown(leaving=False)), self.timeout, only=others)
        self._rebuild(agents, gen + 1, "; ".join(fails(torn, "tear its communicators down")))
        return self._resumed(agents, 0)

    def _retire(self, trial: list[str]) -> None:
        """The moving ranks are the joiners' now: this agent's registry follows them (their
        stand-ins with it), then each ends once it has run the rest of its step."""
        for r in sorted(self.moving):
            try:
                self.ask(self.record.here, self.job, r, P.Moved(to=trial[r]), self.timeout)
            except AgentError as e:
                self.log.warning("rank %d moved to %s, but this agent could not note it: %s", r, trial[r], e)
        retired = self.ranks.all(self.record.agents, each(P.Retire()), self.timeout, only=sorted(self.moving))
        for why in fails(retired, "retire"):
            self.log.warning("%s: it is ended all the same", why)
        for r in sorted(self.moving):
            if not self.leaving.gone(self.job, r, self.timeout):
                self.log.warning("rank %d's old process did not end within %.0f s of retiring: killed", r, self.timeout)

    def _drop_joiners(self) -> None:
        for r, pid in sorted(self.record.joiners.items()):
            if r in self.record.kept:
                continue
            try:
                kill = P.Signal(signum=int(signal.SIGKILL))  # (of this job's rank alone: its name may be another's)
                answer = self.ask(self.moving[r][1], self.job, r, kill, self.timeout, self.record.key)
                why = answer.error
            except AgentError as e:
                why = str(e)
            if why:
                self.log.warning("rank %d's new process (PID %d) could not be ended: %s", r, pid, why)
            else:
                self.log.info("rank %d's new process (PID %d) on %s was ended", r, pid, self.moving[r][1])

    def _dry_run_aware(
        self, agents: list[str], where: dict[int, P.Standing], problems: list[str]
    ) -> tuple[Outcome, int]:
        steps = {r: a.step for r, a in where.items()}
        self.state = SourceState.FAILED.value if problems else SourceState.DONE.value
        moving = ", ".join(f"rank {r} to {self.moving[r][1]}" for r in sorted(self.moving))
        verdict = "it would fail" if problems else "all checks pass"
        self.emit(
            f"dry run of job {self.job}, moving the training state of {moving}: all {len(agents)} ranks answer "
            f"(steps {steps}); {verdict}",
            problems=tuple(problems),
        )
        return Outcome.DRY_RUN, 0

    def _finish(self) -> tuple[Outcome, int]:
        """After a restart: before the teardown, the joiners are dropped and the job goes on; after
        it, a rank whose joiner was kept is retired, every other joiner dropped, and every rank
        rebuilds where it now runs."""
        r = self.record
        if not self.aware:
            return super()._finish()
        if not r.key:
            self._learn_key(r.agents)
        self._drop_joiners()
        if r.phase in (Phase.CHECKING, Phase.PAUSING):
            return super()._finish()
        agents = list(r.agents)
        for rank in r.kept:
            agents[rank] = self.moving[rank][1]
        if r.kept:
            self._retire(agents)
        r.gen += 1
        self._write(r.phase)
        self._rebuild(agents, r.gen)
        return self._resumed(agents, r.joiners[r.kept[-1]] if r.kept else 0)


def _unmovable(seen: P.Standing) -> str:
    """Why a rank cannot move as its state: its state cannot be read back, or it registered none."""
    if seen.no_replicas.startswith(P.UNREADABLE):
        return f": {seen.no_replicas}"
    return " registered no training state (tpagent_rank.register)"
