"""Ordinary GPU training jobs, one shape each (tests/workloads/gpu_job.py), dumped and restored on a
node and moved between two, each ending bit-identical to an uninterrupted run of the same shape
(skipped on machines without an NVIDIA GPU; the GPU proof runs them, DataLoader workers first).

Each shape's uninterrupted run starts first, all of them at once; then, one shape after another,
the same job runs under `tpagent launch` on node A, is dumped and restored there (`tpagent dump`,
`tpagent restore`), runs on, is moved to node B (`tpagent migrate`, two agents), and runs to its
end.  Its loss at every step and its final parameters must equal the uninterrupted run's.  With
``TPAGENT_JOBS_REPORT=FILE`` each shape adds a JSON row to FILE (the proof's table): image size,
dump, restore and downtime seconds, outcome.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest

from conftest import needs_criu, needs_gpu
from support.cluster import Cluster
from support.helpers import alive, kill_and_wait, wait_until

pytestmark = [needs_criu, *needs_gpu]
JOB = Path(__file__).resolve().parent.parent / "workloads" / "gpu_job.py"
#: In the order the proof drops them when its time is short (from the end).
SHAPES = [
    "dataloader",
    "dataloader-persistent",
    "dataloader-spawn",
    "fork-pool",
    "streams",
    "graph",
    "amp",
    "expandable",
    "hf",
    "compile",
    "compile-graphs",
    "two-gpus",
]
STEPS = 150
#: The shapes whose workers are forked after CUDA started.
FORKS = ("dataloader", "dataloader-persistent", "fork-pool")


def _lines(log: Path) -> list[str]:
    return log.read_text().splitlines() if log.exists() else []


def _steps(log: Path) -> int:
    return sum(ln.startswith("step ") for ln in _lines(log))


def _report(row: dict[str, object]) -> None:
    path = os.environ.get("TPAGENT_JOBS_REPORT")
    if path:
        with open(path, "a") as f:
            f.write(json.dumps(row) + "\n")


class Uninterrupted:
    """Every shape's uninterrupted run, all started at once; :meth:`lines` waits for one's end."""

    def __init__(self, tmp: Path) -> None:
        self.tmp = tmp
        self.runs = {}
        for shape in SHAPES:
            with open(tmp / f"{shape}.out", "ab") as out:
                self.runs[shape] = subprocess.Popen(
                    [sys.executable, str(JOB), shape, str(tmp / f"{shape}.log"), "--steps", str(STEPS)],
                    stdout=out,
                    stderr=out,
                    stdin=subprocess.DEVNULL,
                    start_new_session=True,
                )

    def lines(self, shape: str) -> list[str]:
        try:
            self.runs[shape].wait(timeout=600)
        except subprocess.TimeoutExpired:
            self.runs[shape].kill()
            self.runs[shape].wait()
        return _lines(self.tmp / f"{shape}.log") or (self.tmp / f"{shape}.out").read_text().splitlines()[-3:]

    def close(self) -> None:
        for run in self.runs.values():
            if run.poll() is None:
                run.kill()
                run.wait()


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Uninterrupted]:
    runs = Uninterrupted(tmp_path_factory.mktemp("uninterrupted"))
    try:
        yield runs
    finally:
        runs.close()


@pytest.fixture(scope="module")
def nodes(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    with Cluster.with_agents(tmp_path_factory.mktemp("nodes"), ["A", "B"]) as c:
        yield c


def _on_a(c: Cluster, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        c.nodes["A"].exec(sys.executable, "-m", "cli.main", *args),
        cwd=Path(__file__).resolve().parent.parent.parent,
        capture_output=True,
        text=True,
        timeout=600,
    )


@pytest.mark.parametrize("shape", SHAPES)
def test_job_shape_dumped_restored_and_moved_bit_identical(
    shape: str, uninterrupted: Uninterrupted, nodes: Cluster, tmp_path: Path
) -> None:
    want = uninterrupted.lines(shape)
    row: dict[str, object] = {"shape": shape, "outcome": "failed"}
    if want and want[0].startswith("skip "):
        row |= {"outcome": "skipped", "detail": want[0][5:]}
        _report(row)
        pytest.skip(want[0][5:])
    assert want and want[-1].startswith("final "), f"the uninterrupted run did not end: {want[-3:]}"
    log = tmp_path / "job.log"
    root = 0
    try:
        cmd = (sys.executable, str(JOB), shape, str(log), "--steps", str(STEPS))
        root = nodes.nodes["A"].launch(tmp_path / "job.out", *cmd)
        wait_until(lambda: _steps(log) >= 20, f"{shape} to step", 300)
        for _ in range(10):  # (a DataLoader without persistent workers has none between its epochs)
            doctor = _on_a(nodes, "doctor", "--pid", str(root))
            row["doctor"] = [ln for ln in doctor.stdout.splitlines() if "forked" in ln]
            if shape not in FORKS or row["doctor"]:
                break
        if shape in FORKS:  # (doctor names each child forked after CUDA started, and what is done with it)
            assert any("left from a fork: they are removed" in ln for ln in row["doctor"]), doctor.stdout
        children = [c.pid for c in psutil.Process(root).children(recursive=True)]
        row["processes"] = len(children) + 1
        t0 = time.monotonic()
        dump = _on_a(nodes, "dump", str(root), "--out", str(tmp_path / "snap"), "--json")
        row["dump_s"] = round(time.monotonic() - t0, 2)
        assert dump.returncode == 0, f"{dump.stderr}\n{doctor.stdout}"
        row["image_bytes"] = json.loads(dump.stdout)["bytes"]
        at = _steps(log)
        inspect = _on_a(nodes, "inspect", str(tmp_path / "snap"))
        t0 = time.monotonic()
        res = _on_a(nodes, "restore", str(tmp_path / "snap"), "--json")
        row["restore_s"] = round(time.monotonic() - t0, 2)
        assert res.returncode == 0, res.stderr
        root = json.loads(res.stdout)["pid"]
        wait_until(lambda: _steps(log) >= at + 20, f"{shape} to step on after its restore", 300)
        mig = nodes.migrate(root, "A", "B", "--json", timeout=600)
        assert mig.returncode == 0, mig.stderr + mig.stdout
        doc = json.loads(mig.stdout)
        row["downtime_s"] = doc["timings"].get("downtime")
        row["move_timings"] = doc["timings"]
        root = doc["new_pid"]
        ended = lambda: any(ln.startswith("final ") for ln in _lines(log)) or not alive(root)  # noqa: E731
        wait_until(ended, f"{shape} to end", 600)
        got = _lines(log)
        assert got == want, f"{shape} differs from its uninterrupted run: {_first_difference(got, want)}"
        row["outcome"] = "passed"
        row["forked"] = [f for f in inspect.stdout.splitlines() if "forked" in f or "no CUDA context" in f]
    finally:
        _report(row)
        if root and alive(root):
            kill_and_wait(root)


def test_workers_reading_a_pinned_dataset_move_with_it(nodes: Cluster, tmp_path: Path) -> None:
    """DataLoader workers that read a dataset in pinned memory their parent allocated before the
    fork.  The driver gives pinned memory as ordinary anonymous memory (the workload says where it
    lies), which a fork copies: the workers read their own copy, keep it through the strip of the
    driver's mappings, and the job moves and steps on with its data.  Were it in a driver mapping
    (another driver), the strip would take it from the workers: said, as a failure."""
    log = tmp_path / "job.log"
    cmd = (sys.executable, str(JOB), "pinned-dataset", str(log), "--steps", "100000")
    root = nodes.nodes["A"].launch(tmp_path / "job.out", *cmd)
    try:
        wait_until(lambda: _steps(log) >= 20, "the job to step", 300)
        where = next(ln.split()[1] for ln in _lines(log) if ln.startswith("pinned-in "))
        _report({"shape": "pinned-dataset", "pinned_in": where})
        assert not where.startswith("/dev/nvidia"), f"pinned memory lies in {where} with this driver: not handled"
        mig = nodes.migrate(root, "A", "B", "--json", timeout=600)
        assert mig.returncode == 0, mig.stderr + mig.stdout
        root = json.loads(mig.stdout)["new_pid"]
        at = _steps(log)
        wait_until(lambda: _steps(log) >= at + 10 or not alive(root), "the moved job to step on", 120)
        assert _steps(log) >= at + 10, (tmp_path / "job.out").read_text()[-2000:]
    finally:
        if alive(root):
            kill_and_wait(root)


def _first_difference(got: list[str], want: list[str]) -> str:
    for i, (g, w) in enumerate(zip(got, want, strict=False)):
        if g != w:
            return f"line {i}: {g!r}, uninterrupted {w!r}"
    return f"{len(got)} lines, uninterrupted {len(want)}: last {got[-1:]!r}"
