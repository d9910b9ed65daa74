"""A migration left unresolved (the target went away mid-restore): operators see it in the
metrics, SIGTERM still stops the agent (the journal keeps it), the next start takes it up,
and it ends with exactly one running copy once the target is back."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest

from conftest import needs_criu
from support.cluster import Cluster, Node, Ticker
from support.helpers import kill_and_wait, slow_restore_criu, wait_until

pytestmark = needs_criu
GAUGES = ("tpagent_frozen_seconds", "tpagent_unresolved_migrations")


@pytest.fixture
def cluster(tmp_path: Path) -> Iterator[Cluster]:
    c = Cluster(tmp_path, ["A", "B"])
    try:
        yield c
    finally:
        c.close()


def _scrape(node: Node) -> dict[str, float]:
    code = f"import urllib.request; print(urllib.request.urlopen('http://{node.addr}:9400/metrics').read().decode())"
    out = subprocess.run(node.exec(sys.executable, "-c", code), capture_output=True, text=True, timeout=30)
    assert out.returncode == 0, out.stderr
    values = {name: float(v) for name, v in (ln.split() for ln in out.stdout.splitlines() if ln.startswith(GAUGES))}
    assert set(values) == set(GAUGES), out.stdout
    return values


def _journal_states(node: Node) -> list[str]:
    return [json.loads(p.read_text())["state"] for p in (node.work / "agent" / "migrations").glob("*.json")]


def test_an_unresolved_migration_shows_survives_sigterm_and_ends_with_one_copy(
    cluster: Cluster, tmp_path: Path
) -> None:
    """B's agent dies while its CRIU restores the copy: A cannot know whether a copy exists, so
    its original stays frozen while A asks B.  A SIGTERM stops A at once, whether its migration
    still waits in the run (restore_timeout: an hour) or in a resolver, far inside the grace
    (shutdown_grace: 2 min here) that a migration's own work gets."""
    a = cluster.nodes["A"]
    b = cluster.nodes["B"]
    slow, started = slow_restore_criu(tmp_path, 4)
    b.start_agent(criu=str(slow))
    a_settings = {"shutdown_grace": "120", "metrics_listen": f"{a.addr}:9400"}
    a.start_agent(**a_settings)
    ticker = Ticker.launch(a, tmp_path, mib=64)
    try:
        assert _scrape(a) == dict.fromkeys(GAUGES, 0.0)
        mig = cluster.start_migrate(ticker.pid, "A", "B", "--json")
        wait_until(started.exists, "B's CRIU to start restoring", 120)
        b.kill_agent()  # B cannot say whether its copy exists: A keeps the original frozen and asks on
        first = wait_until(lambda: (m := _scrape(a))["tpagent_frozen_seconds"] > 0 and m, "A to report it frozen")
        wait_until(lambda: _scrape(a)["tpagent_frozen_seconds"] > first["tpagent_frozen_seconds"], "the gauge to grow")
        assert ticker.running_copies() == 0  # frozen: not lost, not doubled

        for _ in range(2):  # stopped while its run waits for B, then while a resolver does
            # (kill_agent gives the agent 30 s, a quarter of its grace: one that waited for B would fail here)
            a.kill_agent(signal.SIGTERM)
            assert "stopped" in a.agent_log().splitlines()[-1]
            mig.communicate(timeout=60)
            assert ticker.running_copies() == 0  # the journal keeps it; CRIU still holds the original
            a.start_agent(**a_settings)  # takes it up again
            held = wait_until(lambda: (m := _scrape(a))["tpagent_unresolved_migrations"] == 1 and m, "A's resolver")
            assert held["tpagent_frozen_seconds"] > 0

        b.start_agent()  # drops the copy its CRIU made meanwhile; then A resumes the original
        wait_until(lambda: "rolled_back" in _journal_states(a), "A to roll back", 120)
        ticker.assert_one_copy_continuous()
        ticker.verify_state()
        assert _scrape(a) == dict.fromkeys(GAUGES, 0.0)
        assert _journal_states(b) == ["discarded"]
    finally:
        kill_and_wait(ticker.pid)


