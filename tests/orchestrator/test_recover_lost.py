"""A node killed outright mid-step (issue 27, items 3 and 4, checks (b), (c) and (d)): every process of its
network namespace SIGKILLed at once, its agent too.  The job is DDP over nodes A, B, C, as srun
starts it (a stand-in per rank, rank 0's serving the job's store on A), its script registering its
training state (``tests/workloads/ddp_job.py --aware``); D is a free spare.

(b) C is killed: its peers' collectives fail and are held from the script; once C stops
    reporting, the orchestrator has A's agent rebuild rank 2 on D from a replica's held state,
    every survivor restarts in its own process from its last step boundary, and the job runs on.
    Every rank's losses, step by step, and final parameters equal the uninterrupted run's, bit for
    bit (the step that was in flight is done again); no line is written twice, but by a survivor
    taken back to the others' boundary (as in (g), where the node died decides).  The rebuilt
    rank's exit status, which its launcher (lost with C) cannot see, is written down by the
    orchestrator.
(c) A is killed: rank 0 and the job's store its stand-in served are lost together.  The store is
    served anew on B, whose agent rebuilds rank 0 on D, every rank from then on told to reach
    the store there; the job runs on, bit-identical, as in (b).  B's agent restarted meanwhile,
    the store outlives it, and ends once the job has.
(d) The same job with each rank its own shard (``--aware-alone``: no replica of rank 2 survives):
    it cannot be rebuilt, and every rank ends with one sentence saying so; nothing hangs.  The
    same where both replicas of one shard of an HSDP job (below, (m)) are killed together.
(m) The job is HSDP's, four ranks (two replicas of two shards): B is killed, and its rank is
    rebuilt from the replica of its own shard, on D; the job runs on, bit-identical.
(k) Rank 2's only surviving replica is rank 1 (``--replicas 0;1,2``): A's agent rebuilds it from
    rank 1's state on B, as in (b).
(e) B and C are killed together: ranks 1 and 2 are rebuilt together on D from rank 0's held
    state (the rebuild asked about one node finds the other's rank does not answer either), and
    the job runs on, bit-identical.
(f) Rank 1's training process alone is SIGKILLed (its node, its agent and its stand-in live on):
    B's agent holds its end from its stand-in and reports it; the orchestrator has it rebuilt on
    D as in (b), and B's stand-in follows it there, so that every launcher ends as the script
    does (0), rank 1's too, and the job is bit-identical.
(g) Rank 0 dies alone once rank 2 has finished the step rank 1 is caught in (``--die-at``): the
    job goes on from rank 1's boundary, rank 2 taken back to it with a replica's state.
(h) With lost ranks left to their jobs (``lost_grace`` 0), a rank killed alone ends at once: its
    end is not held for a rebuild that will not come.
(i) The orchestrator is set to take a silent node as unreachable only after an hour: C killed,
    its peers' collectives fail, each says so to its agent, which reports at once, and the
    orchestrator asks C's agent, which does not answer; C is taken as lost then, and (b) follows.
(j) C's link goes down before its processes are killed, as at a power loss: its peers see no
    reset, their collectives wait in silence; C has missed its reports for ``quiet_after`` and
    its host takes no connection: it is taken as lost then, and (b) follows.  A node whose agent
    alone is down is not, whether its host refuses the connection or drops it: its ranks run on,
    and its job goes on without word from it.
(l) C's reports do not reach the orchestrator, but its job goes on: C is unreachable, its ranks
    not lost; once C is killed and the job stands still, they are taken as lost, and (b) follows."""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import socket
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import psutil
import pytest

from conftest import needs_criu
from support.cluster import Cluster
from support.helpers import wait_until
from support.orchestrator import Orchestrator
from support.rankjob import IFNAME, JOB, RUN, Job, hurry, rank_log, steps
from support.users import NOBODY, as_user, user_dir, user_python
from tpagent.daemon.rpc import pb, stub
from tpagent.jobs.storeserver import STORE_SERVER

pytestmark = needs_criu

DYING = Path(__file__).resolve().parent.parent / "attackers" / "dying_rank.py"


def _lose(c: Cluster, name: str) -> list[psutil.Process]:
    """Every process of node ``name`` killed at once, its agent too, as a crash loses them."""
    lost = c.nodes[name].processes_and_children()
    for p in lost:
        with contextlib.suppress(psutil.Error):
            p.send_signal(signal.SIGKILL)
    return lost


