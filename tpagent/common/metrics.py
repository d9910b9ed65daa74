"""The agent's Prometheus metrics (text format, served on ``metrics_listen``)."""

from __future__ import annotations

import socket
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from prometheus_client import CONTENT_TYPE_LATEST, REGISTRY, Gauge, Histogram, generate_latest
from prometheus_client import Counter as Metric

from tpagent_rank.strangers import Strangers

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


#: Scrapes served at once, at most (a newcomer past them cuts the oldest of the address holding
#: most: :mod:`tpagent_rank.strangers`); seconds each may take in all, from its connection to its
#: answer's last byte (a connection that says nothing, or trickles, holds a place no longer).
SCRAPES_MAX = 16
SCRAPE_WITHIN = 5.0


class _Scrape(BaseHTTPRequestHandler):
    timeout = SCRAPE_WITHIN  # (each read of the request; the whole of it: MetricsServer.service_actions)

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
    """The metrics port: a thread per scrape, but at most :data:`SCRAPES_MAX` of them, each
    served within :data:`SCRAPE_WITHIN` seconds in all; a crowd or a trickle from some
    addresses never keeps another's scrape out."""

    daemon_threads = True
    request_queue_size = 64

    def __init__(self, host: str, port: int) -> None:
        self.address_family = socket.AF_INET6 if ":" in host else socket.AF_INET
        self.scrapes = Strangers(SCRAPES_MAX, SCRAPE_WITHIN)
        super().__init__((host, port), _Scrape)

    def verify_request(self, request: Any, client_address: Any) -> bool:
        if self.scrapes.admit(request, str(client_address[0])):
            REFUSED.labels("metrics", "cut for a newcomer").inc()
        request.settimeout(SCRAPE_WITHIN)
        return True

    def service_actions(self) -> None:  # (serve_forever's loop: twice a second)
        if cut := self.scrapes.expire():
            REFUSED.labels("metrics", "too slow").inc(cut)

    def shutdown_request(self, request: Any) -> None:  # (each scrape's end, served or not)
        self.scrapes.leave(request)
        super().shutdown_request(request)