def test_a_target_restarted_under_a_stuck_restore_serves_at_once_and_ends_it_at_its_deadline(
    cluster: Cluster, tmp_path: Path
) -> None:
    """B's agent dies while its CRIU restore is stuck (as one waiting behind a lock is). Started
    again, B serves at once: it does not wait for that CRIU before it answers anyone, it says the
    migration is still restoring, and once a restore's time (restore_timeout, 20 s here) has
    passed it stops that CRIU and drops the copy. A, which kept its original frozen and asked,
    then resumes it: one copy, intact."""
    a = cluster.nodes["A"]
    b = cluster.nodes["B"]
    stuck, started = slow_restore_criu(tmp_path, 600)
    settings = {"criu": str(stuck), "rpc_timeout": "5", "restore_timeout": "20"}
    b.start_agent(**settings)
    a.start_agent()
    ticker = Ticker.launch(a, tmp_path, mib=16)
    try:
        mig = cluster.start_migrate(ticker.pid, "A", "B", "--json")
        wait_until(lambda: started.exists() or mig.poll() is not None, "B's CRIU to start restoring", 120)
        assert started.exists(), mig.communicate()
        b.kill_agent()
        mig.kill()  # (its answer is not what this test watches)
        mig.communicate(timeout=60)
        b.start_agent(**settings)  # (it must serve within start_agent's minute, the CRIU sleeping on)
        assert _journal_states(b) == ["restoring"]
        assert ticker.running_copies() == 0  # frozen at A, restoring at B: none runs yet
        wait_until(lambda: _journal_states(b) == ["discarded"], "B to stop the stuck restore at its deadline", 120)
        assert "its CRIU was stopped" in b.agent_log()
        wait_until(lambda: "rolled_back" in _journal_states(a), "A to resume its original", 120)
        ticker.assert_one_copy_continuous()
        ticker.verify_state()
    finally:
        kill_and_wait(ticker.pid)


class _Stuck:
    """A workload on A migrating to B, whose CRIU restore never returns (as one waiting behind a
    lock does): ``mig`` is the `tpagent migrate` of it, waiting in B's restore."""

    def __init__(self, cluster: Cluster, tmp_path: Path, **b_settings: str) -> None:
        self.cluster = cluster
        self.a = cluster.nodes["A"]
        self.b = cluster.nodes["B"]
        self.wrapper, started = slow_restore_criu(tmp_path, 600)
        self.b.start_agent(criu=str(self.wrapper), **b_settings)
        self.a.start_agent()
        self.ticker = Ticker.launch(self.a, tmp_path, mib=16)
        self.mig = cluster.start_migrate(self.ticker.pid, "A", "B", "--json")
        wait_until(lambda: started.exists() or self.mig.poll() is not None, "B's CRIU to start restoring", 120)
        assert started.exists(), self.mig.communicate()

    def cancel(self) -> None:
        (mid,) = [p.stem for p in (self.a.work / "agent" / "migrations").glob("*.json")]
        cancel = [sys.executable, "-m", "cli.main", "cancel", mid, "--agent", self.a.agent_address, "--json"]
        said = subprocess.run(cancel, env=self.cluster.cli_env("A"), capture_output=True, text=True, timeout=60)
        assert said.returncode == 0, said.stdout + said.stderr
        assert json.loads(said.stdout)["migration_id"] == mid  # (--json, as the README says; it was refused)

    def rolled_back(self, why: str) -> None:
        """The migration rolled back (saying ``why``), nothing of the restore is left on B, and
        the original runs on at A: one copy, intact."""
        out, err = self.mig.communicate(timeout=120)
        doc = json.loads(out)
        assert doc["state"] == "rolled_back" and why in doc["message"], out + err
        assert _journal_states(self.b) == ["discarded"]
        left = []
        for p in self.b.processes():
            with contextlib.suppress(psutil.Error):
                if str(self.wrapper) in " ".join(p.cmdline()) or p.cmdline()[:2] == ["sleep", "600"]:
                    left.append(p)
        assert not left, left
        self.ticker.assert_one_copy_continuous()
        self.ticker.verify_state()