def _store_servers(c: Cluster, name: str) -> list[psutil.Process]:
    out = []
    for p in c.nodes[name].processes_and_children():
        with contextlib.suppress(psutil.Error):
            if STORE_SERVER in p.cmdline() and p.status() != psutil.STATUS_ZOMBIE:
                out.append(p)
    return out


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


@contextlib.contextmanager
def _running(
    tmp_path: Path,
    extra: tuple[str, ...],
    grace: float = 2.0,
    step_time: float = 0.05,
    names: str = "ABC",
    **settings: float,
) -> Iterator[tuple[Cluster, Orchestrator, Job]]:
    """Nodes ``names`` and one more, the spare (D, after A-C), with agents and an orchestrator,
    and the job running a rank on each of ``names``, every rank seen by the orchestrator; all of
    it ended on the way out."""
    c = Cluster(tmp_path, [*names, chr(ord(names[-1]) + 1)], ifname=IFNAME)
    o = Orchestrator(c, tmp_path, lost_grace=grace, **settings)
    job: Job | None = None
    try:
        o.start()
        c.start_agents(rewire_timeout="60", orchestrator=o.address, report_period="0.5")
        job = Job(c, tmp_path, srun=True, extra=extra, step_time=step_time, names=names)
        job.at_step(len(names) - 1, 20)
        every = range(len(names))
        wait_until(lambda: all(o.rank_on(RUN, r) for r in every), "the orchestrator to see every rank", 60, 0.5)
        yield c, o, job
    finally:
        if job is not None:
            job.close()
        o.close()
        c.close()


def _twice(lines: list[str], step: int) -> list[str]:
    """``lines`` with the line of ``step`` written again right after itself (the step done again)."""
    return [x for ln in lines for x in ([ln, ln] if ln.startswith(f"step {step} ") else [ln])]


def _ran_on(c: Cluster, o: Orchestrator, job: Job, reference: Path, survivors: str, rebuilt: str) -> str:
    """Once the surviving nodes' launchers end: each ended 0, one rebuild put ``rebuilt`` on D, and
    every rank's output (each step once, its losses and final parameters) is the uninterrupted
    run's, but for a survivor that had finished the step the others were caught in (where the
    node died decides): taken back, it did that step again, and wrote its line of it again, the
    same; that rebuild's event.  (Once it is rebuilt, the steps left run unpaced.)"""
    wait_until(lambda: _events_of(o, "recovered"), "the job to be rebuilt", 300, 0.5)
    hurry(job.logs)
    codes = {name: job.runs[name].wait(timeout=600) for name in survivors}
    assert codes == dict.fromkeys(survivors, 0), job.output()
    recovered = _events_of(o, "recovered")
    (spare,) = (node for name, node in c.nodes.items() if name not in job.names)
    assert len(recovered) == 1 and f"rank(s) {rebuilt} rebuilt on {spare.name}" in recovered[0], recovered
    found = re.search(r"runs on from step (\d+),", recovered[0])
    assert found, recovered[0]
    back = re.search(r"rank\(s\) ([\d, ]+), at another step, given it from a replica", recovered[0])
    again = {int(r) for r in back.group(1).split(", ")} if back else set()
    lost = {int(r) for r in rebuilt.split(", ")}
    for r in range(len(job.names)):
        got = rank_log(job.logs, r)
        before = any(ln.startswith(f"step {int(found.group(1)) - 1} ") for ln in got)
        want = _twice(rank_log(reference, r), int(found.group(1))) if r in again else rank_log(reference, r)
        if r in lost | again and not before:
            # (the lost rank was killed once it had done its part of the step before the one the
            # job runs on from, but before it wrote that step's line: its new process starts past
            # it; a rank brought forward to the job's step, from a replica, starts past it too)
            want = [ln for ln in rank_log(reference, r) if not ln.startswith(f"step {int(found.group(1)) - 1} ")]
        assert [ln.split()[1] for ln in got if ln.startswith("step ")] == [
            ln.split()[1] for ln in want if ln.startswith("step ")
        ], r
        assert got == want, f"rank {r}: its losses or final parameters differ"
    assert "Traceback" not in job.output()
    print(recovered[0])
    return recovered[0]


