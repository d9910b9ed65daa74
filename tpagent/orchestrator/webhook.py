"""Prometheus Alertmanager's webhook (``webhook_configs`` of a receiver, its JSON format version 4):
a site's own alerts taint and untaint nodes and GPUs.

    POST /alertmanager   Authorization: Bearer TOKEN    (the token in webhook_token_file)
    {"version": "4", "status": "firing", "alerts": [
        {"status": "firing" | "resolved", "labels": {"node": "gpu-17", "UUID": "GPU-...", ...},
         "annotations": {"summary": "..."}, "fingerprint": "..."}, ...]}

An alert names its node by the first of ``alert_node_labels`` it has (``instance``'s port is
dropped) and, optionally, a GPU by one of ``alert_gpu_labels``.  A firing alert taints what it
names (pre-emptive; the taint's source is the alert's fingerprint, so that each alert taints
once and its resolution removes its own taint only); a resolved one removes that taint.  The
whole message is checked before anything changes: a message that is not authenticated gets 401,
one that is malformed gets 400, each with one sentence saying why; an alert the orchestrator
refuses (a node or GPU it does not know) changes nothing and is named in the answer, the others
taken.  HTTPS with the orchestrator's certificate unless ``webhook_plaintext``.
"""

from __future__ import annotations

import contextlib
import hmac
import json
import logging
import socket
import ssl
import sys
import threading
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from host.hushed import Hushed
from tpagent.common.metrics import REFUSED
from tpagent.orchestrator.api import Refused, TaintKind, printable
from tpagent.orchestrator.core import Orchestrator
from tpagent_rank.strangers import Strangers

log = logging.getLogger(__name__)
#: Connections that broke in their handler (anyone may send bytes that are not TLS): once a second.
BROKE = Hushed(log)
#: Calls without the bearer token (anyone may make them): once a second, each counted.
UNKNOWN = Hushed(log)
PATH = "/alertmanager"
BODY_MAX = 1 << 20
ALERTS_MAX = 1000
READ_WITHIN = 10.0
REQUEST_WITHIN = 30.0
#: Connections held at once before their bearer token is read (each a thread); a newcomer past
#: them cuts the oldest of the address holding most (:mod:`tpagent_rank.strangers`).
CONNECTIONS_MAX = 16


@dataclass(frozen=True)
class Alert:
    firing: bool
    node: str
    gpu: str
    source: str  # "alert:FINGERPRINT"
    reason: str


def alerts_of(body: bytes, node_labels: tuple[str, ...], gpu_labels: tuple[str, ...]) -> list[Alert]:
    """The alerts of one webhook message; :class:`Refused` (one sentence) if it is malformed."""
    try:
        doc = json.loads(body)
    except (ValueError, UnicodeDecodeError) as e:
        raise Refused(f"the message is not JSON ({e}).") from e
    except RecursionError as e:  # ("[" * 100000: nested deeper than the parser goes)
        raise Refused("the message is not JSON this webhook reads: it is nested too deeply.") from e
    if not isinstance(doc, dict) or not isinstance(doc.get("alerts"), list):
        raise Refused("the message is not Alertmanager's webhook JSON: it has no list of alerts.")
    if str(doc.get("version", "")) != "4":
        raise Refused(f"Alertmanager webhook version {printable(repr(doc.get('version')), 64)} is not known; 4 is.")
    if len(doc["alerts"]) > ALERTS_MAX:
        raise Refused(f"the message holds more than {ALERTS_MAX} alerts.")
    out = []
    for i, a in enumerate(doc["alerts"]):
        labels = a.get("labels") if isinstance(a, dict) else None
        if not isinstance(labels, dict) or a.get("status") not in ("firing", "resolved"):
            raise Refused(f"alert {i} has no labels or no status firing or resolved.")
        name = printable(str(labels.get("alertname", "?")), 64)
        node = next((str(labels[k]) for k in node_labels if labels.get(k)), "")
        if not node:
            raise Refused(f"alert {i} ({name}) names no node (labels: {', '.join(node_labels)}).")
        if labels.get("instance") == node and ":" in node:
            node = node.rpartition(":")[0]  # (instance is HOST:PORT)
        gpu = next((str(labels[k]) for k in gpu_labels if labels.get(k)), "")
        fingerprint = printable(str(a.get("fingerprint") or labels.get("alertname", "")), 64)
        notes = a.get("annotations") if isinstance(a.get("annotations"), dict) else {}
        summary = str(notes.get("summary") or notes.get("description") or "")
        reason = f"alert {name}" + (f": {summary}" if summary else "")
        out.append(
            Alert(a["status"] == "firing", printable(node), printable(gpu), f"alert:{fingerprint}", printable(reason))
        )
    return out


