"""Moving a rank of a running torchrun job when something fails on the way (issue 11): the
spare dies while the rank is restored on it, a peer rank dies at the boundary, the person at
the CLI presses Ctrl-C, the source agent is killed mid-migration.  Each time, either the job
goes on and ends bit-identical to the uninterrupted run (:mod:`support.rankjob`), with exactly one
copy of every rank, or the failure is reported in one sentence and nothing waits forever."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from conftest import needs_criu
from support.cluster import Cluster
from support.helpers import NOBODY, wait_until
from support.rankjob import Job, hurry, steps

pytestmark = [needs_criu, pytest.mark.timeout(600)]


def _target_states(c: Cluster, node: str) -> list[str]:
    return [json.loads(p.read_text())["state"] for p in (c.nodes[node].work / "agent" / "migrations").glob("*.json")]


def _moving(job: Job, node: str) -> bool:
    """The rewire run by ``node``'s agent has started moving its rank (the communicators are down)."""
    return bool(job.rewire_record(node).get("moves"))


def test_the_spare_dies_during_the_restore(quad: Cluster, tmp_path: Path, reference: Path) -> None:
    """D reboots while the rank is restored on it (and comes back, as a rebooted node does):
    the rank resumes on B where it stood, every rank rebuilds, the job ends bit-identical."""
    job = Job(quad, tmp_path)
    try:
        job.at_step(1, 20)
        mig = job.start_move(1, "D", "--json")
        wait_until(
            lambda: {"restoring", "ready", "starting", "confirming"} & set(_target_states(quad, "D")),
            "D to restore the rank",
            180,
        )
        quad.nodes["D"].reboot()
        quad.nodes["D"].start_agent(rewire_timeout="60")
        out, err = mig.communicate(timeout=240)
        doc = json.loads(out)
        assert mig.returncode == 1 and doc["state"] == "rolled_back", out + err
        assert "rank 1 on " + quad.nodes["B"].agent_address in doc["message"], doc["message"]
        assert job.where(1) == "B" and job.copies(1) == ["B"]
        job.finishes_as(reference)
    finally:
        job.close()


def test_a_copy_that_cannot_join_the_new_communicators_is_dropped_and_the_rank_resumes_where_it_stood(
    quad: Cluster, tmp_path: Path, reference: Path
) -> None:
    """A firewall on D drops everything D sends to A, where the job's store and rank 0 are: rank
    1's copy is restored and runs on D, but cannot build the new communicators there.  Nothing is
    final until they are up on every rank, so the copy is dropped (the target kills it), rank 1's
    original resumes on B where it stood, every rank builds them again there, and the job ends
    bit-identical.  (B's rewire deadline is 20 s here, so the copy gives up on the store soon.)"""
    b = quad.nodes["B"]
    d = quad.nodes["D"]
    b.kill_agent(signal.SIGTERM)
    b.start_agent(rewire_timeout="20")
    a = quad.nodes["A"].addr
    rules = f"table inet tpagent_test {{\nchain out {{\ntype filter hook output priority 0; ip daddr {a} drop\n}}\n}}\n"
    subprocess.run(d.exec("nft", "-f", "-"), input=rules, text=True, check=True)
    job = Job(quad, tmp_path)
    try:
        job.at_step(1, 20)
        mig = job.start_move(1, "D", "--json")
        out, err = mig.communicate(timeout=240)
        doc = json.loads(out)
        assert mig.returncode == 1 and doc["state"] == "rolled_back", out + err
        assert "rank 1 on " + b.agent_address in doc["message"], doc["message"]
        assert "could not be built with it on " + d.agent_address in doc["message"], doc["message"]
        assert _target_states(quad, "D") == ["discarded"], _target_states(quad, "D")
        assert job.where(1) == "B" and job.copies(1) == ["B"]
        assert job.rewire_record("B")["gen"] == 2  # (the first try's generation is never used again)
        job.finishes_as(reference)
    finally:
        job.close()