@pytest.mark.timeout(900)
def test_a_node_killed_mid_step_is_rebuilt_on_the_spare_and_the_job_runs_on_bit_identical(
    tmp_path: Path, reference_aware: Path
) -> None:
    with _running(tmp_path, ("--aware",)) as (c, o, job):
        _lose(c, "C")
        _ran_on(c, o, job, reference_aware, "AB", "2")
        assert not [e for e in _events(o) if e["kind"] == "lost"]
        # Its launcher on C went with C: the rebuilt rank's end is the orchestrator's to write down.
        wait_until(lambda: _ended(o), "the orchestrator to write the rebuilt rank's end down", 60, 0.5)
        assert _ended(o) == [f"rank 2 of job {RUN} (rebuilt) exited with status 0"]


@pytest.mark.timeout(900)
def test_a_node_killed_is_looked_for_as_soon_as_its_peers_collectives_fail(
    tmp_path: Path, reference_aware: Path
) -> None:
    # (unreachable_after an hour: its silence alone never makes it lost here)
    with _running(tmp_path, ("--aware",), unreachable_after=3600.0) as (c, o, job):
        _lose(c, "C")
        _ran_on(c, o, job, reference_aware, "AB", "2")
        found = _events_of(o, "unreachable")
        assert len(found) == 1 and found[0].startswith(f"{c.nodes['C'].name} does not answer (5 s, twice)"), found
        assert f"while ranks of job {RUN} saw a collective fail" in found[0]


@pytest.mark.timeout(900)
def test_the_node_serving_the_jobs_store_killed_mid_step_is_rebuilt_and_its_store_served_anew(
    tmp_path: Path, reference_aware: Path
) -> None:
    with _running(tmp_path, ("--aware",)) as (c, o, job):
        _lose(c, "A")
        wait_until(lambda: _events_of(o, "recovered"), "the job to be rebuilt", 300, 0.5)
        served = re.search(r"is served at ([\d.]+):(\d+)", _events_of(o, "recovered")[0])
        assert served and served.group(1) == c.nodes["B"].addr, _events_of(o, "recovered")
        # It outlives the agent that serves it, restarted (its ranks run on, and need it to move).
        c.nodes["B"].kill_agent()
        c.nodes["B"].start_agent(rewire_timeout="60", orchestrator=o.address, report_period="0.5")
        socket.create_connection((served.group(1), int(served.group(2))), timeout=5).close()
        assert "kept again" in c.nodes["B"].agent_log()
        recovered = _ran_on(c, o, job, reference_aware, "BC", "0")
        assert f"its store, lost with {c.nodes['A'].name}, is served at {c.nodes['B'].addr}:" in recovered
        # ... until no rank of its job is left there.
        wait_until(lambda: not _store_servers(c, "B"), "the store served anew on B to end with its job", 60, 0.5)


@pytest.mark.timeout(900)
def test_a_lost_rank_whose_only_replica_runs_on_another_node_than_the_rebuilding_agent_is_rebuilt_from_it(
    tmp_path: Path, reference_aware: Path
) -> None:
    """Rank 0 registers itself alone, ranks 1 and 2 each other (``--replicas 0;1,2``, as HSDP's
    replica groups would): C is killed, and A's agent (rank 0's, the lowest surviving rank's)
    rebuilds rank 2 from rank 1's state on B, its command rank 0's renumbered."""
    with _running(tmp_path, ("--aware", "--replicas", "0;1,2")) as (c, o, job):
        _lose(c, "C")
        _ran_on(c, o, job, reference_aware, "AB", "2")
        assert "rank(s) 2 rebuilt on" in c.nodes["A"].agent_log()


@pytest.mark.timeout(900)
def test_an_hsdp_job_loses_a_node_and_its_rank_is_rebuilt_from_the_replica_of_its_own_shard(
    tmp_path: Path, reference_aware_hsdp: Path
) -> None:
    """Four ranks, FSDP2 on a 2 x 2 mesh (two replicas of two shards; the replicas derived from the
    mesh), on A-D, E the spare: B (rank 1, shard 1) is killed.  A's agent rebuilds rank 1 on E
    from rank 3's state on D, the other replica of shard 1 (ranks 0 and 2 hold shard 0), and the
    job, every rank restarted from its boundary with its state's DTensors, runs on bit-identical."""
    with _running(tmp_path, ("--aware", "--hsdp"), names="ABCD") as (c, o, job):
        _lose(c, "B")
        _ran_on(c, o, job, reference_aware_hsdp, "ACD", "1")
        assert "rank(s) 1 rebuilt on" in c.nodes["A"].agent_log()
        # (rank 1's, from rank 3; a survivor brought forward from its replica is named too, before it)
        assert re.search(r"state (rank \d+'s from rank \d+, )*rank 1's from rank 3 \(", c.nodes["A"].agent_log())


