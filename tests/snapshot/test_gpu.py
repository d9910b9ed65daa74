"""The real CUDA driver and real CRIU on an NVIDIA GPU (skipped on machines without one).

A torch process holds 1 or 8 GiB on the GPU; it is dumped (lock -> checkpoint -> criu) and
restored (criu -> restore -> unlock), the driver's state is checked as each stage starts,
and the whole GPU tensor is compared with the host shadow copy it took at start.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import needs_criu, needs_gpu
from snapshot import restore
from snapshot.api import Stage
from snapshot.dump import checkpoint
from support.helpers import alive, kill_and_wait, wait_until

pytestmark = [needs_criu, *needs_gpu]
HOLD = Path(__file__).resolve().parent.parent / "workloads" / "gpu_hold.py"


def _lines(log: Path) -> list[str]:
    return log.read_text().splitlines() if log.exists() else []


def _steps(log: Path) -> list[int]:
    return [int(ln.split()[1]) for ln in _lines(log) if ln.startswith("step ")]


def _verify(pid: int, log: Path) -> None:
    before = sum(ln.startswith("verify") for ln in _lines(log))
    os.kill(pid, signal.SIGUSR1)
    wait_until(lambda: sum(ln.startswith("verify") for ln in _lines(log)) > before, "a verify line", 300)
    assert [ln for ln in _lines(log) if ln.startswith("verify")][-1] == "verify ok"


@pytest.mark.parametrize("gib", [1, 8])
def test_gpu_process_dump_restore_bit_exact(tmp_path: Path, gib: int) -> None:
    from snapshot.cuda import CudaDriver

    log = tmp_path / "gpu.log"
    with open(tmp_path / "gpu.out", "ab") as out:
        popen = subprocess.Popen(
            [sys.executable, str(HOLD), str(log), str(gib)],
            stdout=out,
            stderr=out,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
        )
    pid = popen.pid
    try:
        wait_until(lambda: len(_steps(log)) > 5, "the GPU workload to start", 300)
        driver = CudaDriver()
        seen: dict[str, str] = {}

        def progress(stage: Stage, msg: str) -> None:
            if not msg and stage in (
                Stage.CUDA_LOCK,
                Stage.CUDA_CHECKPOINT,
                Stage.CRIU_DUMP,
                Stage.CUDA_RESTORE,
                Stage.CUDA_UNLOCK,
            ):
                seen[stage.value] = driver.state(pid).value
            if not msg and stage is Stage.CUDA_RESTORE:  # the driver's restore thread lives in the restored process
                seen["restore_thread"] = str(
                    driver.restore_thread_id(pid) in {int(t) for t in os.listdir(f"/proc/{pid}/task")}
                )

        m = checkpoint(pid, tmp_path / "snap", progress=progress)
        popen.wait(timeout=60)
        assert m.cuda_pids == [pid] and m.gpus, m
        assert seen == {"cuda_lock": "running", "cuda_checkpoint": "locked", "criu_dump": "checkpointed"}
        stopped = _steps(log)[-1]
        uuid = m.gpus[0]["uuid"]
        result = restore.restore(tmp_path / "snap", {uuid: uuid}, progress=progress)  # exercises gpuPairs
        assert result.pid == pid
        assert (
            seen["cuda_restore"] == "checkpointed"
            and seen["cuda_unlock"] == "locked"
            and seen["restore_thread"] == "True"
        )
        assert driver.state(pid).value == "running"
        wait_until(lambda: _steps(log)[-1] > stopped + 5, "the restored workload to step on", 120)
        steps = _steps(log)
        assert steps == list(range(len(steps)))  # went on from where it stood
        _verify(pid, log)  # every byte of the GPU tensor is what it was
    finally:
        kill_and_wait(pid)
        if popen.poll() is None:
            popen.wait(timeout=30)


def _launch_hold(tmp_path: Path, gib: int) -> tuple[int, Path]:
    """gpu_hold.py under `tpagent launch`: the namespace's PID and the workload's log."""
    from support.helpers import tpagent

    log = tmp_path / "gpu.log"
    proc = tpagent("launch", "--stdout", str(tmp_path / "gpu.out"), "--", sys.executable, str(HOLD), str(log), str(gib))
    assert proc.returncode == 0, proc.stderr
    return int(proc.stdout), log


def test_gpu_process_in_launched_namespace(tmp_path: Path) -> None:
    from support.helpers import tpagent

    root, log = _launch_hold(tmp_path, 1)
    try:
        wait_until(lambda: len(_steps(log)) > 5, "the GPU workload to start", 300)
        dump = tpagent("dump", str(root), "--out", str(tmp_path / "snap"))
        assert dump.returncode == 0, dump.stderr
        stopped = _steps(log)[-1]
        res = tpagent("restore", str(tmp_path / "snap"), "--json")
        assert res.returncode == 0, res.stderr
        import json

        root = json.loads(res.stdout)["pid"]
        wait_until(lambda: _steps(log)[-1] > stopped + 5, "the restored workload to step on", 120)
        import psutil

        _verify(psutil.Process(root).children()[0].pid, log)
    finally:
        if alive(root):
            kill_and_wait(root)


def test_gpu_process_migrates_between_two_agents(tmp_path: Path) -> None:
    """Two nodes, each a network namespace of this machine with its agent: an 8 GiB GPU process
    launched on A moves to B under `tpagent migrate`, its GPU data bit-exact; each stage's time
    is printed.  (Not two agents in one namespace: the CUDA driver holds an abstract socket named
    after the process, which its copy cannot bind there while the original is held.)"""
    import json

    import psutil

    from support.cluster import Cluster

    c = Cluster(tmp_path, ["A", "B"])
    root = 0
    try:
        for node in c.nodes.values():
            node.start_agent()
        log = tmp_path / "gpu.log"
        root = c.nodes["A"].launch(tmp_path / "gpu.out", sys.executable, str(HOLD), str(log), "8")
        wait_until(lambda: len(_steps(log)) > 5, "the GPU workload to start", 300)
        mig = c.migrate(root, "A", "B", "--json", timeout=900)
        assert mig.returncode == 0, mig.stderr + mig.stdout + (c.nodes["A"].work / "agent.log").read_text()[-3000:]
        doc = json.loads(mig.stdout)
        print("GPU migration timings:", json.dumps(doc["timings"]), "total", doc["seconds"])
        wait_until(lambda: not alive(root), "the original to be ended", 60)
        root = doc["new_pid"]
        stopped = _steps(log)[-1]
        wait_until(lambda: _steps(log)[-1] > stopped + 5, "the migrated workload to step on", 120)
        steps = _steps(log)
        assert steps == list(range(len(steps)))
        _verify(psutil.Process(root).children()[0].pid, log)
    finally:
        if root and alive(root):
            kill_and_wait(root)
        c.close()
