"""A node lost without a word (issue 27, item 3), as the orchestrator acts on it: it stopped
reporting, and the ranks of its jobs there are taken as gone (their peers would otherwise wait in
their next collective for its timeout, every GPU of the job idle).  It is looked for before its
silence has lasted ``unreachable_after``: a rank whose collective fails says so to its agent,
which reports at once, and each other node of that job whose agent does not answer then is
taken as unreachable (:meth:`LostNodes.broke`); and a node running ranks that has missed its
reports for ``quiet_after`` (a power loss, a panic: no peer of it saw a connection reset) is
taken as unreachable if its host takes no connection (:meth:`LostNodes.quiet`).  Neither it nor a
node silent for ``unreachable_after`` is taken as lost while a job of its ranks goes on without
it (:class:`Steps`): its ranks run, whatever the network says of the node (its agent down behind
a firewall that drops what it would refuse, the orchestrator cut off from it alone).

* A job whose ranks registered their training state is rebuilt (``recover_lost``): one agent of
  its surviving ranks is asked to rebuild the lost ranks on a free spare from their data-parallel
  replicas (:class:`~tpagent_rank.protocol.Recover`, :mod:`tpagent.jobs.recovery`); the job goes
  on from its last step boundary.  Nodes lost together are rebuilt together: the rebuild takes
  every rank whose agent does not answer, and a node found lost while a rebuild of its job runs
  is left to that rebuild.  Its launcher lost the lost ranks with their node, so their
  ends are written down here: each rebuilt rank's exit status (event ``ended``) once it exits.
* Where it is not (nothing registered, no replica of a lost rank survives, no spare is free, the
  rebuild fails), the agents running its other ranks tell them (:class:`~tpagent_rank.protocol.Lost`),
  and each that makes no progress for ``lost_grace`` breaks off the collective it waits in and
  ends with one sentence: the job ends at once, and its launcher can restart it from its
  checkpoint.  A job that runs on (the node is cut off from us, not from its peers) is left alone
  by its ranks.
* A rank that died alone, its node's agent alive (killed by a signal: a crash, the OOM killer),
  is rebuilt the same way: its agent holds its end from its stand-in and reports it
  (:meth:`LostNodes.died`); once it is rebuilt, its agent says where
  (:class:`~tpagent_rank.protocol.Rebuilt`) and its stand-in follows it there, so that its
  launcher sees it end as its script does; where it is not, its end stands.  Where lost ranks are
  left to their jobs (``lost_grace`` 0), its end is passed on at once (event ``died``).
"""

from __future__ import annotations

import logging
import socket
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Protocol

import grpc

from host.api import unbracketed
from tpagent.common.credentials import Credentials
from tpagent.daemon import rankwire
from tpagent.daemon.client import rpc_text
from tpagent.daemon.rpc import pb, stub
from tpagent.migration.api import Refused
from tpagent.orchestrator.api import RankSeen, View, job_identity, job_name
from tpagent.orchestrator.config import OrchestratorConfig
from tpagent.orchestrator.steps import Steps
from tpagent_rank import lines
from tpagent_rank import protocol as P

log = logging.getLogger(__name__)


class Event(Protocol):
    """An event written down (the orchestrator's)."""

    def __call__(
        self, kind: str, text: str, job: str = "", node: str = "", move: int = 0, level: int = logging.INFO
    ) -> None: ...


#: A node taken as unreachable, and why (a clause): the orchestrator's.
Declare = Callable[[str, str], None]
#: A free spare for a job's ranks lost with a node (not that node): its name and its agent; or None.
SpareFor = Callable[[str, str, tuple[int, ...]], "tuple[str, str] | None"]
#: The longest a rebuild may take, its fresh processes' warm-up included.
RECOVER_TIMEOUT = 900.0
#: How long a rank that died is not rebuilt again once its rebuild ended (its agent's reports may
#: still name it for a moment).
SETTLED = 60.0
#: How long an agent is given to answer, twice, when ranks of its job elsewhere saw a collective
#: fail (and a quiet node's host to take a connection): one that is alive but busy (its node's
#: CPUs all taken, its Python threads waiting their turn) answers well within it.
PROBE = 5.0
#: A job's nodes are looked for so at most this often.
PROBE_EVERY = 10.0
#: Agents asked at once.
PROBES = 32
#: How many times an agent is told how a rebuild goes, or that a node is lost, while its answer
#: says the call was not heard (:data:`UNHEARD`).
SAY_TRIES = 4
#: What a call ends with when the agent did not act on it: not reached, or too busy to take it.
UNHEARD = frozenset({grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.RESOURCE_EXHAUSTED})
#: How often a rebuilt rank's agent is asked whether it has ended.
FOLLOW_PERIOD = 2.0
#: How long a rebuilt rank's agent may not answer before its end is given up on.
FOLLOW_LOST = 600.0