@pytest.mark.timeout(900)
def test_two_nodes_killed_together_are_rebuilt_together_and_the_job_runs_on_bit_identical(
    tmp_path: Path, reference_aware: Path
) -> None:
    with _running(tmp_path, ("--aware",)) as (c, o, job):
        _lose(c, "B")
        _lose(c, "C")
        _ran_on(c, o, job, reference_aware, "A", "1, 2")
        wait_until(lambda: len(_ended(o)) == 2, "the orchestrator to write both rebuilt ranks' ends down", 60, 0.5)
        assert sorted(_ended(o)) == [f"rank {r} of job {RUN} (rebuilt) exited with status 0" for r in (1, 2)]


@pytest.mark.timeout(900)
def test_a_rank_killed_alone_is_rebuilt_on_the_spare_and_its_stand_in_follows_it(
    tmp_path: Path, reference_aware: Path
) -> None:
    with _running(tmp_path, ("--aware",)) as (c, o, job):
        (training,) = [p for p in c.nodes["B"].processes_and_children() if _runs(p, JOB)]
        training.send_signal(signal.SIGKILL)
        recovered = _ran_on(c, o, job, reference_aware, "ABC", "1")  # (B's launcher too: its rank's end, 0)
        assert "died on" in _events_of(o, "recovering")[0] and "their stand-ins follow them there" in recovered
        said = (tmp_path / "torchrun-B.out").read_text()
        assert f"rank 1 of job {RUN} now runs on {c.nodes['D'].agent_address} (rebuilt)" in said, said[-3000:]
        assert not _events_of(o, "lost")


@pytest.mark.timeout(900)
def test_a_rank_that_finished_the_step_the_others_were_caught_in_is_taken_back_to_theirs(
    tmp_path: Path, reference_aware: Path
) -> None:
    """Rank 0 dies in step 80 once rank 2, in no collective with it from there on, has finished
    that step, while rank 1 is caught in the all-reduce it shares with rank 0: rank 2 holds step 81,
    rank 1 step 80.  Rank 2 is taken back to 80 from a replica's state and does step 80 again (its
    line of it written twice, the same); the job is otherwise bit-identical."""
    with _running(tmp_path, ("--aware", "--die-at", "80")) as (c, o, job):
        recovered = _ran_on(c, o, job, reference_aware, "ABC", "0")
        assert (
            "runs on from step 80," in recovered and "rank(s) 2, at another step, given it from a replica" in recovered
        )
        # Rank 2 was taken back where it ran: no copy of it was started on the spare.
        assert "rank 2 of job" not in c.nodes["D"].agent_log()


def test_ranks_caught_after_their_forward_pass_keep_their_batchnorm_statistics_of_the_boundary(
    tmp_path: Path, reference_aware_bn: Path
) -> None:
    """The model has a BatchNorm layer (``--batchnorm``), whose forward pass updates its running
    statistics in place; rank 2 dies in step 80 right after its forward pass, and ranks 0 and 1,
    theirs done, are caught in its gradients' all-reduce.  Their held state kept the live
    statistics, already updated by step 80, and the step done again counted twice in them: the
    losses and parameters were bit-identical, the statistics (and the final digest) not.  Now those
    tensors are copied as each step starts (tpagent_rank.inplace): the job is bit-identical, its
    buffers too."""
    with _running(tmp_path, ("--aware", "--batchnorm", "--die-in-forward", "80")) as (c, o, job):
        recovered = _ran_on(c, o, job, reference_aware_bn, "ABC", "2")
        assert "runs on from step 80," in recovered


@pytest.mark.timeout(600)
def test_with_lost_ranks_left_to_their_jobs_a_rank_killed_alone_ends_at_once_as_it_did(tmp_path: Path) -> None:
    """``lost_grace`` 0: B's agent holds rank 1's end as ever (it cannot know), and the orchestrator
    has it passed on at once, not after the hold (a minute): B's launcher ends as its rank did."""
    with _running(tmp_path, ("--aware",), grace=0.0) as (c, o, job):
        (training,) = [p for p in c.nodes["B"].processes_and_children() if _runs(p, JOB)]
        training.send_signal(signal.SIGKILL)
        assert job.runs["B"].wait(timeout=40) not in (0, None), job.output()  # (the hold: 60 s)
        died = _events_of(o, "died")
        assert len(died) == 1 and f"rank(s) 1 died on {c.nodes['B'].name}, not rebuilt" in died[0], died
        assert not _events_of(o, "recovering") and not _events_of(o, "lost")


