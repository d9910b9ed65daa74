"""`tpagent migrate` between agents on "nodes" (network namespaces): the workload moves and
goes on from where it stood; on every failure exactly one copy runs, with its state intact."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import psutil
import pytest

from conftest import needs_criu
from snapshot.criu import Criu
from support.certs import node_certs
from support.cluster import Cluster, Node, Ticker
from support.helpers import ROOT, STATEFUL, assert_one_sentence_error, kill_and_wait, slow_restore_criu, wait_until
from support.proxy import Proxy

pytestmark = needs_criu
ABSENT_GPU = "GPU-00000000-0000-0000-0000-0000000000a0"  # (no GPU of any node here)


def _cli(*args: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    proc = subprocess.run(
        [sys.executable, "-m", "cli.main", *args],
        cwd=ROOT,
        env={**os.environ, **env},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 0, proc.stderr
    return proc


def test_workload_moves_a_to_b_to_c_and_goes_on(cluster: Cluster, ticker: Ticker) -> None:
    for src, dst in (("A", "B"), ("B", "C")):
        proc = cluster.migrate(ticker.pid, src, dst, "--json")
        assert proc.returncode == 0, proc.stderr + cluster.nodes[src].agent_log()[-3000:]
        doc = json.loads(proc.stdout)
        assert doc["state"] == "done" and doc["new_pid"] > 0
        ticker.pid = doc["new_pid"]
        ticker.assert_one_copy_continuous()
        ticker.verify_state()
    ns_c = Path(f"/run/netns/{cluster.nodes['C'].name}").stat().st_ino
    assert Path(f"/proc/{ticker.pid}/ns/net").stat().st_ino == ns_c  # it runs on node C now


def test_another_users_process_named_in_no_encoding_does_not_stop_a_migration(
    cluster: Cluster, ticker: Ticker, tmp_path: Path
) -> None:
    """A source looks through every process of its node for one that maps a file of the
    workload's; a process of nobody's that maps a file named in bytes of no encoding (any user
    may) made every migration on the node fail with an internal error (UnicodeDecodeError)."""
    odd = Path(tempfile.mkdtemp(prefix="tpagent-odd-", dir="/tmp"))  # (one nobody reaches)
    os.chown(odd, 65534, 65534)
    stranger = subprocess.Popen(
        ["setpriv", "--reuid=nobody", "--regid=nogroup", "--clear-groups", "--", "/usr/bin/python3", "-I",
         str(STATEFUL.parent / "odd_names.py"), str(odd / "log")],
        stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    try:
        wait_until(lambda: (odd / "log").exists() and "tick 2 " in (odd / "log").read_text(), "the stranger to run")
        proc = cluster.migrate(ticker.pid, "A", "B", "--json")
        assert proc.returncode == 0, proc.stderr + cluster.nodes["A"].agent_log()[-3000:]
        ticker.pid = json.loads(proc.stdout)["new_pid"]
        ticker.assert_one_copy_continuous()
        ticker.verify_state()
    finally:
        kill_and_wait(stranger.pid)
        stranger.wait()
        shutil.rmtree(odd)


@pytest.fixture
def big(cluster: Cluster, tmp_path: Path) -> Iterator[Ticker]:
    """A workload large enough that a fault can be injected while its snapshot is moving."""
    t = Ticker.launch(cluster.nodes["A"], tmp_path, mib=768)
    yield t
    kill_and_wait(t.pid)


def _only_the_original_runs(cluster: Cluster, t: Ticker) -> None:
    t.assert_one_copy_continuous()  # the original went on where it stood, and no copy ticks beside it
    t.verify_state()
    assert Path(f"/proc/{t.pid}").exists()
    for name in ("B", "C"):
        assert not list((cluster.nodes[name].work / "agent" / "incoming").glob("*/images")), (
            f"node {name} kept a snapshot"
        )
        assert not list((cluster.nodes[name].work / "agent" / "incoming").glob(".*.partial-*")), (
            f"node {name} kept a partial snapshot"
        )


def test_target_agent_killed_mid_transfer(cluster: Cluster, big: Ticker) -> None:
    mig = cluster.start_migrate(big.pid, "A", "B", "--json")
    wait_until(lambda: cluster.receiving("B"), "the snapshot to start arriving on B")
    cluster.nodes["B"].kill_agent()
    out, err = mig.communicate(timeout=300)
    assert mig.returncode == 1, err
    assert json.loads(out)["state"] == "rolled_back"
    cluster.nodes["B"].start_agent()  # back up, it drops what it had half received
    _only_the_original_runs(cluster, big)


def test_link_cut_mid_transfer(cluster: Cluster, big: Ticker) -> None:
    for node in (cluster.nodes["A"], cluster.nodes["B"]):  # a silent link is noticed in seconds, not 30
        node.kill_agent(signal.SIGTERM)
        node.start_agent(io_timeout="2")
    mig = cluster.start_migrate(big.pid, "A", "B", "--json")
    wait_until(lambda: cluster.receiving("B"), "the snapshot to start arriving on B")
    cluster.nodes["B"].link(up=False)
    out, err = mig.communicate(timeout=300)
    cluster.nodes["B"].link(up=True)
    assert mig.returncode == 1, err
    doc = json.loads(out)
    assert doc["state"] == "rolled_back" and "transfer" in doc["message"]
    incoming = cluster.nodes["B"].work / "agent" / "incoming"
    wait_until(
        lambda: not list(incoming.glob(".*.partial-*")), "B to drop its partial snapshot once A reaches it again", 60
    )
    _only_the_original_runs(cluster, big)


def test_a_partition_during_the_transfer_is_survived_and_the_move_completes(cluster: Cluster, big: Ticker) -> None:
    """The link goes down in the middle of the transfer for several times the streams' silence
    limit (2 s here) and comes back: the sender's streams reconnect (the receiver cutting their
    unfinished handshakes as the link heals is no refusal) and the move completes."""
    for node in (cluster.nodes["A"], cluster.nodes["B"]):
        node.kill_agent(signal.SIGTERM)
        node.start_agent(io_timeout="2")
    mig = cluster.start_migrate(big.pid, "A", "B", "--json")
    wait_until(lambda: cluster.receiving("B"), "the snapshot to start arriving on B")
    cluster.nodes["B"].link(up=False)
    time.sleep(6)  # (the partition itself)
    cluster.nodes["B"].link(up=True)
    out, err = mig.communicate(timeout=300)
    assert mig.returncode == 0, err + out
    doc = json.loads(out)
    assert doc["state"] == "done", doc
    big.pid = doc["new_pid"]
    big.assert_one_copy_continuous()
    big.verify_state()


@pytest.mark.parametrize("stream_buffer_mib", ["256", "0"], ids=["streamed", "files"])
def test_corrupted_chunk_is_fetched_again(cluster: Cluster, big: Ticker, stream_buffer_mib: str) -> None:
    """A byte flipped on the wire between the agents: caught by the chunk's check, sent again;
    from the memory it is kept in until acknowledged when CRIU's images stream straight to the
    transfer, from the images' files when they are written on the source first."""
    a = cluster.nodes["A"]
    b = cluster.nodes["B"]
    proxy = Proxy((b.addr, 7411), flip_at=1 << 20, on=1, listen=(cluster.bridge_addr, 7412))
    try:
        a.kill_agent(signal.SIGTERM)
        # one data stream: the proxy's connection 1 carries every chunk
        a.start_agent(streams="1", stream_buffer_mib=stream_buffer_mib)
        b.kill_agent(signal.SIGTERM)
        b.start_agent(transfer_port="7411", transfer_address=f"{cluster.bridge_addr}:7412")
        proc = cluster.migrate(big.pid, "A", "B", "--json")
        assert proc.returncode == 0, proc.stderr
        assert proxy.connections >= 2 and proxy.flipped == 1  # the transfer went through the proxy, and was hit
        big.pid = json.loads(proc.stdout)["new_pid"]
        big.assert_one_copy_continuous()
        big.verify_state()  # its 768 MiB arrived intact all the same
        assert ("went from CRIU straight to the transfer" in a.agent_log()) == (stream_buffer_mib != "0")
    finally:
        proxy.close()


