"""Children forked (without exec) after their parent started CUDA: what they kept of the driver is
removed inside them before the freeze, and a child that drives the device by itself is refused first.

Without a GPU the driver's device files are a stand-in file (tests/workloads/forked_workers.py
maps it shared before it forks its batch workers, as a CUDA process's ``/dev/nvidia*`` mappings
are inherited) and the driver's checkpoint calls are faked (only the parent has a context).  CRIU
could dump a mapping of an ordinary file, so what these show is the detection, the removal (made
inside the workers through ptrace, real), the refusals, and workers that still serve batches
after the restore; that CRIU then dumps a real DataLoader job is shown on a GPU
(tests/snapshot/test_gpu_jobs.py).
"""

from __future__ import annotations

import dataclasses
import mmap
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from pathlib import Path

import psutil
import pytest

from conftest import needs_criu
from host import forked
from host.api import UsageError
from snapshot import restore
from snapshot.api import SnapshotConfig, Timeouts, ToolError
from snapshot.cuda import CudaState
from snapshot.dump import checkpoint
from support.fake_cuda import FakeCudaDriver
from support.helpers import alive, kill_and_wait, wait_until

WORKLOAD = Path(__file__).resolve().parent.parent / "workloads" / "forked_workers.py"


class Job:
    def __init__(self, tmp: Path, *flags: str) -> None:
        self.log = tmp / "job.log"
        self.device = Path("/dev/shm") / f"tpagent-standin-nvidia-{tmp.name}"
        lib = tmp / "libcuda.so.1"
        lib.write_bytes(b"\0" * mmap.PAGESIZE)
        with open(tmp / "job.out", "ab") as out:
            self.popen = subprocess.Popen(
                [sys.executable, str(WORKLOAD), str(self.log), str(lib), str(self.device), *flags],
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=out,
                start_new_session=True,
            )
        self.pid = self.popen.pid
        self.group = self.pid
        wait_until(lambda: len(self.ticks()) >= 5 or self.popen.poll() is not None, "the job to serve batches")
        assert self.popen.poll() is None, (tmp / "job.out").read_text()[-2000:]

    def lines(self) -> list[str]:
        return self.log.read_text().splitlines() if self.log.exists() else []

    def ticks(self) -> list[tuple[int, int]]:
        return [(int(ln.split()[1]), int(ln.split()[5])) for ln in self.lines() if ln.startswith("tick ")]

    def workers(self) -> list[int]:
        return sorted(c.pid for c in psutil.Process(self.pid).children())

    def serves_on(self, what: str) -> None:
        """More batches, each checked by the job, from both workers; never a broken one."""
        n = self.ticks()[-1][0]
        wait_until(lambda: self.ticks()[-1][0] > n + 6, f"the job to serve batches {what}")
        assert not [ln for ln in self.lines() if ln.startswith("broken")], self.lines()[-3:]
        ticks = self.ticks()
        assert [k for k, _ in ticks] == list(range(len(ticks))), "a batch was skipped or served twice"
        assert {w for _, w in ticks[-4:]} == set(self.workers()), "a worker stopped serving"

    def holds_device(self, pid: int) -> bool:
        return bool(forked.device_mappings(pid, self.stand_in) or forked.device_fds(pid, self.stand_in))

    @property
    def stand_in(self) -> tuple[str, ...]:
        return (str(self.device),)

    def close(self) -> None:
        with suppress(ProcessLookupError):  # (the job and its workers: one process group, restored as it was)
            os.killpg(self.group, signal.SIGKILL)
        if alive(self.pid):
            kill_and_wait(self.pid)
        self.popen.wait(timeout=30)
        self.device.unlink(missing_ok=True)


@pytest.fixture
def job_factory(tmp_path: Path) -> Iterator[type]:
    made: list[Job] = []

    def make(*flags: str) -> Job:
        made.append(Job(tmp_path, *flags))
        return made[-1]

    yield make  # type: ignore[misc]
    for j in made:
        j.close()