def _nobodys_rank(c: Cluster, node: str, home: Path, *how: str) -> dict[str, Any]:
    """How nobody starts on ``node``, through its agent's stand-in channel, a "rank 1" of a job
    named as root's job (``tests/attackers/dying_rank.py``, told ``how``): subprocess's arguments."""
    python, env = user_python()
    return {
        "args": c.nodes[node].exec(*as_user(NOBODY), python, "-m", "cli.main", "rank", "--stdout", str(home / "out"),
                                   "--", python, str(DYING), *how),
        "cwd": home,
        "env": {"PATH": os.defpath, "HOME": str(home), "RANK": "1", "TPAGENT_JOB": RUN, **env},
    }  # fmt: skip


@pytest.mark.timeout(600)
def test_another_users_rank_named_after_the_job_dying_tells_none_of_its_ranks(tmp_path: Path) -> None:
    """nobody starts on the spare, through its agent's stand-in channel, a "rank 1" of a job named
    as root's job, which says hello and dies by SIGKILL: its agent holds its end and reports it
    died.  To the orchestrator it is a job of its own (another identity) with no other rank: it is
    not rebuilt, its end is passed on, and root's ranks hear nothing; the job runs to its end
    (before: every root rank of the job was told to end, and one that stood still for
    ``lost_grace``, as in a checkpoint's save, ended the job)."""
    with _running(tmp_path, ("--aware",)) as (c, o, job), user_dir(NOBODY) as home:
        fake = subprocess.run(**_nobodys_rank(c, "D", home), capture_output=True, text=True, timeout=120)
        assert fake.returncode == -signal.SIGKILL or fake.returncode == 128 + signal.SIGKILL, fake
        died = wait_until(lambda: _events_of(o, "died"), "the died rank's end passed on", 60, 0.5)
        assert f"rank(s) 1 died on {c.nodes['D'].name}, not rebuilt: no other rank of the job reports" in died[0]
        assert not _events_of(o, "lost") and not _events_of(o, "recovering")
        hurry(job.logs)
        codes = {name: job.runs[name].wait(timeout=300) for name in "ABC"}
        assert codes == dict.fromkeys("ABC", 0), job.output()
        told = [n for n in "ABC" if "told its job lost a node" in c.nodes[n].agent_log()]
        assert not told, f"root's ranks on {told} were told of nobody's rank"


@pytest.mark.timeout(600)
def test_a_rank_s_end_reaches_an_agent_too_busy_to_take_it_at_once(tmp_path: Path) -> None:
    """A rank's init tells its agent how the rank ended, and waits for the word to be taken (the
    agent believes it only from an init still alive).  It waited 2 s: an agent busier than that
    (a loaded node; here stopped for 4 s) heard from an init gone and refused the word.  And a
    report built as the word was taken listed the rank twice, running and died, so its node
    counted as running its job still: "its other ranks are told" (of nobody's rank, root's).
    Either way the death was not passed on as it is (a test once failed so, on a busy machine)."""
    with _running(tmp_path, ("--aware",)) as (c, o, job), user_dir(NOBODY) as home:
        spare = c.nodes["D"]
        assert spare.agent is not None
        with subprocess.Popen(**_nobodys_rank(c, "D", home), stdout=subprocess.PIPE, text=True) as fake:
            assert fake.stdout is not None and fake.stdout.readline().startswith("its agent said:")
            spare.agent.send_signal(signal.SIGSTOP)  # (the rank dies a second later)
            try:
                wait_until(lambda: not any(_runs(p, DYING) for p in psutil.process_iter()), "the rank to die")
                time.sleep(4)  # (longer than the init once waited: no condition to wait for, it is the test)
            finally:
                spare.agent.send_signal(signal.SIGCONT)
            assert fake.wait(timeout=120) in (-signal.SIGKILL, 128 + signal.SIGKILL)
        died = wait_until(lambda: _events_of(o, "died"), "the died rank's end passed on", 60, 0.5)
        assert f"rank(s) 1 died on {spare.name}, not rebuilt" in died[0], died
        hurry(job.logs)
        assert {name: job.runs[name].wait(timeout=300) for name in "ABC"} == dict.fromkeys("ABC", 0), job.output()


