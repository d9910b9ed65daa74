"""Unplanned recovery (issue 27, item 3), as the agent of a surviving rank runs it: ranks of a
job were lost with their node (no process image is left to move), and the job is rebuilt from
their data-parallel replicas, on a spare, without a restart from its checkpoint.  The ranks'
side is :mod:`tpagent_rank.recover`::

    where      every surviving rank, settled (it enters no new optimizer step from now on):
               each registered its state, holds its last step boundary's, and says which ranks
               are its replicas; a rank whose agent does not answer either was lost too (nodes
               lost together), and is rebuilt with the others.  A rank in no collective with a
               lost one may have finished the step the others were caught in.  The job goes on
               from the earliest boundary held, S, from which every lost rank and every survivor
               at another has a surviving replica holding it: one a step further is taken back
               to S (its step done again, its line written again), or, where a lost rank's state
               survives only a step further, the others are brought forward to it (the step
               they were caught in is a replica's: their line of it is never written); each
               given its state by a replica, as a lost rank is
    store      where the job's store no longer answers (it was served on the lost node), it is
               served anew on this node, holding the job's identity, and every rank started
               from here on is told where (:mod:`tpagent.jobs.storeserver`)      -- "store"
    join       each lost rank's command is started on the spare, as a surviving replica of it
               runs here (its rank's variables set to the lost rank's)          -- "replacement"
    restart    every survivor runs its command again in its own process, from the state it held
               (the step in flight is dropped); a replica that gives a lost rank its state does
               so once its state has been fetched; one taken back, with none  -- "rollback"
    save/load  that replica offers its held state once, rank to rank, under a fresh secret; the
               lost rank's new process (or the one taken back) fetches it        -- "state"
    stand      every rank stands at S, warmed up, its state taken                -- "standing"
    rebuild    every rank's communicators, under a new generation               -- "rebuild"
    resume     step S+1, done again where it was in flight

The orchestrator asks it (:class:`~tpagent_rank.protocol.Recover`) of one agent of the job.  Where
the job cannot be rebuilt (a lost rank has no surviving replica, a rank registered nothing, a
step fails), every rank of it still running is told to end with one sentence, as it would have
ended without tpagent, and its launcher can restart it from its checkpoint.  Nothing here is
written down: an agent that restarts mid-way leaves ranks that end at their hold's deadline
(:data:`tpagent_rank.recover.HOLD`), as the job would have; a store it served anew outlives it
(:func:`tpagent.jobs.storeserver.adopt`).
"""

from __future__ import annotations

import dataclasses
import logging
import os
import secrets
import signal
import time
from collections.abc import Callable
from pathlib import Path

from host.api import unbracketed
from tpagent.jobs import storeserver
from tpagent.jobs.api import Ask, Leaving
from tpagent.jobs.moves import Asking, each, fails
from tpagent.migration.api import AgentError, PeerUnreachable, Refused, Why, is_agent_address
from tpagent_rank import protocol as P
from tpagent_rank.recover import QUIET
from tpagent_rank.store import reachable

log = logging.getLogger(__name__)

#: The environment variables that give a rank its number, as launchers set them (torchrun, srun,
#: MPI, PMIx): a lost rank's command is a replica's with these set to its own.
RANK_VARIABLES = ("RANK", "ROLE_RANK", "SLURM_PROCID", "PMI_RANK", "PMIX_RANK", "OMPI_COMM_WORLD_RANK")
#: How long a fresh process may take to warm up and stand at the boundary.
WARM_TIMEOUT = 300.0
#: How long one rank is given to answer one request.
TIMEOUT = 60.0
#: How long the job's store is given to accept a connection before it is taken as lost.
STORE_PROBE = 3.0


class Failed(Exception):
    """The job cannot be rebuilt: why, in a clause."""