def test_a_carried_file_that_differs_on_the_target_is_one_clean_sentence(cluster: Cluster, big: Ticker) -> None:
    """The log the process had open is carried; on the target a file of other content sits at
    its path (here: the shared file system's same file, changed after the freeze), so the
    restore is refused: the message names it in one sentence (no ``.;`` where the target's
    sentence meets ours), and the original runs on."""
    mig = cluster.start_migrate(big.pid, "A", "B", "--json")
    held = lambda: list((cluster.nodes["A"].work / "agent").rglob("log/held"))  # noqa: E731
    wait_until(held, "the snapshot to be sealed on A, its original held frozen")
    with open(big.log, "a") as f:  # (the original is frozen: only the test writes now)
        f.write("changed after the freeze\n")
    out, err = mig.communicate(timeout=300)
    assert mig.returncode == 1, err
    doc = json.loads(out)
    assert doc["state"] == "rolled_back" and f"{big.log} exists on this node with other content" in doc["message"]
    assert ".;" not in doc["message"] and "move it away first; the original was resumed" in doc["message"]
    _only_the_original_runs(cluster, big)


def test_target_refuses_for_lack_of_memory(cluster: Cluster, ticker: Ticker) -> None:
    cluster.nodes["B"].kill_agent(signal.SIGTERM)
    cluster.nodes["B"].start_agent(memory_limit=str(64 << 20))
    proc = cluster.migrate(ticker.pid, "A", "B", "--json")
    assert proc.returncode == 1
    doc = json.loads(proc.stdout)
    assert doc["state"] == "failed" and "memory_limit" in doc["message"]
    _only_the_original_runs(cluster, ticker)


