"""A node killed outright mid-step (issue 27, items 3 and 4, checks (b), (c) and (d)): every process of its
network namespace SIGKILLed at once, its agent too.  The job is DDP over nodes A, B, C, as srun
starts it (a stand-in per rank, rank 0's serving the job's store on A), its script registering its
training state (``tests/workloads/ddp_job.py --aware``); D is a free spare.

(b) C is killed: its peers' collectives fail and are held from the script; once C stops
    reporting, the orchestrator has A's agent rebuild rank 2 on D from a replica's held state,
    every survivor restarts in its own process from its last step boundary, and the job runs on.
    Every rank's losses, step by step, and final parameters equal the uninterrupted run's, bit for
    bit (the step that was in flight is done again); no line is written twice.  The rebuilt
    rank's exit status, which its launcher (lost with C) cannot see, is written down by the
    orchestrator.
(c) A is killed: rank 0 and the job's store its stand-in served are lost together.  The store is
    served anew on B, whose agent rebuilds rank 0 on D, every rank from then on told to reach
    the store there; the job runs on, bit-identical, as in (b).
(d) The same job with each rank its own shard (``--aware-alone``: no replica of rank 2 survives):
    it cannot be rebuilt, and every rank ends with one sentence saying so; nothing hangs.
(e) B and C are killed together: ranks 1 and 2 are rebuilt together on D from rank 0's held
    state (the rebuild asked about one node finds the other's rank does not answer either), and
    the job runs on, bit-identical.
(f) Rank 1's training process alone is SIGKILLed (its node, its agent and its stand-in live on):
    B's agent holds its end from its stand-in and reports it; the orchestrator has it rebuilt on
    D as in (b), and B's stand-in follows it there, so that every launcher ends as the script
    does (0), rank 1's too, and the job is bit-identical."""

from __future__ import annotations

import contextlib
import json
import signal
from pathlib import Path

import psutil
import pytest

from conftest import needs_criu
from support.cluster import Cluster
from support.helpers import wait_until
from support.orchestrator import Orchestrator
from support.rankjob import IFNAME, JOB, RUN, STEPS, Job, rank_log

pytestmark = needs_criu


def _lose(c: Cluster, name: str) -> list[psutil.Process]:
    """Every process of node ``name`` killed at once, its agent too, as a crash loses them."""
    lost = c.nodes[name].processes_and_children()
    for p in lost:
        with contextlib.suppress(psutil.Error):
            p.send_signal(signal.SIGKILL)
    return lost


def _events(o: Orchestrator) -> list[dict[str, str]]:
    return [json.loads(line) for line in o.ok("events", "--json").splitlines()]


def _runs(p: psutil.Process, script: Path) -> bool:
    """Whether ``p`` is the training script's process (not its stand-in, nor its namespace's init)."""
    try:
        return p.cmdline()[1:2] == [str(script)]
    except psutil.Error:
        return False


def _events_of(o: Orchestrator, kind: str) -> list[str]:
    return [e["text"] for e in _events(o) if e["kind"] == kind]


def _ended(o: Orchestrator) -> list[str]:
    return _events_of(o, "ended")


def _running(tmp_path: Path, extra: tuple[str, ...]) -> tuple[Cluster, Orchestrator, Job]:
    c = Cluster(tmp_path, list("ABCD"), ifname=IFNAME)
    o = Orchestrator(c, tmp_path, lost_grace=2.0)
    try:
        o.start()
        for node in c.nodes.values():
            node.start_agent(rewire_timeout="60", orchestrator=o.address, report_period="0.5")
        job = Job(c, tmp_path, srun=True, extra=extra)  # (ranks 0, 1, 2 on A, B, C; D the spare)
    except BaseException:
        o.close()
        c.close()
        raise
    job.at_step(2, 20)
    wait_until(lambda: all(o.rank_on(RUN, r) for r in range(3)), "the orchestrator to see every rank", 60, 0.5)
    return c, o, job


def _ran_on(c: Cluster, o: Orchestrator, job: Job, reference: Path, survivors: str, rebuilt: str) -> str:
    """Once the surviving nodes' launchers end: each ended 0, every rank's output (each step once,
    its losses and final parameters) is the uninterrupted run's, and one rebuild put ``rebuilt``
    on D; that rebuild's event."""
    codes = {name: job.runs[name].wait(timeout=600) for name in survivors}
    assert codes == dict.fromkeys(survivors, 0), job.output()
    for r in range(3):
        got = rank_log(job.logs, r)
        assert [ln.split()[1] for ln in got if ln.startswith("step ")] == [str(k) for k in range(STEPS)], r
        assert got == rank_log(reference, r), f"rank {r}: its losses or final parameters differ"
    assert "Traceback" not in job.output()
    recovered = [e["text"] for e in _events(o) if e["kind"] == "recovered"]
    assert len(recovered) == 1 and f"rank(s) {rebuilt} rebuilt on {c.nodes['D'].name}" in recovered[0], recovered
    print(recovered[0])
    return recovered[0]


