"""``tpagent serve``: run the node agent until SIGTERM/SIGINT.

On start it sets the umask to 077, makes sure its work directory is its own (created 0700,
or refused), recovers the migrations a previous run left half-way (see
:meth:`tpagent.agent.Agent.recover`), then serves the Agent API (mutual TLS, every call
authenticated: :mod:`tpagent.rpc`), grpc.health.v1 Check on a plain-text port of its own
for probes, and Prometheus metrics.  On SIGTERM: health NOT_SERVING, then
``server.stop(grace)``, then ``wait_for_termination``.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import threading

import grpc
from prometheus_client import start_http_server

from snapshot.api import SnapshotConfig, UsageError
from snapshot.safefs import private_dir
from tpagent import metrics
from tpagent.agent import Agent
from tpagent.config import AgentConfig
from tpagent.rpc import AuthInterceptor, Health, HealthOnly, pb_grpc
from tpagent.rpc import server as rpc_server

log = logging.getLogger(__name__)
GRACE = 30.0


class JsonLines(logging.Formatter):
    """One JSON object per line: time, level, logger, message, and the node and migration
    the record is about (set by the agent's log adapters)."""

    def format(self, record: logging.LogRecord) -> str:
        doc = {"ts": self.formatTime(record, "%Y-%m-%dT%H:%M:%S"), "level": record.levelname, "logger": record.name, "msg": record.getMessage()}
        for key in ("node", "migration"):
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


def serve(cfg: AgentConfig, ready: threading.Event | None = None, stop: threading.Event | None = None) -> None:
    stop = stop or threading.Event()
    if threading.current_thread() is threading.main_thread():
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, lambda *_: stop.set())  # only a flag: shutdown happens below
    umask = os.umask(0o077)  # snapshots are someone's whole memory: nothing we write is for others
    try:
        _serve(cfg, ready, stop)
    finally:
        os.umask(umask)


def _serve(cfg: AgentConfig, ready: threading.Event | None, stop: threading.Event) -> None:
    private_dir(cfg.work_dir)
    agent = Agent(cfg, SnapshotConfig())
    agent.recover()
    health = Health()
    interceptor = AuthInterceptor(agent.creds.secret, cfg.audiences, health, lambda reason: metrics.REFUSED.labels("rpc", reason).inc())
    server, tls = rpc_server(agent.creds, interceptor)
    pb_grpc.add_AgentServicer_to_server(agent, server)
    if server.add_secure_port(cfg.listen, tls) == 0:
        raise UsageError(f"cannot listen on {cfg.listen}; is another agent running there?")
    probes = None
    if cfg.health_listen:
        # (no limit on calls: Check reads nothing and answers at once, so none can hold a place)
        probes = grpc.server(health.pool, interceptors=[HealthOnly(health)])
        if probes.add_insecure_port(cfg.health_listen) == 0:
            raise UsageError(f"cannot serve health checks on {cfg.health_listen}; is another agent running there?")
    if cfg.metrics_listen:
        host, _, port = cfg.metrics_listen.rpartition(":")
        try:
            start_http_server(int(port), addr=host or "0.0.0.0")
        except (OSError, ValueError) as e:
            raise UsageError(f"cannot serve metrics on {cfg.metrics_listen}: {e}") from e
    server.start()
    if probes is not None:
        probes.start()
    health.serving = True
    log.info("serving on %s (mutual TLS)", cfg.listen, extra={"node": cfg.node})
    if ready is not None:
        ready.set()
    try:
        stop.wait()
    finally:
        health.serving = False
        server.stop(GRACE)
        server.wait_for_termination(GRACE)
        if probes is not None:
            probes.stop(0)
        log.info("stopped", extra={"node": cfg.node})
