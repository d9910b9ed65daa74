"""One ``Rank`` call, as the agent answers it: a request of the rank's runtime is passed on to the
rank (:meth:`tpagent.jobs.ranks.Ranks.call`), the others are answered here, by a dispatch over the
rank protocol's ops (:mod:`tpagent_rank.protocol`).  Each request comes decoded and checked by
type and size (:mod:`tpagent_rank.codec`, :mod:`tpagent.daemon.rankwire`); what each means is
checked here (an agent's address, a signal, an output's descriptor and offset)."""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import signal
from collections.abc import Callable
from typing import Any, Protocol, TypeVar, cast

from host import signals
from tpagent.jobs.connection import RankGone
from tpagent.jobs.ranks import NotTheJob, Ranks
from tpagent.migration.api import AgentError, Refused, Why, is_agent_address
from tpagent_rank import protocol as P

log = logging.getLogger(__name__)
A = TypeVar("A", bound=P.Answer)
#: Where an output's offset ends (no file is near it; pread refuses an offset near 2**63).
OFFSET_END = 1 << 62
#: The signals a stand-in passes on to its rank (SIGKILL: its launcher gave up on it).
PASSED_ON = frozenset({signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGKILL})
#: The longest job's key (``RankRequest.job_key``) an agent compares.
KEY_MAX = 128
#: What a stand-in asks of its rank wherever it runs: asked with the job's identity (a user's
#: stand-in's, relayed by the agent where it started the rank), each is of that job's rank alone.
FOLLOWED = frozenset({P.Op.LOCATE, P.Op.SIGNAL, P.Op.OUTPUT})
#: The longest a rank told its job lost a node waits for its collectives before it breaks off.
LOST_GRACE_MAX = 3600.0


def _peer_to_peer(request: P.Request[Any]) -> bool:
    """Whether a save or load names the hand-over from rank to rank (:mod:`tpagent_rank.handover`)
    rather than bytes on the rank's line, which a Rank call cannot carry."""
    if isinstance(request, P.Save):
        return bool(request.listen and request.secret)
    return isinstance(request, P.Load) and bool(request.source and request.secret)


class Rewiring(Protocol):
    def __call__(self, job: str, rank: int | None = None, /) -> bool: ...


