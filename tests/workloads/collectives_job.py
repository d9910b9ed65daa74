"""An ordinary torch.distributed script (gloo, CPU) that calls every kind of collective torch
offers a script, plain and coalesced, object collectives, point-to-point, a subgroup, and an
FSDP2 (``fully_shard``) training loop, then prints what each gave as one JSON line.  Nothing of
tpagent in it: run with and without the rank runtime, the lines must be the same.

    collectives_job.py STORE_FILE RANK WORLD_SIZE   (WORLD_SIZE >= 3)
"""

from __future__ import annotations

import json
import os
import sys
import warnings

import torch
import torch.distributed as dist


def main() -> None:
    warnings.simplefilter("ignore", FutureWarning)  # (torch renames some of these calls)
    store_file = sys.argv[1]
    r = int(sys.argv[2])
    w = int(sys.argv[3])
    dist.init_process_group("gloo", store=dist.FileStore(store_file, w), rank=r, world_size=w)
    out: dict[str, object] = {"backend": dist.get_backend()}
    f = float(r)
    pair = dist.new_group([0, 2])

    t = torch.arange(4, dtype=torch.float32) + r
    dist.all_reduce(t)
    out["all_reduce"] = t.tolist()
    dist.all_reduce(torch.ones(3) * r, async_op=True).wait()
    objs: list[object] = [None] * w
    dist.all_gather_object(objs, {"r": r})
    out["all_gather_object"] = objs
    sent: list[object] = [r * 10]
    dist.broadcast_object_list(sent, src=1)
    out["broadcast_object_list"] = sent
    dist.barrier()
    dist.monitored_barrier()
    flat = torch.empty(w * 2)
    dist.all_gather_into_tensor(flat, torch.tensor([f, f + 0.5]))
    out["all_gather_into_tensor"] = flat.tolist()
    parts = [torch.empty(1) for _ in range(w)]
    dist.all_gather(parts, torch.tensor([f]))
    out["all_gather"] = [x.item() for x in parts]
    if r in (0, 2):
        x = torch.tensor([f])
        dist.all_reduce(x, group=pair)
        out["subgroup"] = [x.item(), dist.get_backend(pair)]
    if r == 0:
        dist.send(torch.tensor([42.0]), 1)
    elif r == 1:
        y = torch.empty(1)
        dist.recv(y, 0)
        out["recv"] = y.item()
    s = torch.tensor([f])
    dist.reduce(s, dst=0)
    out["reduce"] = s.item()
    one = torch.empty(1)
    dist.scatter(one, [torch.tensor([float(i)]) for i in range(w)] if r == 0 else None, src=0)
    out["scatter"] = one.item()
    got = [torch.empty(1) for _ in range(w)] if r == 0 else None
    dist.gather(torch.tensor([f]), got, dst=0)
    out["gather"] = [x.item() for x in got] if got else None
    a2a = [torch.empty(1) for _ in range(w)]
    dist.all_to_all(a2a, [torch.tensor([float(r * 10 + i)]) for i in range(w)])
    out["all_to_all"] = [x.item() for x in a2a]
    single = torch.empty(w)
    dist.all_to_all_single(single, torch.arange(w, dtype=torch.float32) + 10 * r)
    out["all_to_all_single"] = single.tolist()
    rs = torch.empty(1)
    dist.reduce_scatter(rs, [torch.tensor([float(r + i)]) for i in range(w)])
    out["reduce_scatter"] = rs.item()
    rst = torch.empty(2)
    dist.reduce_scatter_tensor(rst, torch.arange(2 * w, dtype=torch.float32) * 0.1 + r)
    out["reduce_scatter_tensor"] = rst.tolist()

    outs = [torch.empty(2 * w), torch.empty(w)]
    with dist._coalescing_manager(async_ops=True) as cm:  # (as FSDP's all-gathers are)
        for o, i in zip(outs, [torch.tensor([f, 1.0]), torch.tensor([f * 2])], strict=True):
            dist.all_gather_into_tensor(o, i)
    cm.wait()
    out["coalesced_all_gather"] = [o.tolist() for o in outs]
    outs = [torch.empty(1), torch.empty(2)]
    ins = [torch.arange(w, dtype=torch.float32) * (r + 1), torch.arange(2 * w, dtype=torch.float32) + r]
    with dist._coalescing_manager(async_ops=True) as cm:
        for o, i in zip(outs, ins, strict=True):
            dist.reduce_scatter_tensor(o, i)
    cm.wait()
    out["coalesced_reduce_scatter"] = [o.tolist() for o in outs]

    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
    fully_shard(model[0])
    fully_shard(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    data = torch.Generator().manual_seed(r)
    losses = []
    for _ in range(5):
        loss = (model(torch.randn(4, 8, generator=data)) ** 2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item().hex())
    out["fsdp_losses"] = losses
    dist.destroy_process_group()
    print(json.dumps(out, sort_keys=True), flush=True)


if __name__ == "__main__":
    main()
    # What the job wrote is its result; past it, torch's gloo threads can abort the
    # interpreter's teardown now and then (SIGABRT, "terminate called without an active
    # exception", pytorch/pytorch#190489), which is not the job's doing.
    sys.stdout.flush()
    os._exit(0)
