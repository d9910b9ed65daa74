"""An ordinary torch.distributed DDP training script (gloo, CPU), nothing of tpagent in it:
the workload of the rewire tests.  Deterministic: fixed seeds, data drawn per rank from its
own generator, so every rank's losses and the final parameters are the same on every run.

    ddp_job.py --steps N --log-dir DIR [--step-time S] [--width W] [--no-optimizer]

With ``--no-optimizer`` it updates its parameters by hand (no torch.optim: the rank runtime
never sees an optimizer step, so a rewire stops it between two collectives).

Each rank appends "step K <its loss> <global loss> <subgroup loss>" (floats in hex: exact) to
DIR/rank{R}.log, one open per line, and "done <sha256 of the parameters>" at the end; and
prints "rank R step K loss L" to stdout, as training scripts do.
"""

from __future__ import annotations

import argparse
import hashlib
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--log-dir", type=Path, required=True)
    p.add_argument("--step-time", type=float, default=0.0)
    p.add_argument("--width", type=int, default=64)
    p.add_argument("--no-optimizer", action="store_true")
    a = p.parse_args()
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    pair = dist.new_group([0, 1])  # a subgroup: rebuilt too
    torch.manual_seed(0)
    model = DDP(nn.Sequential(nn.Linear(16, a.width), nn.Tanh(), nn.Linear(a.width, 1)))
    opt = None if a.no_optimizer else torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    data = torch.Generator().manual_seed(1000 + rank)
    log = a.log_dir / f"rank{rank}.log"
    for step in range(a.steps):
        x = torch.randn(32, 16, generator=data)
        y = torch.sin(x.sum(dim=1, keepdim=True))
        model.zero_grad()
        loss = ((model(x) - y) ** 2).mean()
        loss.backward()
        if opt is not None:
            opt.step()
        else:
            with torch.no_grad():
                for param in model.parameters():
                    param -= 0.05 * param.grad
        total = loss.detach().clone()
        dist.all_reduce(total)
        sub = loss.detach().clone()
        if rank in (0, 1):
            dist.all_reduce(sub, group=pair)
        with open(log, "a") as f:
            f.write(f"step {step} {loss.item().hex()} {(total.item() / world).hex()} {sub.item().hex()}\n")
        print(f"rank {rank} step {step} loss {loss.item():.6f}", flush=True)
        time.sleep(a.step_time)
    digest = hashlib.sha256(b"".join(t.detach().numpy().tobytes() for t in model.parameters())).hexdigest()
    with open(log, "a") as f:
        f.write(f"done {digest}\n")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
