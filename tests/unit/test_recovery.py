"""A lost rank's command, as unplanned recovery starts it on the spare (:func:`tpagent.jobs.recovery.for_rank`):
a surviving replica's, with the launcher's rank variables set to the lost rank's and its output
in files of its own; what the orchestrator's ``recover`` names is checked before anything runs; and
which surviving replica gives each rank rebuilt, or taken back to the job's boundary, its state."""

from __future__ import annotations

import re
import typing

import pytest

from tpagent.jobs.api import Ask, Leaving
from tpagent.jobs.calls import RankCalls
from tpagent.jobs.recovery import Failed, Recovery, for_rank
from tpagent.migration.api import Refused
from tpagent_rank import protocol as P


def _spec(*env: str, stderr: str = "/w/out/rank0.err") -> P.Join:
    return P.Join(
        cmd=("python3", "train.py"),
        env=env,
        cwd="/w",
        umask=0o022,
        uid=1000,
        gid=1000,
        groups=(1000,),
        stdout="/w/out/rank0.out",
        stderr=stderr,
        owner=1000,
    )


def test_the_lost_ranks_command_is_its_replicas_with_its_own_rank_and_output() -> None:
    spec = _spec("RANK=0", "SLURM_PROCID=0", "LOCAL_RANK=0", "WORLD_SIZE=3", "OTHER=0")
    got = for_rank(spec, 0, 2, "job1")
    env = dict(e.split("=", 1) for e in got.env)
    assert env == {"RANK": "2", "SLURM_PROCID": "2", "LOCAL_RANK": "0", "WORLD_SIZE": "3", "OTHER": "0"}
    assert re.fullmatch(r"/w/out/job1\.rank2\.recovered-\d{8}-\d{6}-[0-9a-f]{4}\.out", got.stdout), got.stdout
    assert got.stderr == got.stdout.removesuffix(".out") + ".err"
    assert for_rank(spec, 0, 2, "job1").stdout != got.stdout  # (each rebuild's own: a second one never appends)
    assert (got.cmd, got.cwd, got.uid, got.gid, got.groups, got.owner) == (
        spec.cmd,
        spec.cwd,
        1000,
        1000,
        (1000,),
        1000,
    )
    same = for_rank(_spec("RANK=0", stderr="/w/out/rank0.out"), 0, 2, "job1")
    assert same.stderr == same.stdout  # (one file for both, as the replica had)


def test_a_lost_rank_whose_store_is_served_anew_is_told_where() -> None:
    got = for_rank(_spec("RANK=1", "MASTER_ADDR=10.0.0.1", "MASTER_PORT=29500"), 1, 0, "job1", "10.0.0.2:41234")
    env = dict(e.split("=", 1) for e in got.env)
    assert env[P.STORE_VARIABLE] == "10.0.0.2:41234" and env["RANK"] == "0"
    assert (env["MASTER_ADDR"], env["MASTER_PORT"]) == ("10.0.0.1", "29500")  # (as its script names it)
    assert P.STORE_VARIABLE not in dict(e.split("=", 1) for e in for_rank(_spec("RANK=1"), 1, 0, "job1").env)


def test_a_command_that_names_its_rank_in_no_known_variable_cannot_be_rebuilt() -> None:
    with pytest.raises(Failed, match="names its rank in none of RANK"):
        for_rank(_spec("WORLD_SIZE=3", "MY_RANK=0"), 0, 2, "job1")
    with pytest.raises(Failed):  # (a variable holding another number is not the rank)
        for_rank(_spec("RANK=1"), 0, 2, "job1")


@pytest.mark.parametrize(
    "request_",
    [
        P.Recover(node="not an address", ranks=(2,), spare="10.0.0.9:7400", grace=60.0),
        P.Recover(node="10.0.0.2:7400", ranks=(2,), spare="10.0.0.9:7400", grace=0.0),
        P.Recover(node="10.0.0.2:7400", ranks=(2,), spare="10.0.0.9:7400", grace=1e9),
    ],
)
def test_a_recover_naming_no_lost_agent_or_no_grace_is_refused_before_anything_runs(request_: P.Recover) -> None:
    called: list[P.Recover] = []

    def recover(job: str, rank: int, r: P.Recover) -> P.Recovered:
        called.append(r)
        return P.Recovered()

    calls = RankCalls(None, "n", lambda _job, _rank=None: False, recover=recover)  # type: ignore[arg-type]
    with pytest.raises(Refused, match="recover needs the lost node's agent"):
        calls("job1", 0, request_, 10.0)
    assert not called


def _recovery(lost: tuple[int, ...], back: list[int]) -> Recovery:
    request = P.Recover(node="10.0.0.3:7400", ranks=lost, spare="10.0.0.4:7400", grace=5.0)
    out = Recovery("job1", 0, request, typing.cast(Ask, None), "10.0.0.2:7400", typing.cast(Leaving, None))
    out.back = back
    return out


