"""A node lost without a word (issue 27, item 3's first part): the job's other ranks would wait
in their next collective for its timeout (half an hour, gloo's default), every GPU of the job
idle.  Once the orchestrator finds the node unreachable, the agents of the job's other nodes tell
their ranks, and each that has made no progress for ``lost_grace`` breaks off and ends with one
sentence: the job ends at once, and its launcher can restart it from its checkpoint."""

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
from support.rankjob import IFNAME, RUN, Job

pytestmark = needs_criu


@pytest.mark.timeout(600)
def test_the_ranks_of_a_lost_nodes_job_stop_waiting_and_say_why(tmp_path: Path) -> None:
    c = Cluster(tmp_path, list("ABC"), ifname=IFNAME)
    o = Orchestrator(c, tmp_path, lost_grace=2.0)  # (unreachable after 10 s)
    job: Job | None = None
    lost: list[psutil.Process] = []
    try:
        o.start()
        c.start_agents(rewire_timeout="60", orchestrator=o.address, report_period="0.5")
        job = Job(c, tmp_path)  # (ranks 0, 1, 2 on A, B, C; the store on A)
        job.at_step(2, 5)
        wait_until(lambda: all(o.rank_on(RUN, r) for r in range(3)), "the orchestrator to see every rank", 60, 0.5)
        # C is lost as a power cut loses it: every process of it stops at once, its agent too,
        # and not one connection is closed (its peers hear nothing, ever).
        lost = c.nodes["C"].processes_and_children()
        for p in lost:
            with contextlib.suppress(psutil.Error):
                p.send_signal(signal.SIGSTOP)
        for name in "AB":  # (without a word from tpagent, each waits for its collective's timeout)
            job.runs[name].wait(timeout=240)
        said = "".join(p.read_text(errors="replace") for p in tmp_path.glob("*.out"))
        for rank in (0, 1):
            assert f"rank {rank} of job {RUN} stops: node {c.nodes['C'].name} running rank(s) of the job" in said, said
        assert all(job.runs[name].returncode != 0 for name in "AB")
        events = [json.loads(line) for line in o.ok("events", "--json").splitlines()]
        assert any(e["kind"] == "lost" and "lost rank(s) 2" in e["text"] for e in events), events
    finally:
        for p in lost:
            with contextlib.suppress(psutil.Error):
                p.kill()
        if job is not None:
            job.close()
        o.close()
        c.close()
