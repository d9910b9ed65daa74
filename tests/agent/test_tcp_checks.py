"""TCP sockets that cannot survive the move are refused at check time (the dry run and the
migration's own check), in one sentence naming the socket, and the workload runs on untouched.
A tree holding both ends of its connections moves (tests/agent/test_migrate.py's TCP pair).
So is a unix socket bound to an abstract name that a process on the target already holds."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import pytest

from conftest import needs_criu
from support.cluster import Cluster, Node
from support.helpers import ROOT, kill_and_wait, wait_until

pytestmark = needs_criu
PEER = ROOT / "tests" / "workloads" / "tcp_peer.py"


@pytest.fixture
def cluster(tmp_path: Path) -> Iterator[Cluster]:
    with Cluster.with_agents(tmp_path, ["A", "B"]) as c:
        yield c


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
    return node.launch(tmp / "client.out", sys.executable, str(PEER), "client", str(log), connect, listen), log


def _pairs(log: Path) -> list[tuple[int, int]]:
    if not log.exists():
        return []
    return [(int(a), int(b)) for _, a, _, b in (ln.split() for ln in log.read_text().splitlines())]


@pytest.mark.parametrize("case", ["loopback-peer", "address-missing", "port-taken"])
def test_a_socket_the_target_cannot_take_is_refused_at_check(
    cluster: Cluster, helpers: Helpers, tmp_path: Path, case: str
) -> None:
    a = cluster.nodes["A"]
    b = cluster.nodes["B"]
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


# Binds a unix socket to the abstract name argv[2] (listening), then counts to the log argv[1].
ABSTRACT = """
import socket, sys, time
s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
s.bind("\\0" + sys.argv[2])
s.listen()
i = 0
while True:
    with open(sys.argv[1], "a") as log:
        log.write(f"tick {i}\\n")
    i += 1
    time.sleep(0.05)
"""


def test_an_abstract_unix_name_the_target_holds_is_refused_at_check(
    cluster: Cluster, helpers: Helpers, tmp_path: Path
) -> None:
    """What a CUDA process meets where a process moved from another node holds its driver's
    @cuda-uvmfd-NSINO-PID@: refused before anything is frozen, and the move works once the
    name is free there."""
    a = cluster.nodes["A"]
    b = cluster.nodes["B"]
    name = f"tpagent-test-{tmp_path.name}"
    holder = tmp_path / "holder.log"
    helpers.start(b.exec(sys.executable, "-c", ABSTRACT, str(holder), name))
    wait_until(holder.exists, "B's process to hold the name")
    log = tmp_path / "w.log"
    pid = a.launch(tmp_path / "w.out", sys.executable, "-c", ABSTRACT, str(log), name)
    ticks = lambda: [int(ln.split()[1]) for ln in log.read_text().split("\n")[:-1]] if log.exists() else []  # noqa: E731
    try:
        wait_until(lambda: len(ticks()) > 5, "the workload to run")
        named = f"the abstract unix socket @{name} is bound on {b.name} already, so the copy could not bind it there"
        dry = cluster.migrate(pid, "A", "B", "--dry-run", "--json")
        assert dry.returncode == 1, dry.stderr
        assert json.loads(dry.stdout)["problems"] == [named + ": pick another node, or end what holds it there"]
        run = cluster.migrate(pid, "A", "B", "--json")
        doc = json.loads(run.stdout)
        assert run.returncode == 1 and doc["state"] == "failed" and named in doc["message"], doc
        assert not list((b.work / "agent" / "incoming").glob("*")), "B was sent something"
        n = len(ticks())  # never frozen: it counts on, on A
        wait_until(lambda: len(ticks()) > n + 10, "the workload to go on")
        assert ticks() == list(range(len(ticks())))
        assert Path(f"/proc/{pid}/ns/net").stat().st_ino == Path(f"/run/netns/{a.name}").stat().st_ino

        helpers.close()  # (the name is free on B now: the same move goes through, the name with it)
        helpers.procs.clear()
        run = cluster.migrate(pid, "A", "B", "--json")
        assert run.returncode == 0, run.stdout + run.stderr
        pid = json.loads(run.stdout)["new_pid"]
        n = len(ticks())
        wait_until(lambda: len(ticks()) > n + 10, "the moved workload to go on")
        assert ticks() == list(range(len(ticks())))
        assert Path(f"/proc/{pid}/ns/net").stat().st_ino == Path(f"/run/netns/{b.name}").stat().st_ino
        bound = subprocess.run(b.exec("cat", "/proc/net/unix"), capture_output=True, text=True, check=True).stdout
        assert f"@{name}" in bound
    finally:
        kill_and_wait(pid)


def test_a_name_a_copy_in_flight_will_bind_is_refused_to_a_second(tmp_path: Path) -> None:
    """Two processes of two other nodes, each holding one name (a CUDA process's
    @cuda-uvmfd-NSINO-PID@), offered to one node at once: the second is refused while the first
    copy is in flight there (neither is bound there yet), and taken once the first is dropped."""
    from support.agents import agent_config, node_of
    from tpagent.migration.api import Offer

    node = node_of(agent_config(tmp_path, "C"))
    name = "@cuda-uvmfd-4026532000-2@"
    first = Offer("a" * 32, "A", "", 1 << 20, abstract_sockets=(name, "@other"))
    second = Offer("b" * 32, "B", "", 1 << 20, abstract_sockets=(name,))
    assert node.receive(first).problems == ()
    said = node.receive(replace(second, dry_run=True)).problems
    assert len(said) == 1 and said[0].startswith(
        f"the abstract unix socket {name} is to be bound on C by a copy it receives (the CUDA driver's"
    ), said
    assert node.receive(second).problems == said  # (and nothing is reserved for it)
    node.finish(first.migration_id, False)  # (the first copy is dropped: the name is free again)
    wait_until(lambda: not node.receive(replace(second, dry_run=True)).problems, "the name to be free")
    assert node.receive(second).problems == ()
    node.finish(second.migration_id, False)
