"""Moving a rank that holds NCCL communicators and GPU memory (issue 11, on a GPU machine; skipped
elsewhere).  One GPU: NCCL takes no two ranks on one GPU, so a job of several NCCL ranks cannot
run here; what one GPU can show is shown instead:

- a world-size-1 NCCL job (model, data and its group's backend on the GPU) moved between two
  agents, each in a network namespace of its own on this machine;
- the same job bound to its GPU (``init_process_group(device_id=...)``: NCCL connects at once)
  with its subgroup made by ``split_group``, as a DeviceMesh makes its groups on a GPU;
- a 2-rank job on CPU gloo whose rank 0 also keeps a sum on the GPU, all-reduced each step over
  an NCCL group of its own; rank 0 moves (its GPU memory with it, its NCCL group torn down and
  built again), rank 1 carries on.

Each ends bit-identical to the same job run under plain torchrun (deterministic algorithms, the
same GPU).  Each move changes the rank's node address, which NCCL keeps from its first
communicator: tpagent_rank.nccladdr rewrites it (first run on an H100: without it, every
communicator built after the move failed to bind, and the rank went back).  Both nodes are on
this one machine, so the host identity NCCL holds stays true and the GPU keeps its PCI bus id:
the cross-host cases (cuda-checkpoint issue 48, NCCL issue 2348) are handled by mapping and
checks tested without a GPU (tests/unit/test_gpu_pairing.py, tests/rank/test_rewire_protocol.py),
not shown here."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from conftest import needs_criu, needs_gpu
from host import gpus
from support.cluster import Cluster
from support.rankjob import Job, _reference, serving

pytestmark = [
    needs_criu,
    *needs_gpu,
    pytest.mark.timeout(900),
]


@pytest.fixture
def trio(tmp_path: Path) -> Iterator[Cluster]:
    yield from serving(tmp_path, "ABC", "120")


def _moved_and_identical(
    c: Cluster, tmp: Path, extra: tuple[str, ...], names: str, moves: list[tuple[int, str]], named: bool = True
) -> None:
    """The job on ``names`` (rank r on the r-th), each of ``moves`` (rank, node) made in turn at
    steps 20, 60, ..., ends as the same job under plain torchrun; ``named``: each move names the
    machine's GPU as the one its copy may use (`--to-gpu`, as the orchestrator names a spare's)."""
    (tmp / "reference").mkdir()
    (tmp / "run").mkdir()
    reference = _reference(tmp / "reference", *extra, nproc=len(names))
    job = Job(c, tmp / "run", extra=extra, names=names)
    try:
        for i, (rank, to) in enumerate(moves):
            job.at_step(rank, 20 + 40 * i)
            done = job.move(rank, to, *(("--to-gpu", gpus.inventory()[0].uuid) if named else ()))
            assert done.returncode == 0, done.stdout + done.stderr
            print(f"move of rank {rank} to {to}:\n{done.stdout}")  # (its stage times: in the GPU proof's log, -rA)
            assert job.where(rank) == to and job.copies(rank) == [to]
        job.finishes_as(reference)
    finally:
        job.close()


def test_a_world_size_1_nccl_job_moves_between_two_agents(trio: Cluster, tmp_path: Path) -> None:
    # (and back: the GPU it left is free again)
    _moved_and_identical(trio, tmp_path, ("--cuda", "--backend", "nccl"), "A", [(0, "B"), (0, "A")], named=False)


def test_a_job_bound_to_its_gpu_with_a_split_group_moves(trio: Cluster, tmp_path: Path) -> None:
    _moved_and_identical(trio, tmp_path, ("--cuda", "--backend", "nccl", "--device-id"), "A", [(0, "B")])


def test_a_rank_with_an_nccl_group_and_gpu_memory_moves_beside_a_cpu_rank(trio: Cluster, tmp_path: Path) -> None:
    _moved_and_identical(trio, tmp_path, ("--gpu-rank", "0"), "AB", [(0, "C")])
