"""A torchrun DDP job whose ranks tpagent can move (issue 11), for the rewire tests: three
network-namespace nodes A, B, C run it (gloo, CPU, the unchanged script
``tests/workloads/ddp_job.py``), a fourth, D, is the spare; each node runs `tpagent serve` and
every rank is started by `tpagent rank` under torchrun.  ``reference`` is the same job under
plain torchrun with no tpagent at all: what every run must equal, bit for bit."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any, TypeVar

import psutil
import pytest

from support.cluster import Cluster
from support.helpers import ROOT, wait_until
from tpagent.common.credentials import Credentials
from tpagent.daemon.client import GrpcPeer
from tpagent_rank import protocol as P

A = TypeVar("A", bound=P.Answer)

JOB = ROOT / "tests" / "workloads" / "ddp_job.py"
FSDP_JOB = ROOT / "tests" / "workloads" / "fsdp_job.py"
MESH_JOB = ROOT / "tests" / "workloads" / "mesh_job.py"
RUN = "job1"
STEPS = 160
#: A variable of every rank's environment whose value is no UTF-8 (an environment is bytes): a rank
#: started again from how another runs (a model-aware move, a rebuild) has it as it was.
NOT_UTF8 = "TPAGENT_TEST_LATIN1"
NOT_UTF8_VALUE = b"caf\xe9"
IFNAME = "eth0"  # every node's interface has this name (GLOO_SOCKET_IFNAME holds wherever a rank runs)


def rank_log(d: Path, rank: int) -> list[str]:
    f = d / f"rank{rank}.log"
    return f.read_text().splitlines() if f.exists() else []


def steps(d: Path, rank: int) -> int:
    return sum(ln.startswith("step ") for ln in rank_log(d, rank))


def hurry(d: Path) -> None:
    """The job logging into ``d`` runs its steps left unpaced (its ``--step-time`` sleep goes, its
    losses stay): a test's moves are over, and it waits only for the end."""
    (d / "hurry").touch()


def _reference(d: Path, *extra: str, nproc: int = 3, script: Path = JOB) -> Path:
    subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc-per-node",
            str(nproc),
            str(script),
            "--steps",
            str(STEPS),
            "--log-dir",
            str(d),
            *extra,
        ],
        cwd=ROOT,
        env={**os.environ, "USE_LIBUV": "0"},
        check=True,
        capture_output=True,
        timeout=240,
    )
    assert all(rank_log(d, r)[-1].startswith("done ") for r in range(nproc))
    return d


