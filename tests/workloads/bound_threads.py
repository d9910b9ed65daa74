"""Test workload: threads bound to CPUs, as Slurm's --cpu-bind, taskset or a launcher's NUMA
binding leave them.

    python bound_threads.py LOG CPU

The main thread binds itself to CPU, a second thread binds itself to every CPU but CPU, a third
is left as it started.  Every 20 ms it writes ``tick N main A other B free C`` to LOG: each
thread's CPUs as it sees them itself (``sched_getaffinity(0)``), as bit masks.
"""

import os
import sys
import threading
import time

log = open(sys.argv[1], "a", buffering=1)  # noqa: SIM115 (kept open)
cpu = int(sys.argv[2])
seen: dict[str, int] = {}


def mask() -> int:
    return sum(1 << c for c in os.sched_getaffinity(0))


def run(name: str, cpus: set[int] | None) -> None:
    if cpus is not None:
        os.sched_setaffinity(0, cpus)
    while True:
        seen[name] = mask()
        time.sleep(0.01)


everything = os.sched_getaffinity(0)
for name, cpus in (("other", everything - {cpu}), ("free", None)):
    threading.Thread(target=run, args=(name, cpus), daemon=True).start()
os.sched_setaffinity(0, {cpu})
n = 0
while True:
    if len(seen) == 2:
        log.write(f"tick {n} main {mask()} other {seen['other']} free {seen['free']}\n")
        n += 1
    time.sleep(0.02)
