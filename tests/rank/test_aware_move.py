"""A model-aware move as the ranks see it (issue 27, item 2; :mod:`tpagent_rank.join`): a fresh
process of a rank's command warms up on its own, takes the rank's registered state at the
agreed boundary, and goes on in its place; the rank it replaced ends at its next collective.
The test plays every rank's agent on its socket, in the order a moving agent asks.  Four DDP
ranks (gloo, a FileStore); what each prints per step, and the final parameters, must equal an
uninterrupted run's bit for bit, with no line printed twice or lost."""

from __future__ import annotations

import io
import json
import os
import secrets
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from support.awarejob import WORLD, final, outputs, start, steps
from support.helpers import ROOT, wait_until
from support.runtime import PlayedAgent, ask_all, runtime_env
from tpagent_rank import handover
from tpagent_rank import protocol as P

pytest.importorskip("torch")

MOVED = 1


class Job:
    """Four ranks under the runtime, each with its agent played here, and a joiner for rank 1."""

    def __init__(self, tmp: Path, warmup: int) -> None:
        self.tmp = tmp
        name = f"tpagent-test-{os.getpid()}-aware"
        self.agents = [PlayedAgent(f"{name}-{r}") for r in range(WORLD)]
        self.joiner_agent = PlayedAgent(f"{name}-joiner")
        self.envs = [runtime_env(tmp, TPAGENT_JOB="j", TPAGENT_RANK_SOCKET=f"{name}-{r}") for r in range(WORLD)]
        self.procs = [start(tmp, r, self.envs[r]) for r in range(WORLD)]
        for a in self.agents:
            a.welcome()
        joiner_env = {
            **self.envs[MOVED],
            "TPAGENT_RANK_SOCKET": f"{name}-joiner",
            P.JOIN_VARIABLE: "1",
            "AWARE_WARMUP": str(warmup),
        }
        self.joiner = start(tmp, MOVED, joiner_env)

    @staticmethod
    def all(agents: list[PlayedAgent], request: P.Request[Any]) -> list[P.Answer]:
        return ask_all(agents, request)

    def stop_all(self, ahead: int = 8) -> int:
        """Every rank parked ``ahead`` steps past the furthest one (the boundary S); as a rewire
        does, further ahead while some rank is past it already (a busy machine)."""
        for _attempt in range(4):
            at_step = max(a.ask(P.Where()).step for a in self.agents) + ahead
            paused = self.all(self.agents, P.Pause(at=at_step))
            if all(a.ok for a in paused):
                break
            assert all(a.ok or (isinstance(a, P.Paused) and a.late) for a in paused), (paused, self.ended())
            assert all(a.ok for a in self.all(self.agents, P.Cancel()))
            ahead *= 4
        at = self.all(self.agents, P.Boundary(timeout=120))
        assert all(isinstance(a, P.AtBoundary) and a.ok and a.step == at_step for a in at), (at, self.ended())
        return at_step

    def hold(self) -> None:
        """The job held at an early step while the joiner starts (a loaded machine may take
        longer to start it than the job takes to end), then on again."""
        self.stop_all(ahead=3)
        self.joiner_agent.welcome()
        _waiting(self.joiner_agent)
        assert all(a.ok for a in self.all(self.agents, P.Cancel()))

    def ended(self) -> list[str]:
        """What each process that ended said last (for a failure's message)."""
        return [
            f"{p.args[4]}: {p.returncode}: {p.communicate()[1][-2000:]}"
            for p in [*self.procs, self.joiner]
            if p.poll() is not None
        ]

    def close(self) -> None:
        for p in [*self.procs, self.joiner]:
            if p.poll() is None:
                p.kill()
                p.wait()
        for a in [*self.agents, self.joiner_agent]:
            a.close()


@pytest.fixture
def warmup() -> int:
    """The warm-up the joiner registers (a test parametrizes it)."""
    return 2


@pytest.fixture
def job(tmp_path: Path, warmup: int) -> Iterator[Job]:
    j = Job(tmp_path, warmup)
    try:
        yield j
    finally:
        j.close()


def _waiting(agent: PlayedAgent) -> P.Standing:
    seen: list[P.Standing] = []

    def ready() -> bool:
        seen.append(agent.ask(P.Where()))
        return seen[-1].state == P.RankState.WAITING.value

    wait_until(ready, "the joiner to warm up and wait for a state", timeout=180, interval=0.2)
    return seen[-1]


