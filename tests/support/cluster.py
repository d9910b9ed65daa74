"""Several "nodes" on one machine: network namespaces on a bridge, each running `tpagent serve`."""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import shutil
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import psutil
from grpc_health.v1 import health_pb2, health_pb2_grpc

from support.certs import node_certs
from support.helpers import ROOT, STATEFUL, wait_until


def ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True)


@dataclass
class Node:
    name: str  # the network namespace
    addr: str  # its IP on the bridge
    dev: str  # its end of the veth pair (inside the namespace)
    work: Path
    secret: Path
    tls: Path  # ca.crt, tls.crt, tls.key of this node
    env: dict[str, str] = field(default_factory=dict)
    agent: subprocess.Popen[bytes] | None = None

    @property
    def agent_address(self) -> str:
        return f"{self.addr}:7400"

    @property
    def health_address(self) -> str:
        return f"{self.addr}:7401"

    def exec(self, *args: str) -> list[str]:
        return ["ip", "netns", "exec", self.name, *args]

    def launch(self, stdout: Path, *cmd: str, timeout: float = 120) -> int:
        """``cmd`` started on this node under `tpagent launch` (its output in ``stdout``): its PID."""
        out = subprocess.run(
            self.exec(sys.executable, "-m", "cli.main", "launch", "--stdout", str(stdout), "--", *cmd),
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=timeout,
        )
        assert out.returncode == 0, out.stderr
        return int(out.stdout)

    def start_agent(self, listen: str = "", **settings: str) -> None:
        """``listen``: where it serves (default: its address, port 7400; "0.0.0.0:7400": the loopback too,
        where `tpagent rank` finds it by default)."""
        self.spawn_agent(listen, **settings)
        self.wait_serving()

    def spawn_agent(self, listen: str = "", **settings: str) -> None:
        """The agent started, not waited for (:meth:`wait_serving`): several nodes' start at once."""
        settings = {"metrics_listen": "", **settings}  # (no metrics unless a test asks)
        env = {**os.environ, **self.env, **{f"TPAGENT_{k.upper()}": v for k, v in settings.items()}}
        with open(self.work / "agent.log", "ab") as log:
            self.agent = subprocess.Popen(
                self.exec(
                    sys.executable,
                    "-m",
                    "cli.main",
                    "serve",
                    "--listen",
                    listen or self.agent_address,
                    "--advertise",
                    self.addr,
                    "--node",
                    self.name,
                    "--work-dir",
                    str(self.work / "agent"),
                    "--secret-file",
                    str(self.secret),
                    "--tls-dir",
                    str(self.tls),
                    "--health-listen",
                    self.health_address,
                ),
                cwd=ROOT,
                env=env,
                stdout=log,
                stderr=log,
                stdin=subprocess.DEVNULL,
            )

    def wait_serving(self) -> None:
        wait_until(self._serving, f"the agent of {self.name} to serve", 60)

    def _serving(self) -> bool:
        assert self.agent is not None
        if self.agent.poll() is not None:
            raise AssertionError(f"the agent of {self.name} exited: {(self.work / 'agent.log').read_text()[-3000:]}")
        # (asked from this process: a probe process of its own each time cost more than the agent's start)
        with grpc.insecure_channel(self.health_address) as channel:
            try:
                answer = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=2)
            except grpc.RpcError:
                return False
        return bool(answer.status == health_pb2.HealthCheckResponse.SERVING)

    def kill_agent(self, sig: signal.Signals = signal.SIGKILL, wait: bool = True) -> None:
        """Only the agent's own process, as a crash would: CRIU runs in a session of its own.
        ``wait``: until it has exited (else the caller waits, :meth:`wait_agent`)."""
        if self.agent is not None and self.agent.poll() is None:
            # `ip netns exec` execs the agent: the Popen PID is the agent itself.
            os.kill(self.agent.pid, sig)
        if wait:
            self.wait_agent()

    def wait_agent(self) -> None:
        if self.agent is not None:
            self.agent.wait(30)

    def processes(self) -> list[psutil.Process]:
        """Every process in this node's network namespace (its agent, CRIU, workloads)."""
        ns = Path(f"/run/netns/{self.name}").stat().st_ino
        out = []
        for p in psutil.process_iter():
            try:
                if os.stat(f"/proc/{p.pid}/ns/net").st_ino == ns:
                    out.append(p)
            except OSError:
                continue
        return out

    def processes_and_children(self) -> list[psutil.Process]:
        """:meth:`processes` and whatever descends from them wherever it runs (a CRIU restore
        between namespaces was once missed, and outlived its test stopped)."""
        out = {p.pid: p for p in self.processes()}
        for p in list(out.values()):
            with contextlib.suppress(psutil.Error):
                out.update((c.pid, c) for c in p.children(recursive=True))
        return list(out.values())

    def reboot(self) -> None:
        """What a power cycle does to this node: every process of it stopped at once, then
        killed (workloads, frozen or not, never run again; CRIU and its hook die with them),
        and what its tmpfs held gone: the snapshots in flight.  The journal is on persistent
        storage (work/agent/migrations) and stays.  The agent is not started again."""
        for _ in range(3):  # (stopped first, so that nothing runs on once CRIU is gone)
            for p in self.processes_and_children():
                with contextlib.suppress(psutil.Error):
                    p.send_signal(signal.SIGSTOP)
        procs = self.processes_and_children()
        for p in procs:
            with contextlib.suppress(psutil.Error):
                p.kill()
        if self.agent is not None:
            self.agent.wait(30)  # (our child: reaped here, else it stays a zombie)
        psutil.wait_procs(procs, timeout=30)
        for d in ("incoming", "outgoing"):
            shutil.rmtree(self.work / "agent" / d, ignore_errors=True)

    def link(self, up: bool) -> None:
        ip("-n", self.name, "link", "set", self.dev, "up" if up else "down")

    def agent_log(self) -> str:
        return (self.work / "agent.log").read_text(errors="replace")