def test_a_peer_killed_at_the_boundary_is_reported_and_nothing_hangs(quad: Cluster, tmp_path: Path) -> None:
    """Rank 2 is killed while the ranks stop at the boundary for rank 1's move: the command
    names rank 2 in one sentence, rank 1 never leaves B, and every torchrun ends (the job failed:
    one of its ranks is dead) well before any deadline of the rewire, none waiting for it."""
    job = Job(quad, tmp_path)
    try:
        job.at_step(1, 20)
        victim = job.rank_pid(2)
        mig = job.start_move(1, "D", "--json")
        wait_until(lambda: job.rewire_record("B").get("phase") == "pausing", "the ranks to be asked to stop", 60)
        psutil.Process(victim).kill()
        t0 = time.monotonic()
        out, err = mig.communicate(timeout=120)
        doc = json.loads(out)
        assert mig.returncode == 1 and doc["state"] == "failed", out + err
        assert "rank 2 could not" in doc["message"] and "\n" not in doc["message"], doc["message"]
        assert job.copies(1) in (["B"], []) and not _target_states(quad, "D"), "rank 1 went somewhere"
        codes = job.wait(timeout=120)
        assert codes["C"] != 0, "torchrun on C did not see its rank die"
        assert time.monotonic() - t0 < 120, "the job outlived the deadline of its rewire"
        assert not any(job.copies(r) for r in range(3)), "a rank is still running"
        assert job.rewire_record("B")["phase"] == "failed"
    finally:
        job.close()


def test_a_peer_killed_after_the_teardown_ends_the_job(quad: Cluster, tmp_path: Path) -> None:
    """Rank 2 is killed once rank 1's migration has started (every communicator is down): rank 2
    cannot rebuild, so the job cannot go on.  Rank 1's copy is dropped (nothing is final until the
    new communicators are up), its original on B is told too.  The command says so naming rank 2,
    and every other rank is told: each ends with that reason as soon as rank 2 is found gone, not
    parked until its own deadline (10 min) or the group's timeout (30 min); every torchrun ends."""
    job = Job(quad, tmp_path)
    try:
        job.at_step(1, 20)
        victim = job.rank_pid(2)
        mig = job.start_move(1, "D", "--json")
        wait_until(lambda: _moving(job, "B"), "rank 1's migration to start", 120)
        psutil.Process(victim).kill()
        t0 = time.monotonic()
        out, err = mig.communicate(timeout=180)
        doc = json.loads(out)
        assert mig.returncode == 1 and doc["state"] == "failed", out + err
        assert "rank 2 could not build its communicators" in doc["message"], doc["message"]
        assert "the job cannot go on" in doc["message"] and "\n" not in doc["message"], doc["message"]
        codes = job.wait(timeout=120)
        assert all(code != 0 for code in codes.values()), codes
        assert time.monotonic() - t0 < 150, "the ranks outlived the deadline of their rewire"
        assert not any(job.copies(r) for r in range(3)), "a rank is still running"
        assert _target_states(quad, "D") == ["discarded"], "rank 1's copy was kept though the job could not go on"
        said = "".join((tmp_path / f"rank-on-{n}.out").read_text() for n in "AB")
        assert said.count("the job cannot go on") >= 2, said[-3000:]  # (ranks 0 and 1, each with the reason)
    finally:
        job.close()


def test_the_cli_interrupted(quad: Cluster, tmp_path: Path, reference: Path) -> None:
    """Ctrl-C once rank 1's migration has started: the agent rolls it back (the rank stays on B),
    rebuilds every rank where it runs, the command exits 130 saying so, the job ends bit-identical."""
    job = Job(quad, tmp_path)
    try:
        job.at_step(1, 20)
        mig = job.start_move(1, "D")
        wait_until(lambda: _moving(job, "B"), "rank 1's migration to start", 120)
        mig.send_signal(signal.SIGINT)
        out, err = mig.communicate(timeout=240)
        assert mig.returncode == 130, out + err
        assert "rolled_back" in err or "resumed" in out + err, out + err
        wait_until(lambda: job.rewire_record("B").get("phase") in ("rolled_back", "done"), "the rewire to end", 120)
        stays = job.rewire_record("B")["phase"] == "rolled_back"
        assert job.copies(1) == (["B"] if stays else ["D"])
        n = steps(job.logs, 1)
        job.at_step(1, n + 5)  # it goes on
        job.finishes_as(reference)
    finally:
        job.close()