def test_removal_inside_a_running_worker_leaves_it_serving(job_factory) -> None:  # type: ignore[no-untyped-def]
    """Each worker is blocked reading its next request when the calls are made inside it: it goes
    on as before (its read restarted), without the device; its parent keeps its own mapping."""
    job = job_factory()
    found = forked.find(job.workers(), [job.pid], job.stand_in)
    assert [left.pid for left in found] == job.workers()
    assert all(len(left.maps) == 1 and left.fds for left in found), found
    assert forked.refusals(found, [job.pid], job.stand_in) == []
    for left in found:
        assert forked.remove(left) == 1 << 20
    assert not any(job.holds_device(w) for w in job.workers())
    assert forked.device_mappings(job.pid, job.stand_in), "the parent lost its own mapping"
    job.serves_on("after the removal")


def test_removal_acts_only_on_the_process_and_mappings_that_were_found(job_factory) -> None:  # type: ignore[no-untyped-def]
    """Between the look and the removal a worker may end and its PID go to another process, or
    its mappings change: once it is stopped it is looked at again, and nothing else is touched."""
    job = job_factory()
    first, second = forked.find(job.workers(), [job.pid], job.stand_in)
    reused = dataclasses.replace(first, started=first.started + 1)  # (as if the PID now named another process)
    assert forked.remove(reused) == 0
    assert job.holds_device(first.pid)
    (m,) = second.maps
    moved = dataclasses.replace(second, maps=(dataclasses.replace(m, start=m.start + mmap.PAGESIZE),), fds=())
    assert forked.remove(moved) == 0  # (a mapping it no longer has as found: left alone)
    assert forked.device_mappings(second.pid, job.stand_in) == [m]
    assert forked.remove(first) == 1 << 20 and not job.holds_device(first.pid)
    job.serves_on("after a removal that found nothing to do")