class LostNodes:
    def __init__(
        self,
        cfg: OrchestratorConfig,
        creds: Credentials,
        event: Event,
        spare_for: SpareFor,
        spare_done: Callable[[str, str], None] = lambda job, spare: None,
    ) -> None:
        self.cfg = cfg
        self.creds = creds
        self.event = event
        self.spare_for = spare_for  # (which holds the spare it gives for the job's rebuild...)
        self.spare_done = spare_done  # (... until this is told the rebuild ended)
        self.lock = threading.Lock()
        self.rebuilding: dict[str, set[int]] = {}  # job -> ranks found lost since its rebuild began
        self.settled: dict[tuple[str, int, str], float] = {}  # (job, rank, node) died there: when its rebuild ended
        self.probed: dict[str, float] = {}  # job -> when its nodes were last looked for (broke)
        self.asked: dict[str, float] = {}  # node -> when its host was last asked, as it was quiet
        self.moved: dict[str, frozenset[str]] = {}  # lost node -> its jobs a move was under way of
        #: The longest a job is watched for two of its steps (a slower job's silent node is lost
        #: once silent that long) and how long the steps of its ranks are kept for it.
        self.window = 4 * cfg.unreachable_after
        self.steps = Steps(self.window + 2 * cfg.report_period)

    def running(self, view: View, node: str) -> tuple[str, float] | None:
        """Why ``node``'s ranks are taken as running though it is silent, and when to look again:
        a job of them went on without it since its ranks could last have run (a report period
        after its last report), or too few of a job's steps have passed since then to tell (two,
        at its pace before, as its ranks say them and the reports carry them).  None once every
        job of them has stood still that long: a job that stops stops with its ranks (the window
        slides, no longer than ``unreachable_after`` or two of its steps)."""
        silent = view.nodes[node]
        last = silent.seen + self.cfg.report_period
        now = time.monotonic()
        early: tuple[str, float] | None = None
        for job in sorted({r.job for r in silent.ranks}):
            others = _others(view, node, job)
            pace = self.steps.pace(job, others, last) or 0.0
            span = min(2 * max(pace, lines.STEPPED_EVERY) + 2 * self.cfg.report_period, self.window)
            went = self.steps.went_on(job, others, max(last, now - max(span, self.cfg.unreachable_after)))
            if went is not None:
                return went, now + PROBE_EVERY
            if now < last + span and early is None:
                early = f"job {job_name(job)} steps every {pace:.1f} s: too few of its steps have passed", last + span
        return early

    def lost(self, view: View, node: str, moving: Callable[[str], bool], only: frozenset[str] | None = None) -> None:
        """``node`` is unreachable: each job of it (of ``only``, where given) rebuilt, or its other
        ranks told (see the module).  The jobs a move is under way of are left for now (its
        agents decide: it may save the job): :meth:`later` names them again."""
        lost = view.nodes[node]
        later = set()
        jobs = {r.job for r in lost.ranks}
        for job in sorted(jobs if only is None else jobs & only):
            ranks = tuple(sorted(r.rank for r in lost.ranks if r.job == job and not _elsewhere(view, node, r)))
            users = tuple(sorted({u for r in lost.ranks if r.job == job for u in r.users}))
            tell = P.Lost(lost.agent, self._why(node), self.cfg.lost_grace, users, identity=job_identity(job))
            if ranks and moving(job):
                later.add(job)
            elif ranks:
                self._recover(view, node, job, ranks, tell)
        with self.lock:
            self.moved[node] = frozenset(later)

    def later(self, unreachable: frozenset[str]) -> list[tuple[str, frozenset[str]]]:
        """The jobs of nodes still ``unreachable`` that :meth:`lost` left for their moves."""
        with self.lock:
            self.moved = {n: jobs for n, jobs in self.moved.items() if jobs and n in unreachable}
            return sorted(self.moved.items())

    def died(self, view: View, node: str, moving: Callable[[str], bool], rebuild: bool = True) -> None:
        """Ranks died on ``node`` by a signal, its agent holding their ends from their stand-ins
        (it reports them): each job of them rebuilt as a lost node's is, and that agent told how it
        went (:class:`~tpagent_rank.protocol.Rebuilt`: their stand-ins follow them); a job a move is
        under way of, once it has ended (its agent says them again in each report).  Not
        ``rebuild`` (``lost_grace`` 0: lost ranks are left to their jobs), their ends are let go at once."""
        seen = view.nodes[node]
        now = time.monotonic()
        with self.lock:  # (a report made before its agent heard how its rebuild went says them again)
            fresh = [r for r in seen.died if now - self.settled.get((r.job, r.rank, node), -SETTLED) >= SETTLED]
        for job in sorted({r.job for r in fresh}):
            ranks = tuple(sorted(r.rank for r in fresh if r.job == job))
            why = f"rank(s) {_listed(ranks)} of the job died on {node}, killed by a signal"
            # (told to the ranks of its users alone: another user's job of that name is not theirs)
            users = tuple(sorted({u for r in fresh if r.job == job for u in r.users}))
            tell = P.Lost(seen.agent, why, self.cfg.lost_grace, users, died=True, identity=job_identity(job))
            if rebuild and moving(job):
                continue
            if rebuild:
                self._recover(view, node, job, ranks, tell)
            else:
                self._let_go(job, ranks, node, tell.node, "lost ranks are left to their jobs (lost_grace 0)")

    def _let_go(self, job: str, ranks: tuple[int, ...], node: str, agent: str, why: str) -> None:
        """The died ``ranks``' ends given to their stand-ins (by another thread: their agent's
        report waits for none of it), once."""
        with self.lock:
            self.settled.update({(job, r, node): time.monotonic() for r in ranks})
        text = f"job {job_name(job)}: rank(s) {_listed(ranks)} died on {node}, not rebuilt: {why}; "
        text += "their ends are passed on"
        self.event("died", text, job, node, level=logging.WARNING)

        def let_go() -> None:
            for r in ranks:
                self._rebuilt(job, r, agent, P.Rebuilt())

        threading.Thread(target=let_go, name=f"let-go-{job}", daemon=True).start()

    def broke(self, view: View, node: str, declare: Declare) -> None:
        """Ranks on ``node`` said a collective of theirs failed (a peer's process or node is gone):
        each other node of their jobs whose agent does not answer (:data:`PROBE` s, twice) is
        ``declare``d unreachable now, not once its silence has lasted ``unreachable_after``.  (The
        agent that rebuilds its ranks asks it again before it does: it must not answer it either.)"""
        jobs = sorted({r.job for r in view.nodes[node].ranks if r.broke})
        now = time.monotonic()
        with self.lock:
            fresh = [j for j in jobs if now - self.probed.get(j, -PROBE_EVERY) >= PROBE_EVERY]
            self.probed.update(dict.fromkeys(fresh, now))
        for job in fresh:
            args = (view, job, node, declare)
            threading.Thread(target=self._look_for, args=args, name=f"probe-{job}", daemon=True).start()

    def _look_for(self, view: View, job: str, by: str, declare: Declare) -> None:
        nodes = sorted(
            n
            for n, seen in view.nodes.items()
            if n != by and view.reachable(n) and any(r.job == job for r in seen.ranks)
        )
        with ThreadPoolExecutor(max_workers=PROBES, thread_name_prefix="probe") as pool:
            answered = list(pool.map(self._answers, [view.nodes[n].agent for n in nodes]))
        for n in (n for n, ok in zip(nodes, answered, strict=True) if not ok):
            declare(n, f"does not answer ({PROBE:g} s, twice) while ranks of job {job_name(job)} saw a collective fail")

    def quiet(self, view: View, nodes: list[str], declare: Declare) -> None:
        """``nodes`` have missed their reports for ``quiet_after``: each that runs ranks, whose
        host does not answer (:data:`PROBE` s, twice), is ``declare``d unreachable now, not once
        its silence has lasted ``unreachable_after`` (each asked at most every :data:`PROBE_EVERY` s)."""
        now = time.monotonic()
        with self.lock:
            fresh = [n for n in nodes if view.nodes[n].ranks and now - self.asked.get(n, -PROBE_EVERY) >= PROBE_EVERY]
            self.asked.update(dict.fromkeys(fresh, now))
        for n in fresh:
            threading.Thread(target=self._ask, args=(view, n, declare), name=f"ask-{n}", daemon=True).start()

    def _ask(self, view: View, node: str, declare: Declare) -> None:
        """``node`` declared if its host is gone (its agent cannot answer then) and its jobs stand
        still: an agent that is down or stuck on a live host (its ranks may run on) is left to
        ``unreachable_after``, and so is a node of a job that still steps, or that has not stood
        still for two of its steps yet."""
        seen = view.nodes[node]
        silent = time.monotonic() - seen.seen
        if self._runs(view, node, silent):
            return
        if not _host_answers(seen.agent):
            if self._runs(view, node, silent):  # (what was reported meanwhile)
                return
            declare(node, f"has not reported for {silent:.0f} s, and its host does not answer ({PROBE:g} s, twice)")
        else:
            log.info("node %s has not reported for %.0f s, but its host answers: its ranks may run on", node, silent)

    def _runs(self, view: View, node: str, silent: float) -> bool:
        """Whether quiet ``node``'s ranks are taken as running (:meth:`running`): said, and asked
        again once it is worth it."""
        got = self.running(view, node)
        if got is not None:
            log.info(
                "node %s has not reported for %.0f s, but %s: its ranks are taken as running", node, silent, got[0]
            )
            with self.lock:
                self.asked[node] = got[1] - PROBE_EVERY
        return got is not None

    def _answers(self, agent: str) -> bool:
        """Whether the agent at ``agent`` says anything (a refusal too) within :data:`PROBE` s, twice:
        asked of a migration of no id, which it says at once it has not (Info would read its GPUs,
        which may be what hangs)."""
        for _ in range(2):
            try:
                stub(agent, self.creds).Status(pb.MigrationRef(migration_id=""), timeout=PROBE)
                return True
            except grpc.RpcError as e:
                if e.code() not in (grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.UNAVAILABLE):
                    return True
        return False

    def _recover(self, view: View, node: str, job: str, ranks: tuple[int, ...], tell: P.Lost) -> None:
        others = sorted(
            n
            for n, seen in view.nodes.items()
            if (n != node or tell.died) and view.reachable(n) and any(r.job == job for r in seen.ranks)
        )
        if not others:  # (no other rank of it reports: nothing to rebuild from, no one to tell)
            if tell.died:
                self._let_go(job, ranks, node, tell.node, "no other rank of the job reports")
            return
        with self.lock:
            if job in self.rebuilding:  # (that rebuild takes every rank that does not answer)
                self.rebuilding[job].update(ranks)
                return
            self.rebuilding[job] = set()
        agents = [view.nodes[n].agent for n in others]
        spare = self.spare_for(job, node, ranks) if self.cfg.recover_lost else None
        if spare is None:
            with self.lock:
                self.rebuilding.pop(job, None)
            self._tell(job, ranks, node, agents, tell, "no spare is free" if self.cfg.recover_lost else "")
            return
        # (asked of the agent of the lowest surviving rank: a replica there gives its state)
        first = min((r.rank, view.nodes[n].agent) for n in others for r in view.nodes[n].ranks if r.job == job)
        rebuild = P.Recover(tell.node, ranks, spare[1], self.cfg.lost_grace, _agents(view, job), tell.died)
        how = "died on" if tell.died else "lost with"
        text = (
            f"job {job_name(job)}: rank(s) {_listed(ranks)} {how} {node}: rebuilding them on {spare[0]} from replicas"
        )
        self.event("recovering", text, job, node, level=logging.WARNING)
        args = (job, first, rebuild, (node, spare[0]), agents, tell)
        threading.Thread(target=self._rebuilding, args=args, name=f"recover-{job}", daemon=True).start()

    def _rebuilding(
        self, job: str, first: tuple[int, str], rebuild: P.Recover, nodes: tuple[str, str], *rest: Any
    ) -> None:
        """(A thread of its own.)  :meth:`_rebuild`, then its spare let go, whatever came of it."""
        try:
            self._rebuild(job, first, rebuild, nodes, *rest)
        except BaseException:
            with self.lock:
                self.rebuilding.pop(job, None)  # (a failure of ours: the job may be rebuilt again)
            raise
        finally:
            self.spare_done(job, nodes[1])

    def _why(self, node: str) -> str:
        return f"node {node} running rank(s) of the job stopped reporting ({self.cfg.unreachable_after:g} s)"

    def _rebuild(
        self,
        job: str,
        first: tuple[int, str],
        rebuild: P.Recover,
        nodes: tuple[str, str],
        agents: list[str],
        tell: P.Lost,
    ) -> None:
        """(A thread of its own.)  ``nodes``: the lost one and the spare."""
        rank, agent = first
        node, spare = nodes
        t0 = time.monotonic()
        for r in rebuild.ranks if rebuild.died else ():  # (their ends held while it runs)
            self._rebuilt(job, r, rebuild.node, P.Rebuilt(hold=RECOVER_TIMEOUT + 60))
        try:
            reply = stub(agent, self.creds).Rank(
                rankwire.request_pb(job_name(job), rank, rebuild, RECOVER_TIMEOUT), timeout=RECOVER_TIMEOUT + 60
            )
            done = rankwire.answer_of(rebuild, reply)
        except grpc.RpcError as e:
            done = P.Recovered(ok=False, error=rpc_text(e))
        except Refused as e:  # (an answer of another kind: an agent of another version)
            done = P.Recovered(ok=False, error=str(e))
        for r in rebuild.ranks if rebuild.died else ():  # (each rebuilt one's stand-in follows it)
            to = rebuild.spare if done.ok and r in done.ranks else ""
            self._rebuilt(job, r, rebuild.node, P.Rebuilt(to=to))
        with self.lock:
            self.settled.update({(job, r, node): time.monotonic() for r in rebuild.ranks if rebuild.died})
            meanwhile = self.rebuilding.pop(job, set()) - set(done.ranks)
        if done.ok and meanwhile:  # (their agents answered the rebuild: they run on, as far as it saw)
            text = f"job {job_name(job)}: rank(s) {_listed(tuple(sorted(meanwhile)))} were found lost "
            text += "while it was rebuilt, "
            self.event("lost", text + "but answered its rebuild: left as they are", job, level=logging.WARNING)
        if done.ok:
            stages = ", ".join(done.stages)
            text = f"job {job_name(job)} runs on from step {done.step}, rank(s) {_listed(done.ranks)} rebuilt on "
            text += f"{spare} in {time.monotonic() - t0:.1f} s ({stages})"
            text += f"; its store, lost with {node}, is served at {done.store}" if done.store else ""
            text += f"; rank(s) {_listed(done.back)}, at another step, given it from a replica" if done.back else ""
            text += "" if not rebuild.died else "; their stand-ins follow them there"
            self.event("recovered", text, job, node, level=logging.WARNING)
            for r in done.ranks:
                args = (job, r, rebuild.spare)
                threading.Thread(target=self._follow, args=args, name=f"follow-{job}-{r}", daemon=True).start()
            return
        self._tell(job, rebuild.ranks, node, agents, tell, done.error)

    def _rebuilt(self, job: str, rank: int, agent: str, word: P.Rebuilt) -> None:
        """Tell the agent where rank ``rank`` died how its rebuild goes."""
        self._say(agent, job, rank, word)

    def _say(self, agent: str, job: str, rank: int, request: P.Request[P.Answer]) -> None:
        """Ask ``request`` of ``agent`` about rank ``rank`` of ``job``: asked again, :data:`SAY_TRIES`
        times at most, while the agent was not reached or turned the call away unheard (too busy);
        never after a call that may have been heard.  A failure is logged."""
        for tried in range(1, SAY_TRIES + 1):
            try:
                stub(agent, self.creds).Rank(rankwire.request_pb(job_name(job), rank, request, 30.0), timeout=40)
                return
            except grpc.RpcError as e:
                if tried < SAY_TRIES and e.code() in UNHEARD:
                    time.sleep(tried)
                    continue
                said = (agent, request.OP.value, job, rank, rpc_text(e))
                log.warning("the agent at %s was not told %s (job %s, rank %d): %s", *said)
                return

    def _follow(self, job: str, rank: int, agent: str) -> None:
        """Wait for rank ``rank`` of ``job``, rebuilt at ``agent``, to end (following it where it
        moves), and write its exit status down: its launcher, lost with its node, cannot."""
        where = agent
        heard = time.monotonic()
        while True:
            try:
                reply = stub(where, self.creds).Rank(
                    rankwire.request_pb(job_name(job), rank, P.Locate(), 10.0), timeout=20
                )
                loc = rankwire.answer_of(P.Locate(), reply)
                heard = time.monotonic()
            except grpc.RpcError as e:
                if time.monotonic() - heard > FOLLOW_LOST:
                    self.event(
                        "ended",
                        f"rank {rank} of job {job_name(job)} (rebuilt) is not heard of at {where}: {rpc_text(e)}",
                        job,
                    )
                    return
                loc = P.Located(state=P.Whereabouts.HERE.value)
            if loc.state == P.Whereabouts.EXITED.value:
                code = loc.code if loc.code >= 0 else 128 - loc.code
                self.event("ended", f"rank {rank} of job {job_name(job)} (rebuilt) exited with status {code}", job)
                return
            if loc.state == P.Whereabouts.MOVED.value and loc.node:
                where = loc.node
                continue
            if not loc.ok or loc.state == P.Whereabouts.GONE.value:
                why = loc.error or f"its process is gone from {where} without an exit status"
                self.event(
                    "ended", f"rank {rank} of job {job_name(job)} (rebuilt) ended: {why}", job, level=logging.WARNING
                )
                return
            time.sleep(FOLLOW_PERIOD)

    def _tell(self, job: str, ranks: tuple[int, ...], node: str, agents: list[str], tell: P.Lost, why: str) -> None:
        """Every agent of the job's other ranks tells them its node is lost (or its ranks died)."""
        text = f"job {job_name(job)} lost rank(s) {_listed(ranks)} with {node}"
        text = f"job {job_name(job)}: rank(s) {_listed(ranks)} died on {node}" if tell.died else text
        text += f" and cannot be rebuilt ({why.rstrip('.')})" if why else ""
        text += f": its other ranks are told (each stops once it waits {self.cfg.lost_grace:g} s)"
        self.event("lost", text, job, node, level=logging.WARNING)
        for r in ranks if tell.died else ():  # (their stand-ins end as they did)
            self._rebuilt(job, r, tell.node, P.Rebuilt())
        for agent in agents:
            threading.Thread(target=self._say, args=(agent, job, 0, tell), daemon=True).start()


