"""``tpagent serve``: run the node agent until SIGTERM/SIGINT.

On start it sets the umask to 077 (run as a process's main thread: in a thread it leaves it,
and the signals, to the process), makes sure its work directory is its own (created 0700, or
refused), recovers the migrations a previous run left half-way (see
:meth:`tpagent.daemon.node.Node.recover`), then serves the Agent API (mutual TLS, every call
authenticated: :mod:`tpagent.daemon.rpc`), grpc.health.v1 Check on a plain-text port of its own
for probes, and Prometheus metrics.

Shutdown (SIGTERM or SIGINT), as uvicorn does it: health NOT_SERVING and no new migration
admitted; every wait on a peer gives up at once (an unresolved migration, frozen original and
all, is in the journal: it never holds up a stop); the running migrations get
``shutdown_grace`` seconds to end, and so do the restores of copies here (then their CRIU is
stopped and each copy dropped: its original runs on at its source); a second signal cuts that short; then the waiters (a
source asking its target, a held copy asking its source) are told to stop and the server
stops.  Whatever was cut short is in the journal, and the next start takes it up from there.
"""

from __future__ import annotations

import functools
import json
import logging
import os
import signal
import stat
import threading
import time
from pathlib import Path

from host import paths
from host.api import UsageError, unbracketed
from host.safefs import private_dir
from snapshot.api import SnapshotConfig
from tpagent.common import metrics
from tpagent.common.config import AgentConfig
from tpagent.common.credentials import Credentials
from tpagent.common.threads import Threads
from tpagent.daemon import report
from tpagent.daemon.client import GrpcPeer
from tpagent.daemon.node import Node
from tpagent.daemon.rpc import AuthInterceptor, Health, listen, pb_grpc, probe_server
from tpagent.daemon.rpc import server as rpc_server
from tpagent.daemon.service import Service
from tpagent.migration import watch
from tpagent.migration.context import Context
from tpagent.migration.journal import Journal, on_tmpfs
from tpagent.migration.receivers import Receivers
from transfer.api import MAX_STREAMS, Compress, TlsFiles, TransferConfig
from transfer.transports import make_transport

log = logging.getLogger(__name__)


class JsonLines(logging.Formatter):
    """One JSON object per line: time, level, logger, message, and the node and migration
    the record is about (set by the agent's log adapters)."""

    def format(self, record: logging.LogRecord) -> str:
        doc = {
            "ts": self.formatTime(record, "%Y-%m-%dT%H:%M:%S"),
            "level": record.levelname,
            "logger": record.name,
            "msg": record.getMessage(),
        }
        for key in ("node", "migration", "job", "rank", "move"):
            if hasattr(record, key):
                doc[key] = getattr(record, key)
        if record.exc_info:
            doc["error"] = self.formatException(record.exc_info)
        return json.dumps(doc)


def structured_logs(level: int = logging.INFO) -> None:
    handler = logging.StreamHandler()
    handler.setFormatter(JsonLines())
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level)


def context(
    cfg: AgentConfig, creds: Credentials | None = None, snapshot_config: SnapshotConfig = SnapshotConfig()
) -> Context:
    """Everything the protocol needs, wired for a real agent: its journal, gRPC peers, the
    configured transport and this node's credentials (read and checked now)."""
    creds = creds or cfg.credentials()
    t = cfg.timeouts
    transfer = TransferConfig(
        secret=creds.secret,
        compress=Compress(cfg.compress),
        io_timeout=t.io,
        connect_timeout=min(10.0, t.io),
        start_timeout=t.io,
        streams=max(1, min(MAX_STREAMS, cfg.streams)),
    )
    tls = TlsFiles.in_dir(cfg.tls_dir)  # (TCP: mutual TLS with the agent's certificates; UCX has none)
    return Context(
        cfg=cfg,
        snapshot_config=snapshot_config,
        journal=Journal(paths.WorkDir(cfg.work_dir).migrations),
        peer=lambda address: GrpcPeer(address, creds),
        transport=lambda: make_transport(cfg.transport, t.io, tls),
        transfer_config=transfer,
        threads=Threads(),
        log=logging.LoggerAdapter(log, {"node": cfg.node}),
    )


def serve(cfg: AgentConfig, ready: threading.Event | None = None, stop: threading.Event | None = None) -> None:
    """Serve until ``stop`` is set (or SIGTERM/SIGINT in the main thread; a second one forces)."""
    stop = stop or threading.Event()
    force = threading.Event()
    if threading.current_thread() is not threading.main_thread():
        # In a thread (tests run agents so): the umask and the signals are the process's, not
        # this agent's.  Two agents whose umask calls interleaved left the process at 077 for
        # good (the first to stop put back the 022 it found, the second the 077 it found).
        _serve(cfg, ready, stop, force)
        return

    def on_signal(*_: object) -> None:  # only flags: shutdown happens below
        (force if stop.is_set() else stop).set()

    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, on_signal)
    umask = os.umask(0o077)  # snapshots are someone's whole memory: nothing we write is for others
    try:
        _serve(cfg, ready, stop, force)
    finally:
        os.umask(umask)