def test_the_source_agent_killed_mid_migration(quad: Cluster, tmp_path: Path, reference: Path) -> None:
    """B's agent, which runs the rewire, is killed once rank 1's migration has started (the
    other ranks wait at the boundary with their communicators down).  Started again, it
    settles the migration from its journal and finishes the rewire from what it wrote down:
    every rank rebuilds where it now runs, and the job ends bit-identical.  The CLI, which lost
    its agent mid-migration, waits for it to come back and says how the rewire ended."""
    job = Job(quad, tmp_path)
    try:
        job.at_step(1, 20)
        mig = job.start_move(1, "D", "--json")
        wait_until(lambda: _moving(job, "B"), "rank 1's migration to start", 120)
        b = quad.nodes["B"]
        b.kill_agent()
        stopped = {r: steps(job.logs, r) for r in range(3)}
        time.sleep(2)
        assert {r: steps(job.logs, r) for r in range(3)} == stopped, "a rank went on with its communicators down"
        assert mig.poll() is None, "the CLI gave up on its agent at once"
        b.start_agent(rewire_timeout="60")
        out, err = mig.communicate(timeout=300)
        wait_until(
            lambda: job.rewire_record("B").get("phase") in ("rolled_back", "done", "failed"),
            "B to finish the rewire it was running",
            180,
        )
        record = job.rewire_record("B")
        assert record["phase"] in ("rolled_back", "done"), record
        assert json.loads(out)["state"] == record["phase"], out + err
        assert "finishing what the agent left" in b.agent_log()
        where = job.copies(1)
        assert where == (["B"] if record["phase"] == "rolled_back" else ["D"]), where
        job.finishes_as(reference)
    finally:
        job.close()


STORE_WRITER = Path(__file__).parents[1] / "attackers" / "store_writer.py"


def test_a_jobs_store_cannot_steer_a_rewire_onto_another_job_of_the_same_name(
    quad: Cluster, tmp_path: Path, reference: Path
) -> None:
    """Two jobs of one name (job1, ranks 0-2, the same user): the first on A, B, C, the other all
    on D.  A local user (nobody, on A) rewrites in the first job's store that its rank 2's agent
    is D's.  Moving the first job's rank 1 is then refused before any rank stops (no generation
    begun), in a sentence that names D and why; the other job is never asked to stop, and both
    end bit-identical to the uninterrupted run."""
    (tmp_path / "first").mkdir()
    (tmp_path / "other").mkdir()
    # (steps slow enough that both jobs still run when the move is asked, on a busy machine too: at
    # 0.05 s a step the other job once ended first, and its rank 2 was "no longer running")
    job = Job(quad, tmp_path / "first", step_time=0.3)
    other = Job(quad, tmp_path / "other", names="D", per_node=3, step_time=0.3)
    try:
        job.at_step(1, 20)
        other.at_step(2, 20)
        env = next(p.environ() for p in quad.nodes["A"].processes() if job._script(p) and p.environ()["RANK"] == "0")
        d = quad.nodes["D"].agent_address
        forged = subprocess.run(
            [*quad.nodes["A"].exec(*NOBODY, sys.executable, str(STORE_WRITER)), env["MASTER_ADDR"], env["MASTER_PORT"]]
            + ["2", d],
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert forged.returncode == 0 and f"was {quad.nodes['C'].agent_address}" in forged.stdout, (
            forged.stdout + forged.stderr[-3000:]
        )
        moved = quad.migrate(0, "B", "C", "--job", "job1", "--rank", "1", timeout=240)
        said = moved.stdout + moved.stderr
        assert moved.returncode != 0, said
        assert f"rank 2 of job job1 on {quad.nodes['D'].name} is not the rank asked for" in said, said
        assert "store names the wrong node" in said and "nothing was changed" in said, said
        assert job.rewire_record("B").get("gen", 0) == 0, job.rewire_record("B")  # (no rank was asked to stop)
        hurry(other.logs)  # (while the first job ends, the other's last steps run unpaced too)
        job.finishes_as(reference)
        other.finishes_as(reference)
    finally:
        job.close()
        other.close()


def test_torchrun_killed_on_the_stores_node_mid_move_ends_the_move_in_one_sentence(
    quad: Cluster, tmp_path: Path
) -> None:
    """torchrun's agent on A, which serves the job's store, is killed once rank 1 is on its way
    to D (every communicator down): no rank can rebuild without the store, which refuses at once
    (nothing listens on its port), and the other torchruns end their ranks: the move ends saying
    so in one sentence, well inside one rewire deadline (60 s here; it once took two), and rank 1
    runs in one place at most, never two."""
    job = Job(quad, tmp_path)
    try:
        job.at_step(1, 20)
        mig = job.start_move(1, "D", "--json")
        wait_until(lambda: _moving(job, "B"), "the rewire to move rank 1", 120)
        job.runs["A"].kill()  # (`ip netns exec` execs torchrun: this is it)
        out, err = mig.communicate(timeout=100)
        doc = json.loads(out)
        assert mig.returncode == 1, out + err
        said = doc["message"]
        # (the store refuses the rebuild, or the other torchruns, having lost their rendezvous, end their ranks first)
        assert "refuses connections: it has ended" in said or "the job cannot go on" in said, said
        assert "\n" not in said and len(job.copies(1)) <= 1
    finally:
        job.close()
