"""An ordinary torch.distributed DDP training script (gloo, CPU), nothing of tpagent in it:
the workload of the rewire tests.  Deterministic: fixed seeds, data drawn per rank from its
own generator, so every rank's losses and the final parameters are the same on every run.

    ddp_job.py --steps N --log-dir DIR [--step-time S] [--width W] [--no-optimizer]
               [--cuda [--backend nccl] [--device-id]] [--gpu-rank R]
               [--aware | --aware-alone] [--replicas GROUPS] [--own-groups BACKEND] [--die-at K]
               [--die-in-forward K]
               [--hsdp] [--batchnorm]

With ``--no-optimizer`` it updates its parameters by hand (no torch.optim: the rank runtime
never sees an optimizer step, so a rewire stops it between two collectives).  With ``--cuda``
the model and data are on the GPU (deterministic algorithms), its group's backend ``--backend``;
with ``--device-id`` too, the default group is bound to the GPU (NCCL connects at once) and the
subgroup is split from it (``split_group``), as a DeviceMesh makes its groups then.
With ``--gpu-rank R`` rank R also keeps a sum on the GPU, all-reduced each step over an NCCL
group of its own (one GPU: NCCL takes no two ranks on one), beside the CPU job.

With ``--aware`` it registers its training state with tpagent_rank (model-aware mode: a model,
an optimizer and its step, what its replicas share; each step's batch is drawn from the step and
the rank), loops on the registered step, and all-reduces its metrics and writes its log line
before ``opt.step()``: what runs after the optimizer step runs, in a model-aware move, in the rank
that leaves and (quietly, on its own values) in the process taking its place, so it issues no
collective; and it writes its log only while
``tpagent_rank.joining()`` is false (a print is silenced there by the runtime).  With
``--aware-alone`` each rank registers itself as its only replica (as plain FSDP shards would);
with ``--replicas GROUPS`` (``0;1,2``: groups of ranks, ``;`` between them) each rank registers
its group as its replicas (as HSDP's replica groups would: fewer than DDP's, the same training).
With ``--own-groups BACKEND`` (and ``--aware``) every rank also keeps an average of its
parameters (float64, on the GPU where BACKEND is nccl), updated each step before the optimizer
step into a new tensor and all-reduced over a group of its own on BACKEND (world size 1: one GPU
takes no two ranks of one NCCL communicator, but a communicator each), registered with its
training state, its sum written on each line ("... avg <hex>").
With ``--die-at K`` (and ``--aware``), rank 0 SIGKILLs itself once, in step K, after the job-wide
all-reduce and once rank 2 has written its line of step K: rank 2, in no collective with rank 0
from there on, finishes step K, while rank 1 is caught in the subgroup's all-reduce.
With ``--die-in-forward K`` (and ``--aware``), the last rank SIGKILLs itself once, in step K, right
after its forward pass: the others, their forward passes of step K done, are caught in its
gradients' all-reduce.
With ``--hsdp`` (an even number of ranks) the model is FSDP2's on a (world / 2, 2) DeviceMesh
(replicate x shard) instead of DDP: each rank holds half of every parameter, its optimizer state
too, replicated on the ranks of the same shard (rank r's replicas hold shard r % 2: with
``--aware`` the runtime derives them from the mesh).

With ``--batchnorm`` the model has a BatchNorm1d after its first layer: buffers (its running
statistics and count) that each forward pass updates in place, not the optimizer step.

Each rank appends "step K <its loss> <global loss> <subgroup loss>" (floats in hex: exact) to
DIR/rank{R}.log, one open per line, and "done <sha256 of the parameters and buffers>" at the end; and
prints "rank R step K loss L" to stdout, as training scripts do.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import signal
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.distributed_c10d import split_group
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.nn.utils import parameters_to_vector


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--log-dir", type=Path, required=True)
    p.add_argument("--step-time", type=float, default=0.0)
    p.add_argument("--width", type=int, default=64)
    p.add_argument("--no-optimizer", action="store_true")
    p.add_argument("--cuda", action="store_true")
    p.add_argument("--backend", default="gloo")
    p.add_argument("--device-id", action="store_true")
    p.add_argument("--gpu-rank", type=int, default=-1)
    p.add_argument("--aware", action="store_true")
    p.add_argument("--aware-alone", action="store_true")
    p.add_argument("--die-at", type=int, default=-1)
    p.add_argument("--die-in-forward", type=int, default=-1)
    p.add_argument("--own-groups", default="")
    p.add_argument("--replicas", default="")
    p.add_argument("--hsdp", action="store_true")
    p.add_argument("--batchnorm", action="store_true")
    a = p.parse_args()
    # (tests/support/rankjob.py's variable of bytes that are no UTF-8: a process of this rank started
    # again from how another ran, on another node, has it as it was)
    if os.environb.get(b"TPAGENT_TEST_LATIN1", b"caf\xe9") != b"caf\xe9":
        sys.exit(f"TPAGENT_TEST_LATIN1 is {os.environb[b'TPAGENT_TEST_LATIN1']!r}, not b'caf\\xe9'")
    dev = torch.device("cuda", 0) if a.cuda else torch.device("cpu")
    if a.cuda:
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # (cuBLAS's deterministic mode)
        torch.use_deterministic_algorithms(True)
    dist.init_process_group(a.backend, device_id=dev if a.device_id else None)
    rank = dist.get_rank()
    world = dist.get_world_size()
    two = list(range(min(2, world)))
    pair = split_group(split_ranks=[two]) if a.device_id else dist.new_group(two)  # a subgroup: rebuilt too
    alone = dist.new_group([a.gpu_rank], backend="nccl") if a.gpu_rank >= 0 else None
    own = [dist.new_group([r], backend=a.own_groups) for r in range(world)][rank] if a.own_groups else None
    gpu_sum = torch.zeros(1, dtype=torch.float64, device="cuda") if rank == a.gpu_rank else None
    torch.manual_seed(0)
    if a.batchnorm:  # (its statistics summed by one thread: the same sums however many ranks a node runs)
        torch.set_num_threads(1)
    norm = [nn.BatchNorm1d(a.width)] if a.batchnorm else []  # (buffers its forward pass updates in place)
    net = nn.Sequential(nn.Linear(16, a.width), *norm, nn.Tanh(), nn.Linear(a.width, 1)).to(dev)
    if a.hsdp:
        mesh = init_device_mesh(dev.type, (world // 2, 2), mesh_dim_names=("replicate", "shard"))
        model: nn.Module = fully_shard(net, mesh=mesh)
    else:
        model = DDP(net)
    opt = None if a.no_optimizer else torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    data = torch.Generator().manual_seed(1000 + rank)
    log = a.log_dir / f"rank{rank}.log"
    if a.aware or a.aware_alone:
        assert opt is not None and gpu_sum is None, "--aware trains with an optimizer, on the CPU"
        _aware(a, model, opt, data, log, pair, own)
        return
    for step in range(a.steps):
        x = torch.randn(32, 16, generator=data).to(dev)
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
        gpu = ""
        if gpu_sum is not None:
            gpu_sum += loss.detach().double().to(gpu_sum.device)
            dist.all_reduce(gpu_sum, group=alone)
            gpu = f" gpu {gpu_sum.item().hex()}"
        with open(log, "a") as f:
            f.write(f"step {step} {loss.item().hex()} {(total.item() / world).hex()} {sub.item().hex()}{gpu}\n")
        print(f"rank {rank} step {step} loss {loss.item():.6f}", flush=True)
        _pace(a)
    _done(model, log)


def _done(model: nn.Module, log: Path) -> None:
    tensors = list(model.parameters()) + list(model.buffers())  # (BatchNorm's running statistics too)
    whole = [t.full_tensor() if isinstance(t, DTensor) else t for t in tensors]  # (sharded: gathered)
    digest = hashlib.sha256(b"".join(t.detach().cpu().numpy().tobytes() for t in whole)).hexdigest()
    with open(log, "a") as f:
        f.write(f"done {digest}\n")
    dist.destroy_process_group()


def _aware(
    a: argparse.Namespace,
    model: nn.Module,
    opt: torch.optim.Optimizer,
    data: torch.Generator,
    log: Path,
    pair: dist.ProcessGroup,
    own: dist.ProcessGroup | None,
) -> None:
    """The same training, its state registered (``--aware``)."""
    import tpagent_rank

    rank, world = dist.get_rank(), dist.get_world_size()
    state = {"step": 0}
    where = torch.device("cuda", 0) if a.own_groups == "nccl" else torch.device("cpu")
    # (a new tensor each step: the one held at the last boundary is never changed mid-step)
    avg = {"average": parameters_to_vector(model.parameters()).detach().double().to(where)} if own else {}

    # What its replicas share: a replica's state may rebuild this rank (unplanned recovery), so
    # the rank's own data position is not in it: each step's batch is drawn from (step, rank).
    def save() -> dict[str, object]:
        return {"model": model.state_dict(), "opt": opt.state_dict(), "step": state["step"], **avg}

    def load(saved: dict[str, object]) -> None:
        model.load_state_dict(saved["model"])  # type: ignore[arg-type]
        opt.load_state_dict(saved["opt"])  # type: ignore[arg-type]
        state["step"] = int(saved["step"])  # type: ignore[call-overload]
        if own is not None:
            avg["average"] = saved["average"]  # type: ignore[assignment]

    groups = [[int(r) for r in g.split(",")] for g in a.replicas.split(";")] if a.replicas else []
    replicas = [rank] if a.aware_alone else next((g for g in groups if rank in g), None)
    tpagent_rank.register(save=save, load=load, replicas=replicas)
    while state["step"] < a.steps:
        step = state["step"]
        data.manual_seed(1000 * (1000 + step) + rank)
        x = torch.randn(32, 16, generator=data)
        y = torch.sin(x.sum(dim=1, keepdim=True))
        model.zero_grad()
        loss = ((model(x) - y) ** 2).mean()
        if rank == world - 1 and step == a.die_in_forward and not tpagent_rank.joining():
            _die_once(a.log_dir, step, wait=False)
        loss.backward()
        total = loss.detach().clone()
        dist.all_reduce(total)
        sub = loss.detach().clone()
        if rank == 0 and step == a.die_at and not tpagent_rank.joining():
            _die_once(a.log_dir, step)
        if rank in (0, 1):
            dist.all_reduce(sub, group=pair)
        said = ""
        if own is not None:
            new = 0.9 * avg["average"] + 0.1 * parameters_to_vector(model.parameters()).detach().double().to(where)
            dist.all_reduce(new, group=own)
            avg["average"] = new
            said = f" avg {new.sum().item().hex()}"
        if not tpagent_rank.joining():  # (a process warming up to take a rank's place writes nothing)
            with open(log, "a") as f:
                f.write(f"step {step} {loss.item().hex()} {(total.item() / world).hex()} {sub.item().hex()}{said}\n")
        opt.step()  # (the step boundary: what follows runs on the registered state alone)
        state["step"] += 1
        print(f"rank {rank} step {step} loss {loss.item():.6f}", flush=True)
        _pace(a)
    _done(model, log)


def _die_once(log_dir: Path, step: int, wait: bool = True) -> None:
    """(``--die-at``, ``--die-in-forward``: ``wait`` False.)  SIGKILLed, unless it was once: the rank
    rebuilt goes on."""
    marker = log_dir / "died"
    if marker.exists():
        return
    marker.touch()
    theirs = log_dir / "rank2.log"
    deadline = time.monotonic() + 60
    while (
        wait and f"step {step} " not in (theirs.read_text() if theirs.exists() else "") and time.monotonic() < deadline
    ):
        time.sleep(0.01)
    os.kill(os.getpid(), signal.SIGKILL)


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