def test_criu_restore_failing_on_target(cluster: Cluster, ticker: Ticker, tmp_path: Path) -> None:
    """Node B's CRIU refuses every restore (a real CRIU binary behind a wrapper that fails restore)."""
    real = Criu().path
    wrapper = tmp_path / "criu-no-restore"
    wrapper.write_text(
        "#!/bin/sh\n"
        'if [ "$1" = restore ]; then echo "Error (criu/cr-restore.c:1): restore refused on this node" >&2; exit 1; fi\n'
        f'exec {real} "$@"\n'
    )
    wrapper.chmod(0o755)
    cluster.nodes["B"].kill_agent(signal.SIGTERM)
    cluster.nodes["B"].start_agent(criu=str(wrapper))
    proc = cluster.migrate(ticker.pid, "A", "B", "--json")
    assert proc.returncode == 1
    doc = json.loads(proc.stdout)
    assert doc["state"] == "rolled_back" and "restore refused on this node" in doc["message"]
    _only_the_original_runs(cluster, ticker)


def test_source_agent_killed_and_restarted_mid_migration(cluster: Cluster, big: Ticker) -> None:
    """The CLI's source agent dies in the middle (SIGKILL) and comes back, as systemd restarts
    it: the restarted agent rolls the migration back from its journal, and the CLI, which
    waited for it, names the migration and how it ended (not "is `tpagent serve` running?")."""
    mig = cluster.start_migrate(big.pid, "A", "B")
    wait_until(lambda: cluster.receiving("B"), "the snapshot to start arriving on B")
    cluster.nodes["A"].kill_agent()
    # CRIU, in its own session, holds the frozen original once its images are sealed; before
    # that they stream from CRIU through the agent, and with the agent gone CRIU fails the dump
    # and rolls it back: the original runs on at once.  Never two copies, never none for good.
    assert big.running_copies() in (0, 1)
    cluster.nodes["A"].start_agent()  # finds the migration in its journal and rolls it back
    out, err = mig.communicate(timeout=300)
    _only_the_original_runs(cluster, big)
    record = next((cluster.nodes["A"].work / "agent" / "migrations").glob("*.json"))
    # (the journal says so once the snapshot is removed, a moment after the original runs again)
    wait_until(lambda: "rolled back after the agent restarted" in record.read_text(), "A to journal the rollback", 60)
    assert mig.returncode == 1, err
    assert f"stopped answering during migration {record.stem} (" in err, err
    assert "is `tpagent serve` running" not in err
    assert "FAILED: " in out and "rolled back" in out, out


