"""Unplanned recovery as the ranks see it (issue 27, item 3; :mod:`tpagent_rank.recover`): a rank
of a registered DDP job is killed outright mid-run.  Its peers' collectives fail, and are held
from the script (no traceback, no exit); each holds the state of its last step boundary.  A fresh
process of the dead rank's command takes that state from one of them (its replica), each survivor
restarts in its own process from the state it held, and all rebuild their communicators: every
rank's per-step losses and final parameters equal an uninterrupted run's, bit for bit (the step
that was in flight is done again).  The test plays every rank's agent on its socket, in the order
a recovering agent asks."""

from __future__ import annotations

import os
import secrets
import signal
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from support.awarejob import WORLD, final, start, steps
from support.helpers import wait_until
from support.runtime import PlayedAgent, ask_all, runtime_env
from tpagent_rank import protocol as P

pytest.importorskip("torch")

DEAD = 3
WRITTEN = 160  # lines, one each 50 ms (AWARE_WRITE)


class Job:
    """Four ranks under the runtime, each with its agent played here."""

    def __init__(self, tmp: Path, hold: int = 240, extra: dict[int, dict[str, str]] | None = None) -> None:
        self.tmp = tmp
        self.name = f"tpagent-test-{os.getpid()}-recover"
        self.agents = [PlayedAgent(f"{self.name}-{r}") for r in range(WORLD)]
        self.envs = [
            runtime_env(
                tmp,
                TPAGENT_JOB="j",
                TPAGENT_RANK_SOCKET=f"{self.name}-{r}",
                TPAGENT_RANK_HOLD=str(hold),
                **(extra or {}).get(r, {}),
            )
            for r in range(WORLD)
        ]
        self.procs = [start(tmp, r, self.envs[r]) for r in range(WORLD)]
        for a in self.agents:
            a.welcome()
        self.spare_agent: PlayedAgent | None = None
        self.spare: subprocess.Popen[str] | None = None

    def start_spare(self) -> PlayedAgent:
        """A fresh process of the dead rank's command, to take its place."""
        self.spare_agent = PlayedAgent(f"{self.name}-spare")
        env = {**self.envs[DEAD], "TPAGENT_RANK_SOCKET": f"{self.name}-spare", P.JOIN_VARIABLE: "1"}
        self.spare = start(self.tmp, DEAD, env)  # (welcomed once its runtime connects)
        return self.spare_agent

    @staticmethod
    def all(agents: list[PlayedAgent], request: P.Request[Any]) -> list[P.Answer]:
        return ask_all(agents, request)

    def close(self) -> None:
        for p in [*self.procs, self.spare]:
            if p is not None and p.poll() is None:
                p.kill()
            if p is not None:
                p.communicate()
        for a in [*self.agents, self.spare_agent]:
            if a is not None:
                a.close()


@pytest.fixture
def job(tmp_path: Path) -> Iterator[Job]:
    j = Job(tmp_path)
    try:
        yield j
    finally:
        j.close()


def _standing(agent: PlayedAgent, ready: Any, what: str) -> P.Standing:
    seen: list[P.Standing] = []

    def check() -> bool:
        seen.append(agent.ask(P.Where()))
        return bool(ready(seen[-1]))

    wait_until(check, what, timeout=180, interval=0.1)
    return seen[-1]


def _offer(source: PlayedAgent, taker: PlayedAgent) -> int:
    """``source``'s held state offered once, and taken by ``taker`` (a fresh process): its step."""
    secret = secrets.token_hex(32)
    saved = source.ask(P.Save(listen="127.0.0.1", secret=secret, held=True))
    assert saved.ok and saved.port > 0, saved
    load = P.Load(saved.size, saved.step, saved.collectives, f"127.0.0.1:{saved.port}", secret, groups=saved.groups)
    assert taker.ask(load).ok
    return saved.step


def test_a_rank_killed_outright_is_rebuilt_from_a_replica_and_the_job_runs_on_bit_identical(
    job: Job, aware_reference: list[str]
) -> None:
    """Where the rank was killed decides whether a survivor had finished the step the others are
    caught in (the dead rank had sent it all it needed): settled, it is a boundary ahead, and is
    taken back to the others' with a replica's state, as a recovering agent does."""
    _standing(job.agents[0], lambda s: s.step >= 5 and s.held == s.step, "the job to take a few steps")
    job.procs[DEAD].send_signal(signal.SIGKILL)
    before = steps(job.procs[DEAD].communicate(timeout=60)[0])
    # A ring neighbour's collective fails (the others wait on peers that wait): held, not raised.
    said = _standing(job.agents[0], lambda s: s.broken, "rank 0 to hold its failed collective").broken
    assert "Connection" in said or "closed" in said, said
    _recover(job, aware_reference, before)


