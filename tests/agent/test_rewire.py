"""One rank of a running torchrun DDP job moves to another node while the others carry on
(issue 11): three network-namespace nodes run the job (gloo, CPU, an unchanged training
script), a fourth is the spare, each node runs `tpagent serve`, and every rank is started by
`tpagent rank` under torchrun.  Each rank's losses, step by step, and the final parameters
must be bit-identical to the same job run by plain torchrun with no tpagent at all."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from cluster import Cluster
from conftest import needs_criu
from helpers import ROOT, wait_until
from tpagent.client import GrpcPeer
from tpagent.credentials import Credentials

pytestmark = needs_criu
JOB = ROOT / "tests" / "workloads" / "ddp_job.py"
RUN = "job1"
STEPS = 160
IFNAME = "eth0"  # every node's interface has this name (GLOO_SOCKET_IFNAME holds wherever a rank runs)


def _log(d: Path, rank: int) -> list[str]:
    f = d / f"rank{rank}.log"
    return f.read_text().splitlines() if f.exists() else []


def _steps(d: Path, rank: int) -> int:
    return sum(ln.startswith("step ") for ln in _log(d, rank))


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The job under plain torchrun, no tpagent: what every run must equal."""
    d = tmp_path_factory.mktemp("reference")
    subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "3", str(JOB),
         "--steps", str(STEPS), "--log-dir", str(d)],
        cwd=ROOT, env={**os.environ, "USE_LIBUV": "0"}, check=True, capture_output=True, timeout=240,
    )  # fmt: skip
    assert all(_log(d, r)[-1].startswith("done ") for r in range(3))
    return d


class Job:
    """The job on nodes A, B, C (torchrun's store on A), each rank under `tpagent rank`."""

    def __init__(self, c: Cluster, tmp: Path, step_time: float = 0.05) -> None:
        self.c, self.logs = c, tmp / "logs"
        self.logs.mkdir()
        self.runs: dict[str, subprocess.Popen[bytes]] = {}
        host = c.nodes["A"].addr
        tpagent = Path(sys.executable).parent / "tpagent"
        for name in "ABC":
            node = c.nodes[name]
            env = {**c.cli_env(name), "GLOO_SOCKET_IFNAME": IFNAME, "USE_LIBUV": "0"}
            cmd = node.exec(
                sys.executable, "-m", "torch.distributed.run", "--nnodes", "3", "--nproc-per-node", "1",
                "--rdzv-backend", "c10d", "--rdzv-endpoint", f"{host}:29400", "--rdzv-id", RUN,
                "--rdzv-conf", f"is_host={int(name == 'A')}", "--local-addr", node.addr, "--max-restarts", "0",
                "--monitor-interval", "0.5", "--no-python",
                str(tpagent), "rank", "--agent", node.agent_address, "--stdout", str(tmp / f"rank-on-{name}.out"),
                "--", sys.executable, str(JOB), "--steps", str(STEPS), "--log-dir", str(self.logs),
                "--step-time", str(step_time),
            )  # fmt: skip
            with open(tmp / f"torchrun-{name}.out", "wb") as out:
                self.runs[name] = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT)
        self.creds = Credentials.load(c.secret, c.nodes["A"].tls)

    def where(self, rank: int) -> str:
        """The node whose agent has ``rank`` running."""
        for name, node in self.c.nodes.items():
            try:
                if GrpcPeer(node.agent_address, self.creds).rank(RUN, rank, {"op": "locate"}, 10)["state"] == "here":
                    return name
            except Exception:  # noqa: BLE001 (not known there)
                continue
        raise AssertionError(f"rank {rank} runs nowhere")

    def at_step(self, rank: int, n: int) -> None:
        wait_until(lambda: _steps(self.logs, rank) >= n, f"rank {rank} to reach step {n}", 180)

    def move(self, rank: int, to: str) -> subprocess.CompletedProcess[str]:
        return self.c.migrate(0, self.where(rank), to, "--job", RUN, "--rank", str(rank), timeout=240)

    def wait(self, timeout: float = 240) -> dict[str, int]:
        return {name: p.wait(timeout) for name, p in self.runs.items()}

    def close(self) -> None:
        for p in self.runs.values():
            if p.poll() is None:
                p.kill()
                p.wait()


@pytest.fixture
def quad(tmp_path: Path) -> Iterator[Cluster]:
    c = Cluster(tmp_path, ["A", "B", "C", "D"], ifname=IFNAME)
    try:
        for node in c.nodes.values():
            node.start_agent(rewire_timeout="60")
        yield c
    finally:
        c.close()


def _same_as_reference(logs: Path, reference: Path) -> None:
    for r in range(3):
        got, want = _log(logs, r), _log(reference, r)
        assert [ln.split()[1] for ln in got if ln.startswith("step ")] == [str(k) for k in range(STEPS)], (
            f"rank {r}: steps repeated or skipped (the group restarted, or a copy went back)"
        )
        assert got == want, f"rank {r}: its losses or final parameters differ from the uninterrupted run"


@pytest.mark.timeout(600)
def test_ranks_move_and_the_job_carries_on_bit_identical(quad: Cluster, tmp_path: Path, reference: Path) -> None:
    job = Job(quad, tmp_path)
    try:
        job.at_step(1, 20)
        first = job.where(1)
        moved = job.move(1, "D")
        assert moved.returncode == 0, moved.stdout + moved.stderr
        assert "resumed at step" in moved.stdout + moved.stderr
        assert job.where(1) == "D"

        job.at_step(0, _steps(job.logs, 0) + 20)
        moved = job.move(0, "D")
        assert moved.returncode == 0, moved.stdout + moved.stderr
        assert job.where(0) == "D"

        job.at_step(1, _steps(job.logs, 1) + 20)
        moved = job.move(1, first)
        assert moved.returncode == 0, moved.stdout + moved.stderr
        assert job.where(1) == first

        codes = job.wait()
        assert codes == {"A": 0, "B": 0, "C": 0}, "torchrun (or a stand-in) failed: " + "".join(
            (tmp_path / f"torchrun-{n}.out").read_text()[-2000:] for n in "ABC"
        )
        _same_as_reference(job.logs, reference)
        for name in "ABC":
            assert "Restarting" not in (tmp_path / f"torchrun-{name}.out").read_text()
    finally:
        job.close()