@pytest.fixture(scope="session")
def reference(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _reference(tmp_path_factory.mktemp("reference"))


@pytest.fixture(scope="session")
def reference_no_optimizer(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The job updating its parameters by hand (no optimizer step for the runtime to count)."""
    return _reference(tmp_path_factory.mktemp("reference-no-opt"), "--no-optimizer")


@pytest.fixture(scope="session")
def reference_aware(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The job registering its training state with tpagent_rank (``--aware``: model-aware mode)."""
    return _reference(tmp_path_factory.mktemp("reference-aware"), "--aware")


@pytest.fixture(scope="session")
def reference_aware_bn(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """``--aware`` with a BatchNorm layer (``--batchnorm``: buffers its forward pass updates in place)."""
    return _reference(tmp_path_factory.mktemp("reference-aware-bn"), "--aware", "--batchnorm")


@pytest.fixture(scope="session")
def reference_aware_hsdp(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """``--aware`` with FSDP2 on a 2 x 2 mesh, four ranks (``--hsdp``: two replicas of two shards)."""
    return _reference(tmp_path_factory.mktemp("reference-aware-hsdp"), "--aware", "--hsdp", nproc=4)


#: ``--aware`` where each rank also keeps GPU state reduced over an NCCL group of its own (world
#: size 1: one GPU takes no two ranks of one NCCL communicator), registered with its training state.
AWARE_ON_GPU = ("--aware", "--own-groups", "nccl")


@pytest.fixture(scope="session")
def reference_aware_gpu(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The job of :data:`AWARE_ON_GPU` (the gpu tier's model-aware move and unplanned recovery)."""
    return _reference(tmp_path_factory.mktemp("reference-aware-gpu"), *AWARE_ON_GPU)


@pytest.fixture(scope="session")
def reference_fsdp(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The FSDP2 script fed by DataLoader workers (``tests/workloads/fsdp_job.py``)."""
    return _reference(tmp_path_factory.mktemp("reference-fsdp"), script=FSDP_JOB)


@pytest.fixture(scope="session")
def reference_mesh(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The 2-D DeviceMesh script, four ranks (``tests/workloads/mesh_job.py``)."""
    return _reference(tmp_path_factory.mktemp("reference-mesh"), nproc=4, script=MESH_JOB)


def serving(tmp_path: Path, names: str, rewire_timeout: str) -> Iterator[Cluster]:
    """Nodes ``names``, each running `tpagent serve` (for a fixture to yield from)."""
    c = Cluster(tmp_path, list(names), ifname=IFNAME)
    try:
        c.start_agents(rewire_timeout=rewire_timeout)
        yield c
    finally:
        c.close()


@pytest.fixture
def quad(tmp_path: Path) -> Iterator[Cluster]:
    yield from serving(tmp_path, "ABCD", "60")


@pytest.fixture
def three_nodes(tmp_path: Path) -> Iterator[Cluster]:
    yield from serving(tmp_path, "ABC", "60")


class Job:
    """The job on nodes A, B, C (or ``names``), ranks r * per_node ... on the r-th of them.  torchrun
    (its store on the first node, in torchrun's agent), or as srun starts one (``srun=True``: a stand-in per rank,
    SLURM_PROCID and SLURM_NTASKS set, the script's own ``env://`` rendezvous at
    MASTER_ADDR:MASTER_PORT on the first, whose store rank 0 would serve); ``wrap`` goes before the rank's
    Python on its command line.  Each rank's own output is in ``tmp/job1-rankR.log`` (the stand-in's
    default, in torchrun's working directory) or, one rank per node, ``tmp/rank-on-NODE.out``."""

    def __init__(
        self,
        c: Cluster,
        tmp: Path,
        step_time: float = 0.05,
        extra: tuple[str, ...] = (),
        srun: bool = False,
        wrap: tuple[str, ...] = (),
        names: str = "ABC",
        script: Path = JOB,
        per_node: int = 1,
    ) -> None:
        assert per_node == 1 or not srun
        self.c = c
        self.tmp = tmp
        self.logs = tmp / "logs"
        self.names = names
        self.script = script
        self.nodes_of = [name for name in names for _ in range(per_node)]  # (rank -> the node it starts on)
        self.logs.mkdir()
        self.runs: dict[str, subprocess.Popen[bytes]] = {}
        host = c.nodes[names[0]].addr  # (its store: torchrun's on the first node, or rank 0's there)
        tpagent = Path(sys.executable).parent / "tpagent"
        for r, name in enumerate(names):
            node = c.nodes[name]
            env = {
                **c.cli_env(name),
                "GLOO_SOCKET_IFNAME": IFNAME,
                "USE_LIBUV": "0",
                NOT_UTF8: os.fsdecode(NOT_UTF8_VALUE),
            }
            rank_out = ["--stdout", str(tmp / f"rank-on-{name}.out")] if per_node == 1 else []
            stand_in = [
                str(tpagent),
                "rank",
                "--agent",
                node.agent_address,
                *rank_out,
                "--",
                *wrap,
                sys.executable,
                str(script),
                "--steps",
                str(STEPS),
                "--log-dir",
                str(self.logs),
                "--step-time",
                str(step_time),
                *extra,
            ]
            if srun:
                env.update(
                    {
                        "SLURM_JOB_ID": RUN,
                        "SLURM_PROCID": str(r),
                        "SLURM_LOCALID": "0",
                        "SLURM_NTASKS": str(len(names)),
                        "MASTER_ADDR": host,
                        "MASTER_PORT": "29500",
                    }
                )
                cmd = node.exec(*stand_in)
            else:
                cmd = node.exec(
                    sys.executable,
                    "-m",
                    "torch.distributed.run",
                    "--nnodes",
                    str(len(names)),
                    "--nproc-per-node",
                    str(per_node),
                    "--rdzv-backend",
                    "c10d",
                    "--rdzv-endpoint",
                    f"{host}:29400",
                    "--rdzv-id",
                    RUN,
                    "--rdzv-conf",
                    f"is_host={int(name == names[0])}",
                    "--local-addr",
                    node.addr,
                    "--max-restarts",
                    "0",
                    "--monitor-interval",
                    "0.5",
                    "--no-python",
                    *stand_in,
                )
            with open(tmp / f"torchrun-{name}.out", "wb") as out:
                self.runs[name] = subprocess.Popen(
                    cmd, cwd=ROOT if per_node == 1 else tmp, env=env, stdout=out, stderr=subprocess.STDOUT
                )
        self.creds = Credentials.load(c.secret, c.nodes["A"].tls)

    def _script(self, p: psutil.Process) -> bool:
        """The training script itself: not the namespace's init or its holder, whose command
        lines name it too, nor its DataLoader workers (forked: its command line and RANK)."""
        return p.cmdline()[1:2] == [str(self.script)] and p.parent().cmdline()[1:2] != [str(self.script)]

    def ask(self, node: str, rank: int, request: P.Request[A]) -> A:
        return GrpcPeer(self.c.nodes[node].agent_address, self.creds).rank(RUN, rank, request, 10)

    def where(self, rank: int) -> str:
        """The node whose agent has ``rank`` running."""
        for name in self.c.nodes:
            try:
                if self.ask(name, rank, P.Locate()).state == P.Whereabouts.HERE.value:
                    return name
            except Exception:  # noqa: BLE001 (not known there, or that agent is down)
                continue
        raise AssertionError(f"rank {rank} runs nowhere")

    def copies(self, rank: int) -> list[str]:
        """The nodes where a process of ``rank`` runs (its script with its rank's log)."""
        out = []
        for name, node in self.c.nodes.items():
            for p in node.processes():
                try:
                    env = p.environ()
                    if self._script(p) and env.get("RANK") == str(rank) and p.status() != "zombie":
                        out.append(name)
                        break
                except psutil.Error:
                    continue
        return out

    def rank_pid(self, rank: int) -> int:
        """The PID of ``rank``'s script (not its namespace's init)."""
        for node in self.c.nodes.values():
            for p in node.processes():
                try:
                    if self._script(p) and p.environ().get("RANK") == str(rank):
                        return p.pid
                except psutil.Error:
                    continue
        raise AssertionError(f"rank {rank}'s script runs nowhere")

    def at_step(self, rank: int, n: int) -> None:
        wait_until(lambda: steps(self.logs, rank) >= n, f"rank {rank} to reach step {n}", 180)

    def move(self, rank: int, to: str, *extra: str) -> subprocess.CompletedProcess[str]:
        return self.c.migrate(0, self.where(rank), to, "--job", RUN, "--rank", str(rank), *extra, timeout=240)

    def moves(self, rank: int, to: str) -> str:
        """Move ``rank`` to ``to``: it must run there, and only there, after; what the CLI said."""
        moved = self.move(rank, to)
        out = moved.stdout + moved.stderr
        assert moved.returncode == 0, out
        assert self.where(rank) == to and self.copies(rank) == [to]
        return out

    def start_move(self, rank: int, to: str, *extra: str) -> subprocess.Popen[str]:
        return self.c.start_migrate(0, self.where(rank), to, "--job", RUN, "--rank", str(rank), *extra)

    def rewire_record(self, node: str) -> dict[str, Any]:
        """The rewire that ``node``'s agent wrote down (the only one), or {} before it has."""
        found = list((self.c.nodes[node].work / "agent" / "rewires").glob("*.json"))
        return dict(json.loads(found[0].read_text())) if found else {}

    def wait(self, timeout: float = 240) -> dict[str, int]:
        return {name: p.wait(timeout) for name, p in self.runs.items()}

    def output(self) -> str:
        return "".join((self.tmp / f"torchrun-{n}.out").read_text()[-2000:] for n in self.names)

    def close(self) -> None:
        for p in self.runs.values():
            if p.poll() is None:
                p.kill()
                p.wait()

    def finishes_as(self, reference: Path) -> None:
        """Every torchrun ends well, never restarting its group, and every rank's losses, step
        by step, and final parameters are those of the uninterrupted run.  (The moves are over:
        the steps left run unpaced.)"""
        hurry(self.logs)
        codes = self.wait()
        assert codes == dict.fromkeys(self.names, 0), "torchrun (or a stand-in) failed: " + self.output()
        for r in range(len(self.nodes_of)):
            got = rank_log(self.logs, r)
            want = rank_log(reference, r)
            assert [ln.split()[1] for ln in got if ln.startswith("step ")] == [str(k) for k in range(STEPS)], (
                f"rank {r}: steps repeated or skipped (the group restarted, or a copy went back)"
            )
            assert got == want, f"rank {r}: its losses or final parameters differ from the uninterrupted run"
        for r, name in enumerate(self.nodes_of):
            shown = (self.tmp / f"torchrun-{name}.out").read_text()
            assert "Restarting" not in shown
            # What the rank printed, wherever it ran, is in its launcher's log: every line, once, in order.
            printed = [int(k) for k in re.findall(rf"^rank {r} step (\d+) loss ", shown, re.MULTILINE)]
            assert printed == list(range(STEPS)), f"rank {r}'s output was not relayed whole to its launcher: {printed}"
