"""The orchestrator with a real Slurm (issue 26): seven network-namespace nodes, six of them Slurm
nodes with their own slurmd and hostname (partition ``train``: A, B, C, E; ``spares``: D; ``other``:
G), F an agent Slurm does not know.  The 3-rank job of the rewire tests is submitted with sbatch, its ranks
started as the README says (``srun tpagent rank -- python train.py``); a low-priority job holds E.
Slurm must agree with every move: tainted nodes drained, spares held by placeholder jobs, the
job's record saying where its ranks run, the low-priority job requeued to free a spare and run
again, everything released at the end; the job ends bit-identical to plain torchrun."""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest

from conftest import needs_criu
from host.proc import CAP_SYS_RESOURCE, has_capability
from support.cluster import Cluster
from support.helpers import ROOT, wait_until
from support.orchestrator import Orchestrator
from support.rankjob import IFNAME, JOB, STEPS, hurry, rank_log, steps
from support.slurm import Slurm, have_slurm
from support.users import NOBODY, user_dir, user_python

pytestmark = [
    needs_criu,
    pytest.mark.skipif(not have_slurm(), reason="Slurm (slurmctld, slurmd, munged) is not installed"),
]

LOW_PRIORITY = 10
JOB_PRIORITY = 1000


@pytest.fixture
def slurm_cluster(tmp_path: Path) -> Iterator[tuple[Cluster, Slurm]]:
    c = Cluster(tmp_path, list("ABCDEFG"), ifname=IFNAME)
    s = None
    try:
        s = Slurm(c, {"train": list("ABCE"), "spares": ["D"], "other": ["G"]})
        yield c, s
    finally:
        if s is not None:
            s.close()
        c.close()


def _ns(c: Cluster, name: str) -> str:
    return c.nodes[name].name


def _events(o: Orchestrator) -> str:
    return o.ok("events")


def _submit(
    c: Cluster, s: Slurm, home: Path, user: tuple[int, int] | None = None, step_time: float = 0.75
) -> tuple[str, Path]:
    """The job, submitted from ``home`` by root, or by ``user`` (their directory):
    `srun tpagent rank -- python ...` (a user's `tpagent` is `python -m cli.main`: the .venv's entry
    point may be root's alone)."""
    logs = home / "logs"
    logs.mkdir()
    script = home / "train.sbatch"
    python, paths = user_python() if user else (sys.executable, {})
    tpagent = f"{python} -m cli.main" if user else str(Path(sys.executable).parent / "tpagent")
    train = f"{python} {JOB} --steps {STEPS} --log-dir {logs} --step-time {step_time}"
    script.write_text(f"#!/bin/bash\nsrun {tpagent} rank -- {train}\n")
    if user:
        for f in (logs, script):
            os.chown(f, *user)
    env = {
        **(c.cli_env() if not user else {"PATH": os.environ["PATH"], "HOME": str(home)}),
        **paths,
        "GLOO_SOCKET_IFNAME": IFNAME,
        "USE_LIBUV": "0",
        "MASTER_ADDR": c.nodes["A"].addr,
        "MASTER_PORT": "29500",
    }
    nodes = ",".join(_ns(c, n) for n in "ABC")
    args = ["--nodes=3", "--ntasks-per-node=1", f"--nodelist={nodes}", "--partition=train"]
    args += [f"--priority={JOB_PRIORITY}", f"--output={home / 'job-%j.out'}", f"--chdir={home}", str(script)]
    job = s.sbatch(*args, env=env, user=user)
    return job, logs


def _every_rank_seen(c: Cluster, s: Slurm, o: Orchestrator, job: str, home: Path) -> None:
    """Until the orchestrator sees all three ranks (Slurm's scheduling, srun's steps, three ranks
    importing torch and meeting, on a busy machine: minutes at worst); else where each part stood."""

    def where() -> str:
        out = home / f"job-{job}.out"
        ranks = [(r["rank"], r["node"]) for r in o.cluster()["ranks"] if r["job"] == job]
        agents = "\n".join(f"{n}: {node.agent_log()[-600:]}" for n, node in c.nodes.items())
        printed = out.read_text(errors="replace")[-1500:] if out.exists() else "(no output yet)"
        return f"{s.where(job)}\norchestrator sees {ranks}\njob output: {printed}\n{agents}"

    wait_until(lambda: all(o.rank_on(job, r) for r in range(3)), "the orchestrator to see every rank", 300, 0.5, where)