def test_cli_interrupted(cluster: Cluster, big: Ticker) -> None:
    mig = cluster.start_migrate(big.pid, "A", "B")
    wait_until(lambda: cluster.receiving("B"), "the snapshot to start arriving on B")
    mig.send_signal(signal.SIGINT)
    out, err = mig.communicate(timeout=120)
    assert mig.returncode == 130, err
    assert "rolled_back" in err or "resumed" in out + err
    _only_the_original_runs(cluster, big)


def test_a_gpu_the_target_lacks_is_refused_there_and_the_process_runs_on(cluster: Cluster, ticker: Ticker) -> None:
    """`--to-gpu` travels to the target agent, which places the copy only on the GPUs named (the
    orchestrator names its free, untainted ones): one it lacks is refused before anything freezes."""
    for dry in (("--dry-run",), ()):
        proc = cluster.migrate(ticker.pid, "A", "B", "--to-gpu", ABSENT_GPU, *dry, "--json")
        doc = json.loads(proc.stdout)
        said = f"{ABSENT_GPU}, named for the copy, is not a GPU of {cluster.nodes['B'].name}"
        assert proc.returncode == 1 and any(said in p for p in [doc.get("message", ""), *doc["problems"]]), doc
        ticker.assert_one_copy_continuous()  # never frozen: no gap in its ticks
    _only_the_original_runs(cluster, ticker)


def test_dry_run_checks_both_sides_and_freezes_nothing(cluster: Cluster, ticker: Ticker) -> None:
    proc = cluster.migrate(ticker.pid, "A", "B", "--dry-run", "--json")
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout)["problems"] == []
    cluster.nodes["B"].kill_agent(signal.SIGTERM)
    cluster.nodes["B"].start_agent(memory_limit=str(1 << 20))
    proc = cluster.migrate(ticker.pid, "A", "B", "--dry-run", "--json")
    assert proc.returncode == 1
    assert any("memory_limit" in p for p in json.loads(proc.stdout)["problems"])
    ticker.assert_one_copy_continuous()  # never frozen: no gap in its ticks


def test_a_target_that_is_no_agent_address_is_refused_and_leaves_the_process_free(
    cluster: Cluster, ticker: Ticker
) -> None:
    """A --to the agent took as an address (a colon in it) but no channel could (no host, no port,
    a port over 65535, a control character): the migration's thread failed as it began and it
    stayed "checking" for good, its process refused every later move ("already being migrated"),
    a cancel changed nothing, and the agent's next start failed on it again.  Now refused in one
    sentence as the request comes; the same process then moves."""
    for bad in (":7400", "x:abc", "x:99999", "\x1b]0;X\x07:7400"):
        cmd = [sys.executable, "-m", "cli.main", "migrate", str(ticker.pid), "--from"]
        cmd += [cluster.nodes["A"].agent_address, "--to", bad, "--dry-run"]
        proc = subprocess.run(cmd, cwd=ROOT, env=cluster.cli_env("A"), capture_output=True, text=True, timeout=60)
        assert_one_sentence_error(proc, f"{bad!r} is not an agent address (HOST:PORT)")
        assert proc.returncode == 2 and "\x1b" not in proc.stderr
    proc = cluster.migrate(ticker.pid, "A", "B", "--json")
    assert proc.returncode == 0, proc.stderr
    ticker.assert_one_copy_continuous()