def for_rank(spec: P.Join, source: int, rank: int, job: str, store: str = "") -> P.Join:
    """``spec`` (how rank ``source`` runs) as rank ``rank`` runs: its rank's variables set, its
    output in new files of its own beside the source's (``JOB.rankR.recovered-WHEN-RANDOM.out``),
    told where the job's store is served anew (``store``, if it is); Failed if no variable names
    the rank."""
    env = dict(e.split("=", 1) for e in spec.env)
    named = [k for k in RANK_VARIABLES if env.get(k) == str(source)]
    if not named:
        raise Failed(
            f"rank {source}'s command names its rank in none of {', '.join(RANK_VARIABLES)}, "
            f"so it cannot be started as rank {rank}"
        )
    env.update(dict.fromkeys(named, str(rank)))
    if store:
        env[P.STORE_VARIABLE] = store
    # (a name of each rebuild's own: a second one, on the same node or a shared file system, appended
    # to the first's file, whose lines the stand-in then relayed again)
    when = time.strftime("%Y%m%d-%H%M%S", time.gmtime())
    out = os.path.join(os.path.dirname(spec.stdout), f"{job}.rank{rank}.recovered-{when}-{secrets.token_hex(2)}.out")
    err = out if spec.stderr == spec.stdout else out[: -len(".out")] + ".err"
    named_env = tuple(f"{k}={v}" for k, v in sorted(env.items()))
    return dataclasses.replace(spec, env=named_env, stdout=out, stderr=err)


