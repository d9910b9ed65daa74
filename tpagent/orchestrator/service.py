"""The Orchestrator gRPC service (mutual TLS, every call signed with the cluster secret, as the
agents' API: :mod:`tpagent.daemon.rpc`): a thin adapter over :class:`~.core.Orchestrator`.
Everything that comes from the network is bounded and checked here before it is used; a node's
report is taken only from the address it names (its agent's host is the caller's)."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from typing import NoReturn

import grpc

from tpagent.daemon.rpc import audience_of, pb, pb_grpc
from tpagent.migration.api import is_agent_address
from tpagent.orchestrator import policy
from tpagent.orchestrator.api import (
    IDENTITY,
    Finding,
    Gpu,
    RankSeen,
    Refused,
    TaintKind,
    Why,
    job_identity,
    job_key,
    job_name,
    printable,
)
from tpagent.orchestrator.api import NodeSeen as Seen
from tpagent.orchestrator.core import NAME_MAX, Orchestrator
from tpagent_rank.protocol import RANK_MAX

CODES = {
    Why.INVALID: grpc.StatusCode.INVALID_ARGUMENT,
    Why.NOT_FOUND: grpc.StatusCode.NOT_FOUND,
    Why.PRECONDITION: grpc.StatusCode.FAILED_PRECONDITION,
}
MAX_RANKS = 4096
MAX_GPUS = 64
MAX_FINDINGS = 256
MAX_FOLLOWERS = 8


def _abort(context: grpc.ServicerContext, e: Refused) -> NoReturn:
    context.abort(CODES[e.why], str(e))
    raise AssertionError("unreachable")


def _caller_names(context: grpc.ServicerContext) -> set[str]:
    """What the caller is: its IP ("ipv4:10.0.0.1:5555" -> "10.0.0.1", "ipv6:[::1]:5555" -> "::1")
    and the names and addresses its certificate (the cluster CA's) was issued for."""
    peer = str(context.peer())
    names = {audience_of(peer.partition(":")[2])} if peer.startswith(("ipv4:", "ipv6:")) else set()
    for n in context.auth_context().get("x509_subject_alternative_name", []):
        names.add((n.decode() if isinstance(n, bytes) else str(n)).lower())
    return names


def _p(text: str, limit: int = NAME_MAX) -> str:
    return printable(text, limit)


def seen_of(r: pb.NodeReport) -> Seen:
    """The report, checked: one sentence (:class:`Refused`) if it is out of bounds."""
    if not 0 < len(r.node) <= NAME_MAX or not r.node.isprintable() or not is_agent_address(r.agent):
        raise Refused("a report must name its node (1 to 256 printable characters) and agent (HOST:PORT).")
    if len(r.ranks) + len(r.died) > MAX_RANKS or len(r.gpus) > MAX_GPUS or len(r.findings) > MAX_FINDINGS:
        raise Refused(f"a report holds at most {MAX_RANKS} ranks, {MAX_GPUS} GPUs and {MAX_FINDINGS} findings.")
    gpus = {g.uuid for g in r.gpus}
    if any(f.gpu not in gpus for f in r.findings):
        raise Refused("a report's finding names a GPU the report does not list.")
    if any(x.identity and not IDENTITY.fullmatch(x.identity) for x in (*r.ranks, *r.died)):
        raise Refused("a rank's identity in a report is 16 hex digits, or none.")
    if any(not (0 <= x.rank < RANK_MAX and 0 <= x.world <= RANK_MAX) for x in (*r.ranks, *r.died)):
        raise Refused(f"a rank in a report is 0 to {RANK_MAX - 1}, of a job of at most {RANK_MAX} ranks.")
    rewiring = set(r.rewiring[:MAX_RANKS])  # (by name: the jobs of its ranks of those names)
    return Seen(
        name=r.node,
        agent=r.agent,
        seen=time.monotonic(),
        gpus=tuple(Gpu(_p(g.uuid), _p(g.name), int(g.memory_total)) for g in r.gpus),
        ranks=tuple(
            RankSeen(
                job_key(_p(x.job), x.identity),
                int(x.rank),
                int(x.world),
                int(x.step),
                int(x.gen),
                tuple(map(_p, x.gpus[:MAX_GPUS])),
                tuple(int(u) for u in x.users[:MAX_GPUS]),
                _p(x.broke),
            )
            for x in r.ranks
        ),
        died=tuple(
            RankSeen(
                job_key(_p(x.job), x.identity),
                int(x.rank),
                int(x.world),
                users=tuple(int(u) for u in x.users[:MAX_GPUS]),
            )
            for x in r.died
        ),
        busy=frozenset(job_key(_p(x.job), x.identity) for x in r.ranks if x.job in rewiring),
        migrations=tuple(map(_p, r.migrations[:MAX_RANKS])),
        incoming=tuple(map(_p, r.incoming[:MAX_RANKS])),
        findings=tuple(Finding(_p(f.gpu), _p(f.what, 64), _p(f.reading)) for f in r.findings),
        foreign=frozenset(_p(g.uuid) for g in r.gpus if g.others),
        driver=_p(r.driver_version, 64),
        cuda=_p(r.cuda_version, 64),
    )


class Service(pb_grpc.OrchestratorServicer):
    def __init__(self, orchestrator: Orchestrator) -> None:
        self.o = orchestrator
        #: Each follower holds one of the server's threads for as long as it follows: bounded, so
        #: that followers never starve the agents' reports.
        self.followers = threading.BoundedSemaphore(MAX_FOLLOWERS)

    def Report(self, request: pb.NodeReport, context: grpc.ServicerContext) -> pb.ReportReply:
        try:
            seen = seen_of(request)
            callers = _caller_names(context)
            if audience_of(seen.agent) not in callers:
                came = ", ".join(sorted(callers)) or "an unknown caller"
                raise Refused(
                    f"a report for {seen.name} names agent {seen.agent}, but came from {came} "
                    "(its address and certificate's names).",
                    Why.INVALID,
                )
            self.o.report(seen, request.version)
        except Refused as e:
            _abort(context, e)
        return pb.ReportReply(period=self.o.cfg.report_period)

    def Taint(self, request: pb.TaintRequest, context: grpc.ServicerContext) -> pb.TaintReply:
        try:
            t = self.o.taint(request.node, request.gpu, request.reason, TaintKind.PLANNED)
        except Refused as e:
            _abort(context, e)
        return pb.TaintReply(message=f"tainted {t.node}{' GPU ' + t.gpu if t.gpu else ''} (taint {t.id}): {t.reason}")

    def Untaint(self, request: pb.TaintRequest, context: grpc.ServicerContext) -> pb.TaintReply:
        try:
            gone = self.o.untaint(request.node, request.gpu)
        except Refused as e:
            _abort(context, e)
        what = f"{request.node}{' GPU ' + request.gpu if request.gpu else ''}"
        return pb.TaintReply(message=f"untainted {what} ({', '.join(f'taint {t.id}: {t.reason}' for t in gone)})")

    def Cluster(self, request: pb.Empty, context: grpc.ServicerContext) -> pb.ClusterView:
        return cluster_pb(self.o)

    def Events(self, request: pb.EventsRequest, context: grpc.ServicerContext) -> Iterator[pb.OrchestratorEvent]:
        if request.follow and not self.followers.acquire(blocking=False):
            context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, f"{MAX_FOLLOWERS} callers follow the events already.")
        try:
            yield from self._events(max(0, int(request.after)), request.follow, context)
        finally:
            if request.follow:
                self.followers.release()

    def _events(self, after: int, follow: bool, context: grpc.ServicerContext) -> Iterator[pb.OrchestratorEvent]:
        while context.is_active() and not self.o.stop.is_set():
            page = self.o.state.events(after)
            for seq, ts, kind, text, job, node, move in page:
                after = seq
                yield pb.OrchestratorEvent(
                    seq=seq, ts=ts, kind=kind, text=text, job=job_name(job), node=node, move=move,
                    identity=job_identity(job),
                )  # fmt: skip
            if not page and not follow:
                return
            if not page:
                self.o.state.wait_event(after, 1.0)