def _recover(job: Job, aware_reference: list[str], before: list[str]) -> None:
    """The job rebuilt as a recovering agent does it, once rank DEAD (which printed ``before``)
    was killed; then every rank's output is the uninterrupted run's.  DDP: every survivor is a
    replica of every rank, so the job's boundary is the earliest held (the agent's rule,
    :meth:`tpagent.jobs.recovery.Recovery._boundary`, gives it), and a rank at another is ahead."""
    survivors = [r for r in range(WORLD) if r != DEAD]
    standing = {r: job.agents[r].ask(P.Settle()) for r in survivors}
    assert all(s.ok and s.replicas == tuple(range(WORLD)) for s in standing.values()), standing
    boundary = min(s.held for s in standing.values())
    back = [r for r in survivors if standing[r].held > boundary]
    assert boundary >= 5 and all(standing[r].held == boundary + 1 for r in back), standing
    assert back != survivors and all(job.procs[r].poll() is None for r in survivors)  # (the script saw no error)
    # Settled, none moves on (one a boundary ahead was in a collective with the dead rank or its peers).
    assert {r: job.agents[r].ask(P.Where()).held for r in survivors} == {r: s.held for r, s in standing.items()}

    print(f"boundary {boundary}, a boundary ahead: {back}")
    source = next(r for r in survivors if r not in back)
    spare = job.start_spare()
    for r in [*(r for r in survivors if r != source), source]:  # (the source once its state is taken)
        if r == source:
            spare.welcome()
            for a in [spare, *(job.agents[b] for b in back)]:
                _standing(a, lambda s: s.state == P.RankState.WAITING.value, "a fresh process to warm up")
                assert _offer(job.agents[source], a) == boundary
        assert job.agents[r].ask(P.Restart(fresh=r in back)).ok
        assert job.agents[r].welcome()["state"] == P.RankState.JOINING.value  # (the process it became)
    everyone = [*(job.agents[r] for r in survivors), spare]
    for a in everyone:
        s = _standing(a, lambda s: s.state == P.RankState.TORN_DOWN.value, "each to stand at the boundary")
        assert s.step == boundary
    assert all(a.ok for a in job.all(everyone, P.Rebuild(gen=1, timeout=120)))
    assert all(a.ok for a in job.all(everyone, P.Resume()))

    assert job.spare is not None
    procs = {**{r: job.procs[r] for r in survivors}, DEAD: job.spare}
    outs = {r: p.communicate(timeout=300) for r, p in procs.items()}
    for r, (out, err) in outs.items():
        assert procs[r].returncode == 0, (r, err[-3000:])
        assert final(out)["params"] == final(aware_reference[r])["params"], r
    for r in survivors:  # (the same PID throughout: what it printed before and after the restart)
        ran = steps(aware_reference[r])
        assert steps(outs[r][0]) == (ran[: boundary + 1] + ran[boundary:] if r in back else ran), r
        assert "Traceback" not in outs[r][1], outs[r][1][-4000:]
        assert "tpagent_rank/" not in outs[r][1], outs[r][1][-4000:]  # (no warning of the runtime's own)
    # What the dead rank printed, then its replacement from the boundary on: the run's, bit for bit.
    assert before == steps(aware_reference[DEAD])[: len(before)] and boundary - 1 <= len(before) <= boundary + 1
    assert steps(outs[DEAD][0]) == steps(aware_reference[DEAD])[boundary:]


def test_a_file_a_survivors_script_writes_is_written_whole_before_it_restarts(
    tmp_path: Path, aware_reference: list[str]
) -> None:
    """Rank 1's script writes a file of its own after step 8, over 8 s (as a checkpoint is written
    after a step), and rank 3 is killed as it begins: the others wait in step 9's collectives, and
    rank 1 is told to restart while it writes (its node's loss seen by the orchestrator, not in a
    collective).  Its restart waits for the write to end (then rank 1 waits in a failed collective
    too): the file is whole, and the job runs on bit-identical."""
    job = Job(tmp_path, extra={1: {"AWARE_WRITE": f"8:{WRITTEN}"}})
    try:
        written = tmp_path / "written-1"
        wait_until(written.exists, "rank 1 to begin writing its file", timeout=180, interval=0.02)
        job.procs[DEAD].send_signal(signal.SIGKILL)
        before = steps(job.procs[DEAD].communicate(timeout=60)[0])
        assert len(written.read_text().splitlines()) < WRITTEN  # (it writes yet: its agent asks now)
        _recover(job, aware_reference, before)
        assert written.read_text() == "".join(f"line {i}\n" for i in range(WRITTEN))
    finally:
        job.close()


def test_a_held_collective_raises_once_no_recovery_comes_and_the_script_ends_as_it_would_have(tmp_path: Path) -> None:
    """No word from the agent within the hold (``TPAGENT_RANK_HOLD``): each survivor's failed
    collective raises in its script, which ends with the error it would have had without tpagent."""
    job = Job(tmp_path, hold=3)
    try:
        _standing(job.agents[0], lambda s: s.step >= 3, "the job to take a few steps")
        job.procs[DEAD].send_signal(signal.SIGKILL)
        for r in range(WORLD):
            out, err = job.procs[r].communicate(timeout=120)
            if r == DEAD:
                continue
            assert job.procs[r].returncode == 1, (r, job.procs[r].returncode, err[-3000:])
            assert "tpagent_rank: no recovery came in 3 s after a collective failed (" in err, err[-3000:]
    finally:
        job.close()
