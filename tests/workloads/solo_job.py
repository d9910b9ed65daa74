"""A joiner's warm-up alone (tpagent_rank.solo): rank RANK of WORLD with no peer running, its
collectives answered locally.  Writes what each returned to OUT (its standard output goes nowhere
while it warms up: it prints there too, to show it).

    solo_job.py STORE_FILE RANK WORLD OUT
"""

from __future__ import annotations

import datetime
import json
import os
import sys

import torch
import torch.distributed as dist
from torch.distributed.distributed_c10d import _set_pg_timeout


def main() -> None:
    store, rank, world, out_file = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
    dist.init_process_group("gloo", store=dist.FileStore(store, world), rank=rank, world_size=world)
    out: dict[str, object] = {"environment": "TPAGENT_RANK_JOIN" in os.environ}
    t = torch.full((3,), float(rank + 1))
    dist.all_reduce(t)
    out["all_reduce"] = t.tolist()
    slots = [torch.zeros(3) for _ in range(world)]
    dist.all_gather(slots, torch.full((3,), 5.0))
    out["all_gather"] = [s.tolist() for s in slots]
    big = torch.zeros(world * 2)
    dist.all_gather_into_tensor(big, torch.tensor([1.0, 2.0]))
    out["all_gather_into_tensor"] = big.tolist()
    mine = torch.zeros(2)
    dist.reduce_scatter_tensor(mine, torch.arange(world * 2, dtype=torch.float32))
    out["reduce_scatter_tensor"] = mine.tolist()
    uneven = torch.full((world + 1,), -7.0)
    dist.all_to_all_single(uneven, torch.arange(world, dtype=torch.float32), [2] + [1] * (world - 1), [1] * world)
    out["all_to_all_single_uneven"] = uneven.tolist()
    group = dist.new_group(list(range(world)))
    dist.barrier(group=group)
    _set_pg_timeout(datetime.timedelta(seconds=100), group)
    out["new_group"] = dist.get_world_size(group)
    print("printed while warming up", flush=True)
    with open(out_file, "w") as f:
        json.dump(out, f)


if __name__ == "__main__":
    main()
