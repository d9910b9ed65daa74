"""A model-aware move between agents (issue 27, item 2, check (a)): a torchrun DDP job whose script
registers its training state (``tests/workloads/ddp_job.py --aware``) on network-namespace nodes
A, B, C with agents, D the spare.  Rank 1 moves to D as its training state only: D's agent starts
the rank's command as the rank ran, the fresh process warms up on its own, takes the state peer
to peer at the boundary, and goes on in its place; the old process ends.  Then it moves back as its
process image (``--mode transparent``), the move it is measured beside.  Every rank's losses, step
by step, its final parameters and what it printed through its launcher must equal the
uninterrupted job's bit for bit."""

from __future__ import annotations

import json
import signal
from pathlib import Path
from typing import Any

import psutil
import pytest

from conftest import needs_criu
from support.cluster import Cluster
from support.helpers import wait_until
from support.rankjob import NOT_UTF8, NOT_UTF8_VALUE, RUN, Job, steps

pytestmark = needs_criu
ABSENT = "GPU-00000000-0000-0000-0000-0000000000a0"  # (no GPU of any node here)
ABSENT_SAID = f"{ABSENT}, named for the copy, is not a GPU of"


def _moved(job: Job, rank: int, to: str, mode: str) -> dict[str, Any]:
    """Move ``rank`` to ``to`` in ``mode``: it runs there, and only there, after; the CLI's report."""
    done = job.c.migrate(
        0, job.where(rank), to, "--job", RUN, "--rank", str(rank), "--mode", mode, "--json", timeout=300
    )
    assert done.returncode == 0, done.stdout + done.stderr
    report: dict[str, Any] = json.loads(done.stdout)
    assert report["state"] == "done", report
    assert job.where(rank) == to and job.copies(rank) == [to]
    return report


@pytest.mark.timeout(720)
def test_a_registered_rank_moves_as_its_training_state_and_the_job_runs_on_bit_identical(
    quad: Cluster, tmp_path: Path, reference_aware: Path
) -> None:
    # (A dry run, two warm-ups, the job stepping on through each, and two moves in 160 steps: at
    # 0.2 s a step, a busy machine's slow warm-ups (12 s seen) still leave the last move steps to
    # stop at.)
    job = Job(quad, tmp_path, extra=("--aware",), step_time=0.2)
    try:
        job.at_step(1, 20)
        first = job.where(1)
        before = job.rank_pid(1)
        dry = job.c.migrate(0, first, "D", "--job", RUN, "--rank", "1", "--mode", "aware", "--dry-run", timeout=120)
        assert dry.returncode == 0 and "all checks pass" in dry.stdout + dry.stderr, dry.stdout + dry.stderr
        # GPUs named on the target: a new process picks its own device, so only the image moves onto them
        # (auto: the target's own check of the names is the image's, so it ran)
        for mode, said in (("aware", "a model-aware move cannot choose the target's GPUs"), ("auto", ABSENT_SAID)):
            named = job.c.migrate(
                0, first, "D", "--job", RUN, "--rank", "1", "--mode", mode, "--to-gpu", ABSENT, "--dry-run", timeout=120
            )
            assert named.returncode != 0 and said in named.stdout + named.stderr, named.stdout + named.stderr
        _killed_while_warming_up(job, first)
        aware = _moved(job, 1, "D", "aware")
        assert "resumed at step" in aware["message"], aware
        environ = Path(f"/proc/{job.rank_pid(1)}/environ").read_bytes().split(b"\0")
        assert NOT_UTF8.encode() + b"=" + NOT_UTF8_VALUE in environ  # (its bytes, through the agents' wire)
        assert not psutil.pid_exists(before)  # (the old process ended once the new one was in)
        state_bytes = aware["timings"]["rank1_state_bytes"]
        assert state_bytes > 0 and {"warmup", "boundary", "handover", "rebuild"} <= set(aware["timings"])

        job.at_step(1, steps(job.logs, 1) + 10)
        image = _moved(job, 1, first, "transparent")
        image_bytes = sum(v for k, v in image["timings"].items() if k.endswith("_image_bytes"))
        assert image_bytes > 10 * state_bytes  # (a process image against a 64-wide MLP's state)
        stopped = {m: r["timings"]["total"] - r["timings"]["boundary"] for m, r in (("aware", aware), ("image", image))}
        print(
            f"rank 1 moved: state {state_bytes:.0f} B, image {image_bytes:.0f} B; the job stood still {stopped} s; "
            f"the joiner warmed up in {aware['timings']['warmup']} s"
        )
        job.finishes_as(reference_aware)
    finally:
        job.close()