@pytest.mark.timeout(900)
def test_another_users_live_rank_named_as_a_lost_one_does_not_stop_its_rebuild(
    tmp_path: Path, reference_aware: Path
) -> None:
    """nobody starts on A, through its agent's stand-in channel, a "rank 1" of a job named as
    root's job, which says hello and stays: the orchestrator sees two jobs of that name (their
    identities differ), not rank 1 running twice.  B is killed: root's rank 1 is rebuilt on D as
    in (b) and the job runs on, bit-identical (before: the orchestrator, which knew jobs by name,
    took rank 1 as running on A, rebuilt nothing, and the job ended with B)."""
    with _running(tmp_path, ("--aware",)) as (c, o, job), user_dir(NOBODY) as home:
        fake = subprocess.Popen(**_nobodys_rank(c, "A", home, "stay"))
        try:

            def ones() -> list[dict[str, str]]:
                return [r for r in o.cluster()["ranks"] if r["job"] == RUN and r["rank"] == 1]

            both = wait_until(lambda: len(ones()) == 2 and ones(), "the orchestrator to see nobody's rank 1", 60, 0.5)
            assert sorted(r["node"] for r in both) == sorted(c.nodes[n].name for n in "AB")
            assert len({r["identity"] for r in both}) == 2, both
            # A's agent, asked to move rank 1 of root's job (by its identity), finds another job's.
            (roots,) = [r["identity"] for r in both if r["node"] == c.nodes["B"].name]
            shown = o.ok("cluster")  # (the two told apart)
            assert f"job {RUN} [{roots[:8]}] rank 1    on {c.nodes['B'].name}," in shown, shown
            asked = pb.MigrateRequest(
                target=c.nodes["D"].agent_address, dry_run=True, job=RUN, ranks=[1], job_identity=roots
            )
            with pytest.raises(grpc.RpcError) as refused:
                list(stub(c.nodes["A"].agent_address, job.creds).Migrate(asked, timeout=30))
            assert "is of another job of that name" in str(refused.value.details())
            _lose(c, "B")
            _ran_on(c, o, job, reference_aware, "AC", "1")
            assert fake.poll() is None  # (nobody's "rank" is nobody's: left as it is)
        finally:
            fake.kill()
            fake.wait(timeout=30)


@pytest.mark.timeout(600)
def test_a_lost_rank_with_no_surviving_replica_ends_the_job_in_one_sentence(tmp_path: Path) -> None:
    with _running(tmp_path, ("--aware-alone",)) as (c, o, job):
        _lose(c, "C")
        _ended_in_one_sentence(job, tmp_path, "AB", lost=2)
        lost = [e for e in _events(o) if e["kind"] == "lost"]
        assert lost and "cannot be rebuilt" in lost[0]["text"], lost


@pytest.mark.timeout(600)
def test_both_replicas_of_a_shard_lost_end_the_hsdp_job_in_one_sentence(tmp_path: Path) -> None:
    """The four-rank HSDP job of (m): B and D, ranks 1 and 3, both replicas of shard 1, are killed
    together: nothing holds that shard any more, and every rank left ends with one sentence."""
    with _running(tmp_path, ("--aware", "--hsdp"), names="ABCD") as (c, o, job):
        _lose(c, "B")
        _lose(c, "D")
        _ended_in_one_sentence(job, tmp_path, "AC", lost=1)
        assert not _events_of(o, "recovered")


def _ended_in_one_sentence(job: Job, tmp_path: Path, survivors: str, lost: int) -> None:
    """The launchers of ``survivors`` end (not 0), each rank of them having said in one line that
    the job cannot be rebuilt: rank ``lost`` has no replica left."""
    for name in survivors:
        assert job.runs[name].wait(timeout=300) != 0
    said = "".join(p.read_text(errors="replace") for p in tmp_path.glob("*.out"))
    for rank in map(job.names.index, survivors):
        assert f"rank {rank} of job {RUN} stops: rank(s) " in said, said[-3000:]
    assert f"of job {RUN} were lost with" in said, said[-3000:]
    assert f"cannot be rebuilt: no replica of rank {lost}'s training state survives" in said, said[-3000:]


