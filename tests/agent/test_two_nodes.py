"""Two "nodes" as network namespaces joined by a veth pair: a workload launched on A is
dumped there, streamed by `tpagent send` to `tpagent receive` on B, restored on B, and runs on."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from conftest import needs_criu
from support.certs import node_certs
from support.helpers import ROOT, STATEFUL, kill_and_wait, wait_until

pytestmark = needs_criu


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True)


@pytest.fixture
def nodes() -> Iterator[tuple[str, str]]:
    tag = uuid.uuid4().hex[:6]
    a = f"tpa-{tag}"
    b = f"tpb-{tag}"
    _ip("netns", "add", a)
    _ip("netns", "add", b)
    try:
        _ip("link", "add", f"va-{tag}", "type", "veth", "peer", "name", f"vb-{tag}")
        _ip("link", "set", f"va-{tag}", "netns", a)
        _ip("link", "set", f"vb-{tag}", "netns", b)
        for ns, dev, addr in ((a, f"va-{tag}", "10.231.0.1/24"), (b, f"vb-{tag}", "10.231.0.2/24")):
            _ip("-n", ns, "addr", "add", addr, "dev", dev)
            _ip("-n", ns, "link", "set", dev, "up")
            _ip("-n", ns, "link", "set", "lo", "up")  # CRIU's restore needs a loopback
        yield a, b
    finally:
        for ns in (a, b):
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)


def _on(ns: str, *args: str, **kw: object) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        ["ip", "netns", "exec", ns, sys.executable, "-m", "cli.main", *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
        **kw,
    )  # type: ignore[call-overload, no-any-return]


def _lock_tables(ns: str) -> list[str]:
    """The nftables tables CRIU's network lock made in node ``ns``."""
    listed = subprocess.run(["ip", "netns", "exec", ns, "nft", "list", "tables"], capture_output=True, text=True)
    return [ln for ln in listed.stdout.splitlines() if "CRIU-" in ln]


@pytest.mark.parametrize("route", ["dump-then-send", "dump-streaming", "dump-streaming-tcp"])
def test_snapshot_moves_from_node_a_to_node_b_and_runs(nodes: tuple[str, str], tmp_path: Path, route: str) -> None:
    """dump-streaming: `tpagent dump --send-to` sends the images while CRIU still writes them;
    -tcp: a workload holding a TCP connection (both ends), whose network lock the dump then
    drops on A (sent elsewhere, it lives on there) and which keeps exchanging data on B."""
    a, b = nodes
    secret = tmp_path / "secret"
    secret.write_text(os.urandom(24).hex())
    secret.chmod(0o600)
    log = tmp_path / "w.log"
    workload = (
        [str(ROOT / "tests" / "workloads" / "tcp_echo.py"), str(log)]
        if "tcp" in route
        else [str(STATEFUL), str(log), "128"]
    )
    launched = _on(a, "launch", "--stdout", str(tmp_path / "w.out"), "--", sys.executable, *workload)
    assert launched.returncode == 0, launched.stderr
    root = int(launched.stdout)
    ticks = lambda: [int(ln.split()[1]) for ln in log.read_text().splitlines() if ln.startswith("tick ")]  # noqa: E731
    try:
        wait_until(lambda: log.exists() and len(ticks()) > 5, "the workload to run on node A")
        env = {
            **os.environ,
            "TPAGENT_SECRET_FILE": str(secret),
            "TPAGENT_TLS_DIR": str(node_certs(tmp_path, "a", "10.231.0.1")),
        }
        env_b = {
            **env,
            "TPAGENT_TLS_DIR": str(node_certs(tmp_path, "b", "10.231.0.2")),
        }  # (A checks it names 10.231.0.2)
        receiver = subprocess.Popen(
            [
                "ip",
                "netns",
                "exec",
                b,
                sys.executable,
                "-m",
                "cli.main",
                "receive",
                "--listen",
                "10.231.0.2:7411",
                "--out",
                str(tmp_path / "on-b"),
                "--json",
                "--timeout",
                "120",
            ],
            cwd=ROOT,
            env=env_b,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        try:
            assert receiver.stderr is not None
            assert "listening on" in receiver.stderr.readline()
            if route == "dump-then-send":
                dumped = _on(a, "dump", str(root), "--out", str(tmp_path / "on-a"))
                assert dumped.returncode == 0, dumped.stderr
                sent = _on(a, "send", str(tmp_path / "on-a"), "10.231.0.2:7411", "--json", env=env)
            else:
                sent = _on(
                    a,
                    "dump",
                    str(root),
                    "--out",
                    str(tmp_path / "on-a"),
                    "--send-to",
                    "10.231.0.2:7411",
                    "--json",
                    env=env,
                )
            assert sent.returncode == 0, sent.stderr
            assert _lock_tables(a) == [], "the dump's network lock stayed on the node the workload left"
            stopped = ticks()[-1]
            out, _ = receiver.communicate(timeout=120)
            assert receiver.returncode == 0
        finally:
            if receiver.poll() is None:
                receiver.kill()
                receiver.communicate()
        on_a = {p.relative_to(tmp_path / "on-a"): p.read_bytes() for p in (tmp_path / "on-a").rglob("*.img")}
        on_b = {p.relative_to(tmp_path / "on-b"): p.read_bytes() for p in (tmp_path / "on-b").rglob("*.img")}
        assert on_a and on_a == on_b  # the images arrived as CRIU finished them
        assert (
            json.loads(out)["bytes_raw"]
            == sum(len(v) for v in on_b.values()) + (tmp_path / "on-b/manifest.json").stat().st_size
        )

        restored = _on(b, "restore", str(tmp_path / "on-b"), "--json")
        assert restored.returncode == 0, restored.stderr
        root = json.loads(restored.stdout)["pid"]
        wait_until(lambda: ticks()[-1] > stopped + 10, "the workload to run on node B")
        seq = ticks()
        assert seq == list(range(len(seq)))  # on B it went on from the step it stopped at on A
        if "tcp" in route:  # (each tick's echo came back over the connection, intact)
            assert all(ln.split()[1] == ln.split()[3] for ln in log.read_text().splitlines() if ln.startswith("tick"))
        net_b = os.stat(f"/run/netns/{b}").st_ino
        assert os.stat(f"/proc/{root}/ns/net").st_ino == net_b  # and it really lives on node B
    finally:
        kill_and_wait(root)
