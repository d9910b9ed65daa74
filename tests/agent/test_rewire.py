"""One rank of a running torchrun DDP job moves to another node while the others carry on
(issue 11), three times: rank 1 to the spare, rank 0 (whose node hosts torchrun's store) to
the spare too, and rank 1 back.  Each rank's losses, step by step, and the final parameters
must be bit-identical to the same job run by plain torchrun with no tpagent at all
(:mod:`support.rankjob`).  A job with no optimizer (parameters updated by hand) stops between two
collectives instead."""

from __future__ import annotations

import contextlib
import json
import subprocess
import sys
from pathlib import Path

import psutil
import pytest

from conftest import needs_criu
from host import sockets
from support.cluster import Cluster, Node
from support.helpers import ROOT
from support.rankjob import FSDP_JOB, MESH_JOB, RUN, Job, steps

pytestmark = needs_criu
ABSENT = "GPU-00000000-0000-0000-0000-0000000000a0"  # (no GPU of any node here)


@pytest.mark.timeout(600)
def test_ranks_move_and_the_job_carries_on_bit_identical(quad: Cluster, tmp_path: Path, reference: Path) -> None:
    job = Job(quad, tmp_path)
    try:
        job.at_step(1, 20)
        first = job.where(1)
        assert "resumed at step" in job.moves(1, "D")
        job.at_step(0, steps(job.logs, 0) + 20)
        job.moves(0, "D")
        job.at_step(1, steps(job.logs, 1) + 20)
        job.moves(1, first)
        job.finishes_as(reference)
    finally:
        job.close()


@pytest.mark.timeout(540)
def test_a_job_without_an_optimizer_stops_between_two_collectives(
    quad: Cluster, tmp_path: Path, reference_no_optimizer: Path
) -> None:
    """... and, with it: a dry run checks each moving rank's own migration and stops nothing; a
    model-aware move of a script that registered no state is refused before anything stops, as is
    one onto a GPU the target lacks (its name passed on by the rewire to each rank's migration); two
    ranks on one node move together, in one command."""
    # (A dry run, a refusal and three moves, the job stepping on through each one's checks, then
    # a look at the node: at 0.1 s a step, a busy machine's slow commands still leave it running.)
    job = Job(quad, tmp_path, extra=("--no-optimizer",), step_time=0.1)
    try:
        job.at_step(2, 20)
        dry = job.c.migrate(0, "C", "D", "--job", RUN, "--rank", "2", "--dry-run", timeout=120)
        out = dry.stdout + dry.stderr
        assert dry.returncode == 0 and "all checks pass" in out, out
        assert job.copies(2) == ["C"]
        elsewhere = job.c.migrate(
            0, "C", "D", "--job", RUN, "--rank", "2", "--to-gpu", ABSENT, "--dry-run", timeout=120
        )
        out = elsewhere.stdout + elsewhere.stderr
        assert elsewhere.returncode != 0 and f"{ABSENT}, named for the copy, is not a GPU of" in out, out
        assert job.copies(2) == ["C"]
        aware = job.c.migrate(0, "C", "D", "--job", RUN, "--rank", "2", "--mode", "aware", timeout=120)
        out = aware.stdout + aware.stderr
        assert aware.returncode != 0 and "rank 2 registered no training state" in out, out  # (its script did not)
        assert "nothing was changed" in out and job.copies(2) == ["C"]
        job.at_step(2, steps(job.logs, 2) + 3)  # (it was not stopped)

        moved = job.move(2, "D")
        out = moved.stdout + moved.stderr
        assert moved.returncode == 0, out
        assert "resumed at collective" in out, out
        assert job.where(2) == "D" and job.copies(2) == ["D"]

        job.at_step(1, steps(job.logs, 1) + 10)
        moved = job.move(1, "D")
        assert moved.returncode == 0, moved.stdout + moved.stderr
        job.at_step(1, steps(job.logs, 1) + 10)
        both = job.c.migrate(0, "D", "C", "--job", RUN, "--rank", "1", "--rank", "2", timeout=240)
        out = both.stdout + both.stderr
        assert both.returncode == 0, out
        assert job.where(1) == "C" and job.where(2) == "C"
        assert job.copies(1) == ["C"] and job.copies(2) == ["C"]
        node = subprocess.run(
            [sys.executable, "-m", "cli.main", "node", "--agent", quad.nodes["C"].agent_address],
            cwd=ROOT,
            env=quad.cli_env("C"),
            capture_output=True,
            text=True,
            timeout=60,
        )
        shown = {(r["job"], r["rank"]): r for r in json.loads(node.stdout)["ranks"]}
        assert {k for k, r in shown.items() if not r["moved_to"]} == {(RUN, 1), (RUN, 2)}, shown
        assert all(shown[RUN, r]["gen"] == 3 and shown[RUN, r]["collectives"] > 0 for r in (1, 2)), shown
        job.finishes_as(reference_no_optimizer)
    finally:
        job.close()


def _workers(pid: int) -> int:
    """How many DataLoader workers the rank has (spawned ones beside multiprocessing's resource tracker)."""
    return sum("resource_tracker" not in " ".join(c.cmdline()) for c in psutil.Process(pid).children())