@pytest.mark.timeout(900)
def test_a_node_whose_peers_hear_nothing_is_found_by_its_quiet_and_the_job_runs_on_bit_identical(
    tmp_path: Path, reference_aware: Path
) -> None:
    with _running(tmp_path, ("--aware",), unreachable_after=3600.0, quiet_after=2.0) as (c, o, job):
        c.nodes["C"].link(up=False)  # (first: nothing C's processes' ends send reaches its peers)
        _lose(c, "C")
        _ran_on(c, o, job, reference_aware, "AB", "2")
        found = _events_of(o, "unreachable")
        assert len(found) == 1 and found[0].startswith(f"{c.nodes['C'].name} has not reported for "), found
        assert found[0].endswith("and its host does not answer (5 s, twice): unreachable"), found


@pytest.mark.timeout(600)
@pytest.mark.parametrize("host", ["refuses", "drops"])
def test_a_quiet_node_whose_agent_alone_is_down_is_not_taken_as_lost(tmp_path: Path, host: str) -> None:
    """Its ranks run on, and its job with them: it is not taken as lost, whether its host refuses
    the connection to its agent (nothing listens) or drops it (a firewall: as a host that is gone
    would), and nothing is rebuilt."""
    with _running(tmp_path, ("--aware",), unreachable_after=3600.0, quiet_after=2.0, step_time=0.1) as (c, o, job):
        with _dropping(c, "C", "input", "tcp dport 7400") if host == "drops" else contextlib.nullcontext():
            c.nodes["C"].kill_agent()
            wait_until(lambda: "taken as running" in o.log(), "the orchestrator to see C's job go on", 60, 0.5)
            at = steps(job.logs, 2)
            wait_until(lambda: steps(job.logs, 2) > at + 5, "rank 2 to go on", 60, 0.2)
            assert not _events_of(o, "unreachable") and not _events_of(o, "recovering")
        c.nodes["C"].start_agent(rewire_timeout="60", orchestrator=o.address, report_period="0.5")
        hurry(job.logs)
        assert {name: job.runs[name].wait(timeout=300) for name in "ABC"} == dict.fromkeys("ABC", 0)
        assert not _events_of(o, "unreachable") and not _events_of(o, "recovering")


@pytest.mark.timeout(900)
def test_a_node_cut_off_from_the_orchestrator_alone_runs_on_and_is_rebuilt_once_it_dies(
    tmp_path: Path, reference_aware: Path
) -> None:
    """C's reports do not reach the orchestrator (its firewall drops them), but its ranks, and the
    job, run on: C is taken as unreachable, not as lost, and nothing is rebuilt.  Once C is killed,
    the job stands still: its ranks are taken as lost then, and rebuilt as in (b)."""
    with _running(tmp_path, ("--aware",), unreachable_after=4.0, quiet_after=0.0, step_time=0.2) as (c, o, job):
        name = c.nodes["C"].name
        with _dropping(c, "C", "output", f"ip daddr {c.bridge_addr} tcp dport {o.port}"):
            wait_until(lambda: _events_of(o, "unreachable"), "C to be taken as unreachable", 60, 0.5)
            (cut,) = _events_of(o, "unreachable")
            assert cut.startswith(f"{name} has not reported for 4 s, but rank ") and "went on from step" in cut, cut
            assert cut.endswith(": its ranks are taken as running, not lost: unreachable"), cut
            at = steps(job.logs, 2)
            wait_until(lambda: steps(job.logs, 2) > at + 5, "rank 2 to go on", 60, 0.2)
            assert not _events_of(o, "recovering") and not _events_of(o, "lost")
            _lose(c, "C")
            _ran_on(c, o, job, reference_aware, "AB", "2")
        assert f"{name}: its jobs stand still now: its ranks are taken as lost" in _events_of(o, "unreachable")


@contextlib.contextmanager
def _dropping(c: Cluster, node: str, hook: str, match: str) -> Iterator[None]:
    """Node ``node``'s kernel drops the packets ``match`` (nft) matches at ``hook``, while in the block."""
    rules = f"table inet tp-test {{\n chain cut {{\n  type filter hook {hook} priority 0;\n  {match} drop;\n }}\n}}\n"
    subprocess.run(c.nodes[node].exec("nft", "-f", "-"), input=rules, text=True, check=True)
    try:
        yield
    finally:
        subprocess.run(c.nodes[node].exec("nft", "delete", "table", "inet", "tp-test"), check=True)
