"""Benchmark: moving a rank of a running torchrun job, and what the rank runtime costs a job
that never moves.

    python bench/rewire.py [--repeats 3] [--rounds 5] [--steps 300] [--width 512] [--json-out F]
    python bench/rewire.py --gpu [--rounds 3] ...   the overhead only, of one NCCL rank on a GPU

1. Overhead.  The same 3-rank DDP job (gloo, CPU; the worker is this file with --worker) runs
   under plain torchrun, and under torchrun with the rank runtime loaded as `tpagent rank`
   loads it (every process group delegating; no agent: nothing ever moves), in interleaved
   rounds (plain, runtime, plain, ...).  With --gpu: one rank (NCCL takes one rank a GPU), the
   model, the data and the collectives on the GPU, each step timed to its end on the device.
   Per round: the median step time over the steps after the first 20; the overhead is the
   median over rounds of runtime / plain - 1 (target < 1 %).
   Step times on a small shared machine vary by several per cent between rounds, so the same
   figure is also given from its parts: the time one 1-element all_reduce takes with and
   without the runtime, in one process of world size 1 (what forwarding adds to a collective,
   undisturbed by the other ranks' scheduling), times the collectives a step issues (as the
   runtime counts them), over the plain step time.
2. A move.  Four network-namespace nodes (tests/support/cluster.py), each running `tpagent serve`;
   the job (tests/workloads/ddp_job.py, under `tpagent rank`) on A, B, C; rank 1 is moved to
   the spare D (`tpagent migrate --job --rank`).  Split as the agent times it: boundary (all
   ranks stopped at one step), teardown, migrate (freeze, stream, restore, confirm: the
   ordinary path), rebuild; and from the request until the rank's first step after the move.
   Beside it, in the same run: the floor, rank 1's own migration stages (what moving its
   process costs with no job around it: freeze to running copy), and the naive route, the
   whole job started again (what a restart from a checkpoint costs at the least: torchrun,
   rendezvous, init_process_group, to the first step; the steps since the checkpoint are lost
   on top).  Medians over --repeats.  Must run as root.  Prints a table, then one JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _sync(gpu: bool) -> None:
    if gpu:
        import torch

        torch.cuda.synchronize()


def worker(a: argparse.Namespace) -> None:
    """One rank: a DDP step loop, each step's wall time written to --out (rank 0's).  With --gpu:
    NCCL, the model and the data on the rank's GPU, each step timed to its end on the device."""
    import torch
    import torch.distributed as dist
    from torch import nn
    from torch.nn.parallel import DistributedDataParallel as DDP

    dist.init_process_group("nccl" if a.gpu else "gloo")
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0"))) if a.gpu else torch.device("cpu")
    if a.gpu:
        torch.cuda.set_device(device)
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(64, a.width), nn.Tanh(), nn.Linear(a.width, a.width), nn.Linear(a.width, 1))
    model = DDP(net.to(device), device_ids=[device.index] if a.gpu else None)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    data = torch.Generator().manual_seed(dist.get_rank())
    times = []
    for _ in range(a.steps):
        t = time.perf_counter()
        x = torch.randn(64, 64, generator=data).to(device)
        opt.zero_grad()
        loss = (model(x) ** 2).mean()
        loss.backward()
        opt.step()
        _sync(a.gpu)
        times.append(time.perf_counter() - t)
    # What one collective costs by itself: a 1-element all_reduce, where the call's own cost
    # shows (the runtime forwards each through the delegating group).
    one = torch.zeros(1, device=device)
    calls = []
    for _ in range(600):
        t = time.perf_counter()
        dist.all_reduce(one)
        _sync(a.gpu)
        calls.append(time.perf_counter() - t)
    hooks = sys.modules.get("tpagent_rank.hooks")  # (where the runtime keeps this process's rank)
    counted = hooks.RANK.collectives if hooks is not None and hooks.RANK is not None else 0
    if dist.get_rank() == 0:
        a.out.write_text(
            json.dumps(
                {
                    "steps": times,
                    "collective_s": statistics.median(calls[100:]),
                    "collectives_per_step": (counted - len(calls)) / a.steps,
                }
            )
        )
    # Every rank's figures are in: out at once.  (torch 2.x's gloo ranks, ending the usual way,
    # now and then abort at exit, "terminate called without an active exception", which made
    # torchrun fail a job whose measurements were whole.)
    dist.barrier()
    sys.stdout.flush()
    os._exit(0)


def forwarding_worker(gpu: bool) -> None:
    """One process, world size 1 (no peer, no scheduling between ranks): the median time of a
    1-element all_reduce (on the GPU, through NCCL, to its end there: ``gpu``), printed.  What
    the delegating group adds shows here undisturbed."""
    import torch
    import torch.distributed as dist

    if gpu:
        torch.cuda.set_device(0)
    dist.init_process_group("nccl" if gpu else "gloo", store=dist.HashStore(), rank=0, world_size=1)
    one = torch.zeros(1, device="cuda" if gpu else "cpu")
    times = []
    for i in range(6000):
        t = time.perf_counter()
        dist.all_reduce(one)
        _sync(gpu)
        if i >= 1000:
            times.append(time.perf_counter() - t)
    runtime = sys.modules.get("tpagent_rank.backend")  # (get_backend names the user's backend either way)
    delegating = runtime is not None and isinstance(dist.group.WORLD, runtime.DelegatingGroup)
    print(json.dumps({"collective_s": statistics.median(times), "delegating": delegating}))
    dist.destroy_process_group()


