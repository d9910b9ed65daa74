"""TCP sockets that cannot survive the move are refused at check time (the dry run and the
migration's own check), in one sentence naming the socket, and the workload runs on untouched.
A tree holding both ends of its connections moves (tests/agent/test_migrate.py's TCP pair)."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from cluster import Cluster, Node
from conftest import needs_criu
from helpers import ROOT, kill_and_wait, wait_until

pytestmark = needs_criu
PEER = ROOT / "tests" / "workloads" / "tcp_peer.py"


@pytest.fixture
def cluster(tmp_path: Path) -> Iterator[Cluster]:
    c = Cluster(tmp_path, ["A", "B"])
    try:
        for node in c.nodes.values():
            node.start_agent()
        yield c
    finally:
        c.close()


class Helpers:
    """Processes a test starts outside the workload's tree (servers, port holders), killed after it."""

    def __init__(self, tmp: Path) -> None:
        self.tmp = tmp
        self.procs: list[subprocess.Popen[bytes]] = []

    def start(self, cmd: list[str]) -> None:
        self.procs.append(subprocess.Popen(cmd, stdin=subprocess.DEVNULL, start_new_session=True))

    def echo_server(self, node: Node | None, host: str) -> int:
        """An echo server on ``host`` (in ``node``'s namespace, or on the host itself): its port."""
        port_file = self.tmp / f"port{len(self.procs)}"
        cmd = [sys.executable, str(PEER), "server", host, str(port_file)]
        self.start(node.exec(*cmd) if node else cmd)
        wait_until(port_file.exists, "the echo server to listen")
        return int(port_file.read_text())

    def close(self) -> None:
        for p in self.procs:
            kill_and_wait(p.pid)
            p.wait(10)


@pytest.fixture
def helpers(tmp_path: Path) -> Iterator[Helpers]:
    h = Helpers(tmp_path)
    yield h
    h.close()


def _launch_client(node: Node, tmp: Path, connect: str, listen: str = "-") -> tuple[int, Path]:
    log = tmp / "client.log"
    out = subprocess.run(node.exec(sys.executable, "-m", "cli.main", "launch", "--stdout", str(tmp / "client.out"),
                                   "--", sys.executable, str(PEER), "client", str(log), connect, listen),
                         cwd=ROOT, capture_output=True, text=True, timeout=120)  # fmt: skip
    assert out.returncode == 0, out.stderr
    return int(out.stdout), log


def _pairs(log: Path) -> list[tuple[int, int]]:
    if not log.exists():
        return []
    return [(int(a), int(b)) for _, a, _, b in (ln.split() for ln in log.read_text().splitlines())]


@pytest.mark.parametrize("case", ["loopback-peer", "address-missing", "port-taken"])
def test_a_socket_the_target_cannot_take_is_refused_at_check(
    cluster: Cluster, helpers: Helpers, tmp_path: Path, case: str
) -> None:
    a, b = cluster.nodes["A"], cluster.nodes["B"]
    if case == "loopback-peer":  # its peer is a process beside it on A's loopback, not in its tree
        port = helpers.echo_server(a, "127.0.0.1")
        pid, log = _launch_client(a, tmp_path, f"127.0.0.1:{port}")
        named = re.compile(
            rf"127\.0\.0\.1:\d+ -> 127\.0\.0\.1:{port} \(PID \d+\) goes to a peer on this node's loopback"
        )
    elif case == "address-missing":  # its peer is off the node; its own address is A's, which B lacks
        port = helpers.echo_server(None, cluster.bridge_addr)
        pid, log = _launch_client(a, tmp_path, f"{cluster.bridge_addr}:{port}")
        named = re.compile(
            rf"TCP connection {re.escape(a.addr)}:\d+ -> {re.escape(cluster.bridge_addr)}:{port} is bound to "
            rf"{re.escape(a.addr)}, an address {b.name} does not have"
        )
    else:  # it listens on a port that a process on B already listens on
        helpers.start(b.exec(sys.executable, str(PEER), "client", str(tmp_path / "holder.log"), "-", "0.0.0.0:7455"))
        wait_until(lambda: _pairs(tmp_path / "holder.log"), "B's process to hold the port")
        pid, log = _launch_client(a, tmp_path, "-", "0.0.0.0:7455")
        named = re.compile(rf"TCP listening socket 0\.0\.0\.0:7455 needs port 7455, which is taken on {b.name}")
    try:
        wait_until(lambda: len(_pairs(log)) > 5, "the workload to run")
        dry = cluster.migrate(pid, "A", "B", "--dry-run", "--json")
        assert dry.returncode == 1, dry.stderr
        problems = json.loads(dry.stdout)["problems"]
        assert len(problems) == 1 and named.search(problems[0]), problems  # one sentence, naming the socket

        run = cluster.migrate(pid, "A", "B", "--json")
        assert run.returncode == 1, run.stderr
        doc = json.loads(run.stdout)
        assert doc["state"] == "failed" and named.search(doc["message"]) and "\n" not in doc["message"], doc
        assert not list((b.work / "agent" / "incoming").glob("*")), "B was sent something"

        n = len(_pairs(log))  # never frozen: it runs on, on A, its connection intact
        wait_until(lambda: len(_pairs(log)) > n + 10, "the workload to go on")
        seq = _pairs(log)
        assert [t for t, _ in seq] == list(range(len(seq))) and all(echo == t for t, echo in seq)
        assert Path(f"/proc/{pid}/ns/net").stat().st_ino == Path(f"/run/netns/{a.name}").stat().st_ino
    finally:
        kill_and_wait(pid)