@pytest.mark.timeout(900)
def test_a_node_killed_mid_step_is_rebuilt_on_the_spare_and_the_job_runs_on_bit_identical(
    tmp_path: Path, reference_aware: Path
) -> None:
    c, o, job = _running(tmp_path, ("--aware",))
    try:
        _lose(c, "C")
        _ran_on(c, o, job, reference_aware, "AB", "2")
        assert not [e for e in _events(o) if e["kind"] == "lost"]
        # Its launcher on C went with C: the rebuilt rank's end is the orchestrator's to write down.
        wait_until(lambda: _ended(o), "the orchestrator to write the rebuilt rank's end down", 60, 0.5)
        assert _ended(o) == [f"rank 2 of job {RUN} (rebuilt) exited with status 0"]
    finally:
        job.close()
        o.close()
        c.close()


@pytest.mark.timeout(900)
def test_the_node_serving_the_jobs_store_killed_mid_step_is_rebuilt_and_its_store_served_anew(
    tmp_path: Path, reference_aware: Path
) -> None:
    c, o, job = _running(tmp_path, ("--aware",))
    try:
        _lose(c, "A")
        recovered = _ran_on(c, o, job, reference_aware, "BC", "0")
        assert f"its store, lost with {c.nodes['A'].name}, is served at {c.nodes['B'].addr}:" in recovered
    finally:
        job.close()
        o.close()
        c.close()


@pytest.mark.timeout(900)
def test_two_nodes_killed_together_are_rebuilt_together_and_the_job_runs_on_bit_identical(
    tmp_path: Path, reference_aware: Path
) -> None:
    c, o, job = _running(tmp_path, ("--aware",))
    try:
        _lose(c, "B")
        _lose(c, "C")
        _ran_on(c, o, job, reference_aware, "A", "1, 2")
        wait_until(lambda: len(_ended(o)) == 2, "the orchestrator to write both rebuilt ranks' ends down", 60, 0.5)
        assert sorted(_ended(o)) == [f"rank {r} of job {RUN} (rebuilt) exited with status 0" for r in (1, 2)]
    finally:
        job.close()
        o.close()
        c.close()


@pytest.mark.timeout(900)
def test_a_rank_killed_alone_is_rebuilt_on_the_spare_and_its_stand_in_follows_it(
    tmp_path: Path, reference_aware: Path
) -> None:
    c, o, job = _running(tmp_path, ("--aware",))
    try:
        (training,) = [p for p in c.nodes["B"].processes_and_children() if _runs(p, JOB)]
        training.send_signal(signal.SIGKILL)
        recovered = _ran_on(c, o, job, reference_aware, "ABC", "1")  # (B's launcher too: its rank's end, 0)
        assert "died on" in _events_of(o, "recovering")[0] and "their stand-ins follow them there" in recovered
        said = (tmp_path / "torchrun-B.out").read_text()
        assert f"rank 1 of job {RUN} now runs on {c.nodes['D'].agent_address} (rebuilt)" in said, said[-3000:]
        assert not _events_of(o, "lost")
    finally:
        job.close()
        o.close()
        c.close()


@pytest.mark.timeout(600)
def test_a_lost_rank_with_no_surviving_replica_ends_the_job_in_one_sentence(tmp_path: Path) -> None:
    c, o, job = _running(tmp_path, ("--aware-alone",))
    try:
        _lose(c, "C")
        for name in "AB":
            assert job.runs[name].wait(timeout=300) != 0
        said = "".join(p.read_text(errors="replace") for p in tmp_path.glob("*.out"))
        for rank in (0, 1):
            assert f"rank {rank} of job {RUN} stops: rank(s) 2 of job {RUN} were lost with" in said, said[-3000:]
        assert "cannot be rebuilt: no replica of rank 2's training state survives" in said
        lost = [e for e in _events(o) if e["kind"] == "lost"]
        assert lost and "cannot be rebuilt" in lost[0]["text"], lost
    finally:
        job.close()
        o.close()
        c.close()
