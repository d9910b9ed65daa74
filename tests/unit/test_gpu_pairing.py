"""Which of the target's GPUs each of a process's GPUs lands on (host.gpus.pair).  After a
restore the CUDA driver may go on reporting the source's PCI bus ids (cuda-checkpoint issue 48),
and NCCL finds its GPU in NVML by bus id: a GPU at the same bus id, where the target has one,
makes that stale answer right.  The inventories are written out here (no GPU on this machine)."""

from __future__ import annotations

from host.gpus import GpuInfo, pair


def gpu(uuid: str, bus: str, used_gib: int, pids: tuple[int, ...] = ()) -> GpuInfo:
    return GpuInfo(0, uuid, "H100", 80 << 30, used_gib << 30, 40, 0, pids, bus)


TARGET = [
    gpu("GPU-t0", "00000000:18:00.0", 0),
    gpu("GPU-t1", "00000000:3B:00.0", 30),
    gpu("GPU-t2", "00000000:86:00.0", 10),
]


def test_each_gpu_lands_at_its_own_bus_id_even_on_a_busier_gpu() -> None:
    assert pair([("GPU-s1", "00000000:3b:00.0")], TARGET) == {"GPU-s1": "GPU-t1"}  # (case: as NVML and CUDA write it)


def test_a_gpu_at_the_same_bus_id_that_a_process_uses_is_not_taken() -> None:
    """(Another rank of the job there, say: NCCL would refuse two ranks on one GPU.)"""
    busy = [gpu("GPU-t0", "00000000:18:00.0", 0, pids=(4242,)), gpu("GPU-t1", "00000000:3B:00.0", 2)]
    assert pair([("GPU-s0", "00000000:18:00.0")], busy) == {"GPU-s0": "GPU-t1"}


def test_a_gpu_with_no_match_takes_the_emptiest_left_and_never_one_a_match_needs() -> None:
    got = pair([("GPU-sx", "00000000:AF:00.0"), ("GPU-s0", "00000000:18:00.0"), ("GPU-sy", "")], TARGET)
    assert got == {"GPU-s0": "GPU-t0", "GPU-sx": "GPU-t2", "GPU-sy": "GPU-t1"}


def test_more_gpus_than_the_target_has_map_only_as_many() -> None:
    got = pair([("a", ""), ("b", ""), ("c", ""), ("d", "")], TARGET)
    assert sorted(got) == ["a", "b", "c"] and sorted(got.values()) == ["GPU-t0", "GPU-t1", "GPU-t2"]
