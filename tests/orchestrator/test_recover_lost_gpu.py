"""Issue 27's check (b) on a GPU machine (skipped elsewhere): a node killed outright mid-step, its
rank holding an NCCL communicator and GPU memory.  One GPU takes no two ranks of one NCCL
communicator, so each rank of the 3-rank DDP job (gloo, CPU: its data-parallel replicas, as srun
starts them) also keeps an average of its parameters on the GPU, all-reduced each step over an
NCCL group of its own (world size 1) and registered with its training state
(``tests/workloads/ddp_job.py --aware --own-groups nccl``).  C is killed, its agent too: rank 2
is rebuilt on D from a replica's held state (the GPU tensor handed over, its NCCL communicator
built anew there), the survivors restart in their own processes (their CUDA contexts and NCCL
communicators given back), and every rank's losses, its average's sum step by step, and its final
parameters equal the uninterrupted run's, bit for bit."""

from __future__ import annotations

from pathlib import Path

import pytest
from test_recover_lost import _ended, _events_of, _lose, _ran_on, _running, _runs

from conftest import needs_criu, needs_gpu
from host import gpus
from support.helpers import wait_until
from support.rankjob import AWARE_ON_GPU, JOB, RUN

pytestmark = [needs_criu, *needs_gpu]


@pytest.mark.timeout(900)
def test_a_node_killed_mid_step_its_rank_holding_nccl_and_gpu_state_is_rebuilt_bit_identical(
    tmp_path: Path, reference_aware_gpu: Path
) -> None:
    with _running(tmp_path, AWARE_ON_GPU) as (c, o, job):
        _lose(c, "C")
        wait_until(lambda: _events_of(o, "recovered"), "the job to be rebuilt", 300, 0.5)
        rebuilt = [p.pid for p in c.nodes["D"].processes_and_children() if _runs(p, JOB)]
        assert len(rebuilt) == 1 and gpus.gpus_of(set(rebuilt)), "rank 2 rebuilt on D holds no GPU context"
        _ran_on(c, o, job, reference_aware_gpu, "AB", "2")
        wait_until(lambda: _ended(o), "the orchestrator to write the rebuilt rank's end down", 60, 0.5)
        assert _ended(o) == [f"rank 2 of job {RUN} (rebuilt) exited with status 0"]