# (one step: its DDP rebuilds its buckets in its 2nd, and the joiner warms up until it has)
@pytest.mark.parametrize("warmup", [1])
def test_a_fresh_process_takes_a_ranks_state_and_place_and_the_job_runs_on_bit_identical(
    job: Job, aware_reference: list[str]
) -> None:
    running = job.agents[0]
    assert running.ask(P.Retire()).error == "it is not stopped at an optimizer step's boundary"
    junk = b"x" * 1000  # (a state for a rank that is not a joiner: its bytes are read all the same)
    assert running.ask(P.Load(size=len(junk), step=1), junk).error == "it is not a joiner"
    assert running.ask(P.Where()).ok  # (the line is where it was)
    job.hold()
    assert job.joiner_agent.hello["state"] == P.RankState.JOINING.value and job.joiner_agent.hello["rank"] == MOVED
    assert job.joiner_agent.ask(P.Pause(at=1)).error.startswith("it is a process started to take")
    standing = job.joiner_agent.ask(P.Where())
    assert standing.aware and standing.step == 0  # (its warm-up steps are not the job's)

    step = job.stop_all()
    torn = job.all(job.agents, P.Teardown())
    assert all(a.ok for a in torn), torn
    secret = secrets.token_hex(32)
    saved = job.agents[MOVED].ask(P.Save(listen="127.0.0.1", secret=secret))
    assert saved.ok and saved.step == step and saved.size > 0 and saved.port > 0, saved
    source = f"127.0.0.1:{saved.port}"
    with pytest.raises(ConnectionError):  # (a peer without the secret is refused, and the offer stands)
        handover.fetch(source, secrets.token_hex(32), saved.size, io.BytesIO(), timeout=30)
    assert saved.groups == standing.groups > 0  # (the joiner made the groups the rank has)
    load = P.Load(
        size=saved.size,
        step=saved.step,
        collectives=saved.collectives,
        source=source,
        secret=secret,
        groups=saved.groups,
    )
    loaded = job.joiner_agent.ask(load)
    assert loaded.ok, loaded
    with pytest.raises(OSError):  # (served once: it listens no more)
        handover.fetch(source, secret, saved.size, io.BytesIO(), timeout=30)
    after = job.joiner_agent.ask(P.Where())
    assert (after.step, after.state) == (step, P.RankState.TORN_DOWN.value)

    now = [a for r, a in enumerate(job.agents) if r != MOVED] + [job.joiner_agent]
    built = job.all(now, P.Rebuild(gen=1, timeout=120))
    assert all(a.ok for a in built), built
    assert job.agents[MOVED].ask(P.Retire()).ok
    assert all(a.ok for a in job.all(now, P.Resume()))

    outs = outputs([*job.procs, job.joiner])
    for r, (code, out, err) in enumerate(outs[:WORLD]):
        assert code == 0, (r, err[-3000:])
        if r != MOVED:
            assert out == aware_reference[r], r  # every line, the final parameters too
    left, joined = outs[MOVED][1], outs[WORLD][1]
    assert steps(left) == steps(aware_reference[MOVED])[:step]  # up to its boundary, its own step's line included
    assert not [ln for ln in left.splitlines() if ln.startswith("{")]  # it ended before the end
    assert outs[WORLD][0] == 0, outs[WORLD][2][-3000:]
    assert steps(joined) == steps(aware_reference[MOVED])[step:]  # nothing of its warm-up
    assert final(joined)["params"] == final(aware_reference[MOVED])["params"]


def test_a_joiner_whose_load_fails_leaves_the_rank_where_it_was(job: Job, aware_reference: list[str]) -> None:
    """A state the joiner cannot take (here: not a state at all): it says why and ends; the rank
    it was to replace rebuilds with its peers and the job runs on as if nothing happened."""
    job.hold()
    job.stop_all()
    assert all(a.ok for a in job.all(job.agents, P.Teardown()))
    junk = b"not a state" * 10
    loaded = job.joiner_agent.ask(P.Load(size=len(junk), step=1), junk)
    assert not loaded.ok and "cannot be read safely" in loaded.error, loaded
    assert all(a.ok for a in job.all(job.agents, P.Rebuild(gen=1, timeout=120)))
    assert all(a.ok for a in job.all(job.agents, P.Resume()))
    outs = outputs(job.procs)
    assert [out for _c, out, _e in outs] == aware_reference
    job.joiner.wait(60)
    assert job.joiner.returncode != 0 and "could not take the state" in job.joiner.communicate()[1]


def test_a_joiner_warms_up_alone_each_collective_answered_here_with_its_shapes(tmp_path: Path) -> None:
    """Rank 1 of 4 with no peer running: every collective completes at once, outputs of the
    right shapes (its own input in each slot, its own chunk); groups, timeouts and barriers
    work; it prints nothing; a process it starts is no joiner."""
    env = runtime_env(tmp_path, TPAGENT_JOB="j", TPAGENT_RANK_SOCKET=f"tpagent-test-{os.getpid()}-none")
    env[P.JOIN_VARIABLE] = "1"
    out = tmp_path / "out.json"
    argv = [
        sys.executable,
        str(ROOT / "tests" / "workloads" / "solo_job.py"),
        str(tmp_path / "store"),
        "1",
        "4",
        str(out),
    ]
    done = subprocess.run(argv, env=env, cwd=tmp_path, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout == ""
    assert json.loads(out.read_text()) == {
        "environment": False,
        "all_reduce": [2.0, 2.0, 2.0],
        "all_gather": [[5.0] * 3] * 4,
        "all_gather_into_tensor": [1.0, 2.0] * 4,
        "reduce_scatter_tensor": [2.0, 3.0],
        "all_to_all_single_uneven": [0.0] * 5,
        "new_group": 4,
    }
