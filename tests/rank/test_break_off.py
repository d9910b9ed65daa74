"""A rank whose job lost a node (:class:`tpagent_rank.protocol.End` with a grace, as its agent
passes on the orchestrator's word): waiting in a collective on a peer that says nothing, it
breaks off and ends with one sentence, where it would wait for the collective's timeout; a rank
whose collectives complete is left alone.  The test plays the rank's agent on its socket."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from support.runtime import PlayedAgent, runtime_env
from tpagent_rank import protocol as P

pytest.importorskip("torch")

JOB = textwrap.dedent(
    """
    import datetime, sys, time
    import torch, torch.distributed as dist
    store, rank, steps = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    dist.init_process_group("gloo", store=dist.FileStore(store, 2), rank=rank, world_size=2,
                            timeout=datetime.timedelta(seconds=900))
    for step in range(steps):
        t = torch.full((2,), float(step))
        dist.all_reduce(t)
        print("step", step, t.tolist(), flush=True)
        time.sleep(0.05)
    print("done", t.tolist(), flush=True)
    dist.destroy_process_group()
    """
)


@contextlib.contextmanager
def _job(
    tmp_path: Path, steps: int, script: str = JOB, **settings: str
) -> Iterator[tuple[list[subprocess.Popen[str]], PlayedAgent]]:
    """Two gloo ranks of ``script``, rank 0's agent played by the test (``settings``: the runtime's
    environment); both ended (killed if need be) after."""
    (tmp_path / "job.py").write_text(script)
    env = {**runtime_env(tmp_path), **settings}
    name = f"tpagent-test-{os.getpid()}-break"
    agent = PlayedAgent(name)
    ranks = [
        subprocess.Popen(
            [sys.executable, "-X", "faulthandler", tmp_path / "job.py", tmp_path / "store", str(r), str(steps)],
            env={**env, "TPAGENT_JOB": "j", "TPAGENT_RANK_SOCKET": name if r == 0 else f"{name}-none"},
            cwd=tmp_path,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for r in range(2)
    ]
    try:
        agent.welcome()
        yield ranks, agent
    finally:
        agent.close()
        for r in ranks:
            r.kill()
            r.communicate()


def _waiting(agent: PlayedAgent) -> None:
    """Until rank 0 waits in a collective: its count of them stays put a whole second."""
    seen = -1
    while True:
        now = agent.ask(P.Where())
        assert isinstance(now, P.Standing)
        if now.collectives == seen:
            return
        seen = now.collectives
        time.sleep(1.0)


def _stepped(rank: subprocess.Popen[str], n: int) -> None:
    """Read ``rank``'s output until its step ``n``."""
    assert rank.stdout is not None
    for line in rank.stdout:
        if line.startswith(f"step {n} "):
            return
    raise AssertionError(f"the rank ended before step {n}: {rank.wait()}")


def test_a_rank_waiting_on_a_silent_peer_breaks_off_and_says_why(tmp_path: Path) -> None:
    with _job(tmp_path, steps=100000) as (ranks, agent):
        _stepped(ranks[0], 5)
        os.kill(ranks[1].pid, signal.SIGSTOP)  # (its node is lost: not a word, no connection closed)
        _waiting(agent)
        answer = agent.ask(P.End(why="node b stopped reporting", grace=2.0))
        assert answer.ok, answer
        _, err = ranks[0].communicate(timeout=120)  # (its collective's timeout is 900 s)
        assert "rank 0 of job j stops: node b stopped reporting" in err, err[-3000:]
        assert ranks[0].returncode != 0


def test_a_rank_whose_collectives_complete_goes_on(tmp_path: Path) -> None:
    with _job(tmp_path, steps=120) as (ranks, agent):
        _stepped(ranks[0], 5)
        assert agent.ask(P.End(why="node b stopped reporting", hold=True)).ok  # (not parked: left as it is)
        answer = agent.ask(P.End(why="node b stopped reporting", grace=2.0))
        assert not answer.ok and "goes on: it is not waiting on node b" in answer.error, answer
        outs = [r.communicate(timeout=120) for r in ranks]
        assert [r.returncode for r in ranks] == [0, 0], outs[0][1][-3000:]
        assert all(out.strip().splitlines()[-1] == "done [238.0, 238.0]" for out, _ in outs), outs
        assert "stops" not in outs[0][1]


def test_a_parked_rank_told_first_says_why_and_ends_only_at_the_next_word(tmp_path: Path) -> None:
    """The job cannot go on (a rewire failed): every rank is told why first (End with hold) and
    says so on its stderr at once, still parked; only the next End ends it, with the reason."""
    with _job(tmp_path, steps=100000) as (ranks, agent):
        _stepped(ranks[0], 3)
        now = agent.ask(P.Where())
        assert isinstance(now, P.Standing)
        at = now.collectives + 5
        assert agent.ask(P.Pause(at=at, unit=P.Unit.COLLECTIVE.value)).ok
        assert agent.ask(P.Boundary(timeout=60)).ok
        why = "rank 1 could not build its communicators; the job cannot go on"
        assert agent.ask(P.End(why=why, hold=True)).ok
        assert agent.ask(P.End(why=why, hold=True)).ok  # (said again: said once)
        still = agent.ask(P.Where())
        assert isinstance(still, P.Standing) and still.collectives == at, still  # (parked there, not ended)
        assert ranks[0].poll() is None
        assert agent.ask(P.End(why=why)).ok
        _, err = ranks[0].communicate(timeout=120)
        assert err.count(f"rank 0 of job j stops: {why}") == 1, err[-3000:]
        assert f"rank 0 of job j stopped after collective {at}: {why}" in err, err[-3000:]
        assert ranks[0].returncode != 0


SCATTER = textwrap.dedent(
    """
    import datetime, sys, time
    import torch, torch.distributed as dist
    import tpagent_rank
    store, rank, steps = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    dist.init_process_group("gloo", store=dist.FileStore(store, 2), rank=rank, world_size=2,
                            timeout=datetime.timedelta(seconds=900))
    w = torch.nn.Parameter(torch.zeros(2))
    opt = torch.optim.SGD([w], lr=0.1)
    tpagent_rank.register(save=lambda: {"w": w.detach().clone()}, load=lambda s: w.data.copy_(s["w"]),
                          replicas=[0, 1])
    for step in range(steps):
        out = torch.zeros(1)
        dist.reduce_scatter_tensor(out, torch.full((2,), float(step)))  # (FSDP2's gradients go so)
        w.grad = out.repeat(2)
        opt.step()
        print("step", step, out.tolist(), flush=True)
        time.sleep(0.05)
    """
)


def test_a_failed_reduce_scatter_is_held_like_any_collective(tmp_path: Path) -> None:
    """gloo's reduce-scatter (every FSDP2 backward's) gives a work without a future: its failure,
    its peer killed outright, is held from the script as every other collective's (it raised at
    once, and the rank a recovery would restart was gone); with no recovery in the hold, it raises
    saying so."""
    with _job(tmp_path, 100000, SCATTER, TPAGENT_RANK_HOLD="3") as (ranks, agent):
        _stepped(ranks[0], 5)
        ranks[1].kill()
        _, err = ranks[0].communicate(timeout=120)
        assert "tpagent_rank: no recovery came in 3 s after a collective failed (" in err, err[-3000:]
        assert ranks[0].returncode != 0
