"""The orchestrator itself: what the agents report, the taints, and the loop that turns the
policy's plan into moves (each written down before it is asked of its source agent).

After a restart it knows the taints, moves and ranks away from home from its database, and the
nodes again from their next reports.  A move that was running when it stopped (or whose call to
its source agent broke) is *settled* from the agents' reports: once both nodes reported after
the settling began, the ranks on the target alone make it done; on the source alone, with no
migration of the job under way there, failed (the source agent rolled it back, or never began
it), and the policy plans it again.  The agents stay the authority: nothing here ever ends a
process.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import threading
import time
from collections.abc import Callable

from prometheus_client import Counter, Gauge, Histogram

from tpagent import __version__
from tpagent.common.credentials import Credentials
from tpagent.orchestrator import lost, mover, policy
from tpagent.orchestrator.api import (
    Move,
    MoveKind,
    MoveState,
    NodeSeen,
    Refused,
    Taint,
    TaintKind,
    View,
    Why,
    job_name,
    printable,
)
from tpagent.orchestrator.config import OrchestratorConfig
from tpagent.orchestrator.kubernetes import Kubernetes
from tpagent.orchestrator.scheduler import Scheduler, SchedulerError, Static, Wanted
from tpagent.orchestrator.slurm import Slurm
from tpagent.orchestrator.state import State

log = logging.getLogger(__name__)

TAINTS = Gauge("tpagent_orchestrator_taints", "Taints in force, by kind.", ["kind"])
SPARES = Gauge("tpagent_orchestrator_spares_free", "Spare nodes (or nodes with free GPUs) no move holds.")
MOVES = Counter("tpagent_orchestrator_moves", "Moves ended, by kind and outcome.", ["kind", "outcome"])
RESUMED = Histogram(
    "tpagent_orchestrator_taint_to_resumed_seconds",
    "From a taint to its ranks' job running again on the spare.",
    buckets=(1, 2.5, 5, 10, 20, 30, 60, 120, 300, 600, 1800),
)
#: Text of a taint's reason, a node's or GPU's name: at most this long.
NAME_MAX = 256
REASON_MAX = 1000
#: Reports a node must send after a move there ended before it is planned on again: the first may
#: have been made before the end, the second was made after the first was answered.
FRESH_AFTER = 2
#: The scheduler is brought in step this often (:meth:`Orchestrator.keep_in_step`) ...
IN_STEP_EVERY = 2.0
#: ... and no move starts for this long after it did not answer a hold.
SCHEDULER_BACKOFF = 10.0
#: The setting ``scheduler``'s adapters (any other: :class:`Static`).
SCHEDULERS: dict[str, Callable[[OrchestratorConfig], Scheduler]] = {"slurm": Slurm, "kubernetes": Kubernetes}


class Orchestrator:
    def __init__(
        self, cfg: OrchestratorConfig, state: State, creds: Credentials, scheduler: Scheduler | None = None
    ) -> None:
        self.cfg = cfg
        self.state = state
        self.creds = creds
        self.scheduler = scheduler or SCHEDULERS.get(cfg.scheduler, Static)(cfg)
        self.scheduler_down = ""  # why the scheduler did not answer last ("": it did)
        self.backoff_until = 0.0  # (monotonic) no move starts before
        self.lock = threading.Lock()
        self.nodes: dict[str, NodeSeen] = {}  # (from reports since this orchestrator started)
        self.unreachable: set[str] = set()
        self.unlost: set[str] = set()  # unreachable nodes whose ranks ran on then: not yet acted on
        self.ended: dict[str, int] = {}  # node -> its reports when a move touching it last ended
        self.held: dict[str, str] = {}  # job -> the spare its rebuild under way holds
        self.heard = False  # (see _heard)
        self.choosing = threading.Lock()  # (a rebuild's spare chosen and held at once)
        self.running: dict[int, threading.Thread] = {}
        #: Moves whose outcome the reports will tell: since when, and each node's reports then.
        self.settling: dict[int, tuple[float, dict[str, int]]] = {
            m.id: (time.monotonic(), {}) for m in state.moves(active=True) if m.state is MoveState.RUNNING
        }
        self.no_spare = False  # (warned once, as the last spare goes)
        self.started = time.monotonic()
        self.wake = threading.Event()
        self.stop = threading.Event()
        self.lost_nodes = lost.LostNodes(cfg, creds, self.event, self._spare_for, self._spare_done)
        for mid in self.settling:
            self.event("settling", f"move {mid} was running when the orchestrator stopped: settling it", move=mid)

    def event(
        self, kind: str, text: str, job: str = "", node: str = "", move: int = 0, level: int = logging.INFO
    ) -> None:
        """Written down (``tpagent events``) and logged, naming the job, node, move and its ranks."""
        self.state.event(kind, text, job, node, move)
        extra: dict[str, object] = {k: v for k, v in (("job", job), ("node", node), ("move", move)) if v}
        if move:
            extra["rank"] = ",".join(map(str, self.state.move(move).ranks))
        log.log(level, "%s", text, extra=extra)

    # ---- what comes in -------------------------------------------------------------------

    def report(self, seen: NodeSeen, version: str) -> None:
        if version != __version__:
            raise Refused(
                f"the agent on {seen.name} is tpagent {version or '(unknown)'} and this orchestrator {__version__}: "
                "run one version across the cluster.",
                Why.PRECONDITION,
            )
        with self.lock:
            before = self.nodes.get(seen.name)
            if before is not None and before.agent != seen.agent and seen.name not in self.unreachable:
                raise Refused(
                    f"node {seen.name} reports from {before.agent}; a report naming it from {seen.agent} is refused "
                    "while it does (two agents with one node name?).",
                    Why.PRECONDITION,
                )
            reports = before.reports + 1 if before else 1
            self.nodes[seen.name] = dataclasses.replace(policy.kept_gpus(seen, before), reports=reports)
            back = seen.name in self.unreachable
            self.unreachable.discard(seen.name)
            self.unlost.discard(seen.name)
        self.lost_nodes.steps.note(seen)
        if before is None or before.gpus != seen.gpus or before.agent != seen.agent:
            self.state.node_seen(seen.name, seen.agent, seen.gpus)
        if before is None or back:
            self.event("node", f"{seen.name} reports ({seen.agent}, {len(seen.gpus)} GPU(s))", node=seen.name)
        if seen.died and seen.name not in self.unreachable:
            self.lost_nodes.died(self.view(), seen.name, self._moving, self.cfg.lost_grace > 0)
        if any(r.broke for r in seen.ranks) and self.cfg.lost_grace > 0:
            self.lost_nodes.broke(self.view(), seen.name, self._declare)
        for f in seen.findings:
            t = self.state.taint(seen.name, f.gpu, TaintKind.PREEMPTIVE, f.reading, f"health:{f.what}")
            if t is not None:
                self.event("taint", f"{seen.name} GPU {f.gpu} tainted by its health: {f.reading}", node=seen.name)
        self.wake.set()

    def check(self, node: str, gpu: str) -> None:
        known = self.state.known()
        if node not in known:
            names = ", ".join(sorted(known)[:20]) or "none yet"
            raise Refused(f"no node {node!r} has reported to this orchestrator (known: {names}).", Why.NOT_FOUND)
        if gpu and gpu not in known[node] and not any(t.node == node and t.gpu == gpu for t in self.state.taints()):
            raise Refused(
                f"node {node} has no GPU {gpu!r} (it has: {', '.join(known[node]) or 'none'}).", Why.NOT_FOUND
            )

    def taint(
        self, node: str, gpu: str, reason: str, kind: TaintKind = TaintKind.PLANNED, source: str = "operator"
    ) -> Taint:
        if not reason.strip() or len(reason) > REASON_MAX or len(node) > NAME_MAX or len(gpu) > NAME_MAX:
            raise Refused(f"give a reason of 1 to {REASON_MAX} characters (--reason) and a node's name.")
        if printable(reason, REASON_MAX) != reason:
            raise Refused("give a reason of printable characters only (no newline, no escape sequence).")
        self.check(node, gpu)
        t = self.state.taint(node, gpu, kind, reason.strip(), source)
        what = f"{node} GPU {gpu}" if gpu else node
        if t is None:
            raise Refused(
                f"{what} is tainted already ({source}); untaint it first to give another reason.", Why.PRECONDITION
            )
        self.event("taint", f"{what} tainted ({kind.value}, {source}): {t.reason}", node=node)
        self.wake.set()
        return t

    def untaint(self, node: str, gpu: str, source: str | None = None) -> list[Taint]:
        self.check(node, gpu)
        gone = self.state.untaint(node, gpu, source)
        what = f"{node} GPU {gpu}" if gpu else node
        others = sorted({t.gpu for t in self.state.taints() if t.node == node and t.gpu})
        if not gone and not gpu and others:
            raise Refused(f"{node} is not tainted, its GPU(s) {', '.join(others)} are: untaint each with --gpu.")
        if not gone:
            raise Refused(f"{what} is not tainted{f' by {source}' if source else ''}.", Why.PRECONDITION)
        for t in gone:
            self.event("untaint", f"{what} untainted ({t.source}: {t.reason})", node=node)
        self.wake.set()
        return gone

    def view(self) -> View:
        heard = self._heard()
        with self.lock:
            stale = {
                n
                for n, at in self.ended.items()
                if n in self.nodes and n not in self.unreachable and self.nodes[n].reports < at + FRESH_AFTER
            }
            spares = frozenset(self.held.values())
            return View(
                dict(self.nodes), frozenset(self.unreachable), frozenset(stale), spares, heard, frozenset(self.held)
            )

    def _reports(self, *nodes: str) -> dict[str, int]:
        with self.lock:
            return {n: self.nodes[n].reports if n in self.nodes else 0 for n in nodes}

    # ---- the loop ------------------------------------------------------------------------

    def run(self) -> None:
        while not self.stop.is_set():
            try:
                self.tick()
            except Exception:  # a bug must not stop the loop unseen; the database has the state
                log.exception("the orchestrator's loop failed; trying again")
            self.wake.wait(1.0)
            self.wake.clear()

    def tick(self) -> None:
        if self.state.legacy and self._heard():  # (rows from before identities: once every node could say its jobs)
            for name, key in self.state.adopt(r.job for n in self.view().nodes.values() for r in n.ranks):
                self.event("adopted", f"job {name}: its moves and ranks away from before identities are its own", key)
        self._reachability()
        self._settle()
        taints = self.state.taints()
        moves = self.state.moves(active=True)
        view = self.view()
        for a, on in policy.followed(view, moves, self.state.away()):
            self.state.follow(a, on)
            text = f"job {job_name(a.job)} rank {a.rank} runs on {on}, not {a.on}: moved outside the orchestrator"
            self.event("followed", text + (" (home)" if on == a.home else ""), a.job, on)
        users = view.users()
        pools = functools.cache(lambda job: self.scheduler.pool(job, users.get(job, frozenset())))
        p = policy.plan(view, taints, moves, self.state.away(), self.state.failed, self.cfg, pools)
        # (no new move until the nodes a move just ended on report what came after, nor, after a start,
        # until every node known reported or could have: the spare first chosen is not the first to report)
        if view.stale or not view.heard:
            p.moves.clear()
        for mid, why in p.cancels:
            gone = self.state.end(mid, MoveState.CANCELLED, why)
            self.event(
                "cancelled", f"move {mid} of job {job_name(gone.job)} cancelled: {why}", gone.job, gone.source, mid
            )
        for tid, why in p.waiting.items():
            if self.state.waiting(tid, why) and why:
                self.event("waiting", f"taint {tid}: nothing moves: {why}")
        for n in p.moves:
            m = self.state.plan(n.job, n.ranks, n.source, n.target, n.kind, n.taint, n.attempt)
            if m is not None:
                ranks = ", ".join(map(str, m.ranks))
                text = f"move {m.id}: job {job_name(m.job)} rank(s) {ranks} {m.source} -> {m.target}"
                text += f" ({m.kind.value}, try {m.attempt})"
                self.event("planned", text, m.job, m.source, m.id)
        away = sum(n.kind is MoveKind.AWAY for n in p.moves)
        self._gauges(taints, len(p.spares) - away, self._heard() and bool(view.nodes))
        self._start(pools("").dedicated)

    def _heard(self) -> bool:
        """Whether every node known has reported since this start, or could have (once so, always)."""
        if not self.heard:
            with self.lock:
                seen = set(self.nodes)
            self.heard = time.monotonic() - self.started > self.cfg.unreachable_after or set(self.state.known()) <= seen
        return self.heard

    def _gauges(self, taints: list[Taint], free: int, known: bool) -> None:
        for kind in TaintKind:
            TAINTS.labels(kind.value).set(sum(t.kind is kind for t in taints))
        SPARES.set(max(free, 0))
        if free <= 0 and not self.no_spare and known:
            self.event("spares", "no spare is left: a new taint's ranks cannot move", level=logging.WARNING)
        self.no_spare = free <= 0 and known

    def _reachability(self) -> None:
        now = time.monotonic()
        with self.lock:
            silence = {n: now - s.seen for n, s in self.nodes.items() if n not in self.unreachable}
        for n in sorted(n for n, s in silence.items() if s > self.cfg.unreachable_after):
            got = self.lost_nodes.running(self.view(), n)  # (its ranks run: the network failed, not they)
            said = f", but {got[0]}: its ranks are taken as running, not lost" if got else ""
            self._declare(n, f"has not reported for {self.cfg.unreachable_after:g} s{said}", lose=got is None)
        with self.lock:
            unlost = sorted(self.unlost & self.unreachable)
        for n in unlost:
            if self.lost_nodes.running(self.view(), n) is None:
                with self.lock:
                    if n not in self.unlost or n not in self.unreachable:  # (it reported meanwhile)
                        continue
                    self.unlost.discard(n)
                self.event("unreachable", f"{n}: its jobs stand still now: its ranks are taken as lost", node=n)
                if self.cfg.lost_grace > 0:
                    self._lost(n)
        with self.lock:
            lost = frozenset(self.unreachable)
        for n, jobs in self.lost_nodes.later(lost):  # (jobs that were being moved: their moves may have ended)
            self._lost(n, jobs)
        after = max(self.cfg.quiet_after, 2 * self.cfg.report_period)  # (one late report is no silence)
        quiet = sorted(n for n, s in silence.items() if after < s <= self.cfg.unreachable_after)
        if quiet and self.cfg.quiet_after and self.cfg.lost_grace > 0:
            self.lost_nodes.quiet(self.view(), quiet, self._declare)

    def _declare(self, node: str, why: str, lose: bool = True) -> None:
        """``node`` taken as unreachable (``why``, a clause), once until it reports again; its ranks
        as lost unless not ``lose`` (then once its jobs stand still: :meth:`_reachability`)."""
        with self.lock:
            if node in self.unreachable or node not in self.nodes:
                return
            self.unreachable.add(node)
            if not lose:
                self.unlost.add(node)
        self.event("unreachable", f"{node} {why}: unreachable", node=node)
        if lose and self.cfg.lost_grace > 0:
            self._lost(node)

    def _lost(self, node: str, only: frozenset[str] | None = None) -> None:
        """``node`` is unreachable: its jobs (of ``only``, where given) rebuilt, or their other
        ranks told (:mod:`.lost`); a job a move is under way of, once the move has ended."""
        self.lost_nodes.lost(self.view(), node, self._moving, only)

    def _moving(self, job: str) -> bool:  # (a move of it under way: the orchestrator's, or tpagent migrate's)
        return any(m.job == job for m in self.state.moves(active=True)) or job in self.view().busy()

    def _spare_for(self, job: str, lost: str, ranks: tuple[int, ...]) -> tuple[str, str] | None:
        """A node no rank uses for ``job``'s ranks lost with ``lost`` (its name, agent: their commands start
        there as their replicas'), chosen as a move's spare is, held until :meth:`_spare_done`; None if none."""
        with self.choosing:
            view = self.view()
            source = view.nodes.get(lost)
            if source is None:
                return None
            source = dataclasses.replace(source, ranks=(*source.ranks, *source.died))  # (GPUs like a died one's)
            pool = self.scheduler.pool(job, view.users().get(job, frozenset()))
            active = [m for m in self.state.moves(active=True) if m.state in (MoveState.PLANNED, MoveState.RUNNING)]
            free = policy.spares(view, self.state.taints(), active, self.state.away(), self.cfg, pool.dedicated)
            spare, _why = policy.choose(view, source, job, ranks, [s for s in free if s.empty], set(), pool)
            if spare is None:
                return None
            with self.lock:
                self.held[job] = spare.node
            return spare.node, view.nodes[spare.node].agent

    def _spare_done(self, job: str, node: str) -> None:
        """The rebuild of ``job`` on ``node`` ended: the spare is let go, nothing decided there till it reports."""
        with self.lock:
            if self.held.get(job) == node:
                del self.held[job]
                self.ended[node] = self.nodes[node].reports if node in self.nodes else 0

    def _start(self, dedicated: dict[str, frozenset[str]]) -> None:
        """The planned moves started, up to ``max_parallel`` running; ``dedicated``: the spares the
        plan reserved (node -> its GPUs reserved, empty: all), whose GPUs alone a move onto them names."""
        active = self.state.moves(active=True)
        slots = self.cfg.max_parallel - sum(m.state is MoveState.RUNNING for m in active)
        if time.monotonic() < self.backoff_until or self.scheduler_down:  # (said: "no move starts until it answers")
            return
        with self.choosing:  # (a rebuild's spare, held since the plan, is not started onto: the next plan cancels it)
            view = self.view()
            taints = self.state.taints()
            for m in active:
                if slots <= 0:
                    break
                if m.state is not MoveState.PLANNED or m.target in view.held:
                    continue
                gpus = policy.target_gpus(view, taints, dedicated, m)
                if not (view.reachable(m.source) and view.reachable(m.target)) or gpus is None:
                    continue  # (too few GPUs left there: the next plan cancels it)
                if not self.state.start(m.id):
                    continue
                slots -= 1
                agents = (view.nodes[m.source].agent, view.nodes[m.target].agent)
                t = threading.Thread(target=self._execute, args=(m, *agents, gpus), name=f"move-{m.id}", daemon=True)
                with self.lock:
                    self.running[m.id] = t
                t.start()

    def _execute(self, m: Move, source: str, target: str, gpus: tuple[str, ...]) -> None:
        out = mover.Outcome(None, "the orchestrator failed while it ran")
        try:
            text = f"move {m.id}: asking {m.source} to move job {job_name(m.job)} to {m.target}"
            self.event("moving", text, m.job, m.source, m.id)
            out = mover.run(
                m,
                source,
                target,
                self.creds,
                self.cfg.move_timeout,
                gpus,
                lambda mid: self.state.migration(m.id, mid),
                lambda: self._held(m),  # (after its dry run: nothing held, nor requeued, for a move that cannot be)
            )
            if out.state is not None:
                self._ended(m, out.state, out.message, out.timings)
        except Exception:  # the move is settled from the reports, as one whose call broke
            log.exception("move %d: the orchestrator failed while it ran", m.id)
            out = mover.Outcome(None, "the orchestrator failed while it ran")
        finally:
            with self.lock:
                self.running.pop(m.id, None)
                if out.state is None:
                    self.settling[m.id] = (time.monotonic(), {})
            self.wake.set()
        if out.state is None:
            self.event("settling", f"move {m.id}: {out.message}; settling it from the reports", m.job, m.source, m.id)

    def _held(self, m: Move) -> mover.Outcome | None:
        """None once the scheduler holds ``m``'s target for it; else how ``m`` ends, and why."""
        view = self.view()
        source = view.nodes.get(m.source)
        ranks = source.ranks if source is not None else ()
        gpus = len(policy.gpus_used(ranks, m.job, m.ranks))
        t0 = time.monotonic()
        try:
            held = self.scheduler.hold(m, gpus, view.users().get(m.job, frozenset()))
        except SchedulerError as e:
            if e.down:  # (not the spare's doing: planned again once the scheduler answers)
                self.backoff_until = time.monotonic() + SCHEDULER_BACKOFF
                return mover.Outcome(
                    MoveState.CANCELLED, f"{e} It is planned again once {self.scheduler.name} answers."
                )
            return mover.Outcome(MoveState.FAILED, str(e))
        for text in held.said:
            self.event("scheduler", text, m.job, m.target, m.id)
        if held.handle:
            text = f"move {m.id}: {m.target} held for job {job_name(m.job)} by {self.scheduler.name} job {held.handle}"
            text += f" ({time.monotonic() - t0:.2f} s)"
            self.event("held", text, m.job, m.target, m.id)
        return None

    def wanted(self) -> Wanted:
        """What the scheduler must be in step with: taints drained, holds where ranks are away
        or moves go, each job's record of where its ranks run."""
        drains: dict[str, str] = {}
        for t in self.state.taints():
            drains.setdefault(t.node, (f"GPU {t.gpu}: " if t.gpu else "") + t.reason)
        # (moves before the ranks away: a move that ends between the two reads is in both, not neither)
        moving = frozenset((m.job, m.target) for m in self.state.moves(active=True))
        away = self.state.away()
        where: dict[str, dict[int, str]] = {}
        for a in away:
            where.setdefault(a.job, {})[a.rank] = a.on
        view = self.view()
        runs = frozenset((r.job, name) for name, n in view.nodes.items() if view.reachable(name) for r in n.ranks)
        return Wanted(drains, frozenset((a.job, a.on) for a in away), moving, where, view.users(), runs)

    def keep_in_step(self) -> None:
        """Bring the scheduler in step every :data:`IN_STEP_EVERY` seconds until stopped."""
        while not self.stop.wait(IN_STEP_EVERY):
            if not self._heard():  # (just after a start: which jobs run is not known yet)
                continue
            try:
                said = self.scheduler.reconcile(self.wanted)
            except SchedulerError as e:
                if not self.scheduler_down:
                    self.event("scheduler", f"{e} No move starts until it answers.", level=logging.WARNING)
                self.scheduler_down = str(e)
                continue
            except Exception:  # (as the loop: a bug must not stop it unseen)
                log.exception("bringing %s in step failed; trying again", self.scheduler.name)
                continue
            if self.scheduler_down:
                self.event("scheduler", f"{self.scheduler.name} answers again")
            self.scheduler_down = ""
            for text in said:
                self.event("scheduler", text)

    def _ended(self, m: Move, state: MoveState, message: str, timings: dict[str, float] | None = None) -> None:
        with self.lock:  # (first: the loop must not plan on these nodes' reports from before the end)
            self.ended.update({n: self.nodes[n].reports if n in self.nodes else 0 for n in (m.source, m.target)})
        m = self.state.end(m.id, state, message, timings)
        MOVES.labels(m.kind.value, state.value).inc()
        where = m.target if state is MoveState.DONE else m.source
        text = f"move {m.id} {state.value}: job {job_name(m.job)} rank(s) {', '.join(map(str, m.ranks))} run on {where}"
        self.event(state.value, f"{text}: {message}" if message else text, m.job, where, m.id)
        taint = self.state.taint_by_id(m.taint) if m.taint else None
        if state is MoveState.DONE and m.kind is MoveKind.AWAY and taint is not None and m.ended is not None:
            RESUMED.observe(m.ended - taint.created)

    def _settle(self) -> None:
        """End each settling move as the agents' reports, made after it stopped, show it."""
        view = self.view()
        with self.lock:
            settling = dict(self.settling)
        for mid, (since, then) in settling.items():
            m = self.state.move(mid)
            if not then:
                then = self._reports(m.source, m.target)
                with self.lock:
                    self.settling[mid] = (since, then)
            now = self._reports(m.source, m.target)
            fresh = {n for n in (m.source, m.target) if now[n] >= then[n] + FRESH_AFTER}
            outcome = mover.outcome_of(m, view, fresh)
            if outcome is None and time.monotonic() - since > self.cfg.move_timeout:
                outcome = (MoveState.INTERRUPTED, f"not settled in {self.cfg.move_timeout:g} s: its nodes say nothing")
            if outcome is None:
                continue
            with self.lock:
                self.settling.pop(mid, None)
            self._ended(m, *outcome)