def cluster_pb(o: Orchestrator) -> pb.ClusterView:
    view = o.view()
    now = time.monotonic()
    dedicated = o.cfg.dedicated()
    taints = o.state.taints()
    spare_nodes = {s.node for s in _free(o)}
    out = pb.ClusterView()
    for name, n in sorted(view.nodes.items()):
        role = "dedicated spare" if name in dedicated else ("spare" if name in spare_nodes else "")
        out.nodes.append(
            pb.ClusterView.Node(
                name=name,
                agent=n.agent,
                seen=now - n.seen,
                reachable=view.reachable(name),
                gpus=[
                    pb.Gpu(uuid=g.uuid, name=g.name, memory_total=g.memory_total, others=int(g.uuid in n.foreign))
                    for g in n.gpus
                ],
                findings=[pb.Finding(gpu=f.gpu, what=f.what, reading=f.reading) for f in n.findings],
                role=role,
                driver_version=n.driver,
            )
        )
    for t in taints:
        out.taints.append(
            pb.ClusterView.Taint(
                id=t.id, node=t.node, gpu=t.gpu, kind=t.kind.value, reason=t.reason, source=t.source,
                since=t.created, waiting=t.waiting,
            )
        )  # fmt: skip
    homes = {(a.job, a.rank): a.home for a in o.state.away()}
    for name, n in sorted(view.nodes.items()):
        for r in n.ranks:
            home = homes.get((r.job, r.rank), "")
            out.ranks.append(
                pb.ClusterView.Rank(
                    job=job_name(r.job), rank=r.rank, node=name, step=r.step, gen=r.gen, home=home,
                    identity=job_identity(r.job),
                )
            )  # fmt: skip
    for m in o.state.moves(last=100):
        end = m.ended or time.time()
        taint = o.state.taint_by_id(m.taint) if m.taint else None
        out.moves.append(
            pb.ClusterView.Move(
                id=m.id, job=job_name(m.job), identity=job_identity(m.job), ranks=list(m.ranks), source=m.source,
                target=m.target, kind=m.kind.value,
                state=m.state.value, message=m.message, started=m.started or 0.0,
                seconds=end - m.started if m.started else 0.0, attempt=m.attempt, timings=o.state.timings(m.id),
                created=m.created, tainted=taint.created if taint else 0.0,
            )
        )  # fmt: skip
    out.spares_free = len(spare_nodes)
    return out


def _free(o: Orchestrator) -> list[policy.Spare]:
    dedicated = o.scheduler.pool("", frozenset()).dedicated
    return list(policy.spares(o.view(), o.state.taints(), o.state.moves(active=True), o.state.away(), o.cfg, dedicated))
