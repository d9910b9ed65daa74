"""Issue 27's check (a) on a GPU machine (skipped elsewhere): a model-aware move of a rank that
holds an NCCL communicator and GPU memory.  One GPU takes no two ranks of one NCCL communicator,
so each rank of the 3-rank DDP job (gloo, CPU: its data-parallel replicas) also keeps an average
of its parameters on the GPU, all-reduced each step over an NCCL group of its own (world size 1)
and registered with its training state (``tests/workloads/ddp_job.py --aware --own-groups nccl``).
Rank 1 moves to D as its training state: the fresh process builds its own NCCL communicator
there and takes the state, the GPU tensor among it, peer to peer.  Then it moves back as its
process image (CUDA checkpoint and CRIU), the move it is measured beside.  Every rank's losses,
its average's sum step by step, and its final parameters must equal the uninterrupted job's
under plain torchrun, bit for bit."""

from __future__ import annotations

from pathlib import Path

import pytest
from test_aware_rewire import _moved

from conftest import needs_criu, needs_gpu
from host import gpus
from support.cluster import Cluster
from support.rankjob import AWARE_ON_GPU, Job, steps

pytestmark = [needs_criu, *needs_gpu]


@pytest.mark.timeout(900)
def test_a_rank_with_an_nccl_group_and_gpu_state_moves_as_its_training_state_bit_identical(
    quad: Cluster, tmp_path: Path, reference_aware_gpu: Path
) -> None:
    job = Job(quad, tmp_path, extra=AWARE_ON_GPU, step_time=0.1)
    try:
        job.at_step(1, 20)
        first = job.where(1)
        aware = _moved(job, 1, "D", "aware")
        assert gpus.gpus_of({job.rank_pid(1)}), "rank 1's new process holds no GPU context: its NCCL group is not there"
        state_bytes = aware["timings"]["rank1_state_bytes"]

        job.at_step(1, steps(job.logs, 1) + 20)
        image = _moved(job, 1, first, "transparent")
        image_bytes = sum(v for k, v in image["timings"].items() if k.endswith("_image_bytes"))
        stopped = {m: r["timings"]["total"] - r["timings"]["boundary"] for m, r in (("aware", aware), ("image", image))}
        print(
            f"rank 1 (NCCL, GPU) moved: state {state_bytes:.0f} B, image {image_bytes:.0f} B; the job stood still "
            f"{stopped} s; the joiner warmed up in {aware['timings']['warmup']} s"
        )
        job.finishes_as(reference_aware_gpu)
    finally:
        job.close()