class Recovery:
    """One recovery of ``job``, asked of this agent (at ``here``) about its rank ``local``."""

    def __init__(
        self, job: str, local: int, request: P.Recover, ask: Ask, here: str, leaving: Leaving, kept: Path | None = None
    ) -> None:
        self.job = job
        self.kept = kept  # where a store served anew is written down (storeserver.Kept)
        self.local = local
        self.request = request
        self.ask = ask
        self.here = here
        self.leaving = leaving
        self.timeout = TIMEOUT
        self.asking = Asking(job, ask, TIMEOUT)
        self.lost = sorted(set(request.ranks))
        self.started: list[int] = []  # the lost ranks whose new processes were started on the spare
        self.restarted: set[int] = set()  # the survivors restarted (parked at the boundary since)
        self.back: list[int] = []  # the survivors at another boundary than the job's (given it by a replica)
        self.stages: dict[str, float] = {}
        self.store = ""  # HOST:PORT of the job's store served anew here ("": it was not lost)
        self.stop_store: Callable[[], None] | None = None  # (of the store served anew here)

    def run(self) -> P.Recovered:
        """The job rebuilt, or every rank of it told to end (then Failed: why)."""
        if not is_agent_address(self.request.spare) or not self.lost:
            raise Refused("recover needs the lost ranks and the spare's agent (HOST:PORT).", Why.INVALID)
        agents = self._agents()
        self._not_running(agents)
        try:
            return self._rebuild(agents)
        except Failed as e:
            self._end(agents, str(e))
            raise
        except Exception as e:  # (a bug: the job ends as it would have, said)
            log.exception("the recovery of job %s failed unexpectedly", self.job)
            self._end(agents, f"internal error: {e}")
            raise Failed(f"internal error: {e}") from e

    def _agents(self) -> list[str]:
        """Every rank's agent, as the job's store says (a lost rank's: its lost node's); where it
        does not (it was lost with its node), as the orchestrator saw them."""
        peers = self.ask(self.here, self.job, self.local, P.Peers(), self.timeout)
        self.asking.key = peers.key  # (the job's identity, as this agent vouches for its rank)
        seen = self.request.agents
        agents = [a or (seen[r] if r < len(seen) else "") for r, a in enumerate(peers.agents)]
        if any(r >= len(agents) for r in self.lost) or not all(agents):
            raise Refused(f"the job's store does not say where every rank of job {self.job} runs", Why.PRECONDITION)
        return agents

    def _not_running(self, agents: list[str]) -> None:
        """Refused (nothing done) if a rank asked for runs after all: the job's store names another
        node than the lost one for it, whose agent has it (rebuilt already, with a node lost
        together with that one)."""
        moved = [d for d in self.lost if agents[d] != self.request.node]
        answers = self.asking.all(agents, each(P.Where()), self.timeout, only=moved)
        running = sorted(r for r, a in answers.items() if not isinstance(a, AgentError) and a.ok)
        if running:
            where = ", ".join(f"rank {r} at {agents[r]}" for r in running)
            raise Refused(f"job {self.job} runs on: {where}, not lost", Why.CONFLICT)

    def _stage(self, name: str, t0: float) -> float:
        now = time.monotonic()
        self.stages[name] = round(now - t0, 4)
        return now

    def _rebuild(self, agents: list[str]) -> P.Recovered:
        t0 = time.monotonic()
        where = self._where(agents, [r for r in range(len(agents)) if r not in self.lost])
        survivors = sorted(where)
        boundary, self.back = self._boundary(where)
        if self.back:  # (a rank in no collective with a lost one finished the step the others hold, or not)
            off = ", ".join(f"rank {r} at {where[r].held}" for r in self.back)
            log.warning("job %s: %s, the others at %d: given its state from a replica", self.job, off, boundary)
        sources = self._sources(agents, where, boundary)
        t = time.monotonic()
        self.store = self._store_anew(where)
        t = self._stage("store", t)
        # (how a lost rank runs: as its source does, or, where that runs on another node, as the
        # rank asked about here does: a job's ranks run one command, but for their numbers; a
        # survivor taken back restarts where it runs)
        like = {d: s if agents[s] == self.here else self.local for d, s in sources.items() if d in self.lost}
        specs = {d: for_rank(self._spec(s), s, d, self.job, self.store) for d, s in like.items()}
        gen = max(w.gen for w in where.values()) + 1
        for d, spec in sorted(specs.items()):
            self._call(self.request.spare, d, spec, f"start rank {d} on {self.request.spare}")
            self.started.append(d)
        others = [r for r in survivors if r not in sources.values() and r not in self.back]
        self._all(agents, P.Restart(self.store), others, "restart from its last step boundary")
        self._all(agents, P.Restart(self.store, fresh=True), self.back, f"restart to take step {boundary}'s state")
        t = self._stage("rollback", t)
        trial = [self.request.spare if r in self.lost else a for r, a in enumerate(agents)]
        self._stand(trial, sorted(sources), P.RankState.WAITING, None, WARM_TIMEOUT)
        t = self._stage("replacement", t)
        self._hand_over(agents, trial, sources, boundary)
        self._all(agents, P.Restart(self.store), sorted(set(sources.values())), "restart from its last step boundary")
        t = self._stage("state", t)
        self._stand(trial, list(range(len(agents))), P.RankState.TORN_DOWN, boundary, WARM_TIMEOUT)
        t = self._stage("standing", t)
        self._all(trial, P.Rebuild(gen=gen, timeout=self.timeout), None, "build its communicators")
        t = self._stage("rebuild", t)
        self._all(trial, P.Resume(), None, "go on")
        self._stage("resume", t)
        self.stages["total"] = round(time.monotonic() - t0, 4)
        lost = ", ".join(map(str, self.lost))
        given = ", ".join(f"rank {d}'s from rank {s}" for d, s in sorted(sources.items()))
        log.info(
            "job %s: rank(s) %s rebuilt on %s from step %d, state %s (%s)",
            self.job,
            lost,
            self.request.spare,
            boundary,
            given,
            self.stages,
        )
        stages = tuple(f"{k}={v}" for k, v in self.stages.items())
        back = tuple(self.back)
        return P.Recovered(step=boundary, gen=gen, stages=stages, store=self.store, ranks=tuple(self.lost), back=back)

    def _where(self, agents: list[str], survivors: list[int]) -> dict[int, P.Standing]:
        """Where each survivor stands, settled (:class:`~tpagent_rank.protocol.Settle`): the
        boundary it holds is the one it restarts from, though it was in no collective with a lost
        rank and trained on."""
        answers = self.asking.all(agents, each(P.Settle()), self.timeout, only=survivors)
        gone = sorted(r for r, a in answers.items() if isinstance(a, PeerUnreachable))
        if gone and len(gone) < len(answers):  # (lost with their nodes too, as the asked ones were)
            log.warning("job %s: rank(s) %s do not answer either: rebuilt too", self.job, ", ".join(map(str, gone)))
            self.lost = sorted({*self.lost, *gone})
            answers = {r: a for r, a in answers.items() if r not in gone}
        bad = fails(answers, "say where it stands")
        if bad:
            raise Failed("; ".join(bad))
        where = {r: a for r, a in answers.items() if isinstance(a, P.Standing)}
        unreadable = [f"rank {r}: {w.no_replicas}" for r, w in where.items() if w.no_replicas.startswith(P.UNREADABLE)]
        if unreadable:
            raise Failed("; ".join(unreadable))
        unregistered = [r for r, w in where.items() if not w.aware or w.held < 0]
        if unregistered:
            ranks = ", ".join(map(str, unregistered))
            raise Failed(f"rank(s) {ranks} hold no training state to rebuild from (tpagent_rank.register)")
        return where

    def _store_anew(self, where: dict[int, P.Standing]) -> str:
        """Where the job's store is served from now on: "" where it answers still (or is no TCP
        store: a FileStore is on a filesystem); else served anew on this node (see the module)."""
        stores = {w.store for w in where.values()}
        if len(stores) != 1 or "" in stores or reachable(next(iter(stores)), STORE_PROBE):
            return ""
        lost = stores.pop()
        agreed = {w.agreed for w in where.values()}
        if len(agreed) != 1 or "" in agreed:
            raise Failed(f"its store ({lost}) is lost, and its ranks do not say one value its identity was agreed on")
        try:
            address, self.stop_store = storeserver.serve_anew(
                self.job,
                self._spec(self.local),
                unbracketed(self.here.rsplit(":", 1)[0]),  # (bare: a server binds it)
                agreed.pop(),
                lambda: self.leaving.here(self.job),
                self.kept,
            )
        except RuntimeError as e:
            raise Failed(f"its store ({lost}) is lost, and it could not be served anew on {self.here} ({e})") from e
        log.warning("job %s: its store (%s) is lost; it is served anew at %s", self.job, lost, address)
        return address

    def _boundary(self, where: dict[int, P.Standing]) -> tuple[int, list[int]]:
        """The boundary the job goes on from, and the survivors at another: the earliest held
        from which every lost rank, and every survivor at another, has a surviving replica
        holding it.  Ranks in no collective with a lost one may have finished the step the
        others were caught in (taken back to the others'), and where the lost rank's only
        replicas did so, the others are brought forward to theirs.  Failed where none serves."""
        alone = [d for d in self.lost if not any(d in w.replicas and r != d for r, w in where.items())]
        if alone:
            raise Failed(f"no replica of rank {alone[0]}'s training state survives")
        short = []
        for b in sorted({w.held for w in where.values()}):
            away = [r for r, w in sorted(where.items()) if w.held != b]
            unheld = [
                d
                for d in [*self.lost, *away]
                if not any(w.held == b and d in w.replicas and r != d for r, w in where.items())
            ]
            if not unheld:
                return b, away
            short.append(f"at step {b}, none for rank{'s' * (len(unheld) > 1)} {', '.join(map(str, sorted(unheld)))}")
        raise Failed(
            "its ranks stand at different step boundaries, and at none of them does every rank that needs one "
            f"have a surviving replica holding it ({'; '.join(short)})"
        )

    def _sources(self, agents: list[str], where: dict[int, P.Standing], boundary: int) -> dict[int, int]:
        """Each lost rank, and each survivor taken back or brought forward -> a surviving replica
        of it that holds ``boundary`` (:meth:`_boundary` found one) and gives it its state (one on
        this node first)."""
        return {
            d: min(
                (r for r, w in where.items() if d in w.replicas and r != d and w.held == boundary),
                key=lambda r: (agents[r] != self.here, r),
            )
            for d in [*self.lost, *self.back]
        }

    def _spec(self, rank: int) -> P.Join:
        try:
            return self.leaving.spec(self.job, rank)
        except AgentError as e:
            raise Failed(f"how rank {rank} runs cannot be read ({str(e).rstrip('.')})") from e

    def _call(self, agent: str, rank: int, request: P.Request[P.Answer], what: str) -> P.Answer:
        try:
            answer = self.ask(agent, self.job, rank, request, self.timeout, self.asking.key)
        except AgentError as e:
            raise Failed(f"rank {rank} could not {what} ({str(e).rstrip('.')})") from e
        if not answer.ok:
            raise Failed(f"rank {rank} could not {what} ({answer.error.rstrip('.')})")
        return answer

    def _all(self, agents: list[str], request: P.Request[P.Answer], only: list[int] | None, what: str) -> None:
        # (a restart waits first for the files its rank writes: tpagent_rank.recover.quiet)
        timeout = self.timeout + QUIET if isinstance(request, P.Restart) else self.timeout
        answers = self.asking.all(agents, each(request), timeout, only=only)
        if isinstance(request, P.Restart):
            self.restarted |= {r for r, a in answers.items() if not isinstance(a, AgentError) and a.ok}
        bad = fails(answers, what)
        if bad:
            raise Failed("; ".join(bad))

    def _hand_over(self, agents: list[str], trial: list[str], sources: dict[int, int], boundary: int) -> None:
        """Each source's held state offered on its node's address, fetched by the new process of the
        rank it gives its state to."""
        for d, s in sorted(sources.items()):
            host = agents[s].rsplit(":", 1)[0]
            secret = secrets.token_hex(32)
            saved = self._call(agents[s], s, P.Save(host, secret, self.timeout, held=True), "give its held state")
            assert isinstance(saved, P.Saved)
            if saved.step != boundary:
                raise Failed(f"rank {s} holds step {saved.step}, not {boundary}")
            # (its process groups are not checked against the replica's: a rank may be in fewer)
            load = P.Load(saved.size, saved.step, saved.collectives, f"{host}:{saved.port}", secret)
            self._call(trial[d], d, load, "take its state in its new process")
            self.stages[f"rank{d}_state_bytes"] = float(saved.size)

    def _stand(self, trial: list[str], ranks: list[int], state: P.RankState, step: int | None, timeout: float) -> None:
        """Wait until each of ``ranks`` stands at ``state`` (and ``step``)."""
        deadline = time.monotonic() + timeout
        left = set(ranks)
        while left:
            for r in sorted(left):
                seen = self._call(trial[r], r, P.Where(), f"say where it stands ({state.value} awaited)")
                assert isinstance(seen, P.Standing)
                if seen.state == state.value and step in (None, seen.step):
                    left.discard(r)
            if left and time.monotonic() > deadline:
                raise Failed(f"rank(s) {sorted(left)} did not stand {state.value} within {timeout:.0f} s")
            if left:
                time.sleep(0.2)

    def _end(self, agents: list[str], why: str) -> None:
        """The job cannot go on: the new processes are ended, every other rank told why."""
        lost = ", ".join(map(str, self.lost))
        sentence = f"rank(s) {lost} of job {self.job} were lost with {self.request.node} and cannot be rebuilt: {why}"
        log.warning("%s", sentence)
        if self.stop_store is not None:
            self.stop_store()
        kill = P.Signal(signum=int(signal.SIGKILL))
        for d in self.started:  # (by the job's identity: another user's rank of the job's name there lives on)
            try:
                self.ask(self.request.spare, self.job, d, kill, self.timeout, self.asking.key)
            except AgentError as e:
                log.warning("rank %d's new process on %s could not be ended: %s", d, self.request.spare, e)
        survivors = [r for r in range(len(agents)) if r not in self.lost]

        def end(r: int) -> P.End:  # (one held, or stalled that long, breaks off; one restarted is parked)
            return P.End(why=sentence, grace=0.0 if r in self.restarted else self.request.grace)

        told = self.asking.end(agents, sentence, self.timeout, end, survivors, self.request.grace + self.timeout)
        for r, answer in told.items():
            if isinstance(answer, AgentError) or not answer.ok:
                log.warning("rank %d of job %s was not told it ends: %s", r, self.job, answer)


def recover(
    job: str, rank: int, request: P.Recover, ask: Ask, here: str, leaving: Leaving, kept: Path | None = None
) -> P.Recovered:
    """(The ``recover`` call.)  The job rebuilt, or Refused with why (its ranks told to end)."""
    try:
        return Recovery(job, rank, request, ask, here, leaving, kept).run()
    except Failed as e:
        raise Refused(f"job {job} cannot be rebuilt: {e}", Why.PRECONDITION) from e