def _at(held: int, replicas: tuple[int, ...] = (0, 1, 2, 3)) -> P.Standing:
    return P.Standing(aware=True, held=held, replicas=replicas)


AGENTS = ["10.0.0.1:7400", "10.0.0.2:7400", "10.0.0.3:7400", "10.0.0.2:7400"]


def test_a_lost_rank_and_one_a_step_further_take_the_state_of_a_replica_at_the_jobs_boundary() -> None:
    # Rank 2 lost; rank 0 finished the step ranks 1 and 3 hold; this agent runs on rank 1's and 3's node.
    where = {0: _at(81), 1: _at(80), 3: _at(80)}
    recovery = _recovery((2,), [])
    assert recovery._boundary(where) == (80, [0])
    recovery.back = [0]
    assert recovery._sources(AGENTS, where, 80) == {2: 1, 0: 1}
    # None here holds it: one elsewhere gives it (its offer on its own node).
    where = {0: _at(80), 1: _at(81), 3: _at(81)}
    recovery = _recovery((2,), [])
    assert recovery._boundary(where) == (80, [1, 3])
    recovery.back = [1, 3]
    assert recovery._sources(AGENTS, where, 80) == {2: 0, 1: 0, 3: 0}


def test_a_job_whose_ranks_no_boundary_has_a_replica_for_cannot_be_rebuilt() -> None:
    """Said in one sentence naming, at each boundary held, the ranks none of whose surviving
    replicas holds it (a survivor too: one at another boundary with no replica there)."""
    where = {0: _at(80, (0,)), 1: _at(81, (1, 2, 3)), 3: _at(81, (1, 2, 3))}
    with pytest.raises(Failed, match=r"\(at step 80, none for ranks 1, 2, 3; at step 81, none for rank 0\)$"):
        _recovery((2,), [])._boundary(where)
    with pytest.raises(Failed, match="^no replica of rank 2's training state survives$"):
        _recovery((2,), [])._boundary({0: _at(80, (0,)), 1: _at(80, (1,))})
    # FSDP, no replicas: nothing lost but a survivor ahead of the other, with no replica of it.
    with pytest.raises(Failed, match=r"\(at step 80, none for rank 1; at step 81, none for ranks 0, 3\)$"):
        _recovery((3,), [])._boundary({0: _at(80, (0, 3)), 1: _at(81, (1,))})


def test_where_a_lost_ranks_only_replicas_got_a_step_further_the_others_are_brought_forward() -> None:
    """HSDP, two shards of two replicas: rank 1 lost once its replica, rank 3, and rank 2 had
    finished step 45, but rank 0 had not.  Rank 1's state at 44 survives nowhere, at 45 on rank 3:
    the job goes on from 45, rank 0 given it by its replica, rank 2 (before: 44, and none held rank
    1's state there, so the job could not be rebuilt)."""
    shard = {0: (0, 2), 1: (1, 3), 2: (0, 2), 3: (1, 3)}
    where = {r: _at(held, shard[r]) for r, held in ((0, 44), (2, 45), (3, 45))}
    recovery = _recovery((1,), [])
    assert recovery._boundary(where) == (45, [0])  # (rank 0 is behind: brought forward, not left at 44)
    recovery.back = [0]
    assert recovery._sources(AGENTS, where, 45) == {1: 3, 0: 2}
    # Where the earliest serves, it is the one: a rank a step further is taken back.
    where = {r: _at(held, shard[r]) for r, held in ((0, 44), (2, 45), (3, 44))}
    assert recovery._boundary(where) == (44, [2])


def test_a_failed_recovery_ends_only_the_processes_of_its_own_jobs_identity_on_the_spare() -> None:
    """The new processes a failed recovery started are killed by the job's identity: by job name and
    rank alone, another user's rank of that name on the spare (torchrun's default job "none") was
    killed in their place."""
    asked: list[tuple[str, int, P.Request[P.Answer], str]] = []

    def ask(agent: str, job: str, rank: int, request: P.Request[P.Answer], timeout: float, key: str = "") -> P.Answer:
        asked.append((agent, rank, request, key))
        return P.Answer()

    request = P.Recover(node="10.0.0.3:7400", ranks=(2,), spare="10.0.0.4:7400", grace=5.0)
    recovery = Recovery("job1", 0, request, ask, "10.0.0.2:7400", typing.cast(Leaving, None))
    recovery.asking.key = "1000:4f2a"
    recovery.started = [2]
    recovery._end(AGENTS, "its replica could not give it its state")
    kills = [(agent, rank, key) for agent, rank, r, key in asked if isinstance(r, P.Signal)]
    assert kills == [("10.0.0.4:7400", 2, "1000:4f2a")]
