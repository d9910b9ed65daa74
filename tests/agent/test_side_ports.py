"""The agent's side ports against a local user: the metrics port serves scrapes with bounded
connections, each within a deadline in all; strangers' connections that say nothing, or
trickle, cost no thread beyond that bound and keep no other scrape out."""

from __future__ import annotations

import http.client
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest

from support.agents import agent_config, free_port, serving
from support.helpers import NOBODY
from tpagent.common import metrics

TRICKLE = Path(__file__).resolve().parent.parent / "attackers" / "trickle_peer.py"


@pytest.fixture
def metrics_port(tmp_path: Path) -> Iterator[int]:
    port = free_port()
    stop = serving(agent_config(tmp_path, "a", metrics_listen=f"127.0.0.1:{port}"))
    yield port
    stop.set()


def _scrape(port: int, source: str) -> str:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10, source_address=(source, 0))
    try:
        conn.request("GET", "/metrics")
        reply = conn.getresponse()
        assert reply.status == 200
        return reply.read().decode()
    finally:
        conn.close()


def test_idle_and_trickling_connections_to_the_metrics_port_are_bounded(metrics_port: int) -> None:
    """A local user keeps 64 connections from eight loopback addresses, a byte every half second,
    opening again each one that is cut: the port's threads stay bounded, and scrapes from a
    ninth address and from one of the eight are served all the same (before: 4 per address and
    16 in all were held for as long as the trickle lasted, and every other scrape was refused)."""
    before = threading.active_count()
    sources = [f"127.0.0.{i}" for i in range(1, 9)]
    cmd = [*NOBODY, sys.executable, "-I", "-S", str(TRICKLE), "127.0.0.1", str(metrics_port), "0.5", "8", *sources]
    p = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert p.stdout is not None and p.stdout.readline() == "ready\n"
        assert psutil.Process(p.pid).uids().real == 65534
        grown = 0
        watch_until = time.monotonic() + 1.0  # (watched over two rounds of its trickle and reconnects)
        while time.monotonic() < watch_until:
            grown = max(grown, threading.active_count() - before)
            time.sleep(0.01)
        # (held ones, and a few cut ones on their way out: not one per connection)
        assert grown <= 2 * metrics.SCRAPES_MAX, f"{grown} threads for the crowd's 64 connections"
        for source in ("127.0.0.9", "127.0.0.3"):
            assert "tpagent_migrations" in _scrape(metrics_port, source), f"a scrape from {source} was not served"
    finally:
        p.communicate("", timeout=30)