class RankCalls:
    """The ``Rank`` calls of this node's agent.  ``rewiring(job, rank=None)``: whether the agent is
    moving ranks of ``job`` (or that rank) now: a rank that ended here is then on its way, not gone."""

    def __init__(
        self,
        ranks: Ranks,
        node: str,
        rewiring: Rewiring,
        answers: Callable[[str], bool] = lambda _agent: False,
        join: Callable[[str, int, P.Join], int] | None = None,
        recover: Callable[[str, int, P.Recover], P.Recovered] | None = None,
    ) -> None:
        self.ranks = ranks
        self.node = node
        self.rewiring = rewiring
        self.answers = answers  # whether the agent at an address answers this one now
        self.join = join  # start a joiner here (:mod:`tpagent.jobs.joiners`): its init's PID
        self.recover = recover  # rebuild a job's lost ranks (:mod:`tpagent.jobs.recovery`)
        self._handlers: dict[P.Op, Callable[[str, int, Any], P.Answer]] = {
            P.Op.EXPECT: self._expect,
            P.Op.MOVED: self._moved,
            P.Op.RELEASE: self._release,
            P.Op.LOCATE: self._locate,
            P.Op.SIGNAL: self._signal,
            P.Op.OUTPUT: self._output,
            P.Op.JOBS: self._jobs,
            P.Op.LOST: self._lost,
            P.Op.JOIN: self._join,
            P.Op.RECOVER: self._recover,
            P.Op.REBUILT: self._rebuilt,
        }

    def __call__(self, job: str, rank: int, request: P.Request[A], timeout: float, key: str = "") -> A:
        """``key``: the job's identity as the asking agent knows it (:meth:`.ranks.Ranks.identity`
        of its own rank); every request but a read (:data:`~tpagent_rank.protocol.ASKED_FREELY`)
        that reaches a rank must name it."""
        if len(key) > KEY_MAX:
            raise Refused(f"a job's key has at most {KEY_MAX} characters.", Why.INVALID)
        if request.OP == P.Op.RELEASE and self.ranks.identity(job, rank) not in ("", key):  # ("": restored here)
            raise Refused(self._not_it(job, rank), Why.CONFLICT)
        if key and request.OP in FOLLOWED and not self.ranks.of_job(job, rank, key):  # (a name another's since)
            raise Refused(self._not_it(job, rank), Why.CONFLICT)
        if request.OP in P.STATE_OPS and not _peer_to_peer(request):
            raise Refused(
                f"{request.OP.value} in a Rank call names where the state goes from rank to rank (listen or "
                "source, and the move's secret): a training state never travels inside a Rank call",
                Why.INVALID,
            )
        if request.OP in P.RUNTIME_OPS | P.STATE_OPS:
            if not key and request.OP not in P.ASKED_FREELY:
                raise Refused(
                    f"asking rank {rank} of job {job} to {request.OP.value} needs the job's identity, which the "
                    "asking agent did not give (is it an older tpagent? every node moving ranks needs this version)",
                    Why.PRECONDITION,
                )
            try:
                answer = self.ranks.call(job, rank, request, timeout, key or None)
            except NotTheJob as e:
                raise Refused(self._not_it(job, rank), Why.CONFLICT) from e
            except RankGone as e:
                raise Refused(str(e), Why.NOT_FOUND) from e
            if isinstance(answer, P.Agents):  # (the identity its agent vouches for, not the rank's word)
                return cast(A, dataclasses.replace(answer, key=self.ranks.identity(job, rank)))
            return answer
        return cast(A, self._handlers[request.OP](job, rank, request))

    def _not_it(self, job: str, rank: int) -> str:
        return (
            f"rank {rank} of job {job} on {self.node} is not the rank asked for: its job is another "
            "(its user, or the job's key and store, differ), so the job's store names the wrong node for it"
        )

    def _expect(self, job: str, rank: int, request: P.Expect) -> P.Answer:
        self.ranks.expect(job, rank, request.pid)
        return P.Answer()

    def _moved(self, job: str, rank: int, request: P.Moved) -> P.Answer:
        if not is_agent_address(request.to):
            raise Refused("moved needs the agent the rank went to.", Why.INVALID)
        self.ranks.moved(job, rank, request.to)
        return P.Answer()

    def _rebuilt(self, job: str, rank: int, request: P.Rebuilt) -> P.Answer:
        if (request.to and not is_agent_address(request.to)) or not 0 <= request.hold <= LOST_GRACE_MAX:
            raise Refused("rebuilt needs the agent the rank was rebuilt at, or a hold of its end.", Why.INVALID)
        self.ranks.rebuilt(job, rank, request.to, request.hold)
        return P.Answer()

    def _release(self, job: str, rank: int, _: P.Release) -> P.Answer:
        self.ranks.release(job, rank)
        return P.Answer()

    def _locate(self, job: str, rank: int, _: P.Locate) -> P.Located:
        where = self.ranks.locate(job, rank)
        if where.state == P.Whereabouts.GONE.value and self.rewiring(job):  # (ended here, not yet known there)
            return dataclasses.replace(where, state=P.Whereabouts.MOVING.value)
        return where

    def _signal(self, job: str, rank: int, request: P.Signal) -> P.Answer:
        if request.signum not in PASSED_ON:
            raise Refused(f"signal {request.signum!r} is not passed on to a rank.", Why.INVALID)
        entry = self.ranks.entry(job, rank)
        if not entry.alive() or entry.moved_to:
            return P.failed(f"rank {rank} of job {job} does not run on {self.node}")
        if request.signum != signal.SIGKILL and self.rewiring(job, rank):  # (frozen, its signals may be taken already)
            return P.failed(
                f"rank {rank} of job {job} is being moved; its stand-in passes the signal on once it is there"
            )
        if request.signum == signal.SIGKILL:
            signals.kill_tree(entry.init, entry.init_start)
        elif not signals.signal_exact(entry.init, entry.init_start, request.signum):  # (its init passes it on)
            return P.failed(f"rank {rank} of job {job} does not run on {self.node}")
        return P.Answer()

    def _output(self, job: str, rank: int, request: P.Output) -> P.Written:
        """What its rank wrote, for a stand-in, wherever the rank runs."""
        if request.fd not in (1, 2) or not 0 <= request.offset < OFFSET_END:
            raise Refused(f"output needs fd 1 or 2 and an offset from 0 below {OFFSET_END}.", Why.INVALID)
        return self.ranks.output(job, rank, request.fd, request.offset, max(1, request.max))

    def _lost(self, job: str, rank: int, request: P.Lost) -> P.Answer:
        """(The orchestrator's.)  A node that ran ranks of ``job`` is lost: each rank of it here
        is told to end, and to break off a collective it has waited in for ``grace`` seconds
        (:class:`~tpagent_rank.protocol.End`).  Answered at once; the ranks are told meanwhile."""
        why = self._not_lost(job, request)
        if why:
            return P.failed(why)
        users = set(request.users) or {0}  # (of the job's ranks that were there; none: root's)
        digests = self.ranks.digests()  # (another job of that name, even of those users, is not told)
        told = [
            r.rank
            for r in self.ranks.jobs()
            if r.job == job
            and r.connected
            and not r.moved_to
            and self.ranks.entry(job, r.rank).uid in users
            and request.identity in ("", digests.get((job, r.rank)))
        ]
        end = P.End(why=f"{request.why} (the node of agent {request.node})", grace=request.grace)
        for r in told:
            self.ranks.threads.spawn("lost", f"lost-{job}-{r}", self._tell, job, r, end)
        return P.Answer(ok=bool(told), error="" if told else f"no rank of job {job} runs on {self.node}")

    def _not_lost(self, job: str, request: P.Lost | P.Recover) -> str:
        """Why the orchestrator's word that ``request.node`` is lost is not acted on here ("": it
        is); Refused if the word names no agent or no grace."""
        if not is_agent_address(request.node) or not 0 < request.grace <= LOST_GRACE_MAX:
            op = request.OP.value
            raise Refused(f"{op} needs the lost node's agent and a grace of 0 to {LOST_GRACE_MAX:.0f} s.", Why.INVALID)
        if self.rewiring(job):
            return f"ranks of job {job} are being moved by {self.node}: its rewire decides"
        if not request.died and self.answers(request.node):
            # (cut off from the orchestrator, not from its peers; a rank that died: its agent said so)
            return f"the agent at {request.node} answers {self.node}: its node is not lost"
        return ""

    def _tell(self, job: str, rank: int, end: P.End) -> None:
        try:
            answer = self.ranks.call(job, rank, end, end.grace + 60)
        except AgentError as e:  # (Refused, RankGone)
            log.info("rank %d of job %s was not told its job lost a node: %s", rank, job, e)
            return
        log.warning("rank %d of job %s, told its job lost a node: %s", rank, job, answer.error or "it stops")

    def _join(self, job: str, rank: int, request: P.Join) -> P.Located:
        if self.join is None:
            raise Refused(f"the agent on {self.node} does not start joiners", Why.PRECONDITION)
        return P.Located(state=P.Whereabouts.HERE.value, pid=self.join(job, rank, request))

    def _recover(self, job: str, rank: int, request: P.Recover) -> P.Recovered:
        """(The orchestrator's.)  Rebuild the job's lost ranks; asked about a rank of it here."""
        if self.recover is None:
            raise Refused(f"the agent on {self.node} does not rebuild lost ranks", Why.PRECONDITION)
        why = self._not_lost(job, request)
        if why:
            raise Refused(why, Why.CONFLICT)
        self.ranks.entry(job, rank)  # (a rank of the job runs here)
        return self.recover(job, rank, request)

    def _jobs(self, job: str, rank: int, _: P.Jobs) -> P.Ranks:
        """Every rank here, each connected one with its step and generation now."""
        rows = []
        for row in self.ranks.jobs():
            if row.connected:
                with contextlib.suppress(AgentError):
                    now = self.ranks.call(row.job, row.rank, P.Where(), 2)
                    row = dataclasses.replace(
                        row,
                        step=now.step,
                        gen=now.gen,
                        collectives=now.collectives,
                        state=now.state,
                        aware=now.aware,
                        replicas=now.replicas,
                    )
            rows.append(row)
        return P.Ranks(ranks=tuple(rows))