def _host_answers(agent: str) -> bool:
    """Whether the host of the agent at ``agent`` (HOST:PORT) takes or refuses a connection
    within :data:`PROBE` s, twice: its kernel runs (no answer: powered off, panicked, cut off)."""
    host, _, port = agent.rpartition(":")
    for _ in range(2):
        try:
            with socket.create_connection((unbracketed(host), int(port)), timeout=PROBE):
                return True
        except ConnectionRefusedError:
            return True
        except OSError:  # (timed out; no route to it)
            continue
    return False


def _elsewhere(view: View, node: str, rank: RankSeen) -> bool:
    """Whether ``rank`` (as ``node`` last reported it) runs on another node that reports (rebuilt
    already, with another node lost together)."""
    return any(
        n != node and view.reachable(n) and any(r.job == rank.job and r.rank == rank.rank for r in seen.ranks)
        for n, seen in view.nodes.items()
    )


def _others(view: View, node: str, job: str) -> list[int]:
    """The ranks of ``job`` on other nodes than ``node`` that report."""
    return [
        r.rank for n, seen in view.nodes.items() if n != node and view.reachable(n) for r in seen.ranks if r.job == job
    ]


def _agents(view: View, job: str) -> tuple[str, ...]:
    """Each rank of ``job`` -> its agent, as the nodes last reported them ("": none did)."""
    placed = {r.rank: seen.agent for seen in view.nodes.values() for r in seen.ranks if r.job == job}
    world = max([*placed, *(r.world - 1 for seen in view.nodes.values() for r in seen.ranks if r.job == job)]) + 1
    return tuple(placed.get(r, "") for r in range(world))


def _listed(ranks: tuple[int, ...]) -> str:
    return ", ".join(map(str, ranks))