@pytest.mark.timeout(600)
@pytest.mark.parametrize("workers", ["fork", "spawn"])
def test_an_fsdp_job_fed_by_dataloader_workers_moves_too(
    quad: Cluster, tmp_path: Path, reference_fsdp: Path, workers: str
) -> None:
    """Another shape of script (tests/workloads/fsdp_job.py): FSDP2, AdamW with a schedule and
    gradient clipping, a metric all-gathered, and two DataLoader worker processes per rank,
    forked or spawned (their queues then on POSIX semaphores: :class:`host.files.Relinked`).
    Rank 1 moves to the spare with its workers, and back; every loss is bit-identical."""
    job = Job(quad, tmp_path, script=FSDP_JOB, extra=("--workers", workers))
    try:
        job.at_step(1, 20)
        first = job.where(1)
        assert _workers(job.rank_pid(1)) == 2
        job.moves(1, "D")
        assert _workers(job.rank_pid(1)) == 2  # they came along
        job.at_step(1, steps(job.logs, 1) + 20)
        job.moves(1, first)
        job.finishes_as(reference_fsdp)
    finally:
        job.close()


@pytest.mark.timeout(600)
def test_a_job_on_a_2d_device_mesh_two_ranks_a_node_moves_its_ranks(
    three_nodes: Cluster, tmp_path: Path, reference_mesh: Path
) -> None:
    """A third shape (tests/workloads/mesh_job.py): four ranks on a 2 x 2 DeviceMesh, HSDP on it,
    the default group made by the mesh itself; and two ranks a node (torchrun's usual
    --nproc-per-node), on A and B, C the spare.  torch's device_mesh holds its own copies of
    init_process_group and new_group: the runtime must reach those too, or the job has no group
    the runtime knows (its ranks cannot even be found).  Rank 3 (B's second) moves to C, then
    rank 0 (A's first: a member of the other replica and the other shard group) joins it there;
    every loss, on each dimension's group, is bit-identical."""
    job = Job(three_nodes, tmp_path, script=MESH_JOB, names="AB", per_node=2)
    try:
        job.at_step(3, 20)
        shown = [(tmp_path / f"{RUN}-rank{r}.log").read_text() for r in range(4)]
        assert all("groups DelegatingGroup DelegatingGroup DelegatingGroup" in out for out in shown), shown
        assert [job.where(r) for r in range(4)] == ["A", "A", "B", "B"]
        job.moves(3, "C")
        job.at_step(0, 60)
        job.moves(0, "C")
        assert [job.where(r) for r in range(4)] == ["C", "A", "B", "C"]
        job.finishes_as(reference_mesh)
    finally:
        job.close()


def _store_server(node: Node) -> psutil.Process:
    """The process on ``node`` that listens on the job's store port (29500)."""
    for p in node.processes():
        with contextlib.suppress(OSError, psutil.Error):
            if any(t.listening and t.local[1] == 29500 for t in sockets.tree_tcp([p.pid])):
                return p
    raise AssertionError(f"nothing listens on port 29500 on {node.name}")


@pytest.mark.timeout(600)
def test_under_srun_the_rank_that_would_serve_the_store_moves(quad: Cluster, tmp_path: Path, reference: Path) -> None:
    """As srun starts a job: no launcher serves a store, and the script's own env:// rendezvous
    would have rank 0 serve it on A.  Rank 0's stand-in serves it instead, outside the rank (with
    the rank's Python), so rank 0 moves: to D, then on to B beside rank 1; the store stays on A."""
    job = Job(quad, tmp_path, srun=True)
    try:
        job.at_step(0, 20)
        server = _store_server(quad.nodes["A"])
        assert server.pid not in {p.pid for p in psutil.Process(job.rank_pid(0)).parents()}  # (not in the rank)
        moved = job.move(0, "D")
        assert moved.returncode == 0, moved.stdout + moved.stderr
        assert job.where(0) == "D" and job.copies(0) == ["D"]

        job.at_step(0, steps(job.logs, 0) + 20)
        moved = job.move(0, "B")
        assert moved.returncode == 0, moved.stdout + moved.stderr
        assert job.where(0) == "B" and job.copies(0) == ["B"]
        assert _store_server(quad.nodes["A"]).pid == server.pid

        job.finishes_as(reference)
    finally:
        job.close()


@pytest.mark.timeout(600)
def test_a_rank_that_serves_the_store_itself_is_not_moved(quad: Cluster, tmp_path: Path, reference: Path) -> None:
    """Started through `env` (not a Python its stand-in could serve the store with), rank 0 serves
    the job's store itself: its stand-in says so as it starts; a move of rank 0 (and its dry run)
    is refused in one sentence before anything stops; the job goes on, another rank still moves,
    and every loss is bit-identical."""
    job = Job(quad, tmp_path, srun=True, wrap=("env",))
    try:
        job.at_step(0, 10)
        said = (tmp_path / "torchrun-A.out").read_text()
        assert "serves the job's store itself, so it cannot be moved" in said, said
        assert _store_server(quad.nodes["A"]).pid == job.rank_pid(0)
        for extra in (("--dry-run",), ()):
            refused = job.c.migrate(0, "A", "D", "--job", RUN, "--rank", "0", *extra, timeout=120)
            out = refused.stdout + refused.stderr
            assert refused.returncode != 0 and "serves the job's store" in out and "cannot move" in out, out
            assert "Traceback" not in out
            assert job.copies(0) == ["A"]
        job.at_step(0, steps(job.logs, 0) + 5)  # (nothing was stopped)
        moved = job.move(2, "D")
        assert moved.returncode == 0, moved.stdout + moved.stderr
        assert job.copies(2) == ["D"]
        job.finishes_as(reference)
    finally:
        job.close()
