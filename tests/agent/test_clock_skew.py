"""Two nodes' clocks apart by more than the signature window (tpagent/common/clock.py).

CLOCK_REALTIME cannot be given a namespace of its own, so a node's clock is stepped with the
agent's test hook TPAGENT_TEST_CLOCK_OFFSET_FILE (seconds added to the clock its signatures
and checks read; a `tpagent` command run "on" that node gets it too)."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from conftest import needs_criu
from support.cluster import Cluster, Ticker
from support.helpers import ROOT, kill_and_wait, slow_restore_criu, wait_until

pytestmark = needs_criu
HOOK = "TPAGENT_TEST_CLOCK_OFFSET_FILE"


@pytest.fixture
def cluster(tmp_path: Path) -> Iterator[Cluster]:
    c = Cluster(tmp_path, ["A", "B"])
    try:
        for name, node in c.nodes.items():
            (tmp_path / f"clock-{name}").write_text("0")
            node.env[HOOK] = str(tmp_path / f"clock-{name}")
        yield c
    finally:
        c.close()


def _on_a(cluster: Cluster, *args: str) -> subprocess.Popen[str]:
    """A `tpagent` command run on node A (its clock)."""
    env = {**cluster.cli_env("A"), HOOK: cluster.nodes["A"].env[HOOK]}
    return subprocess.Popen(
        [sys.executable, "-m", "cli.main", *args],
        cwd=ROOT,
        env=env,
        text=True,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )


def _migrate_args(cluster: Cluster, pid: int, *extra: str) -> list[str]:
    a = cluster.nodes["A"]
    b = cluster.nodes["B"]
    return ["migrate", str(pid), "--from", a.agent_address, "--to", b.agent_address, "--json", *extra]


def test_a_migration_does_not_start_between_clocks_apart(cluster: Cluster, tmp_path: Path) -> None:
    a = cluster.nodes["A"]
    b = cluster.nodes["B"]
    (tmp_path / "clock-A").write_text("100")  # A's clock runs 100 s ahead of B's
    for node in (a, b):
        node.start_agent()
    ticker = Ticker.launch(a, tmp_path, mib=64)
    try:
        out, err = _on_a(cluster, "node", "--agent", b.agent_address).communicate(timeout=60)
        offset = json.loads(out)["clock_offset_seconds"]
        assert -110 < offset < -90 and re.search(r"is (9\d|1\d\d)\.\d s behind this machine's", err), err  # from A

        named = re.compile(
            rf"the clock of {re.escape(b.agent_address)} is (9\d|1\d\d)\.\d s behind this node's, more than"
        )
        out, err = _on_a(cluster, *_migrate_args(cluster, ticker.pid, "--dry-run")).communicate(timeout=120)
        problems = json.loads(out)["problems"]
        assert len(problems) == 1 and named.search(problems[0]), problems
        out, err = _on_a(cluster, *_migrate_args(cluster, ticker.pid)).communicate(timeout=120)
        doc = json.loads(out)
        assert doc["state"] == "failed" and named.search(doc["message"]), doc
        ticker.assert_one_copy_continuous()  # never frozen
        assert "signing calls to it on its clock" in a.agent_log()  # (the calls went through: the check refused)
    finally:
        kill_and_wait(ticker.pid)


def test_a_clock_step_mid_migration_still_ends_with_one_copy(cluster: Cluster, tmp_path: Path) -> None:
    """A's clock steps 100 s ahead while B restores the copy: every call between the two is
    refused once for its timestamp, then signed on the other's clock; the migration commits."""
    a = cluster.nodes["A"]
    b = cluster.nodes["B"]
    slow, started = slow_restore_criu(tmp_path, 3)
    a.start_agent()
    b.start_agent(criu=str(slow), takeover_after="0")  # (B never starts its copy on its own here)
    ticker = Ticker.launch(a, tmp_path, mib=64)
    try:
        mig = _on_a(cluster, *_migrate_args(cluster, ticker.pid))
        wait_until(started.exists, "B to restore the copy", 120)
        (tmp_path / "clock-A").write_text("100")  # the step, past the 60 s window
        out, err = mig.communicate(timeout=120)
        doc = json.loads(out)
        assert mig.returncode == 0 and doc["state"] == "done", (doc, err, a.agent_log()[-3000:])
        ticker.pid = doc["new_pid"]
        ticker.assert_one_copy_continuous()
        ticker.verify_state()
        assert Path(f"/proc/{ticker.pid}/ns/net").stat().st_ino == Path(f"/run/netns/{b.name}").stat().st_ino
        assert "is 100.0 s ahead of this agent's clock, outside the 60 s window" in b.agent_log()  # A's call, refused
        assert "signing calls to it on its clock" in a.agent_log()  # ... then signed on B's clock
    finally:
        kill_and_wait(ticker.pid)