@pytest.mark.parametrize(
    "case, needle",
    [
        ("unknown-pid", "no process with PID"),
        ("not-migratable", "not a migratable process"),
        ("unreachable", "cannot be reached"),
        ("unreachable-to", "the agent at {C} cannot be reached (connection refused); is `tpagent serve` running"),
        ("unreachable-to-dry-run", "the agent at {C} cannot be reached (connection refused)"),
        ("child-in-namespace", "lives inside a PID namespace (a `tpagent launch` workload's); migrate the whole"),
        ("thread-in-namespace", "by giving the PID of its init ({init})"),
        ("wrong-secret", "the agent at {A} refused the call: a wrong cluster secret"),
        ("to-itself", "same agent"),
        ("to-itself-alias", "the same agent ({A_alias} is node {A_node}, as {A} is); give another node as --to."),
    ],
)
def test_bad_requests_get_one_sentence_and_freeze_nothing(
    cluster: Cluster, ticker: Ticker, tmp_path: Path, case: str, needle: str
) -> None:
    pid = ticker.pid
    src = "A"
    dst = "B"
    secret = None
    if case == "unknown-pid":
        pid = 4194000
    elif case == "not-migratable":
        pid = cluster.nodes["A"].agent.pid  # type: ignore[union-attr]  # the agent itself: no GPU, not launched
    elif case == "unreachable":
        cluster.nodes["C"].kill_agent()
        src = "C"
    elif case == "wrong-secret":
        secret = tmp_path / "other-secret"
        secret.write_text("another-secret-of-enough-length")
        secret.chmod(0o600)
    elif case == "to-itself":
        dst = "A"
    elif case.startswith("unreachable-to"):
        cluster.nodes["C"].kill_agent()
        dst = "C"
    elif case.endswith("-in-namespace"):
        pid = psutil.Process(ticker.pid).children()[0].pid  # the workload itself, PID 2 in its namespace
        if case.startswith("thread"):
            pid = next(t.id for t in psutil.Process(pid).threads() if t.id != pid)
    addresses = {name: node.agent_address for name, node in cluster.nodes.items()}
    addresses.update(A_alias=f"{cluster.nodes['A'].addr}:07400", A_node=cluster.nodes["A"].name)
    if case == "to-itself-alias":  # (the source under another address: only the agent knows it is itself)
        cmd = [sys.executable, "-m", "cli.main", "migrate", str(pid), "--from", addresses["A"]]
        cmd += ["--to", addresses["A_alias"]]
        proc = subprocess.run(cmd, cwd=ROOT, env=cluster.cli_env("A"), capture_output=True, text=True, timeout=120)
    else:
        proc = cluster.migrate(pid, src, dst, *(["--dry-run"] if case.endswith("dry-run") else []), secret=secret)
    assert_one_sentence_error(proc, needle.format(init=ticker.pid, **addresses))
    if case.startswith(("unreachable", "to-itself")) or case.endswith("-in-namespace"):
        assert proc.returncode == 2, proc.stderr  # bad input, whichever agent cannot be reached
        assert "ipv4:" not in proc.stderr and "UNKNOWN" not in proc.stderr  # (no gRPC jargon)
    ticker.assert_one_copy_continuous()
    if case == "wrong-secret":
        assert "refused /tpagent.v1.Agent/Migrate" in cluster.nodes["A"].agent_log()  # and logged


def test_two_migrations_of_one_process_at_once(cluster: Cluster, big: Ticker) -> None:
    first = cluster.start_migrate(big.pid, "A", "B", "--json")
    wait_until(lambda: cluster.receiving("B", 1), "the first migration to start")
    second = cluster.migrate(big.pid, "A", "C")
    assert_one_sentence_error(second, "already being migrated")
    out, err = first.communicate(timeout=300)
    assert first.returncode == 0, err
    big.pid = json.loads(out)["new_pid"]
    big.assert_one_copy_continuous()


