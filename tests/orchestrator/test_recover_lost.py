"""A node killed outright mid-step (issue 27, item 3, checks (b) and (d)): every process of its
network namespace SIGKILLed at once, its agent too.  The job is DDP over nodes A, B, C, as srun
starts it (a stand-in per rank, rank 0's serving the job's store on A), its script registering its
training state (``tests/workloads/ddp_job.py --aware``); D is a free spare.

(b) C is killed: its peers' collectives fail and are held from the script; once C stops
    reporting, the orchestrator has A's agent rebuild rank 2 on D from a replica's held state,
    every survivor restarts in its own process from its last step boundary, and the job runs on.
    Every rank's losses, step by step, and final parameters equal the uninterrupted run's, bit for
    bit (the step that was in flight is done again); no line is written twice.
(d) The same job with each rank its own shard (``--aware-alone``: no replica of rank 2 survives):
    it cannot be rebuilt, and every rank ends with one sentence saying so; nothing hangs."""

from __future__ import annotations

import contextlib
import json
import signal
from pathlib import Path

import psutil
import pytest

from conftest import needs_criu
from support.cluster import Cluster
from support.helpers import wait_until
from support.orchestrator import Orchestrator
from support.rankjob import IFNAME, RUN, STEPS, Job, rank_log

pytestmark = needs_criu


def _lose(c: Cluster, name: str) -> list[psutil.Process]:
    """Every process of node ``name`` killed at once, its agent too, as a crash loses them."""
    lost = c.nodes[name].processes_and_children()
    for p in lost:
        with contextlib.suppress(psutil.Error):
            p.send_signal(signal.SIGKILL)
    return lost


def _events(o: Orchestrator) -> list[dict[str, str]]:
    return [json.loads(line) for line in o.ok("events", "--json").splitlines()]


def _running(tmp_path: Path, extra: tuple[str, ...]) -> tuple[Cluster, Orchestrator, Job]:
    c = Cluster(tmp_path, list("ABCD"), ifname=IFNAME)
    o = Orchestrator(c, tmp_path, lost_grace=2.0)
    try:
        o.start()
        for node in c.nodes.values():
            node.start_agent(rewire_timeout="60", orchestrator=o.address, report_period="0.5")
        job = Job(c, tmp_path, srun=True, extra=extra)  # (ranks 0, 1, 2 on A, B, C; D the spare)
    except BaseException:
        o.close()
        c.close()
        raise
    job.at_step(2, 20)
    wait_until(lambda: all(o.rank_on(RUN, r) for r in range(3)), "the orchestrator to see every rank", 60, 0.5)
    return c, o, job


@pytest.mark.timeout(900)
def test_a_node_killed_mid_step_is_rebuilt_on_the_spare_and_the_job_runs_on_bit_identical(
    tmp_path: Path, reference_aware: Path
) -> None:
    c, o, job = _running(tmp_path, ("--aware",))
    try:
        _lose(c, "C")
        codes = {name: job.runs[name].wait(timeout=600) for name in "AB"}
        assert codes == {"A": 0, "B": 0}, job.output()
        for r in range(3):
            got = rank_log(job.logs, r)
            assert [ln.split()[1] for ln in got if ln.startswith("step ")] == [str(k) for k in range(STEPS)], r
            assert got == rank_log(reference_aware, r), f"rank {r}: its losses or final parameters differ"
        recovered = [e for e in _events(o) if e["kind"] == "recovered"]
        assert len(recovered) == 1 and f"rank(s) 2 rebuilt on {c.nodes['D'].name}" in recovered[0]["text"], recovered
        print(recovered[0]["text"])
        assert not [e for e in _events(o) if e["kind"] == "lost"]
        assert "Traceback" not in job.output()
    finally:
        job.close()
        o.close()
        c.close()


@pytest.mark.timeout(600)
def test_a_lost_rank_with_no_surviving_replica_ends_the_job_in_one_sentence(tmp_path: Path) -> None:
    c, o, job = _running(tmp_path, ("--aware-alone",))
    try:
        _lose(c, "C")
        for name in "AB":
            assert job.runs[name].wait(timeout=300) != 0
        said = "".join(p.read_text(errors="replace") for p in tmp_path.glob("*.out"))
        for rank in (0, 1):
            assert f"rank {rank} of job {RUN} stops: rank(s) 2 of job {RUN} were lost with" in said, said[-3000:]
        assert "cannot be rebuilt: no replica of rank 2's training state survives" in said
        lost = [e for e in _events(o) if e["kind"] == "lost"]
        assert lost and "cannot be rebuilt" in lost[0]["text"], lost
    finally:
        job.close()
        o.close()
        c.close()
