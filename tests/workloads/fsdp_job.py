"""A second training script for the rewire tests, shaped unlike ddp_job.py, nothing of tpagent
in it: FSDP2 (``fully_shard``: parameters sharded, gathered and reduce-scattered every step),
AdamW with a learning-rate schedule and gradient clipping (a norm all-reduced over the shards),
fed by a DataLoader with two worker processes (persistent: they move with the rank) over a
DistributedSampler that reshuffles every epoch; a metric gathered with all_gather_into_tensor.
Deterministic: every run gives the same losses and final parameters.

    fsdp_job.py --steps N --log-dir DIR [--step-time S]

As ddp_job.py: each rank appends "step K <its loss> <global loss> <all ranks' losses>" (floats
in hex) to DIR/rank{R}.log, "done <sha256 of the full parameters>" at the end, and prints
"rank R step K loss L".
"""

from __future__ import annotations

import argparse
import hashlib
import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import fully_shard
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--log-dir", type=Path, required=True)
    p.add_argument("--step-time", type=float, default=0.0)
    p.add_argument("--workers", default="fork", help="how its DataLoader starts its workers (fork, spawn, forkserver)")
    a = p.parse_args()
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    world = dist.get_world_size()
    g = torch.Generator().manual_seed(7)
    x = torch.randn(120 * world, 16, generator=g)
    data = TensorDataset(x, torch.sin(x.sum(dim=1, keepdim=True)))
    sampler = DistributedSampler(data, shuffle=True, seed=3)
    loader = DataLoader(
        data, batch_size=8, sampler=sampler, num_workers=2, persistent_workers=True, multiprocessing_context=a.workers
    )
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 48), nn.GELU(), nn.Linear(48, 48), nn.GELU(), nn.Linear(48, 1))
    for layer in (model[0], model[2], model[4]):
        fully_shard(layer)
    fully_shard(model)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.01)
    schedule = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=a.steps)
    log = a.log_dir / f"rank{rank}.log"
    step = 0
    epoch = 0
    while step < a.steps:
        sampler.set_epoch(epoch)
        for xb, yb in loader:
            loss = nn.functional.mse_loss(model(xb), yb)
            opt.zero_grad()
            loss.backward()
            nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            schedule.step()
            total = loss.detach().clone()
            dist.all_reduce(total)
            every = torch.empty(world)
            dist.all_gather_into_tensor(every, loss.detach().reshape(1))
            with open(log, "a") as f:
                f.write(
                    f"step {step} {loss.item().hex()} {total.item().hex()} "
                    f"{','.join(v.hex() for v in every.tolist())}\n"
                )
            print(f"rank {rank} step {step} loss {loss.item():.6f}", flush=True)
            step += 1
            if step == a.steps:
                break
            _pace(a)
        epoch += 1
    digest = hashlib.sha256()
    for name, value in sorted(model.state_dict().items()):  # (each a DTensor: gathered whole)
        digest.update(name.encode() + value.full_tensor().numpy().tobytes())
    with open(log, "a") as f:
        f.write(f"done {digest.hexdigest()}\n")
    dist.destroy_process_group()


def _pace(a: argparse.Namespace) -> None:
    """``--step-time`` between two steps, until DIR/hurry appears: the test is done moving ranks
    and waits only for the end (the sleep alone goes: the losses are the same)."""
    if not (a.log_dir / "hurry").exists():
        time.sleep(a.step_time)


if __name__ == "__main__":
    main()
    # What the job wrote is its result; past it, torch's gloo threads can abort the
    # interpreter's teardown now and then (SIGABRT, "terminate called without an active
    # exception", pytorch/pytorch#190489), which is not the job's doing.
    sys.stdout.flush()
    os._exit(0)
