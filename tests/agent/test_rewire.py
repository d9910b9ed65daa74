"""One rank of a running torchrun DDP job moves to another node while the others carry on
(issue 11), three times: rank 1 to the spare, rank 0 (whose node hosts torchrun's store) to
the spare too, and rank 1 back.  Each rank's losses, step by step, and the final parameters
must be bit-identical to the same job run by plain torchrun with no tpagent at all
(:mod:`rankjob`)."""

from __future__ import annotations

from pathlib import Path

import pytest

from cluster import Cluster
from conftest import needs_criu
from rankjob import Job, steps

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
