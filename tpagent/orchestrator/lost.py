"""A node lost without a word (issue 27, item 3), as the orchestrator acts on it: it stopped
reporting, and the ranks of its jobs there are taken as gone (their peers would otherwise wait in
their next collective for its timeout, every GPU of the job idle).

* A job whose ranks registered their training state is rebuilt (``recover_lost``): one agent of
  its surviving ranks is asked to rebuild the lost ranks on a free spare from their data-parallel
  replicas (:class:`~tpagent_rank.protocol.Recover`, :mod:`tpagent.jobs.recovery`); the job goes
  on from its last step boundary.
* Where it is not (nothing registered, no replica of a lost rank survives, no spare is free, the
  rebuild fails), the agents running its other ranks tell them (:class:`~tpagent_rank.protocol.Lost`),
  and each that makes no progress for ``lost_grace`` breaks off the collective it waits in and
  ends with one sentence: the job ends at once, and its launcher can restart it from its
  checkpoint.  A job that runs on (the node is cut off from us, not from its peers) is left alone
  by its ranks.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import Protocol

import grpc

from tpagent.common.credentials import Credentials
from tpagent.daemon import rankwire
from tpagent.daemon.client import rpc_text
from tpagent.daemon.rpc import stub
from tpagent.orchestrator.api import View
from tpagent.orchestrator.config import OrchestratorConfig
from tpagent_rank import protocol as P

log = logging.getLogger(__name__)


class Event(Protocol):
    """An event written down (the orchestrator's)."""

    def __call__(
        self, kind: str, text: str, job: str = "", node: str = "", move: int = 0, level: int = logging.INFO
    ) -> None: ...


#: A free spare for a job's lost ranks (not ``lost``): its name and its agent; or None.
SpareFor = Callable[[str, str], "tuple[str, str] | None"]
#: The longest a rebuild may take, its fresh processes' warm-up included.
RECOVER_TIMEOUT = 900.0


class LostNodes:
    def __init__(self, cfg: OrchestratorConfig, creds: Credentials, event: Event, spare_for: SpareFor) -> None:
        self.cfg = cfg
        self.creds = creds
        self.event = event
        self.spare_for = spare_for

    def lost(self, view: View, node: str, moving: Callable[[str], bool]) -> None:
        """``node`` is unreachable: each job of it rebuilt, or its other ranks told (see the module)."""
        lost = view.nodes[node]
        for job in sorted({r.job for r in lost.ranks}):
            others = sorted(
                n
                for n, seen in view.nodes.items()
                if n != node and view.reachable(n) and any(r.job == job for r in seen.ranks)
            )
            if not others or moving(job):  # (a move of it, its agents decide: it may be what saves the job)
                continue
            ranks = tuple(sorted(r.rank for r in lost.ranks if r.job == job))
            users = tuple(sorted({u for r in lost.ranks if r.job == job for u in r.users}))
            tell = P.Lost(node=lost.agent, why=self._why(node), grace=self.cfg.lost_grace, users=users)
            agents = [view.nodes[n].agent for n in others]
            spare = self.spare_for(job, node) if self.cfg.recover_lost else None
            if spare is None:
                self._tell(job, ranks, node, agents, tell, "no spare is free" if self.cfg.recover_lost else "")
                continue
            # (asked of the agent of the lowest surviving rank: a replica there gives its state)
            first = min((r.rank, view.nodes[n].agent) for n in others for r in view.nodes[n].ranks if r.job == job)
            rebuild = P.Recover(node=lost.agent, ranks=ranks, spare=spare[1], grace=self.cfg.lost_grace)
            text = f"job {job} lost rank(s) {_listed(ranks)} with {node}: rebuilding them on {spare[0]} from replicas"
            self.event("recovering", text, job, node, level=logging.WARNING)
            args = (job, first, rebuild, (node, spare[0]), agents, tell)
            threading.Thread(target=self._rebuild, args=args, name=f"recover-{job}", daemon=True).start()

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
        try:
            reply = stub(agent, self.creds).Rank(
                rankwire.request_pb(job, rank, rebuild, RECOVER_TIMEOUT), timeout=RECOVER_TIMEOUT + 60
            )
            done = rankwire.answer_of(rebuild, reply)
        except grpc.RpcError as e:
            done = P.Recovered(ok=False, error=rpc_text(e))
        if done.ok:
            stages = ", ".join(done.stages)
            text = f"job {job} runs on from step {done.step}, rank(s) {_listed(rebuild.ranks)} rebuilt on "
            text += f"{spare} in {time.monotonic() - t0:.1f} s ({stages})"
            self.event("recovered", text, job, node, level=logging.WARNING)
            return
        self._tell(job, rebuild.ranks, node, agents, tell, done.error)

    def _tell(self, job: str, ranks: tuple[int, ...], node: str, agents: list[str], tell: P.Lost, why: str) -> None:
        """Every agent of the job's other ranks tells them its node is lost."""
        text = f"job {job} lost rank(s) {_listed(ranks)} with {node}"
        text += f" and cannot be rebuilt ({why.rstrip('.')})" if why else ""
        text += f": its other ranks are told (each stops once it waits {self.cfg.lost_grace:g} s)"
        self.event("lost", text, job, node, level=logging.WARNING)
        for agent in agents:
            threading.Thread(target=self._tell_lost, args=(agent, job, tell), daemon=True).start()

    def _tell_lost(self, agent: str, job: str, request: P.Lost) -> None:
        try:
            stub(agent, self.creds).Rank(rankwire.request_pb(job, 0, request, 30.0), timeout=40)
        except grpc.RpcError as e:
            log.warning("the agent at %s was not told job %s lost a node: %s", agent, job, rpc_text(e))


def _listed(ranks: tuple[int, ...]) -> str:
    return ", ".join(map(str, ranks))
