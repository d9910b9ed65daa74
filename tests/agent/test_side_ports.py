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

import grpc
import psutil
import pytest

from support.agents import agent_config, free_port, serving
from support.helpers import NOBODY
from tpagent.common import metrics

TRICKLE = Path(__file__).resolve().parent.parent / "attackers" / "trickle_peer.py"
H2_STREAMS = TRICKLE.parent / "h2_streams.py"


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


def test_streams_a_stranger_never_ends_on_the_probe_port_hold_no_memory(tmp_path: Path) -> None:
    """nobody opens 200 000 Health/Check streams on four plain-text connections (15 bytes each,
    never ended, their answers never read): gRPC's core held each, and the agent grew by about
    250 MB (52 MB to 539 MB for twice as many).  The probe port now lets a connection have 4
    streams at once and refuses calls past 8; the agent grows by little, and a probe is answered."""
    cfg = agent_config(tmp_path, "a", health_listen=f"127.0.0.1:{free_port()}")
    stop = serving(cfg)
    me = psutil.Process()
    before = me.memory_info().rss
    host, port = cfg.health_listen.split(":")
    cmd = [*NOBODY, "/usr/bin/python3", "-I", "-S", str(H2_STREAMS), host, port, "4", "10", "400000"]
    p = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert p.stdout is not None
        sent = p.stdout.readline().split()
        assert sent[0] == "sent" and int(sent[2]) >= 100_000, sent
        grown = (me.memory_info().rss - before) >> 20
        assert grown < 100, f"the agent grew by {grown} MB for a stranger's never-ended streams"
        assert _health(cfg.health_listen) == 1  # SERVING
    finally:
        p.communicate("", timeout=30)
        stop.set()


def _health(address: str) -> int:
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    with grpc.insecure_channel(address) as channel:
        return int(health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=10).status)