def forwarding_round(runtime: Path | None, gpu: bool) -> float:
    env = {**os.environ, "USE_LIBUV": "0", "OMP_NUM_THREADS": "1"}
    if runtime is not None:
        env.update(
            PYTHONPATH=os.pathsep.join([str(runtime), env.get("PYTHONPATH", "")]),
            TPAGENT_RANK_SOCKET="tpagent-bench-nobody",
            TPAGENT_JOB="bench",
        )
    done = subprocess.run(
        [sys.executable, __file__, "--forwarding-worker", *(["--gpu"] if gpu else [])],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    if done.returncode != 0:
        raise SystemExit(f"the single process failed (exit {done.returncode}):\n{done.stderr[-3000:]}")
    got = json.loads(done.stdout.strip().splitlines()[-1])
    assert got["delegating"] == (runtime is not None), got  # (the runtime was loaded, or not)
    return float(got["collective_s"])


def ranks(a: argparse.Namespace) -> int:
    """The job's ranks: 3 on CPU, 1 on a GPU (NCCL takes one rank a GPU)."""
    return 1 if a.gpu else 3


def overhead_round(runtime: Path | None, a: argparse.Namespace, work: Path) -> tuple[float, float, float]:
    """Median step time, median time of one tiny all_reduce, collectives per step (counted by
    the runtime; 0 without it)."""
    out = work / "times.json"
    out.unlink(missing_ok=True)
    env = {**os.environ, "USE_LIBUV": "0", "OMP_NUM_THREADS": "1"}
    if runtime is not None:  # as `tpagent rank` starts a rank, minus the agent (none answers: nothing moves)
        env.update(
            PYTHONPATH=os.pathsep.join([str(runtime), env.get("PYTHONPATH", "")]),
            TPAGENT_RANK_SOCKET="tpagent-bench-nobody",
            TPAGENT_JOB="bench",
        )
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc-per-node",
            str(ranks(a)),
            __file__,
            "--worker",
            "--steps",
            str(a.steps),
            "--width",
            str(a.width),
            "--out",
            str(out),
            *["--gpu"] * a.gpu,
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    if done.returncode != 0:
        raise SystemExit(f"the job failed (exit {done.returncode}):\n{(done.stdout + done.stderr)[-3000:]}")
    # (the runtime says it found no agent: proof that it was loaded, its groups delegating)
    assert (runtime is not None) == ("no agent answers" in done.stderr), done.stderr[-2000:]
    got = json.loads(out.read_text())
    return statistics.median(got["steps"][20:]), got["collective_s"], got["collectives_per_step"]


def overhead(a: argparse.Namespace, work: Path) -> dict[str, object]:
    sys.path.insert(0, str(ROOT))
    from tpagent_rank import layout

    runtime = work / "runtime"
    runtime.mkdir()
    layout.write_runtime_dir(runtime)
    plain: list[tuple[float, float, float]] = []
    delegating: list[tuple[float, float, float]] = []
    for _ in range(a.rounds):
        plain.append(overhead_round(None, a, work))
        delegating.append(overhead_round(runtime, a, work))
    alone = [(forwarding_round(None, a.gpu), forwarding_round(runtime, a.gpu)) for _ in range(a.rounds)]
    added_alone = statistics.median(d - p for p, d in alone)
    ratios = [d[0] / p[0] - 1 for p, d in zip(plain, delegating, strict=True)]
    step = statistics.median(p[0] for p in plain)
    per_call = statistics.median(d[1] - p[1] for p, d in zip(plain, delegating, strict=True))
    per_step = statistics.median(d[2] for d in delegating)
    # The same figure from its parts: what forwarding adds to one collective, times the
    # collectives a step issues, over the step (far less noisy than two step times).
    derived = added_alone * per_step / step
    return {
        "ranks": ranks(a),
        "backend": "nccl" if a.gpu else "gloo",
        "plain_step_s": step,
        "runtime_step_s": statistics.median(d[0] for d in delegating),
        "overhead": statistics.median(ratios),
        "rounds": a.rounds,
        "steps": a.steps,
        "width": a.width,
        "plain_collective_s": statistics.median(p[1] for p in plain),
        "runtime_collective_s": statistics.median(d[1] for d in delegating),
        "added_per_collective_s": per_call,
        "collectives_per_step": per_step,
        "overhead_from_parts": derived,
        "one_process_plain_collective_s": statistics.median(p for p, _ in alone),
        "one_process_runtime_collective_s": statistics.median(d for _, d in alone),
        "one_process_added_per_collective_s": added_alone,
        "plain_rounds_s": [p[0] for p in plain],
        "runtime_rounds_s": [d[0] for d in delegating],
    }


def move_once(tmp: Path) -> dict[str, float]:
    sys.path[:0] = [str(ROOT), str(ROOT / "tests")]
    from support.cluster import Cluster
    from support.rankjob import IFNAME, Job, rank_log, steps

    c = Cluster(tmp, ["A", "B", "C", "D"], ifname=IFNAME)
    try:
        for node in c.nodes.values():
            node.start_agent(rewire_timeout="60")
        t0 = time.monotonic()
        job = Job(c, tmp)
        try:
            job.at_step(0, 1)
            cold = time.monotonic() - t0  # the naive route's least: a whole job up to its first step
            job.at_step(1, 20)
            seen: dict[int, float] = {}
            stop = threading.Event()

            def watch() -> None:  # when each step of rank 1 appears in its log
                while not stop.is_set():
                    seen.setdefault(steps(job.logs, 1), time.monotonic())
                    time.sleep(0.005)

            threading.Thread(target=watch, daemon=True).start()
            t_request = time.monotonic()
            done = c.migrate(0, "B", "D", "--job", "job1", "--rank", "1", "--json", timeout=600)
            doc = json.loads(done.stdout)
            assert done.returncode == 0 and doc["state"] == "done", done.stdout + done.stderr
            resumed = int(doc["message"].split("resumed at step ")[1].split()[0])  # S+1 (1-based)
            job.at_step(1, resumed)
            stop.set()
            first = min(t for n, t in seen.items() if n >= resumed) - t_request
            timings = doc["timings"]
            inner = {k.split("_", 1)[1]: v for k, v in timings.items() if k.startswith("rank") and "_" in k}
            job.wait()
            assert rank_log(job.logs, 1)[-1].startswith("done ")
        finally:
            job.close()
    finally:
        c.close()
    return {
        "boundary": timings["boundary"],
        "teardown": timings["teardown"],
        "migrate": timings["migrate"],
        "rebuild": timings["rebuild"],
        "request_to_first_step": first,
        "floor_downtime": inner.get("downtime", 0.0),
        "floor_freeze": inner.get("freeze", 0.0),
        "naive_cold_start": cold,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--forwarding-worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--out", type=Path, help=argparse.SUPPRESS)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--width", type=int, default=512)
    ap.add_argument("--skip-move", action="store_true", help="only the overhead (no root, no namespaces)")
    ap.add_argument(
        "--gpu",
        action="store_true",
        help="the overhead on the GPU (NCCL, one rank: a GPU takes one); no move (that needs several GPUs)",
    )
    ap.add_argument("--json-out", type=Path)
    a = ap.parse_args()
    if a.worker:
        worker(a)
        return
    if a.forwarding_worker:
        forwarding_worker(a.gpu)
        return
    sys.path.insert(0, str(ROOT / "bench"))
    import common

    with tempfile.TemporaryDirectory(prefix="bench-rewire-") as d:
        work = Path(d)
        cost = overhead(a, work)
        skip = a.skip_move or a.gpu
        moves = [] if skip else [move_once(Path(tempfile.mkdtemp(dir=work))) for _ in range(a.repeats)]
    print(
        f"per-step time, {cost['rounds']} interleaved rounds of {a.steps} steps "
        f"({cost['ranks']} ranks, {cost['backend']}, width {a.width}):"
    )
    print(f"  plain torchrun        {cost['plain_step_s'] * 1e3:8.3f} ms")
    print(
        f"  with the rank runtime {cost['runtime_step_s'] * 1e3:8.3f} ms   overhead {cost['overhead'] * 100:+.2f} %"
        "   (target < 1 %)"
    )
    print(
        f"  one 1-element all_reduce, {cost['ranks']} ranks: {cost['plain_collective_s'] * 1e6:.1f} us plain, "
        f"{cost['runtime_collective_s'] * 1e6:.1f} us delegating ({cost['added_per_collective_s'] * 1e6:+.1f} us)"
    )
    print(
        f"  the same in one process (world size 1): {cost['one_process_plain_collective_s'] * 1e6:.1f} us plain, "
        f"{cost['one_process_runtime_collective_s'] * 1e6:.1f} us delegating "
        f"({cost['one_process_added_per_collective_s'] * 1e6:+.1f} us)"
    )
    print(
        f"  {cost['collectives_per_step']:.1f} collectives a step: overhead from these parts "
        f"{cost['overhead_from_parts'] * 100:+.3f} %   (target < 1 %)"
    )
    med: dict[str, float] = {}
    if moves:
        med = {k: statistics.median(m[k] for m in moves) for k in moves[0]}
        print(f"\nmoving rank 1 of 3 to a spare node, median of {len(moves)} (seconds):")
        for k in ("boundary", "teardown", "migrate", "rebuild", "request_to_first_step"):
            print(f"  {k:<24} {med[k]:8.3f}")
        print(f"  {'floor: rank 1 alone, freeze to running copy':<24} {med['floor_downtime']:8.3f}")
        print(f"  {'naive: the whole job started again, to its first step':<24} {med['naive_cold_start']:8.3f}")
    common.emit(a, {"bench": "rewire", "overhead": cost, "move_median_s": med, "moves": moves})


if __name__ == "__main__":
    main()