def _end_restores(targets: Receivers, deadline: float, force: threading.Event) -> None:
    """The restores of copies here get until ``deadline``; then their CRIU is stopped (one
    blocked for ever would keep the agent from exiting) and each copy dropped, and each answers
    its source's Restore call (up to 30 s more) before the server stops: the source resumes its
    original."""
    while targets.restoring() and time.monotonic() < deadline and not force.is_set():
        time.sleep(0.05)
    targets.stop_restores("its agent stopped")
    answered = time.monotonic() + 30.0
    while targets.restoring() and time.monotonic() < answered and not force.is_set():
        time.sleep(0.05)


def _own_work_dir(path: Path) -> None:
    """``path`` made, or found the agent's own: 0700 (one left by a run before), or holding
    nothing but what the agent makes (and a new filesystem's lost+found), then shut to 0700.  A
    directory of other files (/etc or /var/lib given by mistake) is refused, never filled."""
    real = private_dir(path)
    mode = stat.S_IMODE(os.stat(real).st_mode)
    if mode != 0o700:
        others = [
            n for n in os.listdir(real) if n != "lost+found" and not n.lstrip(".").startswith(paths.WorkDir.NAMES)
        ]
        if others:
            raise UsageError(
                f"work_dir {path} holds files that are not the agent's ({others[0]}, mode {mode:o}, not 700); "
                "give a new or empty directory (or chmod 700 it, if it is the agent's)."
            )
        os.chmod(real, 0o700)


def _serve(cfg: AgentConfig, ready: threading.Event | None, stop: threading.Event, force: threading.Event) -> None:
    creds = cfg.credentials()  # (first: a refusal of them leaves no work_dir made)
    _own_work_dir(cfg.work_dir)
    ctx = context(cfg, creds)
    if on_tmpfs(ctx.journal.directory):
        log.warning(
            "the journal (%s) is on tmpfs: a reboot of this node loses the migrations in flight "
            "(the original or its copy may then never run); put work_dir on persistent storage",
            ctx.journal.directory,
        )
    node = Node(ctx)
    node.recover()
    health = Health()
    interceptor = AuthInterceptor(
        creds.secret, cfg.audiences, health, lambda reason: metrics.REFUSED.labels("rpc", reason).inc()
    )
    server, tls = rpc_server(creds, interceptor)
    pb_grpc.add_AgentServicer_to_server(Service(node), server)
    listen(server, cfg.listen, tls, "listen", "agent")
    probes = None
    scrapes = None
    if cfg.health_listen:
        probes = probe_server(health)
        listen(probes, cfg.health_listen, None, "serve health checks", "agent")
    if cfg.metrics_listen:
        metrics.FROZEN.set_function(functools.partial(watch.frozen_seconds, ctx, node.sources))
        metrics.UNRESOLVED.set_function(functools.partial(watch.unresolved, ctx, node.sources))
        host, _, port = cfg.metrics_listen.rpartition(":")
        try:
            scrapes = metrics.MetricsServer(unbracketed(host) or "0.0.0.0", int(port))
        except (OSError, ValueError) as e:
            raise UsageError(f"cannot serve metrics on {cfg.metrics_listen}: {e}") from e
    try:
        node.open_sockets()  # (first: a rank socket someone else holds stops the agent here)
    except UsageError:
        if scrapes is not None:
            scrapes.server_close()
        raise
    if scrapes is not None:
        threading.Thread(target=scrapes.serve_forever, name="metrics", daemon=True).start()
    server.start()
    if probes is not None:
        probes.start()
    health.serving = True
    reporting = report.start(node, creds)
    log.info("serving on %s (mutual TLS)", cfg.listen, extra={"node": cfg.node})
    if ready is not None:
        ready.set()
    try:
        stop.wait()
    finally:
        health.serving = False
        reporting.set()
        node.closed = True  # no new migration, as source or target; the running ones go on
        ctx.threads.draining.set()  # but none waits on a peer that does not answer: the journal keeps it
        grace = cfg.timeouts.shutdown_grace
        deadline = time.monotonic() + grace
        left = ctx.threads.join(grace, "migration", give_up=force)
        _end_restores(node.targets, deadline, force)
        if left:
            log.warning(
                "stopping with migrations still running (%s); the next start takes them up from the journal",
                ", ".join(left),
                extra={"node": cfg.node},
            )
        ctx.threads.stopping.set()  # the waiters return; what they wait for is journaled
        node.close_sockets()
        server.stop(0 if force.is_set() else 1.0)
        server.wait_for_termination(grace)
        ctx.threads.join(5.0)
        if probes is not None:
            probes.stop(0)
        if scrapes is not None:
            scrapes.shutdown()
            scrapes.server_close()
        log.info("stopped", extra={"node": cfg.node})
