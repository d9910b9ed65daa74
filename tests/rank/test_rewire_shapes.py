"""Training scripts of shapes a review found broken by an in-place rewire (the agents played by the
test: where, pause, boundary, teardown, rebuild, resume), each against the same script run without
the runtime, output for output: a receive posted ahead of the step boundary (a pipeline stage's:
the rewire killed both ranks; now the boundary refuses, and the job goes on); a thread reducing on a
group of its own (it raised in the rewire's window); a group all ranks destroyed that one still
references (the rebuild hung); a timeout set once the group was made (lost at the rebuild); sends
on the default group of a job without an optimizer, whose rewire counts collectives (the counts
differed from rank to rank); the default group destroyed and made again (never counted)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from support.runtime import PlayedAgent, ask_all, runtime_env
from tpagent_rank import protocol as P

pytest.importorskip("torch")

HEAD = """
import datetime, os, sys, time
import torch, torch.distributed as dist
store, rank, world = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
def init(again=""):
    dist.init_process_group("gloo", store=dist.FileStore(store + again, world), rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=60))
"""

PENDING = """
init()
w = torch.nn.Parameter(torch.zeros(2)); opt = torch.optim.SGD([w], lr=0.1)
acc, r = torch.zeros(2), torch.zeros(2)
pending = dist.irecv(r, 0) if rank == 1 else None  # (posted ahead of the step, as a pipeline stage does)
for it in range(150):
    t = torch.ones(2) * (rank + 1); dist.all_reduce(t); w.grad = t; opt.step()
    if rank == 0:
        dist.send(torch.ones(2) * it, 1)
    else:
        pending.wait(); acc += r
        r = torch.zeros(2); pending = dist.irecv(r, 0) if it < 149 else None
    time.sleep(0.02)
print("acc", acc.tolist(), w.tolist(), flush=True)
"""

MIXED = """
init()
w = torch.nn.Parameter(torch.zeros(2)); opt = torch.optim.SGD([w], lr=0.1)
side = dist.new_group([0, 1])
gone = dist.new_group([0, 1]); dist.all_reduce(torch.ones(1), group=gone); dist.destroy_process_group(gone)
keep = [gone] if rank == 0 else []  # (rank 0 alone still references the group all destroyed)
del gone
dist.distributed_c10d._set_pg_timeout(datetime.timedelta(seconds=2))  # (as a framework shortens it once set up)
for it in range(120):
    t = torch.ones(2) * (rank + it); dist.all_reduce(t); w.grad = t; opt.step(); time.sleep(0.02)
    if it % 10 == 0:
        s = torch.ones(1) * it; dist.all_reduce(s, group=side)
print("w", w.tolist(), "side", s.item(), flush=True)
if rank == 1:
    time.sleep(6)
t0 = time.monotonic()
try:
    dist.all_reduce(torch.ones(1))
except RuntimeError:
    print("the late peer timed out within 5 s:", time.monotonic() - t0 < 5, flush=True)
os._exit(0)
"""

NO_OPTIMIZER = """
init()
dist.all_reduce(torch.ones(1)); dist.destroy_process_group(); init(".2")  # (the default group made again)
acc = torch.zeros(1)
for it in range(int(os.environ.get("ITERS", "600"))):
    if rank == 0:
        for peer in range(1, world):
            dist.send(torch.ones(1) * it, peer)  # (sends: each rank issues its own)
    else:
        t = torch.zeros(1); dist.recv(t, 0); acc += t
    t = torch.ones(1) * (rank + it); dist.all_reduce(t); acc += t
    time.sleep(0.005)
print("acc", acc.item(), flush=True)
"""


def _start(tmp: Path, body: str, n: int, runtime: bool) -> tuple[list[subprocess.Popen[str]], list[PlayedAgent]]:
    (tmp / "job.py").write_text(HEAD + textwrap.dedent(body))
    base = f"tpagent-test-shapes-{os.getpid()}-{tmp.name}"
    agents = [PlayedAgent(f"{base}-{r}", timeout=90) for r in range(n)] if runtime else []
    procs = []
    for r in range(n):
        env = runtime_env(tmp, TPAGENT_JOB="j", TPAGENT_RANK_SOCKET=f"{base}-{r}") if runtime else None
        cmd = [sys.executable, str(tmp / "job.py"), str(tmp / "store"), str(r), str(n)]
        procs.append(subprocess.Popen(cmd, env=env, cwd=tmp, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    for a in agents:
        a.welcome()
    return procs, agents


def _outputs(procs: list[subprocess.Popen[str]]) -> list[str]:
    outs = []
    for p in procs:
        out, err = p.communicate(timeout=180)
        assert p.returncode == 0, err[-3000:]
        outs.append(out)
    return outs


def _plain(tmp: Path, body: str, n: int) -> list[str]:
    (tmp / "plain").mkdir()
    return _outputs(_start(tmp / "plain", body, n, runtime=False)[0])


def _rewired(tmp: Path, body: str, n: int, unit: str) -> tuple[list[str], list[P.Answer]]:
    """The outputs of ``body`` on ``n`` ranks, rewired once in place a little way in; the
    boundary's answers (where one refuses, the rewire is called off and the ranks go on)."""
    (tmp / "rewired").mkdir()
    procs, agents = _start(tmp / "rewired", body, n, runtime=True)
    try:
        time.sleep(1.5)  # (some way in: past the first steps)
        where = [a.ask(P.Where()) for a in agents]
        at = max(getattr(w, "step" if unit == "step" else "collectives") for w in where) + 3
        assert all(a.ok for a in ask_all(agents, P.Pause(at=at, unit=unit)))
        boundary = ask_all(agents, P.Boundary(timeout=30))
        if all(b.ok for b in boundary):
            assert all(a.ok for a in ask_all(agents, P.Teardown())), "teardown"
            assert all(a.ok for a in ask_all(agents, P.Rebuild(gen=1, timeout=60))), "rebuild"
            assert all(a.ok for a in ask_all(agents, P.Resume())), "resume"
        else:
            assert all(a.ok for a in ask_all(agents, P.Cancel()))
        return _outputs(procs), boundary
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
        for a in agents:
            a.close()


def test_a_receive_posted_ahead_of_the_boundary_calls_the_rewire_off_and_the_job_goes_on(tmp_path: Path) -> None:
    rewired, boundary = _rewired(tmp_path, PENDING, 2, "step")
    refused = [b.error for b in boundary if not b.ok]
    assert len(refused) == 1 and "1 send(s) or receive(s) it posted before step" in refused[0], boundary
    assert rewired == _plain(tmp_path, PENDING, 2)


def test_groups_destroyed_groups_and_timeouts_set_later_come_through_a_rewire(tmp_path: Path) -> None:
    rewired, boundary = _rewired(tmp_path, MIXED, 2, "step")
    assert all(b.ok for b in boundary), boundary
    plain = _plain(tmp_path, MIXED, 2)
    assert rewired == plain and "side 220.0" in plain[0], (rewired, plain)
    assert "the late peer timed out within 5 s: True" in plain[0]


def test_a_job_without_an_optimizer_that_sends_and_made_its_group_again_is_rewired_at_a_collective(
    tmp_path: Path,
) -> None:
    rewired, boundary = _rewired(tmp_path, NO_OPTIMIZER, 3, "collective")
    assert all(b.ok for b in boundary), boundary
    assert rewired == _plain(tmp_path, NO_OPTIMIZER, 3)
