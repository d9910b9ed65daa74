"""What a target agent takes of a ``join`` (a model-aware move's fresh process of a rank's
command, :mod:`tpagent.jobs.joiners`) from another node's agent, and what a source agent leaves out
of how its rank runs: the rank runtime's own variables, which each agent sets itself."""

from __future__ import annotations

import dataclasses

import pytest

from tpagent.jobs.joiners import RUNTIME_ROOT, _checked, _without_runtime
from tpagent.migration.api import Refused, Why
from tpagent_rank import protocol as P

GOOD = P.Join(
    cmd=("/usr/bin/python3", "train.py"),
    env=("RANK=1", "WORLD_SIZE=4", "TPAGENT_RANK_SOCKET=@elsewhere", f"{P.JOIN_VARIABLE}=0"),
    cwd="/home/u",
    umask=0o022,
    uid=1000,
    gid=1000,
    groups=(1000,),
    stdout="/home/u/out",
    stderr="/home/u/err",
)


def test_a_join_keeps_the_ranks_environment_but_the_runtimes_own_variables() -> None:
    env = _checked("job1", 1, GOOD)
    assert env == {"RANK": "1", "WORLD_SIZE": "4"}  # (this agent's socket and the join flag are set by it)


@pytest.mark.parametrize(
    ("change", "said"),
    [
        ({"cmd": ()}, "a command"),
        ({"env": ("NOEQUALS",)}, "NAME=value"),
        ({"env": ("A=b\0c",)}, "without NUL"),
        ({"cmd": ("python3", "x\0y")}, "without NUL"),
        ({"cwd": "relative"}, "absolute paths"),
        ({"stdout": "out.log"}, "absolute paths"),
        ({"umask": 0o1777}, "umask is 0 to 0o777"),
        ({"uid": -5}, "by number"),
        ({"groups": (1 << 32,)}, "by number"),
        ({"owner": -2}, "by number"),
    ],
)
def test_a_join_that_names_something_malformed_is_refused_in_one_sentence(change: dict[str, object], said: str) -> None:
    with pytest.raises(Refused, match=said) as refused:
        _checked("job1", 1, dataclasses.replace(GOOD, **change))  # type: ignore[arg-type]
    assert refused.value.why is Why.INVALID


@pytest.mark.parametrize(("job", "rank"), [("", 1), ("job1", -1), ("job1", P.RANK_MAX)])
def test_a_join_names_a_job_and_a_rank(job: str, rank: int) -> None:
    with pytest.raises(Refused, match="a job, a rank"):
        _checked(job, rank, GOOD)


def test_the_source_leaves_out_its_runtime_directory_and_socket() -> None:
    env = {
        "PYTHONPATH": f"{RUNTIME_ROOT}/0.1.0-abc:/home/u/lib",
        "TPAGENT_RANK_SOCKET": "tpagent-rank",
        "TPAGENT_JOB": "job1",
        "RANK": "1",
    }
    assert _without_runtime(env) == ("PYTHONPATH=/home/u/lib", "RANK=1", "TPAGENT_JOB=job1")
    assert _without_runtime({"PYTHONPATH": f"{RUNTIME_ROOT}/0.1.0-abc"}) == ()
