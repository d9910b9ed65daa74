"""A third training script for the rewire tests, nothing of tpagent in it: a 2-D DeviceMesh
(``init_device_mesh``, which here also makes the default group: the script never calls
init_process_group) and HSDP on it (``fully_shard`` over the mesh: parameters sharded along one
dimension, replicated along the other), Adam, and a metric all-reduced over each dimension's
group.  Four ranks (the mesh is 2 x 2).  Deterministic: every run gives the same losses and
final parameters.

    mesh_job.py --steps N --log-dir DIR [--step-time S]

As ddp_job.py: each rank appends "step K <its loss> <over replicas> <over shards> <global>"
(floats in hex) to DIR/rank{R}.log, "done <sha256 of the full parameters>" at the end, and prints
"rank R step K loss L"; first it prints which kind of process group each dimension has.
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
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--log-dir", type=Path, required=True)
    p.add_argument("--step-time", type=float, default=0.0)
    a = p.parse_args()
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    rank = dist.get_rank()
    world = dist.get_world_size()
    replicas = mesh.get_group("replicate")
    shards = mesh.get_group("shard")
    kinds = [type(g).__name__ for g in (dist.group.WORLD, replicas, shards)]
    print(f"rank {rank} groups {' '.join(kinds)}", flush=True)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(12, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 1))
    for layer in (model[0], model[2], model[4]):
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.Adam(model.parameters(), lr=2e-3)
    data = torch.Generator().manual_seed(500 + rank)
    log = a.log_dir / f"rank{rank}.log"
    for step in range(a.steps):
        x = torch.randn(16, 12, generator=data)
        loss = nn.functional.mse_loss(model(x), torch.cos(x[:, :1] * x[:, 1:2]))
        opt.zero_grad()
        loss.backward()
        opt.step()
        sums = []
        for group in (replicas, shards, None):
            t = loss.detach().clone()
            dist.all_reduce(t, group=group)
            sums.append(t.item().hex())
        with open(log, "a") as f:
            f.write(f"step {step} {loss.item().hex()} {' '.join(sums)}\n")
        print(f"rank {rank} step {step} loss {loss.item():.6f}", flush=True)
        _pace(a)
    digest = hashlib.sha256()
    for name, value in sorted(model.state_dict().items()):  # (each a DTensor: gathered whole)
        digest.update(name.encode() + value.full_tensor().numpy().tobytes())
    with open(log, "a") as f:
        f.write(f"done {digest.hexdigest()} of {world}\n")
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
