"""The Slurm adapter's reading of Slurm (``sinfo --json`` and ``squeue --json`` as Slurm 22.05
prints them) and the spares it gives a job from what it read; its commands run against a real
Slurm in tests/orchestrator/test_slurm.py."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest

from tpagent.orchestrator import slurm
from tpagent.orchestrator.api import Move, MoveKind, MoveState
from tpagent.orchestrator.config import OrchestratorConfig
from tpagent.orchestrator.scheduler import SchedulerError, Wanted
from tpagent.orchestrator.slurm import SJob, Slurm, SNode, _job, _node, expand, recorded_in

NOONE: frozenset[int] = frozenset()  # (ranks of root's alone)


def cfg(**kw: object) -> OrchestratorConfig:
    return OrchestratorConfig(secret_file=Path("/dev/null"), scheduler="slurm", **kw)  # type: ignore[arg-type]


def node(name: str, part: str, state: str = "idle", cpus: int = 0, gres: str = "", used: str = "", **kw: Any) -> SNode:
    d = {"name": name, "state": state, "partitions": [part], "gres": gres, "gres_used": used, "alloc_cpus": cpus}
    return _node({**d, **kw})


def job(jid: int, nodes: list[str], priority: int, name: str = "train", part: str = "train", **kw: Any) -> SJob:
    d = {
        "job_id": jid,
        "name": name,
        "job_state": "RUNNING",
        "partition": part,
        "priority": priority,
        "user_id": 1000,
        "account": "ml",
        "job_resources": {"allocated_nodes": [{"nodename": n} for n in nodes]},
    }
    return _job({**d, **kw})


def adapter(nodes: list[SNode], jobs: list[SJob], **kw: object) -> Slurm:
    s = Slurm(cfg(**kw))
    s.read = (time.monotonic(), {n.name: n for n in nodes}, jobs)
    return s


def test_what_sinfo_and_squeue_print_is_read() -> None:
    n = _node(
        {
            "name": "gpu7",
            "state": "mixed",
            "state_flags": ["DRAIN"],
            "partitions": ["train", "all"],
            "reason": "tpagent: ECC",
            "gres": "gpu:h100:8(S:0-1),gpu:a100:2",
            "gres_used": "gpu:h100:3(IDX:0-2)",
            "alloc_cpus": 12,
        }
    )
    assert (n.gpus, n.gpus_used, n.cpus_used, n.drained, n.usable) == (10, 3, 12, True, False)
    assert n.partitions == ("train", "all") and n.reason == "tpagent: ECC"
    j = job(42, ["a", "b"], 7, admin_comment="tpagent hold job=9 node=b")
    assert (j.id, j.nodes, j.priority, j.active, j.hold_of()) == ("42", ("a", "b"), 7, True, None)  # (its name)
    assert job(43, ["b"], 1, name="tpagent-hold", admin_comment="tpagent hold job=9 node=b").hold_of() == ("9", "b")
    assert not job(44, [], 1, job_state="COMPLETED").active
    # (a job's name may hold spaces: its placeholder was not known for its own, so never cancelled
    # and made again at each pass)
    key = "my run node=x#0123456789abcdef"
    assert job(45, ["b"], 1, name="tpagent-hold", admin_comment=f"tpagent hold job={key} node=b").hold_of() == (
        key,
        "b",
    )


def test_a_users_job_named_and_commented_as_a_placeholder_is_not_one() -> None:
    forged = job(50, ["d"], 1, name="tpagent-hold", comment="tpagent hold job=7 node=d")
    assert forged.hold_of() is None
    s = adapter([node("d", "spares")], [forged], slurm_spare_partition="spares")
    assert s.job_of("50", s.read[2], frozenset()) is not None  # (it is a job like any other: not a spare's hold)


def test_dedicated_spares_are_the_spare_partitions_idle_nodes_after_the_configured_ones() -> None:
    nodes = [
        node("s2", "spares"),
        node("s1", "spares"),
        node("s3", "spares", state="allocated", cpus=2),  # (another job runs there)
        node("s4", "spares", state_flags=["DRAIN"]),
        node("s5", "spares"),  # (held for a move already)
        node("x9", "other"),
        node("a", "train", state="allocated", cpus=2),
    ]
    hold = job(9, ["s5"], 1, name="tpagent-hold", admin_comment="tpagent hold job=7 node=s5")
    s = adapter(nodes, [job(7, ["a"], 100), hold], slurm_spare_partition="spares", dedicated_spares=("x9",))
    p = s.pool("7", NOONE)
    assert list(p.dedicated) == ["x9", "s1", "s2"]
    assert p.floating == frozenset() and p.taken == frozenset()  # (train has no idle node)


def test_floating_spares_are_idle_or_gpu_free_nodes_of_the_jobs_own_partition() -> None:
    nodes = [
        node("a", "train", state="allocated", cpus=2, gres="gpu:8", used="gpu:8"),
        node("b", "train"),
        node("c", "train", state="mixed", cpus=1, gres="gpu:8", used="gpu:4"),
        node("d", "train", state="mixed", cpus=1, gres="gpu:8", used="gpu:8"),
        node("e", "other"),
        node("f", "train", state="down"),
    ]
    s = adapter(nodes, [job(7, ["a"], 100)])
    assert s.pool("7", NOONE).floating == frozenset({"b", "c"})
    assert s.pool("job-not-in-slurm", NOONE).floating == frozenset()  # (an unknown job gets dedicated spares only)


def test_a_node_is_taken_only_from_jobs_below_the_threshold_and_the_moving_jobs_priority() -> None:
    nodes = [node(n, "train", state="allocated", cpus=2) for n in ("a", "l", "m", "h")]
    jobs = [
        job(7, ["a"], 100),
        job(8, ["l"], 5),
        job(9, ["m"], 5),
        job(10, ["m"], 60),  # (m also runs a job the threshold protects)
        job(11, ["h"], 150),
    ]
    assert adapter(nodes, jobs, slurm_preempt_below=50).pool("7", NOONE).taken == frozenset({"l"})
    assert adapter(nodes, jobs, slurm_preempt_below=1000).pool("7", NOONE).taken == frozenset(
        {"l", "m"}
    )  # (h: above job 7)
    assert adapter(nodes, jobs).pool("7", NOONE).taken == frozenset()  # (0: never)


def test_with_nothing_read_lately_no_spare_is_given() -> None:
    s = Slurm(cfg())
    assert s.pool("7", NOONE).why and s.pool("7", NOONE).floating == frozenset()
    s.read = (time.monotonic() - 3600, {}, [])
    assert "has not answered" in s.pool("7", NOONE).why


def test_what_later_slurms_print_is_read_too() -> None:
    """Slurm 23.02 and later: states as lists, numbers as objects, a job's nodes as a host list."""
    n = _node({"name": "g1", "state": ["IDLE", "DRAIN"], "partitions": ["train"], "alloc_cpus": 0})
    assert (n.state, n.drained, n.usable) == ("idle", True, False)
    j = _job(
        {
            "job_id": 9,
            "name": "t",
            "job_state": ["RUNNING"],
            "priority": {"set": True, "infinite": False, "number": 4294},
            "nodes": "gpu[01-03,7],cpu1",
            "job_resources": {"nodes": {"count": 5}},
        }
    )
    assert (j.state, j.priority, j.nodes) == ("RUNNING", 4294, ("gpu01", "gpu02", "gpu03", "gpu7", "cpu1"))
    assert expand("n[8-10]") == ("n8", "n9", "n10") and expand("a,b") == ("a", "b")
    # Text after a range, and ranges in several places of a name (were: node1, node2, "-ib").
    assert expand("node[1-2]-ib,x") == ("node1-ib", "node2-ib", "x")
    assert expand("r[1-2]n[08-09]") == ("r1n08", "r1n09", "r2n08", "r2n09")
    assert len(expand("n[1-99999999]")) == 1 << 16  # (bounded)


