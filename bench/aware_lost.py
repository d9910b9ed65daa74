"""The unplanned-recovery part of ``bench/aware.py --lost``: a node of a running job killed
outright, and the job rebuilt from its replicas, its time split into its stages, at a few model
widths.

Four network-namespace nodes (tests/support/cluster.py) with agents and an orchestrator
(unreachable after 10 s); the job is tests/workloads/ddp_job.py --aware (3 DDP ranks as srun
starts them, gloo, CPU, its state registered), its MLP ``--width`` wide.  Node C (rank 2) is
SIGKILLed whole mid-run (``--lost-nodes``: or A, rank 0 and the job's store its stand-in serves;
or ``C/quiet``, its link cut first: its peers see no reset; ``C/silent``, the same found by its
silence alone); D is the spare.  Split:

* **detection**: from the kill to the orchestrator's decision (its ``recovering`` event): the
  survivors' failed collectives said and the node's agent asked; or (``/quiet``) the node silent
  for ``quiet_after`` and its host asked;
* the agent's stages (its ``recovered`` event): **store** (served anew, where it was lost),
  **rollback** (the survivors told to restart from
  their held boundary), **replacement** (the lost rank's command started on the spare, warmed up),
  **state** (the replica's held state handed over), **standing** (every rank warmed up at the
  boundary), **rebuild**, **resume**;
* **stood still**: detection plus the agent's total (the job made no step meanwhile).

Beside it, the naive route: without tpagent the survivors' collectives fail at once and the job
ends; its relaunch from a checkpoint costs at least a fresh start of every rank to its first step
(measured here, as this job starts: **restart**), plus loading the checkpoint, plus the work since
it (on average half the checkpoint interval; not counted).  The floor is the state's bytes handed
over (**state**) once the lost rank's process stands ready.  Must run as root.
"""

from __future__ import annotations

import re
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
STAGES = ("store", "rollback", "replacement", "state", "standing", "rebuild", "resume", "total")


def once(width: int, tmp: Path, lose: str) -> dict[str, float]:
    """One job of ``width`` started, node ``lose`` (A, B or C) killed, the job rebuilt and finished;
    ``C/quiet``: its link cut first, as a power loss leaves its peers hearing nothing (the
    orchestrator's defaults then: ``quiet_after`` 6 s, ``unreachable_after`` 30 s); ``C/silent``:
    the same with ``quiet_after`` 0 (found by its silence alone, as before it)."""
    lose, _, how = lose.partition("/")
    sys.path[:0] = [str(ROOT), str(ROOT / "tests")]
    import contextlib
    import json
    import signal

    import psutil

    from support.cluster import Cluster
    from support.helpers import wait_until
    from support.orchestrator import Orchestrator
    from support.rankjob import IFNAME, RUN, Job, steps

    c = Cluster(tmp, ["A", "B", "C", "D"], ifname=IFNAME)
    quiet = {"quiet": 6.0, "silent": 0.0}
    o = Orchestrator(c, tmp, lost_grace=2.0, **({"unreachable_after": 30.0, "quiet_after": quiet[how]} if how else {}))
    try:
        o.start()
        for node in c.nodes.values():
            node.start_agent(rewire_timeout="300", orchestrator=o.address, report_period="0.5")
        t0 = time.monotonic()
        job = Job(c, tmp, srun=True, extra=("--aware", "--width", str(width)))
        try:
            wait_until(lambda: steps(job.logs, 2) >= 1, "the job's first step", 300, 0.05)
            restart = time.monotonic() - t0
            job.at_step(2, 20)
            wait_until(lambda: all(o.rank_on(RUN, r) for r in range(3)), "the orchestrator to see every rank", 60)
            killed = time.time()
            if how:
                c.nodes[lose].link(up=False)
            for p in c.nodes[lose].processes_and_children():
                with contextlib.suppress(psutil.Error):
                    p.send_signal(signal.SIGKILL)
            try:
                assert job.runs["B" if lose != "B" else "A"].wait(timeout=900) == 0, job.output()
            except BaseException:  # (it failed, hung, or was cut short: what was said, to see why)
                _said(job.output(), o.cli("events").stdout, *(n.agent_log() for n in c.nodes.values()))
                raise
            events = [json.loads(line) for line in o.ok("events", "--json").splitlines()]
        finally:
            job.close()
    finally:
        o.close()
        c.close()
    deciding = next(e for e in events if e["kind"] == "recovering")
    done = next(e for e in events if e["kind"] == "recovered")
    stages = dict(re.findall(r"(\w+)=([0-9.]+)", done["text"]))
    out = {"detection": float(deciding["ts"]) - killed, **{k: float(stages[k]) for k in STAGES}}
    out["state_bytes"] = float(stages[f"rank{'ABC'.index(lose)}_state_bytes"])
    out["stood_still"] = out["detection"] + out["total"]
    out["restart"] = restart
    return out


def _said(*texts: str) -> None:
    for text in texts:
        print(text[-6000:], file=sys.stderr, flush=True)


def run(widths: list[int], repeats: int, nodes: list[str]) -> list[dict[str, Any]]:
    """Medians over ``repeats`` at each width, for each node killed; prints the table."""
    rows = []
    with tempfile.TemporaryDirectory(prefix="bench-aware-lost-") as d:
        for node in nodes:
            for width in widths:
                runs = [once(width, Path(tempfile.mkdtemp(dir=d)), node) for _ in range(repeats)]
                med = {k: round(statistics.median(r[k] for r in runs), 4) for k in runs[0]}
                rows.append({"node": node, "width": width, **med})
    print(
        f"\na node of 3 killed outright (A: rank 0 and the store), the job rebuilt on D; medians of {repeats} (s; MiB)"
    )
    heads = ("node", "width", "state", "detect", "store", "rollbk", "replace", "copy", "stand", "rebuild", "agent")
    print(" ".join(f"{h:>8}" for h in (*heads, "still", "restart")))
    for r in rows:
        cells = [r["detection"], r["store"], r["rollback"], r["replacement"], r["state"], r["standing"], r["rebuild"]]
        cells.append(r["total"])
        print(
            f"{r['node']:>8} {r['width']:>8} {r['state_bytes'] / 2**20:>8.2f} "
            + " ".join(f"{v:>8.3f}" for v in cells)
            + f" {r['stood_still']:>8.2f} {r['restart']:>8.2f}"
        )
    return rows