def apply(o: Orchestrator, alerts: list[Alert]) -> list[str]:
    """Taint and untaint as the alerts say, each alert once (one said twice in a message: the
    second changes nothing).  An alert the orchestrator refuses (naming a node or GPU that never
    reported) changes nothing and is named in the answer: Alertmanager groups alerts of several
    hosts in one message and never sends again what was refused, so the others are taken."""
    done = []
    taints = {(t.node, t.gpu, t.source) for t in o.state.taints()}
    for a in alerts:
        key = (a.node, a.gpu, a.source)
        try:
            if a.firing and key not in taints:
                o.taint(a.node, a.gpu, a.reason, TaintKind.PREEMPTIVE, a.source)
                taints.add(key)
                done.append(f"tainted {a.node}")
            elif not a.firing and key in taints:
                o.untaint(a.node, a.gpu, a.source)
                taints.discard(key)
                done.append(f"untainted {a.node}")
            else:
                o.check(a.node, a.gpu)
        except Refused as e:
            log.warning("an alert was not taken: %s", e)
            done.append(f"ignored: {str(e).rstrip('.')}")
    return done


class _Handler(BaseHTTPRequestHandler):
    server: Webhook
    timeout = READ_WITHIN

    def handle(self) -> None:
        # Each read has READ_WITHIN; the whole request, REQUEST_WITHIN: one sent a byte at a time
        # holds its place no longer.
        cut = threading.Timer(REQUEST_WITHIN, self._cut)
        cut.start()
        try:
            super().handle()
        finally:
            cut.cancel()

    def _cut(self) -> None:
        with contextlib.suppress(OSError):
            self.connection.shutdown(socket.SHUT_RDWR)

    def _answer(self, code: int, text: str) -> None:
        body = (json.dumps({"message": text}) + "\n").encode()
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_POST(self) -> None:
        if self.path.partition("?")[0] != PATH:
            self._answer(404, f"the webhook is at {PATH}.")
            return
        given = self.headers.get("Authorization", "")
        if not hmac.compare_digest(given.encode(), f"Bearer {self.server.token}".encode()):
            UNKNOWN.warning("refused a webhook call from %s: no or a wrong bearer token", self.client_address[0])
            REFUSED.labels("webhook", "token").inc()
            self._answer(401, "refused: no or a wrong bearer token (Authorization: Bearer, webhook_token_file).")
            return
        if not self.server.strangers.leave(self.connection):
            return  # (cut meanwhile, for a newcomer: its peer is told nothing more)
        try:
            size = int(self.headers.get("Content-Length", "-1"))
        except ValueError:
            size = -1
        if not 0 <= size <= BODY_MAX:
            self._answer(400, f"give the message's Content-Length, at most {BODY_MAX} bytes.")
            return
        o = self.server.orchestrator
        try:
            alerts = alerts_of(self.rfile.read(size), o.cfg.alert_node_labels, o.cfg.alert_gpu_labels)
            with self.server.lock:  # (one message at a time: its check and its changes together)
                done = apply(o, alerts)
        except Refused as e:
            log.warning("refused a webhook message: %s", e)
            self._answer(400, str(e))
            return
        self._answer(200, "; ".join(done) or "nothing to change")

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 (http.server's name)
        pass


class Webhook(ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self, address: tuple[str, int], orchestrator: Orchestrator, token: str, tls: ssl.SSLContext | None):
        self.orchestrator = orchestrator
        self.token = token
        self.lock = threading.Lock()
        self.strangers = Strangers(CONNECTIONS_MAX, REQUEST_WITHIN)  # (each _Handler's timer cuts it in time)
        self.address_family = socket.AF_INET6 if ":" in address[0] else socket.AF_INET
        super().__init__(address, _Handler)
        if tls is not None:
            self.socket = tls.wrap_socket(self.socket, server_side=True, do_handshake_on_connect=False)

    def verify_request(self, request: Any, client_address: Any) -> bool:
        self.strangers.admit(request, str(client_address[0]))
        return True

    def handle_error(self, request: Any, client_address: Any) -> None:
        """A connection that broke in its handler (not TLS, a broken TLS record, reset): one
        line, at most once a second, not socketserver's traceback on stderr for each; anything
        else (a fault of the orchestrator's own) logged with its traceback."""
        error = sys.exc_info()[1]
        if isinstance(error, OSError):  # (ssl.SSLError is one)
            BROKE.warning("a webhook connection from %s broke: %s", client_address[0], error)
        else:
            log.error("the webhook failed a call from %s", client_address[0], exc_info=error)

    def shutdown_request(self, request: Any) -> None:  # (each call's end, answered or not)
        self.strangers.leave(request)
        super().shutdown_request(request)
