"""The CUDA calls around CRIU, in order, and their rollback (real CRIU; the driver faked).

The workload maps a file named like the CUDA driver, so tpagent's real detection takes it
for a CUDA process; the driver calls go to tests/support/fake_cuda.py.
"""

from __future__ import annotations

import mmap
import os
import signal
from pathlib import Path

import psutil
import pytest

from conftest import needs_criu
from host.api import UsageError
from snapshot import restore
from snapshot.api import CriuError, CudaError, DumpMode, SnapshotConfig, Stage
from snapshot.cuda import CudaState
from snapshot.dump import checkpoint
from support.fake_cuda import FakeCudaDriver
from support.helpers import alive, assert_continuous, wait_until

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

    m = checkpoint(w.pid, tmp_path / "snap", DumpMode.KILL, progress=progress, cuda_factory=lambda: fake)
    w.reap()
    assert m.cuda_pids == [w.pid]
    assert fake.calls == [("lock", w.pid), ("checkpoint", w.pid)]
    assert seen == [("cuda_lock", "running"), ("cuda_checkpoint", "locked"), ("criu_dump", "checkpointed")]
    stopped_at = w.ticks()[-1][0]

    seen.clear()
    result = restore.restore(tmp_path / "snap", progress=progress, cuda_factory=lambda: fake)
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
        checkpoint(w.pid, tmp_path / "snap", cuda_factory=lambda: fake)
    assert err.value.rolled_back
    assert fake.state(w.pid) is CudaState.RUNNING  # unlocked (and restored) again
    n = w.ticks()[-1][0]
    wait_until(lambda: w.ticks()[-1][0] > n + 5, "the workload to keep running")
    assert_continuous(w.ticks())