def test_a_users_ranks_naming_another_users_slurm_job_are_not_that_job() -> None:
    """A rank's job name is its user's to choose (TPAGENT_JOB): ranks of UID 2000 naming job 7,
    which is UID 1000's, get none of job 7's partition, priority, record or allocation."""
    nodes = [node("a", "train", state="allocated", cpus=2), node("b", "train")]
    s = adapter(nodes, [job(7, ["a"], 100)])
    assert s.job_of("7", s.read[2], frozenset({1000})) is not None
    assert s.job_of("7", s.read[2], frozenset()) is not None  # (root's ranks: root may be anyone's)
    assert s.job_of("7", s.read[2], frozenset({2000})) is None
    assert s.job_of("7", s.read[2], frozenset({1000, 2000})) is None
    assert s.pool("7", frozenset({2000})).floating == frozenset()
    assert s.pool("7", frozenset({1000})).floating == frozenset({"b"})


def test_ranks_outside_their_jobs_nodes_are_held_only_for_a_placed_job_of_slurms(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A requeued job (pending, no nodes: its ranks still reported a moment), a job Slurm does
    not run, a node Slurm knows not, the job's own node: none gets a placeholder.  A running
    job's rank on another node does; where sbatch refuses it (the partition's AllowAccounts),
    that is said once, and the rest of the reconcile goes on."""
    asked: list[tuple[str, ...]] = []

    def refusing(*args: str, timeout: float = 0) -> str:  # (Slurm's sbatch, refusing: no Slurm in this tier)
        asked.append(args)
        raise SchedulerError("Slurm's sbatch --partition failed: Job violates accounting/QOS policy")

    monkeypatch.setattr(slurm, "run", refusing)
    nodes = [node("a", "train", state="allocated", cpus=2), node("b", "train"), node("c", "train")]
    s = adapter(nodes, [job(7, ["a"], 100), job(8, [], 100, job_state="PENDING")])
    runs = frozenset({("8", "b"), ("9", "b"), ("7", "a"), ("7", "zz")})
    want = Wanted(runs=runs, users={"7": NOONE, "8": NOONE, "9": NOONE})
    assert s._remade(want, {n.name: n for n in nodes}, s.read[2]) == [] and asked == []
    refused = Wanted(runs=frozenset({("7", "c")}), users={"7": NOONE})
    said = s._remade(refused, {n.name: n for n in nodes}, s.read[2])
    assert said == [
        "c not held for job 7, whose ranks run there: Slurm's sbatch --partition failed: Job violates "
        "accounting/QOS policy"
    ]
    assert asked[0][0] == "sbatch" and s._remade(refused, {n.name: n for n in nodes}, s.read[2]) == []


def test_the_record_in_a_jobs_admin_comment_keeps_what_an_administrator_wrote_there() -> None:
    record = "tpagent: rank 1 on d (hold 42)"
    assert recorded_in("", record) == record
    assert recorded_in("budget 7", record) == f"budget 7 | {record}"
    assert recorded_in(f"budget 7 | {record}", "tpagent: rank 2 on e") == "budget 7 | tpagent: rank 2 on e"
    assert recorded_in("tpagent: rank 2 on e", record) == record  # (ours alone: replaced)
    assert recorded_in(f"budget 7 | {record}", "") == "budget 7"  # (the ranks home: the administrator's words left)
    assert recorded_in(record, "") == ""
    assert (
        recorded_in("see tpagent: docs", "") == "see tpagent: docs"
    )  # (a record is only ours at its start or after " | ")


def test_a_placeholders_marker_is_never_taken_for_a_record(monkeypatch: pytest.MonkeyPatch) -> None:
    """A placeholder's admin comment names its job, whose name is its user's to choose: one that
    looks like a record (" | tpagent: ...") cut the marker short as records were cleared, and the
    placeholder, no longer known as one, held its node for ever."""
    key = "x | tpagent: rank 0 on d#0123456789abcdef"
    hold = job(9, ["d"], 1, name="tpagent-hold", admin_comment=f"tpagent hold job={key} node=d")
    owner = job(7, ["a"], 100, name="x | tpagent: rank 0 on d")
    asked: list[tuple[str, ...]] = []

    def slurm_cli(*args: str, timeout: float = 0) -> str:
        asked.append(args)
        return ""

    monkeypatch.setattr(slurm, "run", slurm_cli)
    s = adapter([node("a", "train", state="allocated", cpus=2), node("d", "spares")], [owner, hold])
    monkeypatch.setattr(s, "refresh", lambda: (s.read[1], s.read[2]))
    want = Wanted(away=frozenset({(key, "d")}), users={key: NOONE})
    s.reconcile(lambda: want)
    assert not [a for a in asked if "JobId=9" in a], asked  # (its marker left as it is)


def test_no_job_is_requeued_for_a_placeholder_slurm_refuses(monkeypatch: pytest.MonkeyPatch) -> None:
    """(The lower-priority jobs on the spare were requeued first: sbatch then refused the
    placeholder, and they stood requeued for nothing, said nowhere.)"""
    asked: list[tuple[str, ...]] = []

    def refusing(*args: str, timeout: float = 0) -> str:
        asked.append(args)
        if args[0] == "sbatch":
            raise SchedulerError("Slurm's sbatch failed: Requested node configuration is not available")
        return ""

    monkeypatch.setattr(slurm, "run", refusing)
    nodes = [node("a", "train", state="allocated", cpus=2), node("s", "train", state="allocated", cpus=4)]
    s = adapter(nodes, [job(7, ["a"], 100), job(30, ["s"], 5, name="low")], slurm_preempt_below=50)
    monkeypatch.setattr(s, "refresh", lambda: (s.read[1], s.read[2]))
    with pytest.raises(SchedulerError, match="Requested node configuration"):
        s.hold(Move(1, "7", (1,), "a", "s", MoveKind.AWAY, MoveState.RUNNING, 1), 0, NOONE)
    assert [a[0] for a in asked] == ["sbatch"]  # (nothing requeued)
