"""The agent's Prometheus metrics (text format, served on ``metrics_listen``)."""

from __future__ import annotations

import socket
import threading
from collections import Counter
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from prometheus_client import CONTENT_TYPE_LATEST, REGISTRY, Gauge, Histogram, generate_latest
from prometheus_client import Counter as Metric

MIGRATIONS = Metric("tpagent_migrations", "Migrations run by this agent as the source, by outcome.", ["outcome"])
BYTES = Metric("tpagent_transfer_bytes", "Snapshot bytes moved on the wire, by direction.", ["direction"])
REFUSED = Metric(
    "tpagent_refused",
    "Calls and transfer connections refused before they proved themselves, by plane and reason.",
    ["plane", "reason"],
)
STAGE = Histogram(
    "tpagent_stage_seconds",
    "Duration of each migration stage.",
    ["stage"],
    buckets=(0.1, 0.25, 0.5, 1, 2.5, 5, 10, 25, 60, 120, 300, 600),
)
# (Both read at each scrape: tpagent/daemon/serve.py hands them the node's journal.)
FROZEN = Gauge(
    "tpagent_frozen_seconds",
    "How long the longest-frozen original this node holds for a migration has been frozen (0: none).",
)
UNRESOLVED = Gauge(
    "tpagent_unresolved_migrations",
    "Unfinished migrations that wait on the peer agent: as source, those no migrate call drives any more "
    "(the agent keeps asking the target, the original frozen); as target, restored copies held for their "
    "source's word.",
)


#: Scrapes served at once, at most; from one address, at most; seconds each may take to be read
#: (a connection that says nothing, or trickles, holds a place no longer).
SCRAPES_MAX = 16
SCRAPES_PER_PEER = 4
SCRAPE_WITHIN = 5.0


class _Scrape(BaseHTTPRequestHandler):
    timeout = SCRAPE_WITHIN  # (each read of the request)

    def do_GET(self) -> None:
        if self.path.partition("?")[0] not in ("/", "/metrics"):
            self.send_error(404)
            return
        body = generate_latest(REGISTRY)
        self.send_response(200)
        self.send_header("Content-Type", CONTENT_TYPE_LATEST)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 (http.server's name)
        pass


class MetricsServer(ThreadingHTTPServer):
    """The metrics port: a thread per scrape, but at most :data:`SCRAPES_MAX` of them and
    :data:`SCRAPES_PER_PEER` per address (more are closed at once), each read within
    :data:`SCRAPE_WITHIN` seconds."""

    daemon_threads = True
    request_queue_size = 64

    def __init__(self, host: str, port: int) -> None:
        self.address_family = socket.AF_INET6 if ":" in host else socket.AF_INET
        self.lock = threading.Lock()
        self.serving: Counter[str] = Counter()
        super().__init__((host, port), _Scrape)

    def verify_request(self, request: Any, client_address: Any) -> bool:
        peer = str(client_address[0])
        with self.lock:
            if self.serving.total() >= SCRAPES_MAX or self.serving[peer] >= SCRAPES_PER_PEER:
                REFUSED.labels("metrics", "too many").inc()
                return False
            self.serving[peer] += 1
        request.settimeout(SCRAPE_WITHIN)
        return True

    def process_request_thread(self, request: Any, client_address: Any) -> None:
        try:
            super().process_request_thread(request, client_address)
        finally:
            peer = str(client_address[0])
            with self.lock:
                self.serving[peer] -= 1
                if self.serving[peer] <= 0:
                    del self.serving[peer]