def test_a_cancel_while_the_targets_restore_is_stuck_stops_it_and_resumes_the_original(
    cluster: Cluster, tmp_path: Path
) -> None:
    """`tpagent cancel` at A, the source, is taken although the restore was already asked for:
    B stops that CRIU and what it started, drops the copy, and A resumes its original where it
    stood; the migration says it was cancelled."""
    stuck = _Stuck(cluster, tmp_path)
    try:
        stuck.cancel()
        stuck.rolled_back("cancelled by the operator")
    finally:
        kill_and_wait(stuck.ticker.pid)


def test_sigterm_stops_a_target_whose_restore_is_stuck_and_the_source_resumes(cluster: Cluster, tmp_path: Path) -> None:
    """B's agent is told to stop (SIGTERM) while its restore is stuck: after its grace (5 s
    here) it stops that CRIU, drops the copy (the source's Restore call hears so) and exits,
    where a CRIU blocked for ever once kept it running.  A resumes the original."""
    stuck = _Stuck(cluster, tmp_path, shutdown_grace="5")
    try:
        stuck.b.kill_agent(signal.SIGTERM)  # (waits for it to exit: 30 s at most, or this fails)
        assert "stopped" in stuck.b.agent_log().splitlines()[-1]
        stuck.rolled_back("its agent stopped")
    finally:
        kill_and_wait(stuck.ticker.pid)


def test_a_target_that_goes_silent_mid_restore_is_noticed_by_keepalive_and_the_move_can_be_cancelled(
    cluster: Cluster, tmp_path: Path
) -> None:
    """B's agent freezes (SIGSTOP: its connections stay up, nothing answers) while A waits in its
    Restore call, whose deadline is an hour (restore_timeout): A's keepalive ends the call and A
    says so, then asks B how the restore stands.  B thaws, its restore still stuck; a cancel at A
    stops it there, and A resumes the original."""
    stuck = _Stuck(cluster, tmp_path)
    assert stuck.b.agent is not None
    try:
        os.kill(stuck.b.agent.pid, signal.SIGSTOP)
        try:
            notice = "stopped answering its restore call"
            wait_until(lambda: notice in stuck.a.agent_log(), "A to notice B is silent", 120)
        finally:
            os.kill(stuck.b.agent.pid, signal.SIGCONT)
        assert stuck.mig.poll() is None and stuck.ticker.running_copies() == 0  # (frozen: B may yet have a copy)
        stuck.cancel()
        stuck.rolled_back("cancelled by the operator")
    finally:
        kill_and_wait(stuck.ticker.pid)


def test_a_source_stopped_while_the_target_restores_leaves_the_move_to_its_journal(
    cluster: Cluster, tmp_path: Path
) -> None:
    """A is stopped (SIGTERM, as `systemctl stop` does) while B's CRIU restores the copy, and
    its grace (2 s here) passes first.  The migrate command's call ends as A's server stops:
    that was taken for the command going away (a Ctrl-C), and the move was rolled back in its
    name, though A said the next start would take it up from the journal (a reviewer's fault
    injection).  Now the journal keeps it: started again, A settles it with B, whose copy
    runs on; the original ends, and one copy ticks on from where it stood."""
    a = cluster.nodes["A"]
    b = cluster.nodes["B"]
    slow, started = slow_restore_criu(tmp_path, 6)
    b.start_agent(criu=str(slow))
    a.start_agent(shutdown_grace="2")
    ticker = Ticker.launch(a, tmp_path, mib=64)
    try:
        mig = cluster.start_migrate(ticker.pid, "A", "B", "--json")
        wait_until(started.exists, "B's CRIU to start restoring", 120)
        a.kill_agent(signal.SIGTERM)
        assert _journal_states(a) in (["restoring"], ["committing"]), a.agent_log()[-2000:]  # (not rolled back)
        a.start_agent(shutdown_grace="2")
        wait_until(lambda: _journal_states(a) == ["done"], "A to settle the move with B", 120)
        mig.communicate(timeout=120)
        assert _journal_states(b) == ["done"]
        wait_until(lambda: not psutil.pid_exists(ticker.pid), "the original to end")
        (record,) = (b.work / "agent" / "migrations").glob("*.json")
        ticker.pid = int(json.loads(record.read_text())["pid"])  # the copy, on B
        ticker.assert_one_copy_continuous()
        ticker.verify_state()
    finally:
        kill_and_wait(ticker.pid)
