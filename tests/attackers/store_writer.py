"""A user who reaches a job's store (a TCPStore: no authentication) and rewrites where a rank's agent is.

    python store_writer.py HOST PORT RANK ADDRESS

finds the prefix under which the job's ranks keep their agents' addresses (``tpagent/agent/R``,
as the process group's store nests it: torchrun's attempt, the default group, its backend's
device), prints ``was <what it said>``, sets rank RANK's to ADDRESS, and prints ``set <chain>``.
Exits 1 if no rank's address is found (the test then proves nothing).  Run unprivileged (the
tests run it as nobody).
"""

from __future__ import annotations

import datetime
import itertools
import sys
import time

import torch.distributed as dist


def main(host: str, port: int, rank: int, address: str) -> int:
    raw = dist.TCPStore(host, port, is_master=False, timeout=datetime.timedelta(seconds=10), use_libuv=False)
    key = f"tpagent/agent/{rank}"
    for _ in range(300):  # (the rank says where its agent is once it has connected to it)
        for outer, device in itertools.product(("", "/worker/attempt_0"), ("", "cpu/", "cuda/")):
            chain = [p for p in (outer, "default_pg", "0/", device) if p]
            store: dist.Store = raw
            for prefix in chain:
                store = dist.PrefixStore(prefix, store)
            if store.check([key]):
                print("was", store.get(key).decode(), flush=True)
                store.set(key, address)
                print("set", chain, flush=True)
                return 0
        time.sleep(0.1)
    print(f"no {key} found in the store", flush=True)
    return 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]))