def test_failure_after_dump_gives_the_gpu_back(cuda_workload, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    w = cuda_workload
    fake = FakeCudaDriver()
    with pytest.raises(CriuError, match="sealing the snapshot failed") as err:
        checkpoint(
            w.pid, tmp_path / "snap", config=SnapshotConfig(fail_after=Stage.CHECKSUM), cuda_factory=lambda: fake
        )
    assert err.value.rolled_back
    assert fake.calls == [("lock", w.pid), ("checkpoint", w.pid), ("restore", w.pid), ("unlock", w.pid)]
    assert alive(w.pid)
    n = w.ticks()[-1][0]
    wait_until(lambda: w.ticks()[-1][0] > n + 5, "the workload to keep running")
    w.verify_state()


def test_leave_running_gives_the_gpu_back(cuda_workload, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    w = cuda_workload
    fake = FakeCudaDriver()
    checkpoint(w.pid, tmp_path / "snap", DumpMode.LEAVE_RUNNING, cuda_factory=lambda: fake)
    assert fake.state(w.pid) is CudaState.RUNNING
    n = w.ticks()[-1][0]
    wait_until(lambda: w.ticks()[-1][0] > n + 5, "the workload to keep running")


def test_an_interrupt_as_a_leave_running_dump_ends_still_gives_the_gpu_back(cuda_workload, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    """A Ctrl-C (a SIGTERM, a closed terminal) just after CRIU let the tree run again, as the
    stages' times were written, left its GPU checkpointed: the process ran on without it.  The
    snapshot is complete by then: the interrupt comes too late to change anything."""
    w = cuda_workload
    fake = FakeCudaDriver()

    def progress(stage: Stage, msg: str) -> None:
        if stage is Stage.CRIU_DUMP and msg:  # (CRIU is done: its time is being recorded)
            os.kill(os.getpid(), signal.SIGINT)

    m = checkpoint(w.pid, tmp_path / "snap", DumpMode.LEAVE_RUNNING, progress=progress, cuda_factory=lambda: fake)
    assert m.cuda_pids == [w.pid] and fake.state(w.pid) is CudaState.RUNNING
    assert fake.calls == [("lock", w.pid), ("checkpoint", w.pid), ("restore", w.pid), ("unlock", w.pid)]
    n = w.ticks()[-1][0]
    wait_until(lambda: w.ticks()[-1][0] > n + 5, "the workload to keep running")


def test_restore_failure_in_the_driver_kills_the_copy_and_keeps_the_snapshot(cuda_workload, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    w = cuda_workload
    fake = FakeCudaDriver()
    checkpoint(w.pid, tmp_path / "snap", cuda_factory=lambda: fake)
    w.reap()
    fake.fail_on = "restore"
    with pytest.raises(CudaError):
        restore.restore(tmp_path / "snap", cuda_factory=lambda: fake)
    wait_until(lambda: not alive(w.pid), "the half-restored copy to be gone")
    fake.fail_on = None
    result = restore.restore(tmp_path / "snap", cuda_factory=lambda: fake)  # the snapshot still serves
    assert fake.state(result.pid) is CudaState.RUNNING
    w.pid = result.pid
    w.verify_state()


def test_a_stopped_restore_thread_is_refused_not_waited_on(cuda_workload, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    """The driver restores from the process's own restore thread; were it stopped, the driver's
    call would block for good.  The restore refuses, stops the copy and keeps the snapshot."""
    import os
    import signal

    w = cuda_workload
    fake = FakeCudaDriver()
    checkpoint(w.pid, tmp_path / "snap", cuda_factory=lambda: fake)
    w.reap()

    def stop(pid: int) -> None:  # e.g. a job-control stop, or a debugger
        os.kill(pid, signal.SIGSTOP)
        wait_until(lambda: psutil.Process(pid).status() == psutil.STATUS_STOPPED, "the copy to stop")

    fake.on_restore_thread = stop
    with pytest.raises(CudaError, match=f"restore thread \\(TID {w.pid}\\) of PID {w.pid} is stopped"):
        restore.restore(tmp_path / "snap", cuda_factory=lambda: fake)
    assert ("restore", w.pid) not in fake.calls  # the blocking call was never made
    wait_until(lambda: not alive(w.pid), "the stopped copy to be gone")
    fake.on_restore_thread = None
    w.pid = restore.restore(tmp_path / "snap", cuda_factory=lambda: fake).pid
    w.verify_state()


def test_gpu_map_reaches_the_driver_as_uuid_pairs(
    cuda_workload, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:  # type: ignore[no-untyped-def]
    """The snapshot's GPU is not on this node: without a map the restore says which to map;
    with one naming a GPU the node lacks it refuses; with a good one the driver gets the pair."""
    import json

    from host import gpus
    from host.gpus import GpuInfo
    from snapshot.manifest import _body_digest

    old = "GPU-11111111-2222-3333-4444-555555555555"
    new = "GPU-66666666-7777-8888-9999-000000000000"
    w = cuda_workload
    fake = FakeCudaDriver()
    checkpoint(w.pid, tmp_path / "snap", cuda_factory=lambda: fake)
    w.reap()
    # No GPU exists here: write the one the process "used" into the manifest, as NVML would have.
    path = tmp_path / "snap" / "manifest.json"
    data = json.loads(path.read_text())
    data["gpus"] = [
        {"index": 0, "uuid": old, "name": "H100", "memory_total": 80 << 30, "memory_used": 1 << 30, "pids": [w.pid]}
    ]
    data["manifest_sha256"] = _body_digest(data)
    path.write_text(json.dumps(data))
    here = GpuInfo(0, new, "H100", 80 << 30, 0, 40, 0, ())
    monkeypatch.setattr(gpus, "inventory", lambda: [here])
    with pytest.raises(UsageError, match=f"GPU {old} is not on this node.*--gpu-map {old}="):
        restore.restore(tmp_path / "snap", cuda_factory=lambda: fake)
    with pytest.raises(UsageError, match="GPU GPU-00000000-0000-0000-0000-000000000001 is not on this node"):
        restore.restore(tmp_path / "snap", {old: "GPU-00000000-0000-0000-0000-000000000001"}, cuda_factory=lambda: fake)
    assert not alive(w.pid) and fake.gpu_maps == []  # refused before anything started
    w.pid = restore.restore(tmp_path / "snap", {old.lower().removeprefix("GPU-"): new}, cuda_factory=lambda: fake).pid
    assert fake.gpu_maps == [{old: new}]
    w.verify_state()
