"""The agent's reports to the orchestrator (``orchestrator`` in its configuration): every
``report_period`` seconds one ``Report`` call, signed and over mutual TLS as every call between
agents is, saying what runs on this node now: its GPUs and their health findings
(:mod:`host.gpuhealth`), the ranks of jobs here (with the GPUs each uses), and the migrations and
rewires it runs.  The orchestrator keeps no state an agent would need: a report that does not
arrive is only logged (once while the orchestrator stays away), and the agent carries on."""

from __future__ import annotations

import logging
import threading
import time

import grpc

from host import gpus, proc
from host.gpuhealth import Nvml, Thresholds, Watch
from tpagent import __version__
from tpagent.common.credentials import Credentials
from tpagent.daemon.client import rpc_text
from tpagent.daemon.node import Node
from tpagent.daemon.rpc import channel, pb, pb_grpc
from tpagent.migration.api import Role, is_final

log = logging.getLogger(__name__)
#: How often a report's wait looks whether the agent stops.
SLICE = 0.25


def build(node: Node, health: Watch, cuda: str) -> pb.NodeReport:
    """What runs on this node now."""
    found = gpus.inventory()
    ranks = []
    broken = node.ranks.broken()
    digests = node.ranks.digests()
    # The ranks that died first: one whose end is taken between the two reads is in one list
    # at most (it was in both, running and died, and its node counted as running its job still).
    died = node.ranks.died()
    dead = {(e.job, e.rank) for e in died}
    # A GPU's processes that are no rank's are another workload's (a rank of another node's agent
    # is none of them: nodes as namespaces of one host see each other's, as on the GPU proof's).
    ours: set[int] = set()
    for row in node.ranks.jobs():
        if row.moved_to or (row.job, row.rank) in dead:
            continue
        tree = set(proc.tree_pids(row.pid))
        ours |= tree
        used = [g.uuid for g in found if tree & set(g.pids)]
        users = sorted(proc.other_users(tree))
        ranks.append(
            pb.RankReport(
                job=row.job,
                rank=row.rank,
                world=row.world,
                step=row.step,
                gen=row.gen,
                pid=row.pid,
                gpus=used,
                users=users,
                broke=broken.get((row.job, row.rank), ""),
                identity=digests.get((row.job, row.rank), ""),
            )
        )
    with node.lock:
        migrations = [mid for mid, m in node.sources.items() if not is_final(m.record.state)]
    incoming = [r.migration_id for r in node.journal.unfinished() if r.role is Role.TARGET]
    findings = health.findings()
    listed = [
        pb.Gpu(
            uuid=g.uuid,
            name=g.name,
            memory_total=g.memory_total,
            memory_used=g.memory_used,
            others=sum(p not in ours and not proc.environ_value(p, "TPAGENT_RANK_SOCKET") for p in g.pids),
        )
        for g in found
    ]
    lost = sorted({f.gpu for f in findings} - {g.uuid for g in found})  # (NVML no longer lists them)
    return pb.NodeReport(
        node=node.cfg.node,
        agent=node.cfg.agent_address,
        version=__version__,
        gpus=[*listed, *(pb.Gpu(uuid=u, name="(not answering)") for u in lost)],
        ranks=ranks,
        migrations=migrations,
        incoming=incoming,
        findings=[pb.Finding(gpu=f.gpu, what=f.what.value, reading=f.reading) for f in findings],
        driver_version=gpus.driver_version() or "",
        cuda_version=cuda,
        rewiring=sorted({r.job for r in ranks if node.rewires.rewiring(r.job)}),
        died=[
            pb.RankReport(
                job=e.job,
                rank=e.rank,
                world=e.world,
                users=[e.uid] if e.uid > 0 else [],
                identity=digests.get((e.job, e.rank), ""),
            )
            for e in died
        ],
    )


def run(node: Node, creds: Credentials, health: Watch, stop: threading.Event) -> None:
    """Report until ``stop`` is set (the agent's ``orchestrator`` setting says where)."""
    cfg = node.cfg
    orchestrator = pb_grpc.OrchestratorStub(channel(cfg.orchestrator, creds))
    cuda = gpus.cuda_version()
    period = cfg.report_period
    failing = ""
    while not stop.is_set():
        try:
            reply = orchestrator.Report(build(node, health, cuda), timeout=max(5.0, period))
            period = min(max(reply.period or cfg.report_period, 0.1), 3600.0)
            if failing:
                log.info("reporting to the orchestrator at %s again", cfg.orchestrator, extra={"node": cfg.node})
            failing = ""
        except grpc.RpcError as e:
            if rpc_text(e) != failing:
                log.warning(
                    "the orchestrator at %s did not take this node's report: %s",
                    cfg.orchestrator,
                    rpc_text(e),
                    extra={"node": cfg.node},
                )
            failing = rpc_text(e)
        except Exception:  # (NVML, the ranks' registry: this report is lost, not the next ones)
            log.exception("this node's report could not be made", extra={"node": cfg.node})
        _wait(node, stop, period)


def _wait(node: Node, stop: threading.Event, period: float) -> None:
    """Until the next report: ``period`` seconds, or less once a rank here says a collective of it
    failed (its peers' node may be lost: the orchestrator looks for it at once)."""
    deadline = time.monotonic() + period
    while not stop.is_set() and (left := deadline - time.monotonic()) > 0:
        if node.ranks.report_soon.wait(min(left, SLICE)):
            break
    node.ranks.report_soon.clear()


def start(node: Node, creds: Credentials) -> threading.Event:
    """Report in a thread of its own where the agent has an orchestrator; set the event to stop."""
    stop = threading.Event()
    cfg = node.cfg
    if cfg.orchestrator:
        health = Watch(Nvml(), Thresholds(cfg.temperature_c, cfg.temperature_margin_c, cfg.ecc_rise))
        threading.Thread(target=run, args=(node, creds, health, stop), name="report", daemon=True).start()
    return stop
