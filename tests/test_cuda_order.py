"""The CUDA calls around CRIU, in order, and their rollback (real CRIU; the driver faked).

The workload maps a file named like the CUDA driver, so tpagent's real detection takes it
for a CUDA process; the driver calls go to tests/fake_cuda.py.
"""

from __future__ import annotations

import mmap
from pathlib import Path

import pytest

from conftest import needs_criu
from fake_cuda import FakeCudaDriver
from helpers import alive, assert_continuous, wait_until
from snapshot import engine
from snapshot.api import CudaError, DumpMode, SnapshotConfig, Stage
from snapshot.cuda import CudaState

pytestmark = needs_criu


@pytest.fixture
def cuda_workload(start, tmp_path: Path):  # type: ignore[no-untyped-def]
    lib = tmp_path / "libcuda.so.1"
    lib.write_bytes(b"\0" * mmap.PAGESIZE)
    return start(mib=32, extra=("--map", str(lib)))


def test_checkpoint_and_restore_call_the_driver_in_order(cuda_workload, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    w = cuda_workload
    fake = FakeCudaDriver()
    seen: list[tuple[str, str]] = []

    def progress(stage: Stage, msg: str) -> None:
        if not msg:  # a stage starts: record the driver's state then
            seen.append((stage.value, fake.state(w.pid).value))

    m = engine.checkpoint(w.pid, tmp_path / "snap", DumpMode.KILL, progress=progress, cuda_factory=lambda: fake)
    w.reap()
    assert m.cuda_pids == [w.pid]
    assert fake.calls == [("lock", w.pid), ("checkpoint", w.pid)]
    assert seen == [("cuda_lock", "running"), ("cuda_checkpoint", "locked"), ("criu_dump", "checkpointed")]
    stopped_at = w.ticks()[-1][0]

    seen.clear()
    result = engine.restore(tmp_path / "snap", progress=progress, cuda_factory=lambda: fake)
    assert fake.calls[2:] == [("restore", w.pid), ("unlock", w.pid)]
    assert fake.state(result.pid) is CudaState.RUNNING
    assert ("cuda_restore", "checkpointed") in seen and ("cuda_unlock", "locked") in seen
    wait_until(lambda: w.ticks()[-1][0] > stopped_at + 5, "the restored workload to tick on")
    assert_continuous(w.ticks())
    w.verify_state()


@pytest.mark.parametrize("fail_on", ["lock", "checkpoint"])
def test_driver_failure_during_freeze_leaves_it_running(cuda_workload, tmp_path: Path, fail_on: str) -> None:  # type: ignore[no-untyped-def]
    w = cuda_workload
    fake = FakeCudaDriver(fail_on=fail_on)
    with pytest.raises(CudaError, match="CUDA_ERROR_INJECTED") as err:
        engine.checkpoint(w.pid, tmp_path / "snap", cuda_factory=lambda: fake)
    assert err.value.rolled_back
    assert fake.state(w.pid) is CudaState.RUNNING  # unlocked (and restored) again
    n = w.ticks()[-1][0]
    wait_until(lambda: w.ticks()[-1][0] > n + 5, "the workload to keep running")
    assert_continuous(w.ticks())


def test_failure_after_dump_gives_the_gpu_back(cuda_workload, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    w = cuda_workload
    fake = FakeCudaDriver()
    with pytest.raises(Exception):
        engine.checkpoint(w.pid, tmp_path / "snap", config=SnapshotConfig(fail_after=Stage.CHECKSUM), cuda_factory=lambda: fake)
    assert fake.calls == [("lock", w.pid), ("checkpoint", w.pid), ("restore", w.pid), ("unlock", w.pid)]
    assert alive(w.pid)
    n = w.ticks()[-1][0]
    wait_until(lambda: w.ticks()[-1][0] > n + 5, "the workload to keep running")
    w.verify_state()


def test_leave_running_gives_the_gpu_back(cuda_workload, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    w = cuda_workload
    fake = FakeCudaDriver()
    engine.checkpoint(w.pid, tmp_path / "snap", DumpMode.LEAVE_RUNNING, cuda_factory=lambda: fake)
    assert fake.state(w.pid) is CudaState.RUNNING
    n = w.ticks()[-1][0]
    wait_until(lambda: w.ticks()[-1][0] > n + 5, "the workload to keep running")


def test_restore_failure_in_the_driver_kills_the_copy_and_keeps_the_snapshot(cuda_workload, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    w = cuda_workload
    fake = FakeCudaDriver()
    engine.checkpoint(w.pid, tmp_path / "snap", cuda_factory=lambda: fake)
    w.reap()
    fake.fail_on = "restore"
    with pytest.raises(CudaError):
        engine.restore(tmp_path / "snap", cuda_factory=lambda: fake)
    wait_until(lambda: not alive(w.pid), "the half-restored copy to be gone")
    fake.fail_on = None
    result = engine.restore(tmp_path / "snap", cuda_factory=lambda: fake)  # the snapshot still serves
    assert fake.state(result.pid) is CudaState.RUNNING
    w.pid = result.pid
    w.verify_state()
