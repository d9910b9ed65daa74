"""A data-parallel training script that registers its training state with tpagent_rank (the few
lines of model-aware mode), gloo on CPU, a FileStore: no launcher needed.

    aware_job.py STORE_FILE RANK WORLD MODE STEPS STATE_DIR

MODE:
  ddp        DDP over the world; runs to STEPS; prints each step's loss (hex) and the replicas
  steps      as ddp, and prints a line per step as it goes ("step N LOSS"), a few each second
  save       as ddp, then writes its registered state to STATE_DIR/state-RANK (write_state)
  resume-N   a fresh process of the same script: loads STATE_DIR/state-N (rank N's state, a
             replica's for another rank), then trains on to STEPS
  hsdp       FSDP2 on a 2x2 mesh (replicate, shard): prints the replicas derived
  sharded-ddp, sharded-save, sharded-resume-N
             ddp, save and resume-N of the same training with FSDP2 on that mesh (HSDP: each
             rank holds a shard, replicated on the other half; its state holds DTensors)
  hsdp-mesh  the same, the replicas given as (mesh, "replicate")
  fsdp       FSDP2 on a 1-D mesh (shards only): prints that no replicas are known

AWARE_WARMUP in the environment: the warm-up it registers (a joiner's steps on its own).
AWARE_DEFAULTDICT: its state also holds a defaultdict (not what torch's safe loader reads).
AWARE_WRITE=K:N: after step K it writes N lines to STATE_DIR/written-RANK, one each 50 ms
(where that file is not there yet).

Each step's batch is drawn from a generator seeded by (step, rank): a step redone anywhere
draws the same batch.  The loop runs on the registered step, so a loaded state resumes it.
"""

from __future__ import annotations

import collections
import json
import os
import sys
import time
from pathlib import Path

import numpy
import torch
import torch.distributed as dist

import tpagent_rank
from tpagent_rank import aware


def batch(step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * step + rank)
    x = torch.randn(16, 8, generator=g)
    return x, x.sum(dim=1, keepdim=True) * 0.5


def write_slowly(path: Path, lines: int) -> None:
    """A file of the script's own, written a line each 50 ms (as a checkpoint is, after a step)."""
    with open(path, "w") as f:
        for i in range(lines):
            f.write(f"line {i}\n")
            f.flush()
            time.sleep(0.05)


def main() -> None:
    store_file, r, w, mode, steps, state_dir = sys.argv[1:7]
    rank, world, last = int(r), int(w), int(steps)
    dist.init_process_group("gloo", store=dist.FileStore(store_file, world), rank=rank, world_size=world)
    torch.manual_seed(7 if "resume" in mode else 0)  # (a fresh process starts elsewhere)
    net = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
    sharded = mode.startswith("sharded")
    if sharded:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        fully_shard(net, mesh=init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard")))
        mode = mode.removeprefix("sharded-")
    if mode.startswith(("hsdp", "fsdp")):
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        shape, names = ((2, 2), ("replicate", "shard")) if mode.startswith("hsdp") else ((world,), ("shard",))
        mesh = init_device_mesh("cpu", shape, mesh_dim_names=names)
        fully_shard(net, mesh=mesh)
        tpagent_rank.register(save=dict, load=print, replicas=(mesh, "replicate") if mode == "hsdp-mesh" else None)
        print(json.dumps({"replicas": aware.replica_ranks(), "why": aware.why_no_replicas()}), flush=True)
        dist.destroy_process_group()
        return
    model = net if sharded else torch.nn.parallel.DistributedDataParallel(net)
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    state = {"step": 0}

    def load(saved: dict[str, object]) -> None:
        model.load_state_dict(saved["model"])  # type: ignore[arg-type]
        opt.load_state_dict(saved["opt"])  # type: ignore[arg-type]
        state["step"] = int(saved["step"])  # type: ignore[call-overload]
        numpy.random.set_state(saved["numpy"])  # type: ignore[arg-type]

    unreadable = {"seen": collections.defaultdict(int)} if os.environ.get("AWARE_DEFAULTDICT") else {}
    tpagent_rank.register(  # (numpy's RNG state too, as scripts keep it: numpy arrays in a tuple)
        save=lambda: {
            "model": model.state_dict(),
            "opt": opt.state_dict(),
            "step": state["step"],
            "numpy": numpy.random.get_state(),
            **unreadable,
        },
        load=load,
        warmup=int(os.environ.get("AWARE_WARMUP", aware.WARMUP)),
    )
    if mode.startswith("resume-"):
        with open(Path(state_dir) / f"state-{mode.split('-')[1]}", "rb") as f:
            aware.read_state(f)
    losses = {}
    while state["step"] < last:
        x, y = batch(state["step"], rank)
        loss = (model(x) - y).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        state["step"] += 1
        losses[state["step"]] = loss.item().hex()
        if mode == "steps":
            print("step", state["step"], losses[state["step"]], flush=True)
            time.sleep(0.05)
        after, _, lines = os.environ.get("AWARE_WRITE", "-1:0").partition(":")
        if state["step"] == int(after) and not (Path(state_dir) / f"written-{rank}").exists():
            write_slowly(Path(state_dir) / f"written-{rank}", int(lines))  # (once: not again in a warm-up)
    out: dict[str, object] = {"losses": losses, "replicas": aware.replica_ranks()}
    whole = [p.full_tensor() if sharded else p for p in model.parameters()]  # type: ignore[operator]
    out["params"] = [p.detach().flatten().tolist() for p in whole]
    if mode == "save":
        with open(Path(state_dir) / f"state-{rank}", "wb") as f:
            out["bytes"] = aware.write_state(f)
    print(json.dumps(out), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
