"""``tpagent orchestrator``: run the orchestrator until SIGTERM/SIGINT.

It opens its database (creating it, in a directory of root's alone), settles what a previous run
left running (:mod:`.core`), then serves its gRPC API (mutual TLS, every call signed, as the
agents'), the Alertmanager webhook and Prometheus metrics where configured, and runs its loop.
Shutdown: health NOT_SERVING, the loop stops planning, the server stops.  A move running then
goes on in its source agent, which decides it; the next start settles it from the reports.
"""

from __future__ import annotations

import logging
import os
import signal
import sqlite3
import ssl
import threading
import time

import grpc

from host.api import UsageError, unbracketed
from host.trusted import read_private_file
from tpagent.common.metrics import MetricsServer
from tpagent.daemon.rpc import AuthInterceptor, Health, listen, pb_grpc, probe_server
from tpagent.daemon.rpc import server as rpc_server
from tpagent.orchestrator.config import OrchestratorConfig
from tpagent.orchestrator.core import Orchestrator
from tpagent.orchestrator.service import Service
from tpagent.orchestrator.state import State
from tpagent.orchestrator.webhook import Webhook
from transfer.api import TlsFiles

log = logging.getLogger(__name__)


def _host_port(address: str, what: str) -> tuple[str, int]:
    host, _, port = address.rpartition(":")
    try:
        return unbracketed(host) or "0.0.0.0", int(port)
    except ValueError as e:
        raise UsageError(f"{what} {address!r} is not HOST:PORT.") from e


def _webhook(cfg: OrchestratorConfig, o: Orchestrator) -> Webhook | None:
    if not cfg.webhook_listen or cfg.webhook_token_file is None:
        return None
    token = read_private_file(cfg.webhook_token_file, "the webhook's bearer token").decode().strip()
    if len(token) < 16:
        raise UsageError(f"the bearer token in {cfg.webhook_token_file} is shorter than 16 characters.")
    tls = None
    if not cfg.webhook_plaintext:
        files = TlsFiles.in_dir(cfg.tls_dir)
        tls = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        tls.load_cert_chain(files.cert, files.key)
    try:
        return Webhook(_host_port(cfg.webhook_listen, "webhook_listen"), o, token, tls)
    except OSError as e:
        raise UsageError(f"cannot serve the webhook on {cfg.webhook_listen} (webhook_listen): {e.strerror}.") from e


def _metrics(cfg: OrchestratorConfig) -> MetricsServer | None:
    if not cfg.metrics_listen:
        return None
    try:
        return MetricsServer(*_host_port(cfg.metrics_listen, "metrics_listen"))
    except OSError as e:  # (its port taken: it was "[Errno 98] Address already in use", naming no setting)
        raise UsageError(f"cannot serve metrics on {cfg.metrics_listen} (metrics_listen): {e.strerror}.") from e


#: Seconds a stop (SIGTERM) waits for the loops to finish what they are doing; past it the process
#: exits anyway (a systemd or Kubernetes stop does not wait on a slow agent or scheduler call).
STOP_S = 5.0


def serve(cfg: OrchestratorConfig, ready: threading.Event | None = None, stop: threading.Event | None = None) -> None:
    stop = stop or threading.Event()
    if threading.current_thread() is threading.main_thread():
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, lambda *_: stop.set())  # only a flag: shutdown happens below
        os.umask(0o077)
    creds = cfg.credentials()
    try:
        state = State(cfg.state)
    except sqlite3.Error as e:
        raise UsageError(f"the orchestrator's database {cfg.state} cannot be used: {e}.") from e
    o = Orchestrator(cfg, state, creds)
    o.scheduler.check()
    health = Health()
    server, tls = rpc_server(
        creds, AuthInterceptor(creds.secret, cfg.audiences, health), connections=cfg.max_connections
    )
    pb_grpc.add_OrchestratorServicer_to_server(Service(o), server)
    listen(server, cfg.listen, tls, "listen", "orchestrator")
    probes = None
    if cfg.health_listen:
        probes = grpc_probes(health, cfg.health_listen)
    hook = _webhook(cfg, o)
    scrapes = _metrics(cfg)
    for http in (hook, scrapes):
        if http is not None:
            threading.Thread(target=http.serve_forever, name="http", daemon=True).start()
    loop = threading.Thread(target=o.run, name="orchestrator", daemon=True)
    loop.start()
    in_step = threading.Thread(target=o.keep_in_step, name="scheduler", daemon=True)
    in_step.start()
    server.start()
    health.serving = True
    log.info("orchestrator serving on %s (mutual TLS)", cfg.listen)
    if ready is not None:
        ready.set()
    try:
        stop.wait()
    finally:
        health.serving = False
        o.stop.set()
        o.wake.set()
        deadline = time.monotonic() + STOP_S
        server.stop(1.0).wait(STOP_S)
        for http in (hook, scrapes):
            if http is not None:
                http.shutdown()
                http.server_close()
        if probes is not None:
            probes.stop(0)
        for thread in (loop, in_step):
            thread.join(max(0.0, deadline - time.monotonic()))
        busy = [t.name for t in (loop, in_step) if t.is_alive()]
        if busy:  # (a call to an agent or to the scheduler under way: the database has every decision)
            log.info("orchestrator stopped with %s still waiting on a call; its next start resumes", busy)
        else:
            state.close()
            log.info("orchestrator stopped")


def grpc_probes(health: Health, address: str) -> grpc.Server:
    probes = probe_server(health)
    listen(probes, address, None, "serve health checks", "orchestrator")
    probes.start()
    return probes
