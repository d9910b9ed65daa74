"""Never lost, never twice (issue 9, items 1-4): reboots of either node, CRIU dying while it
holds the frozen original, a copy that dies right after it started.  Real agents on "nodes"
(network namespaces), real CRIU; each test asserts on the workload's own tick log where
exactly one copy must be running, and where."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest

from conftest import needs_criu
from support.cluster import Cluster, Node, Ticker
from support.helpers import ROOT, kill_and_wait, wait_until
from support.proxy import Proxy

pytestmark = needs_criu


def _states(node: Node) -> list[str]:
    return [json.loads(p.read_text())["state"] for p in (node.work / "agent" / "migrations").glob("*.json")]


def _record(node: Node) -> dict[str, object]:
    (path,) = (node.work / "agent" / "migrations").glob("*.json")
    return dict(json.loads(path.read_text()))


def _runs_on(pid: int, node: Node) -> bool:
    return Path(f"/proc/{pid}/ns/net").stat().st_ino == Path(f"/run/netns/{node.name}").stat().st_ino


def _through_proxy(cluster: Cluster, node: Node) -> Proxy:
    """A's calls to ``node``'s agent go through this proxy (``node`` must accept calls
    addressed to the bridge: start its agent with aliases=cluster.bridge_addr)."""
    return Proxy((node.addr, int(node.agent_address.rpartition(":")[2])), listen=(cluster.bridge_addr, 0))


def _migrate_via(cluster: Cluster, pid: int, to: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [
            sys.executable,
            "-m",
            "cli.main",
            "migrate",
            str(pid),
            "--from",
            cluster.nodes["A"].agent_address,
            "--to",
            to,
            "--json",
        ],
        cwd=ROOT,
        env=cluster.cli_env("A"),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


@pytest.mark.parametrize("journal", ["kept", "lost"])
def test_the_source_node_reboots_while_the_target_holds_the_copy(
    cluster: Cluster, ticker: Ticker, journal: str
) -> None:
    """A reboots (its agent, CRIU, the frozen original all gone) once B holds the restored
    copy, READY.  kept: A's journal is on persistent storage; its agent, back, finds the
    migration RESTORING and the original gone with the boot, and lets B's copy go on.  lost
    (the journal was on tmpfs): A's agent answers "no such migration", which no longer
    resets B's takeover clock: the copy starts on its own.  Either way: one copy, on B,
    ticking on from where the original stood."""
    a = cluster.nodes["A"]
    b = cluster.nodes["B"]
    b.kill_agent(signal.SIGTERM)
    # (lost: B must still be waiting when A is back and answers, or A's silence alone decides)
    b.start_agent(aliases=cluster.bridge_addr, **({"takeover_after": "15"} if journal == "lost" else {}))
    proxy = _through_proxy(cluster, b)
    proxy.swallow_replies = lambda: "ready" in _states(b)  # A never hears that B holds it
    try:
        mig = _migrate_via(cluster, ticker.pid, proxy.address)
        wait_until(lambda: proxy.swallowed > 0, "B to hold its copy", 120)
        a.reboot()
        mig.kill()  # (the CLI ran on A: it went with the reboot)
        mig.communicate(timeout=60)
        assert not psutil.pid_exists(ticker.pid) and ticker.running_copies() == 0  # the original died with A
        if journal == "lost":
            for p in (a.work / "agent" / "migrations").glob("*.json"):
                p.unlink()
        proxy.swallow_replies = lambda: False
        a.start_agent()
        wait_until(lambda: "done" in _states(b), "B's copy to start and be confirmed", 120)
        if journal == "kept":
            wait_until(lambda: "done" in _states(a), "A to record the migration done", 60)
            assert "has been unreachable" not in b.agent_log()  # A decided, not a takeover
        else:
            assert "without a record of it for 15 s" in b.agent_log()
    finally:
        proxy.close()
    ticker.pid = int(_record(b)["pid"])  # type: ignore[call-overload]
    assert _runs_on(ticker.pid, b)
    ticker.assert_one_copy_continuous()
    ticker.verify_state()


def _copy_running_on_b(cluster: Cluster, ticker: Ticker) -> tuple[subprocess.Popen[str], int]:
    """The ticker's move from A to B, once B's copy runs (and ticks), watched for 30 s; the
    migrate command, and a tick the original had reached as it was frozen (the copy is past it)."""
    b = cluster.nodes["B"]
    b.kill_agent(signal.SIGTERM)
    b.start_agent(confirm_period="30")
    mig = cluster.start_migrate(ticker.pid, "A", "B", "--json")
    wait_until(lambda: "confirming" in _states(b), "B to start its copy", 120)
    frozen_at = max(ticker.ticks(), default=-1)
    wait_until(lambda: max(ticker.ticks()) > frozen_at + 5, "B's copy to tick", 30)
    return mig, frozen_at


def test_the_target_node_reboots_while_the_copy_is_being_confirmed(cluster: Cluster, ticker: Ticker) -> None:
    """B started its copy and watches it (30 s confirmation here) while A keeps the original
    frozen; then B reboots, taking the running copy with it.  B's agent, back, finds the copy
    gone and says so; A resumes its original where it stood.  Before, A asked a rebooted B
    forever, the original frozen (and with B's journal on tmpfs, B did not even know)."""
    a = cluster.nodes["A"]
    b = cluster.nodes["B"]
    mig, frozen_at = _copy_running_on_b(cluster, ticker)
    copy = int(_record(b)["pid"])  # type: ignore[call-overload]
    b.reboot()
    assert not psutil.pid_exists(copy)
    b.start_agent(confirm_period="30")
    out, err = mig.communicate(timeout=120)
    doc = json.loads(out)
    assert doc["state"] == "rolled_back" and "did not outlive a restart" in doc["message"], out + err
    assert _runs_on(ticker.pid, a) and _states(b) == ["discarded"] and _states(a) == ["rolled_back"]
    assert not [p for p in b.processes() if b.agent is None or p.pid != b.agent.pid]  # the copy is gone
    _copy_ran_then_the_original_went_on(ticker, frozen_at)


def _copy_ran_then_the_original_went_on(ticker: Ticker, frozen_at: int) -> None:
    """The copy ran for a while; the original then went on from where it was frozen (by
    ``frozen_at``, a tick the copy had not passed): the ticks are one run up to the copy's last,
    then one run from the original's next, never two at once, and only it ticks now."""
    n = len(ticker.ticks())
    wait_until(lambda: len(ticker.ticks()) > n + 20, "the original to tick on at A", 30)
    seq = ticker.ticks()
    restart = next(i for i in range(1, len(seq)) if seq[i] != seq[i - 1] + 1)
    assert seq[:restart] == list(range(restart)), "the original, then its copy, are one run"
    assert seq[restart] <= frozen_at + 1, "the original resumed where it was frozen, not later"
    tail = seq[restart:]
    assert tail == list(range(tail[0], tail[0] + len(tail))), f"two copies ticked at once: {seq[restart - 8 :][:30]}"
    ticker.verify_state()


@pytest.fixture
def loopback_service(cluster: Cluster) -> Iterator[int]:
    """A UDP echo service on A's loopback: outside the workload's tree, it stays on A."""
    port = 7399
    server = subprocess.Popen(
        cluster.nodes["A"].exec(sys.executable, str(ROOT / "tests" / "workloads" / "udp_echo.py"), str(port))
    )
    yield port
    server.kill()
    server.wait()


def test_a_copy_that_dies_right_after_it_started_leaves_the_original_running(
    cluster: Cluster, loopback_service: int, tmp_path: Path
) -> None:
    """The workload needs a service on its node's loopback.  On B nothing answers there: its
    copy dies at its first question, inside the confirmation period.  The original, frozen
    all along, runs on at A; the migration reports that, not "done" (before, the original was
    ended as the copy started, and the job was lost)."""
    a = cluster.nodes["A"]
    b = cluster.nodes["B"]
    log = tmp_path / "asker.log"
    asker = ROOT / "tests" / "workloads" / "loopback_asker.py"
    t = Ticker(log, a.launch(tmp_path / "asker.out", sys.executable, str(asker), str(log), str(loopback_service)))
    try:
        wait_until(lambda: len(t.ticks()) > 5, "the workload to tick")
        proc = cluster.migrate(t.pid, "A", "B", "--json")
        doc = json.loads(proc.stdout)
        assert proc.returncode != 0 and doc["state"] == "rolled_back", proc.stdout + proc.stderr
        assert "ended" in doc["message"] and "confirmation period" in doc["message"]
        assert _runs_on(t.pid, a) and _states(b) == ["discarded"]
        assert not [p for p in b.processes() if p.pid != (b.agent.pid if b.agent else 0)]  # nothing left on B
        t.assert_one_copy_continuous()  # the copy never got an answer, so never wrote a tick
    finally:
        kill_and_wait(t.pid)


def _criu_of(node: Node) -> psutil.Process:
    """The CRIU dumping (and holding) on ``node`` (run through its own loader: named by its path)."""
    return next(p for p in node.processes() if "dump" in (c := p.cmdline()) and any(a.endswith("/criu") for a in c))


def _stopped(pid: int) -> bool:
    """Whether ``pid`` and every process below it is stopped."""
    root = psutil.Process(pid)
    return all(p.status() == psutil.STATUS_STOPPED for p in [root, *root.children(recursive=True)])


def test_criu_dying_while_it_holds_the_original_drops_the_copy(cluster: Cluster, ticker: Ticker) -> None:
    """A's CRIU, holding the frozen original while B restores (and holds) its copy, is killed:
    the original, let go as CRIU dies, stays stopped (before, it ran at once, for as long as A
    waited for B's answer).  A must then drop B's copy, not start it, and resume the original:
    one copy, its ticks continuous.  (Before that, A still committed: the workload ran twice.)"""
    a = cluster.nodes["A"]
    b = cluster.nodes["B"]
    a.kill_agent(signal.SIGTERM)
    a.start_agent(rpc_timeout="5", restore_timeout="15")
    b.kill_agent(signal.SIGTERM)
    b.start_agent(aliases=cluster.bridge_addr)
    proxy = _through_proxy(cluster, b)
    proxy.swallow_replies = lambda: "ready" in _states(b)  # A waits for its answer meanwhile
    try:
        mig = _migrate_via(cluster, ticker.pid, proxy.address)
        wait_until(lambda: proxy.swallowed > 0, "B to hold its copy", 120)
        frozen = ticker.ticks()
        criu = _criu_of(a)
        criu.kill()
        criu.wait(30)
        wait_until(lambda: _stopped(ticker.pid), "the original to be stopped, its CRIU gone")
        assert ticker.ticks() == frozen, "the original ran again while its copy was held"
        proxy.swallow_replies = lambda: False
        out, err = mig.communicate(timeout=120)
    finally:
        proxy.close()
    doc = json.loads(out)
    assert doc["state"] == "rolled_back" and "ended without a decision" in doc["message"], out + err
    assert _states(b) == ["discarded"] and _runs_on(ticker.pid, a)
    ticker.assert_one_copy_continuous()
    ticker.verify_state()


def test_the_hook_holding_the_original_killed_while_its_copy_runs_never_lets_both_run(
    cluster: Cluster, ticker: Ticker
) -> None:
    """B's copy runs (confirming, 30 s here) while CRIU's post-dump hook on A holds the frozen
    original; the hook is killed, so CRIU rolls back and lets the original go.  Before, it ran
    at once beside the running copy (their ticks interleaved) until A stopped it again (a
    reviewer's fault injection).  Now it stays stopped: A has B drop its copy, then resumes the
    original where it was frozen; at no moment do two copies tick."""
    a = cluster.nodes["A"]
    b = cluster.nodes["B"]
    mig, frozen_at = _copy_running_on_b(cluster, ticker)
    hooks = [p for p in _criu_of(a).children(recursive=True) if "hook" in " ".join(p.cmdline())]
    assert hooks, "no post-dump hook holds the original"
    for hook in hooks:
        hook.kill()
    out, err = mig.communicate(timeout=120)
    doc = json.loads(out)
    assert doc["state"] == "rolled_back" and "ended without a decision" in doc["message"], out + err
    assert _runs_on(ticker.pid, a) and _states(b) == ["discarded"]
    _copy_ran_then_the_original_went_on(ticker, frozen_at)


def _resolve(cluster: Cluster, on: str, mid: str, how: str) -> subprocess.CompletedProcess[str]:
    node = cluster.nodes[on]
    return subprocess.run(
        [sys.executable, "-m", "cli.main", "resolve", mid, how, "--agent", node.agent_address],
        cwd=ROOT,
        env=cluster.cli_env(on),
        capture_output=True,
        text=True,
        timeout=120,
    )


def _unheard_once_ready(cluster: Cluster) -> Proxy:
    """A's agent asks again soon (rpc_timeout 5 s, restore_timeout 10 s); its calls to B go
    through the proxy returned, which swallows B's replies while B holds a copy (READY)."""
    a = cluster.nodes["A"]
    b = cluster.nodes["B"]
    a.kill_agent(signal.SIGTERM)
    a.start_agent(rpc_timeout="5", restore_timeout="10")
    b.kill_agent(signal.SIGTERM)
    b.start_agent(aliases=cluster.bridge_addr)
    proxy = _through_proxy(cluster, b)
    proxy.swallow_replies = lambda: "ready" in _states(b)
    return proxy


def test_a_target_restarted_while_letting_its_copy_go_lets_it_go_and_the_source_commits(
    cluster: Cluster, ticker: Ticker
) -> None:
    """B holds the copy and A has not heard it (the proxy swallows B's replies); B's agent is
    killed and its record says STARTING (it had been told to let the copy go: by a takeover, or
    an operator) when it starts again.  B lets the copy go again; A, whose restore call broke,
    asks B, hears the copy runs, and commits: one copy, on B, ticking on from the frozen point,
    never the original resumed over a copy that ran (which repeated ticks)."""
    a = cluster.nodes["A"]
    b = cluster.nodes["B"]
    proxy = _unheard_once_ready(cluster)
    try:
        mig = _migrate_via(cluster, ticker.pid, proxy.address)
        wait_until(lambda: proxy.swallowed > 0, "B to hold its copy", 120)
        frozen_at = max(ticker.ticks())
        b.kill_agent(signal.SIGKILL)
        (path,) = (b.work / "agent" / "migrations").glob("*.json")
        path.write_text(json.dumps({**json.loads(path.read_text()), "state": "starting"}))
        b.start_agent(aliases=cluster.bridge_addr)
        wait_until(lambda: _states(a) == ["done"] and _states(b) == ["done"], "A and B to finish the migration", 90)
        out, err = mig.communicate(timeout=60)
        assert json.loads(out)["state"] == "done", out + err
    finally:
        proxy.close()
    ticker.pid = int(_record(b)["pid"])  # type: ignore[call-overload]
    assert _runs_on(ticker.pid, b) and max(ticker.ticks()) > frozen_at
    ticker.assert_one_copy_continuous()
    ticker.verify_state()


def _held_unheard(cluster: Cluster, ticker: Ticker) -> tuple[Proxy, str, str]:
    """B holds the restored copy (READY) and A never hears it (A's agent asks again soon): the
    migration is left unresolved.  The proxy between them (the caller closes it), the
    migration's id, and the CLI's output."""
    proxy = _unheard_once_ready(cluster)
    try:
        out, _ = _migrate_via(cluster, ticker.pid, proxy.address).communicate(timeout=120)
        return proxy, str(json.loads(out)["migration_id"]), out
    except BaseException:
        proxy.close()
        raise


def test_an_operator_resolves_a_migration_whose_target_went_silent(cluster: Cluster, ticker: Ticker) -> None:
    """B holds the copy, then goes silent to A: the original stays frozen, the migration
    unresolved.  `tpagent resolve --discard` on A (the operator knows B's copy will not run)
    resumes the original; B, heard from again, drops its copy.  The same rule as the agents':
    a decision is refused wherever the peer still answers, and once the migration is final."""
    a = cluster.nodes["A"]
    b = cluster.nodes["B"]
    proxy, mid, out = _held_unheard(cluster, ticker)
    try:
        assert _states(a) == ["restoring"] and _states(b) == ["ready"], out + a.agent_log()[-3000:]
        assert ticker.running_copies() == 0
        refused = _resolve(cluster, "B", mid, "--commit")  # A answers B: A decides, not the operator
        assert refused.returncode == 2 and "the source agent" in refused.stderr and "answers" in refused.stderr
        done = _resolve(cluster, "A", mid, "--discard")
        assert done.returncode == 0 and "rolled_back" in done.stdout, done.stdout + done.stderr
        ticker.assert_one_copy_continuous()  # the original, where it stood
        proxy.swallow_replies = lambda: False
        wait_until(lambda: _states(b) == ["discarded"], "B to drop its copy once it hears from A", 60)
        again = _resolve(cluster, "A", mid, "--commit")
        assert again.returncode == 2 and "rolled_back already" in again.stderr
    finally:
        proxy.close()
    assert _runs_on(ticker.pid, a)
    ticker.assert_one_copy_continuous()
    ticker.verify_state()


def test_an_operator_commits_the_held_copy_once_the_source_node_is_gone(cluster: Cluster, ticker: Ticker) -> None:
    """B holds the copy; A went silent and then down for good (its original with it).  The
    operator, who knows A will not come back, `tpagent resolve --commit` on B: the copy goes
    on from where the original was frozen, the only copy."""
    a = cluster.nodes["A"]
    b = cluster.nodes["B"]
    proxy, mid, out = _held_unheard(cluster, ticker)
    try:
        assert _states(b) == ["ready"], out
        frozen_at = max(ticker.ticks())
        refused = _resolve(cluster, "B", mid, "--commit")  # (A still answers: A decides)
        assert refused.returncode == 2 and "answers" in refused.stderr, refused.stdout + refused.stderr
        a.reboot()
        done = _resolve(cluster, "B", mid, "--commit")
        assert done.returncode == 0, done.stdout + done.stderr
        wait_until(lambda: max(ticker.ticks()) > frozen_at + 10, "B's copy to tick on", 60)
    finally:
        proxy.close()
    ticker.pid = int(_record(b)["pid"])  # type: ignore[call-overload]
    assert _runs_on(ticker.pid, b)
    ticker.assert_one_copy_continuous()
    ticker.verify_state()