def _claim_subnet() -> tuple[int, int]:
    """A /24 of 10.233.0.0/16 no other cluster on this machine uses (several test runs may
    share it: helpers, a second checkout), held by an flock for the cluster's life."""
    locks = Path("/run/tpagent-tests")
    locks.mkdir(mode=0o700, exist_ok=True)
    for k in range(250):
        fd = os.open(locks / f"net-{k}.lock", os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            continue
        _clear_leftovers(k)
        return k, fd
    raise AssertionError("no free test subnet in 10.233.0.0/16")


def _clear_leftovers(k: int) -> None:
    """What a run killed before its clusters closed left on subnet ``k``, whose lock we now hold
    (so no live cluster owns it): its bridge would route 10.233.k.0/24 away from ours, and no
    agent of ours could be reached.  Its bridge goes, with its nodes and what still runs in them."""
    links = subprocess.run(["ip", "-j", "addr", "show", "type", "bridge"], capture_output=True, text=True, check=True)
    for link in json.loads(links.stdout or "[]"):
        name = link["ifname"]
        if not name.startswith("tpbr-"):
            continue
        if not any(a.get("local") == f"10.233.{k}.254" for a in link.get("addr_info", [])):
            continue
        tag = name.removeprefix("tpbr-")
        for ns in Path("/run/netns").glob(f"tp*-{tag}"):
            pids = subprocess.run(["ip", "netns", "pids", ns.name], capture_output=True, text=True).stdout.split()
            for pid in pids:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(int(pid), signal.SIGKILL)
            subprocess.run(["ip", "netns", "del", ns.name], capture_output=True)
        subprocess.run(["ip", "link", "del", name], capture_output=True)


class Cluster:
    def __init__(self, tmp: Path, names: list[str], ifname: str = "") -> None:
        """``ifname``: the name of every node's interface (by default one per node); a job's
        ranks name it in GLOO_SOCKET_IFNAME, which must hold on whatever node they run."""
        self.tag = uuid.uuid4().hex[:6]
        self.net, self._net_lock = _claim_subnet()
        self.bridge_addr = f"10.233.{self.net}.254"  # the host's end: test proxies listen there
        self.bridge = f"tpbr-{self.tag}"
        self.secret = tmp / "secret"
        self.secret.write_text(os.urandom(24).hex())
        self.secret.chmod(0o600)  # (the agent refuses a secret others can read)
        self.tmp = tmp
        self.nodes: dict[str, Node] = {}
        ip("link", "add", self.bridge, "type", "bridge")
        ip("addr", "add", f"{self.bridge_addr}/24", "dev", self.bridge)
        ip("link", "set", self.bridge, "up")
        for i, name in enumerate(names, start=1):
            ns = f"tp{name}-{self.tag}"
            host_end = f"h{name}-{self.tag}"
            dev = f"n{name}-{self.tag}"
            ip("netns", "add", ns)
            ip("link", "add", host_end, "type", "veth", "peer", "name", dev)
            ip("link", "set", dev, "netns", ns)
            if ifname:
                ip("-n", ns, "link", "set", dev, "name", ifname)
                dev = ifname
            ip("link", "set", host_end, "master", self.bridge)
            ip("link", "set", host_end, "up")
            addr = f"10.233.{self.net}.{i}"
            ip("-n", ns, "addr", "add", f"{addr}/24", "dev", dev)
            ip("-n", ns, "link", "set", dev, "up")
            ip("-n", ns, "link", "set", "lo", "up")
            work = tmp / name
            work.mkdir()
            # (the bridge's address too: test proxies listen there)
            self.nodes[name] = Node(ns, addr, dev, work, self.secret, node_certs(tmp, ns, addr, self.bridge_addr))

    @classmethod
    @contextlib.contextmanager
    def with_agents(cls, tmp: Path, names: list[str]) -> Iterator[Cluster]:
        """Nodes ``names``, each with its agent started; all closed on leaving."""
        c = cls(tmp, names)
        try:
            c.start_agents()
            yield c
        finally:
            c.close()

    def start_agents(self, listen: str = "", **settings: str) -> None:
        """Every node's agent, with the same settings, started at once, then waited for."""
        for node in self.nodes.values():
            node.spawn_agent(listen, **settings)
        for node in self.nodes.values():
            node.wait_serving()

    def close(self) -> None:
        for node in self.nodes.values():  # (all told at once, then waited for)
            node.kill_agent(signal.SIGTERM, wait=False)
        for node in self.nodes.values():
            node.wait_agent()
        for node in self.nodes.values():  # what a failed test left there (a CRIU holding a tree ...) dies too
            for p in node.processes_and_children():
                with contextlib.suppress(psutil.Error):
                    p.kill()
        for node in self.nodes.values():
            subprocess.run(["ip", "netns", "del", node.name], capture_output=True)
        subprocess.run(["ip", "link", "del", self.bridge], capture_output=True)
        os.close(self._net_lock)

    def _migrate_cmd(self, pid: int, src: str, dst: str, *extra: str) -> list[str]:
        return [
            sys.executable,
            "-m",
            "cli.main",
            "migrate",
            str(pid),
            "--from",
            self.nodes[src].agent_address,
            "--to",
            self.nodes[dst].agent_address,
            *extra,
        ]

    def cli_env(self, node: str = "", secret: Path | None = None) -> dict[str, str]:
        """The environment of a tpagent command run on ``node`` (its certificate; default: the first)."""
        tls = self.nodes[node].tls if node else next(iter(self.nodes.values())).tls
        return {**os.environ, "TPAGENT_SECRET_FILE": str(secret or self.secret), "TPAGENT_TLS_DIR": str(tls)}

    def migrate(
        self, pid: int, src: str, dst: str, *extra: str, timeout: float = 300, secret: Path | None = None
    ) -> subprocess.CompletedProcess[str]:
        env = self.cli_env(src, secret)
        return subprocess.run(
            self._migrate_cmd(pid, src, dst, *extra), cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout
        )

    def start_migrate(self, pid: int, src: str, dst: str, *extra: str) -> subprocess.Popen[str]:
        env = self.cli_env(src)
        return subprocess.Popen(
            self._migrate_cmd(pid, src, dst, *extra),
            cwd=ROOT,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )

    def receiving(self, dst: str, at_least: int = 32 << 20) -> bool:
        """True once node ``dst`` has received ``at_least`` bytes of a snapshot in flight."""
        incoming = self.nodes[dst].work / "agent" / "incoming"
        total = 0
        for d in incoming.glob(".*.partial-*"):
            for f in d.rglob("*"):
                try:
                    total += f.stat().st_blocks * 512 if f.is_file() else 0
                except OSError:
                    continue
        return total >= at_least


@dataclass
class Ticker:
    """tests/workloads/stateful.py launched on a node: its log says where it stands."""

    log: Path
    pid: int = 0

    @classmethod
    def launch(cls, node: Node, tmp: Path, mib: int = 256) -> Ticker:
        t = cls(tmp / "w.log")
        t.pid = node.launch(tmp / "w.out", sys.executable, str(STATEFUL), str(t.log), str(mib))
        wait_until(lambda: len(t.ticks()) > 5, "the workload to tick", 120)
        return t

    def ticks(self) -> list[int]:
        if not self.log.exists():
            return []
        return [int(ln.split()[1]) for ln in self.log.read_text().splitlines() if ln.startswith("tick ")]

    def verify_state(self) -> None:
        """The workload re-hashes its memory (SIGUSR1): it must equal the digest it started with."""
        lines = lambda: self.log.read_text().splitlines()  # noqa: E731
        before = sum(ln.startswith("verify ") for ln in lines())
        worker = psutil.Process(self.pid).children()[0]  # the namespace init's child
        os.kill(worker.pid, signal.SIGUSR1)
        wait_until(
            lambda: sum(ln.startswith("verify ") for ln in lines()) > before, "the workload to verify its memory"
        )
        digest = next(ln.split()[1] for ln in lines() if ln.startswith("digest "))
        assert [ln for ln in lines() if ln.startswith("verify ")][-1].split()[1] == digest, "its memory changed"

    def running_copies(self) -> int:
        """How many copies are ticking now: 0, 1, or 2 if the log's ticks repeat."""
        before = self.ticks()
        time.sleep(0.5)
        after = self.ticks()
        grew = len(after) > len(before)
        return (2 if len(after) != len(set(after)) else 1) if grew else 0

    def assert_one_copy_continuous(self) -> None:
        """Exactly one copy ticks, and it went on from where it stood: no step repeated or skipped."""
        wait_until(lambda: len(self.ticks()) > 10, "the workload to tick")
        n = len(self.ticks())
        wait_until(lambda: len(self.ticks()) > n + 10, "the workload to keep ticking")
        seq = self.ticks()
        assert seq == list(range(len(seq))), "ticks repeated or skipped: two copies ran, or one went back"