def test_forked_workers_dump_restore_and_serve_on(job_factory, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    job = job_factory()
    workers = job.workers()
    fake = FakeCudaDriver(contexts={job.pid})
    config = SnapshotConfig(gpu_devices=job.stand_in)
    m = checkpoint(job.pid, tmp_path / "snap", config=config, cuda_factory=lambda: fake)
    job.popen.wait(timeout=30)
    assert m.cuda_pids == [job.pid]
    assert sorted(f["pid"] for f in m.cuda["forked"]) == workers
    assert "forked_children" in m.timings
    result = restore.restore(tmp_path / "snap", config=config, cuda_factory=lambda: fake)
    job.pid = result.pid
    assert job.workers() == workers
    assert not any(job.holds_device(w) for w in workers)
    assert job.holds_device(job.pid), "the CUDA process came back without its own mapping"
    job.serves_on("after the restore")


def test_a_worker_forked_while_the_gpu_is_frozen_is_stripped_too(job_factory, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    """A DataLoader forks its next epoch's workers whenever it gets there, the CUDA freeze
    included: the tree is looked at again just before CRIU, and the new worker is stripped too."""
    job = job_factory()
    fake = FakeCudaDriver(contexts={job.pid})

    def fork_one_more(pid: int) -> None:
        os.kill(pid, signal.SIGUSR1)
        wait_until(lambda: len(job.workers()) == 3, "the third worker")

    fake.on_checkpoint = fork_one_more
    config = SnapshotConfig(gpu_devices=job.stand_in)
    m = checkpoint(job.pid, tmp_path / "snap", config=config, cuda_factory=lambda: fake)
    job.popen.wait(timeout=30)
    assert len(m.cuda["forked"]) == 2  # (the plan saw two)
    job.pid = restore.restore(tmp_path / "snap", config=config, cuda_factory=lambda: fake).pid
    assert len(job.workers()) == 3
    assert not any(job.holds_device(w) for w in job.workers())
    job.serves_on("from three workers after the restore")


def _tracer(pid: int) -> int:
    status = Path(f"/proc/{pid}/status").read_text().splitlines()
    return int(next(ln.split()[1] for ln in status if ln.startswith("TracerPid:")))


@contextmanager
def frozen(pid: int) -> Iterator[None]:
    """``pid`` held in a frozen control group (cgroup v1's freezer, else v2's ``cgroup.freeze``):
    it cannot stop under ptrace until thawed, as a thread in uninterruptible sleep cannot."""
    v1 = Path("/sys/fs/cgroup/freezer")
    v2 = next(
        (d for d in (Path("/sys/fs/cgroup/unified"), Path("/sys/fs/cgroup")) if (d / "cgroup.procs").exists()), None
    )
    if v1.is_dir():
        group, state, freeze, thaw, is_frozen = (
            v1 / f"tpagent-test-{pid}",
            "freezer.state",
            "FROZEN",
            "THAWED",
            "FROZEN",
        )
        root = v1
    elif v2 is not None:
        group, state, freeze, thaw, is_frozen = v2 / f"tpagent-test-{pid}", "cgroup.freeze", "1", "0", "frozen 1"
        root = v2
    else:
        pytest.skip("no cgroup freezer on this machine")
    group.mkdir()
    try:
        (group / "cgroup.procs").write_text(str(pid))
        (group / state).write_text(freeze)
        events = group / ("freezer.state" if root == v1 else "cgroup.events")
        wait_until(lambda: is_frozen in events.read_text(), "the control group to freeze")
        yield
    finally:
        (group / state).write_text(thaw)
        with suppress(OSError):
            (root / "cgroup.procs").write_text(str(pid))
        group.rmdir()


def test_a_worker_that_does_not_stop_fails_the_dump_before_criu_and_is_let_go_untouched(  # type: ignore[no-untyped-def]
    job_factory, tmp_path: Path
) -> None:
    """A worker that cannot be stopped for the removal (a thread of it in uninterruptible sleep on
    a hung network filesystem; here its control group frozen, which holds it the same way) is
    waited for no longer than the stop timeout: the checkpoint fails in one sentence before CRIU
    ran, the GPU is given back, and the worker, let go at once (not left traced), keeps what it
    had and serves on once it can run again."""
    job = job_factory()
    worker = job.workers()[0]
    fake = FakeCudaDriver(contexts={job.pid})
    config = SnapshotConfig(gpu_devices=job.stand_in, timeouts=Timeouts(stop=1.0))
    with frozen(worker):
        with pytest.raises(ToolError) as e:
            checkpoint(job.pid, tmp_path / "snap", config=config, cuda_factory=lambda: fake)
        said = str(e.value)
        assert f"PID {worker} (python" in said and "did not stop within 1 s" in said, said
        assert getattr(e.value, "rolled_back", False), said
        assert fake.states[job.pid] is CudaState.RUNNING and ("unlock", job.pid) in fake.calls
        assert not (tmp_path / "snap").exists()
        wait_until(lambda: _tracer(worker) == 0, "the worker to be let go")
    assert job.holds_device(worker), "the worker given up on was changed"
    job.serves_on("after a dump that gave up on a worker")


def test_a_worker_that_opened_the_device_itself_is_refused_before_anything(  # type: ignore[no-untyped-def]
    job_factory, tmp_path: Path
) -> None:
    """A worker holding its own descriptor of the driver (not one inherited from its CUDA parent)
    drives the GPU without a context: refused in one sentence, nothing frozen or removed."""
    job = job_factory("--own")
    said = r"open \(fd \d+\) by itself, not from its CUDA parent"
    fake = FakeCudaDriver(contexts={job.pid})
    config = SnapshotConfig(gpu_devices=job.stand_in)
    with pytest.raises(UsageError, match=said + r".* Nothing was done\.$"):
        checkpoint(job.pid, tmp_path / "snap", config=config, cuda_factory=lambda: fake)
    assert fake.calls == [], "the GPU was touched before the refusal"
    assert all(job.holds_device(w) for w in job.workers()), "something was removed before the refusal"
    assert not (tmp_path / "snap").exists()
    job.serves_on("after the refusal")


pytestmark = needs_criu