@pytest.mark.timeout(600)
def test_a_rank_of_an_hsdp_job_moves_as_its_shard_of_the_state(
    quad: Cluster, tmp_path: Path, reference_aware_hsdp: Path
) -> None:
    """Four ranks, two a node on A and B, FSDP2 on a 2 x 2 mesh (``--hsdp``: its state holds
    DTensors, each rank's shard of the parameters and of the optimizer's state): rank 3 moves to D
    as its training state, and the job runs on bit-identical."""
    job = Job(quad, tmp_path, extra=("--aware", "--hsdp"), step_time=0.1, names="AB", per_node=2)
    try:
        job.at_step(3, 20)
        before = job.rank_pid(3)
        moved = _moved(job, 3, "D", "aware")
        assert "resumed at step" in moved["message"] and moved["timings"]["rank3_state_bytes"] > 0, moved
        assert not psutil.pid_exists(before)
        job.finishes_as(reference_aware_hsdp)
    finally:
        job.close()


def _killed_while_warming_up(job: Job, first: str) -> None:
    """The fresh process on D killed while it warms up: the move fails in one sentence, nothing
    was changed, and the job runs on with rank 1 where it was."""
    moving = job.c.start_migrate(0, first, "D", "--job", RUN, "--rank", "1", "--mode", "aware")
    try:
        wait_until(lambda: job.copies(1) == [first, "D"] or job.copies(1) == ["D", first], "rank 1 to start on D", 120)
        joiner = next(p for p in job.c.nodes["D"].processes() if job._script(p))
        joiner.send_signal(signal.SIGKILL)
        out, err = moving.communicate(timeout=240)
    finally:
        if moving.poll() is None:
            moving.kill()
    assert moving.returncode != 0, out + err
    assert "rank 1's new process on" in out + err and "nothing was changed" in out + err, out + err
    assert job.copies(1) == [first]
    job.at_step(1, steps(job.logs, 1) + 5)  # (it runs on)


@pytest.mark.timeout(600)
def test_the_source_agent_killed_while_the_new_process_warms_up(
    quad: Cluster, tmp_path: Path, reference_aware: Path
) -> None:
    """The moving rank's agent is killed once its joiner runs on D.  Started again, it finishes the
    rewire from its journal: the joiner written down is ended, the pause is cancelled, and the job,
    never stopped, ends bit-identical with rank 1 where it was (or has ended there meanwhile).  The
    CLI waits for the agent to come back and says the rewire was rolled back."""
    job = Job(quad, tmp_path, extra=("--aware",))
    try:
        job.at_step(1, 20)
        first = job.where(1)
        moving = job.start_move(1, "D", "--mode", "aware", "--json")
        wait_until(lambda: "D" in job.copies(1), "rank 1 to start on D", 120)
        wait_until(lambda: job.rewire_record(first).get("joiners"), "the joiner to be written down", 30)
        node = quad.nodes[first]
        node.kill_agent()
        node.start_agent(rewire_timeout="60")
        out, err = moving.communicate(timeout=300)
        wait_until(lambda: job.rewire_record(first).get("phase") == "rolled_back", "the rewire to be finished", 120)
        assert json.loads(out).get("state") == "rolled_back", out + err
        assert "finishing what the agent left" in node.agent_log()
        wait_until(lambda: "D" not in job.copies(1), "the joiner on D to end", 60)
        job.finishes_as(reference_aware)
    finally:
        job.close()
