"""The Agent gRPC service: a thin adapter that turns each call into one call of
:class:`tpagent.daemon.node.Node` and its answer (or :class:`tpagent.migration.api.Refused`) into protobuf
(or a status code: :data:`tpagent.daemon.rpc.CODES`).  Nothing here decides anything."""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator
from typing import NoReturn, TypeVar

import grpc

from host import mounts
from tpagent.daemon import rankwire
from tpagent.daemon.node import Node
from tpagent.daemon.rpc import CODES, AgentServicer, pb
from tpagent.migration.api import MOST_GPUS, AgentError, Event, NodeInfo, Offer, PeerStatus, Refused, Why
from tpagent_rank import protocol as P

R = TypeVar("R")


#: The longest refusal sent back (gRPC's metadata, which carries it, holds 16 KiB at most: a
#: longer one reached the caller as that limit's error, not as the refusal).
DETAILS_MAX = 4096


def said(text: str) -> str:
    """``text`` as gRPC can carry it: a name in it that is not UTF-8 escaped (``\\udcff``)."""
    return text.encode("utf-8", "backslashreplace").decode()


def _abort(context: grpc.ServicerContext, e: AgentError) -> NoReturn:
    why = e.why if isinstance(e, Refused) else Why.INTERNAL
    text = said(str(e))
    context.abort(CODES[why], text if len(text) <= DETAILS_MAX else text[: DETAILS_MAX - 3] + "...")
    raise AssertionError("unreachable")  # (abort raises)


def _answer(context: grpc.ServicerContext, call: Callable[[], R]) -> R:
    try:
        return call()
    except AgentError as e:
        _abort(context, e)


def status_pb(s: PeerStatus) -> pb.MigrationStatus:
    return pb.MigrationStatus(migration_id=s.migration_id, state=s.state, message=said(s.message), pid=s.pid)


def event_pb(e: Event) -> pb.MigrationEvent:
    return pb.MigrationEvent(
        migration_id=e.migration_id,
        state=e.state,
        message=said(e.message),
        seconds=e.seconds,
        timings=dict(e.timings),
        problems=[said(p) for p in e.problems],
        bytes_done=e.bytes_done,
        bytes_total=e.bytes_total,
        new_pid=e.new_pid,
    )


def info_pb(i: NodeInfo) -> pb.NodeInfo:
    gpus = [
        pb.Gpu(
            uuid=g.uuid,
            name=g.name,
            memory_total=g.memory_total,
            memory_used=g.memory_used,
            temperature_c=g.temperature_c,
            ecc_uncorrected=g.ecc_uncorrected,
        )
        for g in i.gpus
    ]
    return pb.NodeInfo(
        node=i.node,
        hostname=i.hostname,
        gpus=gpus,
        memory_available=i.memory_available,
        agent_version=i.agent_version,
        criu_version=i.criu_version,
        driver_version=i.driver_version,
        healthy=not i.problems,
        problems=list(i.problems),
        clock=i.clock,
    )


class Service(AgentServicer):
    def __init__(self, node: Node) -> None:
        self.node = node

    def Info(self, request: pb.Empty, context: grpc.ServicerContext) -> pb.NodeInfo:
        return info_pb(self.node.info())

    def ListProcesses(self, request: pb.Empty, context: grpc.ServicerContext) -> pb.ProcessList:
        return pb.ProcessList(
            processes=[
                pb.Process(
                    pid=p.pid,
                    cmdline=list(p.cmdline),
                    rss=p.rss,
                    uses_gpu=p.uses_gpu,
                    why=p.why,
                    uid=p.uid,
                    owner=p.owner,
                )
                for p in self.node.migratable()
            ]
        )

    def Migrate(self, request: pb.MigrateRequest, context: grpc.ServicerContext) -> Iterator[pb.MigrationEvent]:
        m = _answer(
            context,
            lambda: self.node.start_migration(
                int(request.pid),
                str(request.target),
                bool(request.dry_run),
                str(request.job),
                tuple(int(r) for r in request.ranks),
                str(request.mode),
                str(request.job_identity),
                tuple(str(g) for g in request.target_gpus[: MOST_GPUS + 1]),
            ),
        )

        # The CLI going away (Ctrl-C) cancels the migration, unless it is past the point of no return;
        # not the calls this agent ends as it stops (it settles its migrations itself, in its own words).
        def went_away() -> None:
            if not self.node.ctx.threads.stopping.is_set():
                m.cancel("the tpagent migrate command went away (interrupted)")

        if not context.add_callback(went_away):
            m.cancel("the tpagent migrate command went away before it started")
        # The first word, at once: the migration's id.  A caller whose call breaks later (this agent
        # killed) follows the migration by it (Status) as this agent settles it from its journal;
        # one that had no word yet could only say this agent cannot be reached.
        m.emit()
        self.node.run(m)
        while (event := m.events.get()) is not None:
            yield event_pb(event)

    def Status(self, request: pb.MigrationRef, context: grpc.ServicerContext) -> pb.MigrationStatus:
        return status_pb(_answer(context, lambda: self.node.status(request.migration_id)))

    def Cancel(self, request: pb.MigrationRef, context: grpc.ServicerContext) -> pb.MigrationStatus:
        return status_pb(_answer(context, lambda: self.node.cancel(request.migration_id)))

    def Resolve(self, request: pb.ResolveRequest, context: grpc.ServicerContext) -> pb.MigrationStatus:
        return status_pb(_answer(context, lambda: self.node.resolve(request.migration_id, request.commit)))

    def Receive(self, request: pb.ReceiveRequest, context: grpc.ServicerContext) -> pb.ReceiveReply:
        offer = Offer(
            str(request.migration_id),
            str(request.source_node),
            str(request.source_agent),
            int(request.bytes_estimate),
            tuple(request.gpu_uuids),
            tuple(request.shared_files),
            bool(request.dry_run),
            tuple(request.carried_files),
            tuple((str(t.local), str(t.remote)) for t in request.tcp),
            float(request.hold),
            tuple(str(b)[:64] for b in request.gpu_bus_ids[:64]),
            tuple(str(n) for n in request.abstract_sockets[:10_000]),
            tuple(str(m) for m in request.mounts[: mounts.MOST]),
            tuple(str(g) for g in request.target_gpus[: MOST_GPUS + 1]),
        )
        a = _answer(context, lambda: self.node.receive(offer))
        return pb.ReceiveReply(
            transfer_address=a.transfer_address,
            gpu_map=dict(a.gpu_map),
            problems=list(a.problems),
            reserved=a.reserved,
            clock=a.clock,
            missing_mounts=list(a.missing_mounts),
        )

    def Restore(self, request: pb.RestoreRequest, context: grpc.ServicerContext) -> pb.RestoreReply:
        r = _answer(context, lambda: self.node.restore(request.migration_id))
        return pb.RestoreReply(pid=r.pid, timings=dict(r.timings))

    def Rank(self, request: pb.RankRequest, context: grpc.ServicerContext) -> pb.RankReply:
        def call() -> pb.RankReply:
            asked = rankwire.request_of(request)
            job = str(request.job)
            answer: P.Answer = self.node.rank_request(job, int(request.rank), asked, request.timeout, request.job_key)
            return rankwire.reply_pb(answer, as_json=rankwire.legacy(request))

        return _answer(context, call)

    def Finish(self, request: pb.FinishRequest, context: grpc.ServicerContext) -> pb.MigrationStatus:
        r = request
        finish = functools.partial(self.node.finish, r.migration_id, bool(r.commit), bool(r.confirmed))
        return status_pb(_answer(context, finish))
