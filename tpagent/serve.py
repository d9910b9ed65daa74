"""``tpagent serve``: run the node agent until SIGTERM/SIGINT.

On start it recovers the migrations a previous run left half-way (see
:meth:`tpagent.agent.Agent.recover`), then serves the Agent API (every call authenticated)
and grpc.health.v1, and exposes Prometheus metrics.  On SIGTERM: health NOT_SERVING, then
``server.stop(grace)``, then ``wait_for_termination``.
"""

from __future__ import annotations

import json
import logging
import signal
import threading
from concurrent import futures

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from prometheus_client import start_http_server

from snapshot.api import SnapshotConfig, UsageError
from tpagent.agent import Agent
from tpagent.config import AgentConfig
from tpagent.rpc import MAX_MESSAGE, AuthInterceptor, pb_grpc

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
    cfg.work_dir.mkdir(parents=True, exist_ok=True)
    agent = Agent(cfg, SnapshotConfig())
    agent.recover()
    server = grpc.server(
        futures.ThreadPoolExecutor(max_workers=32, thread_name_prefix="rpc"),
        interceptors=[AuthInterceptor(agent.secret)],
        options=[("grpc.max_receive_message_length", MAX_MESSAGE), ("grpc.max_send_message_length", MAX_MESSAGE)],
    )
    pb_grpc.add_AgentServicer_to_server(agent, server)
    health_servicer = health.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    if server.add_insecure_port(cfg.listen) == 0:
        raise UsageError(f"cannot listen on {cfg.listen}; is another agent running there?")
    if cfg.metrics_listen:
        host, _, port = cfg.metrics_listen.rpartition(":")
        try:
            start_http_server(int(port), addr=host or "0.0.0.0")
        except (OSError, ValueError) as e:
            raise UsageError(f"cannot serve metrics on {cfg.metrics_listen}: {e}") from e
    server.start()
    for name in ("", "tpagent.v1.Agent"):
        health_servicer.set(name, health_pb2.HealthCheckResponse.SERVING)
    log.info("serving on %s", cfg.listen, extra={"node": cfg.node})
    if ready is not None:
        ready.set()
    try:
        stop.wait()
    finally:
        for name in ("", "tpagent.v1.Agent"):
            health_servicer.set(name, health_pb2.HealthCheckResponse.NOT_SERVING)
        server.stop(GRACE)
        server.wait_for_termination(GRACE)
        log.info("stopped", extra={"node": cfg.node})
