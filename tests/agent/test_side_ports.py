"""The agent's side ports against a local user: the metrics port serves scrapes with bounded
connections, per address and in all, each read within a deadline; strangers' connections that
say nothing, or trickle, cost no thread beyond those bounds."""

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
    before = threading.active_count()
    cmd = [*NOBODY, sys.executable, "-I", "-S", str(TRICKLE), "127.0.0.1", str(metrics_port), "0.5", "150", "127.0.0.1"]
    p = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert p.stdout is not None and p.stdout.readline() == "ready\n"
        assert psutil.Process(p.pid).uids().real == 65534
        grown = 0
        watch_until = time.monotonic() + 1.0  # (watched over two rounds of its trickle and reconnects)
        while time.monotonic() < watch_until:
            grown = max(grown, threading.active_count() - before)
            time.sleep(0.01)
        assert grown <= metrics.SCRAPES_PER_PEER, f"{grown} threads for one address's connections"
        assert "tpagent_migrations" in _scrape(metrics_port, "127.0.0.2"), "another address was not served"
    finally:
        p.communicate("", timeout=30)