def _ranks(c: Cluster) -> list[psutil.Process]:
    """The training scripts running on any node (wherever they were moved)."""
    out = []
    for node in c.nodes.values():
        for p in node.processes():
            with contextlib.suppress(psutil.Error):
                if str(JOB) in p.cmdline()[1:2] and p.parent().cmdline()[1:2] != [str(JOB)]:
                    out.append(p)
    return out


def _holds(s: Slurm, state: str = "RUNNING") -> dict[str, str]:
    """node -> the placeholder job holding it."""
    return {j["nodes"]: str(j["job_id"]) for j in s.jobs("tpagent-hold") if j["job_state"] == state}


def _node_state(s: Slurm, node: str) -> tuple[bool, str]:
    n = s.nodes()[node]
    return "DRAIN" in n["state_flags"] or n["state"].startswith("drain"), n["reason"]


def test_a_bad_spare_partition_is_refused_in_one_sentence(slurm_cluster: tuple[Cluster, Slurm], tmp_path: Path) -> None:
    c, s = slurm_cluster
    o = Orchestrator(c, tmp_path, env=s.env(), scheduler="slurm", slurm_spare_partition="nope")
    out = subprocess.run(
        [sys.executable, "-m", "cli.main", "orchestrator", "--config", str(o.config())],
        cwd=ROOT,
        env=o.env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode != 0
    assert out.stderr.strip().endswith(
        "Slurm has no partition 'nope' (slurm_spare_partition; it has: train, spares, other)."
    )
    assert "Traceback" not in out.stderr


@pytest.mark.timeout(900)
def test_slurm_agrees_with_every_move_and_the_job_is_bit_identical(
    slurm_cluster: tuple[Cluster, Slurm], tmp_path: Path, reference: Path
) -> None:
    c, s = slurm_cluster
    o = Orchestrator(
        c, tmp_path, env=s.env(), scheduler="slurm", slurm_spare_partition="spares", slurm_preempt_below=100
    )
    o.start()
    c.start_agents(listen="0.0.0.0:7400", rewire_timeout="60", orchestrator=o.address, report_period="0.5")
    low = s.sbatch(
        "--partition=train",
        f"--nodelist={_ns(c, 'E')}",
        f"--priority={LOW_PRIORITY}",
        "--output=/dev/null",
        "--wrap",
        "sleep 3600",
    )
    wait_until(lambda: s.job(low).get("job_state") == "RUNNING", "the low-priority job to run on E", 60)
    job, logs = _submit(c, s, tmp_path)
    try:
        _every_rank_seen(c, s, o, job, tmp_path)
        wait_until(lambda: steps(logs, 1) >= 5, "the job to step", 120)
        s.cmd("scontrol", "update", f"JobId={job}", "AdminComment=budget 7")  # (an administrator's: kept)

        # Slurm stops answering: a taint moves nothing (no rank on a spare Slurm does not know is used).
        s.stop_ctld()
        o.ok("taint", _ns(c, "B"), "--reason", "maintenance")
        wait_until(lambda: "does not answer" in _events(o), "the orchestrator to see Slurm down", 60, 0.5)
        at = steps(logs, 1)
        wait_until(lambda: steps(logs, 1) >= at + 3, "rank 1 to step on", 60)
        assert o.rank_on(job, 1) == _ns(c, "B")
        s.start_ctld()

        # It answers again: B drained with the reason, D held by a placeholder, rank 1 runs there.
        o.wait_rank_on(job, 1, _ns(c, "D"))
        wait_until(lambda: _node_state(s, _ns(c, "B")) == (True, "tpagent: maintenance"), "B to be drained", 30, 0.5)
        held = _holds(s)
        assert list(held) == [_ns(c, "D")], held
        hold_d = s.job(held[_ns(c, "D")])
        (identity,) = {r["identity"] for r in o.cluster()["ranks"] if r["job"] == job}  # (the job's, as its key)
        marker = f"tpagent hold job={job}#{identity} node={_ns(c, 'D')}"
        assert hold_d["admin_comment"] == hold_d["comment"] == marker
        assert hold_d["user_name"] == "root" and hold_d["partition"] == "spares"
        wait_until(lambda: "tpagent" in s.job(job)["admin_comment"], "the job's record", 30, 0.5)
        record = f"tpagent: rank 1 on {_ns(c, 'D')} (hold {held[_ns(c, 'D')]})"
        assert s.job(job)["admin_comment"] == f"budget 7 | {record}"
        shown = s.cmd("scontrol", "show", "job", job).stdout
        assert f"AdminComment=budget 7 | tpagent: rank 1 on {_ns(c, 'D')}" in shown
        # Someone cancels the placeholder while rank 1 runs on D: it is made again.
        s.cmd("scancel", held[_ns(c, "D")])
        wait_until(
            lambda: _ns(c, "D") in _holds(s) and held[_ns(c, "D")] not in _holds(s).values(), "D held again", 60, 0.5
        )
        assert f"to hold {_ns(c, 'D')} again: job {job}'s ranks run there" in _events(o)

        # No spare left but E, whose only job has a lower priority: it is requeued, rank 2 goes to E.
        # F (an agent Slurm does not know) is never a spare; its taint says Slurm knows it not.
        o.ok("taint", _ns(c, "F"), "--reason", "not in Slurm")
        o.ok("taint", _ns(c, "C"), "--reason", "a fan")
        o.wait_rank_on(job, 2, _ns(c, "E"))
        events = _events(o)
        assert f"Slurm job {low} (wrap, priority {LOW_PRIORITY}) requeued to free {_ns(c, 'E')}" in events, events
        wait_until(
            lambda: f"Slurm knows no node {_ns(c, 'F')}" in _events(o), "F's taint to be said undrained", 30, 0.5
        )
        assert s.job(low)["job_state"] in ("PENDING", "REQUEUED", "REQUEUE_HOLD"), s.job(low)
        assert _ns(c, "E") in _holds(s)
        both = (f"rank 1 on {_ns(c, 'D')}", f"rank 2 on {_ns(c, 'E')}")
        wait_until(lambda: all(w in s.job(job)["admin_comment"] for w in both), "the record of both ranks", 30, 0.5)

        # C untainted: rank 2 goes home, E's placeholder goes, C is resumed; the low job runs again on E.
        o.ok("untaint", _ns(c, "C"))
        o.wait_rank_on(job, 2, _ns(c, "C"))
        wait_until(lambda: _ns(c, "E") not in _holds(s), "E's placeholder to be cancelled", 60, 0.5)
        wait_until(lambda: not _node_state(s, _ns(c, "C"))[0], "C to be resumed", 30, 0.5)
        wait_until(lambda: s.job(low).get("job_state") == "RUNNING", "the requeued job to run again", 300, 1)
        assert s.job(low)["nodes"] == _ns(c, "E")

        # An operator moves rank 2 by hand onto G, idle in another partition: Slurm would have placed
        # other work there beside it.  G is held for the job while the rank runs there, let go once back.
        moved = c.migrate(0, "C", "G", "--job", job, "--rank", "2", timeout=240)
        assert moved.returncode == 0, moved.stdout + moved.stderr
        o.wait_rank_on(job, 2, _ns(c, "G"))
        wait_until(lambda: _ns(c, "G") in _holds(s), "G to be held for the job", 60, 0.5)
        assert f"to hold {_ns(c, 'G')} for job {job}: its ranks run there, outside its nodes" in _events(o)
        assert s.job(_holds(s)[_ns(c, "G")])["comment"].startswith(f"tpagent hold job={job}#")
        moved = c.migrate(0, "G", "C", "--job", job, "--rank", "2", timeout=240)
        assert moved.returncode == 0, moved.stdout + moved.stderr
        wait_until(lambda: _ns(c, "G") not in _holds(s), "G's placeholder to be cancelled", 60, 0.5)
        assert _ns(c, "D") in _holds(s)  # (rank 1's, on D, kept)

        # The job ends with rank 1 still on D: its placeholder is released; B stays drained until untainted.
        hurry(logs)
        for r in range(3):
            wait_until(lambda r=r: steps(logs, r) >= STEPS, f"rank {r} to finish", 400)
        wait_until(lambda: s.job(job).get("job_state") == "COMPLETED", "the job to complete", 120, 0.5)
        assert s.job(job)["exit_code"] == 0 or s.job(job)["exit_code"].get("return_code", 0) == 0
        wait_until(lambda: not _holds(s), "D's placeholder to be released", 60, 0.5)
        assert f"on {_ns(c, 'D')} cancelled: job {job} ended" in _events(o)
        assert _node_state(s, _ns(c, "B"))[0]
        o.ok("untaint", _ns(c, "B"))
        wait_until(lambda: not _node_state(s, _ns(c, "B"))[0], "B to be resumed", 30, 0.5)
        assert _node_state(s, _ns(c, "D")) == (False, "")

        for r in range(3):
            got = rank_log(logs, r)
            assert [ln.split()[1] for ln in got if ln.startswith("step ")] == [str(k) for k in range(STEPS)]
            assert got == rank_log(reference, r), f"rank {r}: its losses or final parameters differ"
        printed = (tmp_path / f"job-{job}.out").read_text()
        for r in range(3):
            assert printed.count(f"rank {r} step {STEPS - 1} loss") == 1, printed[-2000:]
        moves = [(m["kind"], m["ranks"], m["state"]) for m in o.cluster()["moves"]]
        assert ("away", [1], "done") in moves and ("away", [2], "done") in moves and ("home", [2], "done") in moves
        assert json.loads(o.ok("cluster", "--json"))["taints"] == [
            t for t in o.cluster()["taints"] if t["node"] == _ns(c, "F")
        ]
    finally:
        s.cmd("scancel", job, check=False)
        o.close()


@pytest.mark.timeout(600)
def test_an_ordinary_users_sbatch_job_runs_its_ranks_as_that_user(
    slurm_cluster: tuple[Cluster, Slurm], tmp_path: Path, reference: Path
) -> None:
    """User nobody's job: its stand-ins (srun's tasks, as nobody) have the node's agent start each
    rank as nobody; the rank runtime loads (the agents report each rank's step); a taint of B
    moves rank 1 where the agent may checkpoint another user's process (CAP_SYS_RESOURCE), and is
    refused before anything stops where it may not (these VMs); either way the job ends
    bit-identical and its output is relayed to srun's."""
    c, s = slurm_cluster
    o = Orchestrator(c, tmp_path, env=s.env(), scheduler="slurm", slurm_spare_partition="spares")
    o.start()
    c.start_agents(rewire_timeout="60", orchestrator=o.address, report_period="0.5")
    with user_dir(NOBODY) as home:
        job, logs = _submit(c, s, home, NOBODY, step_time=0.5)
        try:
            assert s.job(job)["user_name"] == "nobody"
            _every_rank_seen(c, s, o, job, home)
            for r, name in enumerate("ABC"):  # (the rank runtime loaded, and reached its agent: nobody can read it)
                said = f"rank {r} of job {job} ("
                log = c.nodes[name].agent_log
                wait_until(lambda s=said, g=log: s in g(), f"rank {r}'s runtime to reach its agent", 60, 0.5)
            assert {p.uids().real for p in _ranks(c)} == {NOBODY[0]} and len(_ranks(c)) == 3
            o.ok("taint", _ns(c, "B"), "--reason", "maintenance")
            if has_capability(CAP_SYS_RESOURCE):
                o.wait_rank_on(job, 1, _ns(c, "D"))
            else:
                wait_until(lambda: "lacks CAP_SYS_RESOURCE" in _events(o), "the move to be refused", 120, 0.5)
                assert o.rank_on(job, 1) == _ns(c, "B")
            hurry(logs)
            for r in range(3):
                wait_until(lambda r=r: steps(logs, r) >= STEPS, f"rank {r} to finish", 300)
            wait_until(lambda: s.job(job).get("job_state") == "COMPLETED", "the job to complete", 120, 0.5)
            for r in range(3):
                assert rank_log(logs, r) == rank_log(reference, r), f"rank {r}: its losses or final parameters differ"
            printed = (home / f"job-{job}.out").read_text()
            for r in range(3):
                assert printed.count(f"rank {r} step {STEPS - 1} loss") == 1, printed[-2000:]
        finally:
            s.cmd("scancel", job, check=False)
            o.close()
