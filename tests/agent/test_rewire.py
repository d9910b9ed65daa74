"""One rank of a running torchrun DDP job moves to another node while the others carry on
(issue 11), three times: rank 1 to the spare, rank 0 (whose node hosts torchrun's store) to
the spare too, and rank 1 back.  Each rank's losses, step by step, and the final parameters
must be bit-identical to the same job run by plain torchrun with no tpagent at all
(:mod:`rankjob`).  A job with no optimizer (parameters updated by hand) stops between two
collectives instead."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from cluster import Cluster
from conftest import needs_criu
from helpers import ROOT
from rankjob import RUN, Job, steps

pytestmark = needs_criu


@pytest.mark.timeout(600)
def test_ranks_move_and_the_job_carries_on_bit_identical(quad: Cluster, tmp_path: Path, reference: Path) -> None:
    job = Job(quad, tmp_path)
    try:
        job.at_step(1, 20)
        first = job.where(1)
        moved = job.move(1, "D")
        assert moved.returncode == 0, moved.stdout + moved.stderr
        assert "resumed at step" in moved.stdout + moved.stderr
        assert job.where(1) == "D" and job.copies(1) == ["D"]

        job.at_step(0, steps(job.logs, 0) + 20)
        moved = job.move(0, "D")
        assert moved.returncode == 0, moved.stdout + moved.stderr
        assert job.where(0) == "D" and job.copies(0) == ["D"]

        job.at_step(1, steps(job.logs, 1) + 20)
        moved = job.move(1, first)
        assert moved.returncode == 0, moved.stdout + moved.stderr
        assert job.where(1) == first and job.copies(1) == [first]

        job.finishes_as(reference)
    finally:
        job.close()


@pytest.mark.timeout(540)
def test_a_job_without_an_optimizer_stops_between_two_collectives(
    quad: Cluster, tmp_path: Path, reference_no_optimizer: Path
) -> None:
    """... and, with it: a dry run checks each moving rank's own migration and stops nothing;
    two ranks on one node move together, in one command."""
    job = Job(quad, tmp_path, extra=("--no-optimizer",))
    try:
        job.at_step(2, 20)
        dry = job.c.migrate(0, "C", "D", "--job", RUN, "--rank", "2", "--dry-run", timeout=120)
        out = dry.stdout + dry.stderr
        assert dry.returncode == 0 and "all checks pass" in out, out
        assert job.copies(2) == ["C"]
        job.at_step(2, steps(job.logs, 2) + 3)  # (it was not stopped)

        moved = job.move(2, "D")
        out = moved.stdout + moved.stderr
        assert moved.returncode == 0, out
        assert "resumed at collective" in out, out
        assert job.where(2) == "D" and job.copies(2) == ["D"]

        job.at_step(1, steps(job.logs, 1) + 10)
        moved = job.move(1, "D")
        assert moved.returncode == 0, moved.stdout + moved.stderr
        job.at_step(1, steps(job.logs, 1) + 10)
        both = job.c.migrate(0, "D", "C", "--job", RUN, "--rank", "1", "--rank", "2", timeout=240)
        out = both.stdout + both.stderr
        assert both.returncode == 0, out
        assert job.where(1) == "C" and job.where(2) == "C"
        assert job.copies(1) == ["C"] and job.copies(2) == ["C"]
        node = subprocess.run([sys.executable, "-m", "cli.main", "node", "--agent", quad.nodes["C"].agent_address],
                              cwd=ROOT, env=quad.cli_env("C"), capture_output=True, text=True, timeout=60)  # fmt: skip
        shown = {(r["job"], r["rank"]): r for r in json.loads(node.stdout)["ranks"]}
        assert {k for k, r in shown.items() if not r["moved_to"]} == {(RUN, 1), (RUN, 2)}, shown
        assert all(shown[RUN, r]["gen"] == 3 and shown[RUN, r]["collectives"] > 0 for r in (1, 2)), shown
        job.finishes_as(reference_no_optimizer)
    finally:
        job.close()