def test_agent_reports_node_processes_and_metrics(cluster: Cluster, ticker: Ticker, tmp_path: Path) -> None:
    """`tpagent node` (Info, ListProcesses), `tpagent status`; Prometheus text after a migration."""
    a = cluster.nodes["A"]
    a.kill_agent(signal.SIGTERM)
    a.start_agent(metrics_listen=f"{a.addr}:9400")
    env = {**cluster.cli_env("A"), "TPAGENT_AGENT": a.agent_address}
    info = json.loads(_cli("node", env=env).stdout)
    assert info["node"] == a.name and info["healthy"] and info["criu_version"].startswith("4.")
    assert {p["pid"]: p["why"] for p in info["migratable"]}.get(ticker.pid) == "launched"
    proc = cluster.migrate(ticker.pid, "A", "B", "--json")
    assert proc.returncode == 0, proc.stderr
    doc = json.loads(proc.stdout)
    ticker.pid = doc["new_pid"]
    assert json.loads(_cli("status", doc["migration_id"], env=env).stdout)["state"] == "done"
    scrape = subprocess.run(
        a.exec(
            sys.executable,
            "-c",
            f"import urllib.request; print(urllib.request.urlopen('http://{a.addr}:9400/metrics').read().decode())",
        ),
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert 'tpagent_migrations_total{outcome="done"} 1.0' in scrape.stdout
    assert 'tpagent_stage_seconds_count{stage="restore"} 1.0' in scrape.stdout
    sent = [ln for ln in scrape.stdout.splitlines() if ln.startswith('tpagent_transfer_bytes_total{direction="sent"}')]
    assert sent and float(sent[0].split()[-1]) > 0


def test_target_agent_killed_while_restoring(cluster: Cluster, ticker: Ticker, tmp_path: Path) -> None:
    """B's agent dies while its CRIU (in a session of its own, so it lives on) restores the
    copy: the source cannot know whether the copy runs, so the original stays frozen; B,
    restarted, waits for that CRIU, stops the copy it made, and only then does A resume the
    original.  At no moment do two copies run."""
    slow, started = slow_restore_criu(tmp_path, 4)
    b = cluster.nodes["B"]
    b.kill_agent(signal.SIGTERM)
    b.start_agent(criu=str(slow))
    mig = cluster.start_migrate(ticker.pid, "A", "B", "--json")
    journal = b.work / "agent" / "migrations"
    wait_until(started.exists, "B's CRIU to start restoring", 120)  # (the journal says so a moment before)
    b.kill_agent()
    assert ticker.running_copies() == 0  # the original is frozen, the copy not yet restored
    b.start_agent()
    out, err = mig.communicate(timeout=300)
    assert mig.returncode == 1, err
    assert json.loads(out)["state"] == "rolled_back"
    _only_the_original_runs(cluster, ticker)
    assert '"discarded"' in next(journal.glob("*.json")).read_text()
    assert "stopping the copy" in b.agent_log()  # CRIU did restore it meanwhile: it was stopped, not left


def test_a_held_copy_is_not_migrated_onward(start, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    """A target's copy waits, restored but held, for its source to commit; an agent asked to
    migrate it meanwhile refuses (the source may still roll back and resume its original)."""
    from support.agents import node_of
    from tpagent.common.config import AgentConfig
    from tpagent.migration.api import Refused, Role, TargetState
    from tpagent.migration.journal import Record

    secret = tmp_path / "secret"
    secret.write_text(os.urandom(24).hex())
    secret.chmod(0o600)
    agent = node_of(
        AgentConfig(
            secret_file=secret,
            node="b",
            work_dir=tmp_path / "agent",
            metrics_listen="",
            tls_dir=node_certs(tmp_path, "b"),
        )
    )
    w = start(mib=16, launched=True)
    mid = "a" * 32
    agent.journal.write(Record(mid, Role.TARGET, TargetState.READY, pid=w.pid, peer="10.0.0.1:7400"))
    with pytest.raises(
        Refused, match=f"PID {w.pid} belongs to the copy that migration {mid} restored here, held until its source"
    ):
        agent.start_migration(w.pid, "10.0.0.3:7400", dry_run=False)
    assert not agent.active and not agent.sources
    agent.journal.write(Record(mid, Role.TARGET, TargetState.DONE, pid=w.pid))  # committed: now an ordinary process
    # Nor is any other process of a copy: one of its root's children, moved on alone, would run
    # twice if the migration then rolled back (its source resumes the whole original tree).
    part = Record("b" * 32, Role.TARGET, TargetState.READY, pid=1, peer="10.0.0.1:7400", tree=[[w.pid, 1]])
    agent.journal.write(part)
    with pytest.raises(Refused, match=f"PID {w.pid} belongs to the copy that migration {'b' * 32} restored here"):
        agent.start_migration(w.pid, "10.0.0.3:7400", dry_run=False)
    agent.journal.write(Record("b" * 32, Role.TARGET, TargetState.DISCARDED, pid=1))
    assert agent.start_migration(w.pid, "10.0.0.3:7400", dry_run=True).pid == w.pid


def _journal_states(node: Node) -> list[str]:
    return [json.loads(p.read_text())["state"] for p in (node.work / "agent" / "migrations").glob("*.json")]


def test_source_node_lost_after_the_restore_the_copy_takes_over(cluster: Cluster, ticker: Ticker) -> None:
    """The source's node goes silent right after the target restored (and holds) the copy: B
    hears nothing for takeover_after (3 s here) and starts the copy itself.  The original, frozen
    on A, never runs again: when A's agent comes back it finds the copy DONE and ends it."""
    a = cluster.nodes["A"]
    b = cluster.nodes["B"]
    b.kill_agent(signal.SIGTERM)
    b.start_agent(takeover_after="3", aliases=cluster.bridge_addr)  # (A reaches it there, below)
    # A reaches B's agent through a proxy that swallows B's answers once B holds its copy: the
    # Restore reply never reaches A, which then dies (its node "lost") before it can commit.
    proxy = Proxy((b.addr, int(b.agent_address.rpartition(":")[2])), listen=(cluster.bridge_addr, 7413))
    proxy.swallow_replies = lambda: "ready" in _journal_states(b)
    try:
        env = cluster.cli_env("A")
        mig = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "cli.main",
                "migrate",
                str(ticker.pid),
                "--from",
                a.agent_address,
                "--to",
                proxy.address,
            ],
            cwd=ROOT,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        wait_until(lambda: proxy.swallowed > 0, "B to hold its copy and answer Restore", 120)
        a.kill_agent()  # its CRIU, in its own session, keeps the original frozen
        assert ticker.running_copies() == 0  # the copy is held, the original frozen: none runs yet
        mig.kill()  # (the CLI would wait for A to come back: A stays down here)
        mig.communicate(timeout=60)
        wait_until(lambda: "done" in _journal_states(b), "B to start its copy on its own", 60)
        assert "has been unreachable for 3 s" in b.agent_log()
        proxy.swallow_replies = lambda: False
        new_pid = json.loads(next((b.work / "agent" / "migrations").glob("*.json")).read_text())["pid"]
        a.start_agent()  # asks B, learns the copy runs, ends the frozen original
        wait_until(lambda: "done" in _journal_states(a), "A to end its original", 120)
    finally:
        proxy.close()
    ticker.pid = new_pid
    ticker.assert_one_copy_continuous()
    ticker.verify_state()
    assert Path(f"/proc/{new_pid}/ns/net").stat().st_ino == Path(f"/run/netns/{b.name}").stat().st_ino  # it runs on B


def test_a_tcp_pair_migrates_there_and_back(cluster: Cluster, tmp_path: Path) -> None:
    """A workload whose tree holds both ends of a TCP connection moves A -> B -> A and keeps
    exchanging data: the network lock CRIU leaves on the node it left is gone (it once dropped
    the connection's packets when the workload came back, which then hung, reported done)."""
    a = cluster.nodes["A"]
    log = tmp_path / "echo.log"
    pid = a.launch(tmp_path / "echo.out", sys.executable, str(ROOT / "tests" / "workloads" / "tcp_echo.py"), str(log))
    pairs = lambda: [tuple(map(int, ln.split()[1::2])) for ln in log.read_text().splitlines()] if log.exists() else []  # noqa: E731
    pids = [pid]

    def unlocked(src: str) -> None:
        tables = subprocess.run(cluster.nodes[src].exec("nft", "list", "tables"), capture_output=True, text=True)
        assert "CRIU-" not in tables.stdout, f"CRIU's network lock stayed on {src}"

    try:
        wait_until(lambda: len(pairs()) > 5, "the TCP workload to run")
        _there_and_back(cluster, pids, lambda: len(pairs()), unlocked)
        seq = pairs()
        assert all(echo == tick for tick, echo in seq) and [t for t, _ in seq] == list(range(len(seq)))
    finally:
        kill_and_wait(pids[-1])


def _there_and_back(
    cluster: Cluster, pids: list[int], count: Callable[[], int], each: Callable[[str], None] = lambda _src: None
) -> None:
    """The workload (its PID last in ``pids``, each new one added) moved A -> B -> A, its work
    (``count``) seen to go on after each move; ``each`` checks the node it left."""
    for src, dst in (("A", "B"), ("B", "A")):
        proc = cluster.migrate(pids[-1], src, dst, "--json")
        assert proc.returncode == 0, proc.stderr + proc.stdout
        pids.append(json.loads(proc.stdout)["new_pid"])
        each(src)
        n = count()
        # (B023: wait_until calls the lambda now, in this iteration)
        wait_until(lambda: count() > n + 10, f"the workload to go on on {dst}", 30)  # noqa: B023


def test_dry_run_warns_of_an_inotify_queue_a_move_may_lose(cluster: Cluster, tmp_path: Path) -> None:
    """inotify events queued at the freeze can be lost on the way (issue 9, item 11): the
    dry run says so as a warning, not a failure, and freezes nothing."""
    a = cluster.nodes["A"]
    watched = tmp_path / "watched"
    log = tmp_path / "loop.log"
    watched.mkdir()
    pid = a.launch(
        tmp_path / "loop.out",
        sys.executable,
        str(ROOT / "tests" / "workloads" / "epoll_loop.py"),
        str(log),
        "--inotify",
        str(watched),
    )
    try:
        wait_until(lambda: log.exists() and log.read_text().count("tick ") > 5, "the loop to tick")
        proc = cluster.migrate(pid, "A", "B", "--dry-run", "--json")
        doc = json.loads(proc.stdout)
        assert proc.returncode == 0 and doc["state"] == "done", proc.stdout + proc.stderr
        assert any(m.startswith("warning: PID") and "inotify" in m for m in doc["checked"]), doc
        n = log.read_text().count("tick ")
        wait_until(lambda: log.read_text().count("tick ") > n + 10, "the loop to tick on (never frozen)")
    finally:
        kill_and_wait(pid)


def test_the_agents_ghost_limit_setting_refuses_a_larger_deleted_file(cluster: Cluster, tmp_path: Path) -> None:
    """Item 12 of issue 9: the agent's ghost_limit_mib bounds the deleted-but-open files a
    migration carries; over it the migration is refused in one sentence naming the setting,
    and the workload runs on where it was."""
    a = cluster.nodes["A"]
    a.kill_agent(signal.SIGTERM)
    a.start_agent(ghost_limit_mib="4")
    log = tmp_path / "w.log"
    pid = a.launch(
        tmp_path / "w.out", sys.executable, str(STATEFUL), str(log), "16", "--ghost", str(tmp_path / "batch"), "8"
    )
    ticks = lambda: [ln for ln in log.read_text().splitlines() if ln.startswith("tick ")] if log.exists() else []  # noqa: E731
    try:
        wait_until(lambda: len(ticks()) > 5, "the workload to tick")
        proc = cluster.migrate(pid, "A", "B", "--json")
        doc = json.loads(proc.stdout)
        assert proc.returncode != 0 and doc["state"] in ("failed", "rolled_back"), proc.stdout + proc.stderr
        assert "ghost limit (4 MiB)" in doc["message"] and "ghost_limit_mib" in doc["message"], doc["message"]
        n = len(ticks())
        wait_until(lambda: len(ticks()) > n + 5, "the workload to run on at A")
        assert psutil.pid_exists(pid)
    finally:
        kill_and_wait(pid)


def test_a_spawn_multiprocessing_pair_moves_and_passes_numbers_on(cluster: Cluster, tmp_path: Path) -> None:
    """A parent and its spawn worker on POSIX semaphores (a DataLoader with spawn workers, in
    miniature) move A -> B -> A: CRIU's names of the semaphores travel as links to their own
    names, the pair goes on in lockstep on one semaphore, and no name is left on any node."""
    before = sorted(n for n in os.listdir("/dev/shm") if n.startswith("link_remap."))
    log = tmp_path / "w.log"
    script = str(ROOT / "tests" / "workloads" / "mp_sync.py")
    pids = [cluster.nodes["A"].launch(tmp_path / "w.out", sys.executable, script, str(log), "spawn")]
    ticks = lambda: [int(ln.split()[1]) for ln in log.read_text().splitlines()] if log.exists() else []  # noqa: E731
    try:
        wait_until(lambda: len(ticks()) > 5, "the pair to pass numbers")
        _there_and_back(cluster, pids, lambda: len(ticks()))
        assert ticks() == list(range(len(ticks())))
        assert sorted(n for n in os.listdir("/dev/shm") if n.startswith("link_remap.")) == before
    finally:
        kill_and_wait(pids[-1])
