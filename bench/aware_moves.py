"""The moves part of ``bench/aware.py --agents``: a rank of a running job moved between agents as
its training state (model-aware) and as its process image (transparent), at a few model widths.

Four network-namespace nodes (tests/support/cluster.py), each running `tpagent serve`; the job is
tests/workloads/ddp_job.py --aware (3 DDP ranks under torchrun and `tpagent rank`, gloo, CPU, its
state registered), its MLP ``--width`` wide.  Rank 1 moves to the spare D in aware mode, then back
in transparent mode.  For each: the time the job stood still (every rank parked at the boundary
until all resumed: the agent's total less its boundary), the bytes moved (the state handed over;
the images sent), and for the aware move the joiner's warm-up (while the job trains on) and the
hand-over.  Must run as root.
"""

from __future__ import annotations

import json
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent


def _move(job: Any, to: str, mode: str) -> dict[str, Any]:
    from support.rankjob import RUN

    done = job.c.migrate(0, job.where(1), to, "--job", RUN, "--rank", "1", "--mode", mode, "--json", timeout=900)
    doc: dict[str, Any] = json.loads(done.stdout)
    assert done.returncode == 0 and doc["state"] == "done", done.stdout + done.stderr
    return dict(doc["timings"])


def once(width: int, tmp: Path) -> dict[str, float]:
    """Both moves of rank 1 of one job of ``width``."""
    sys.path[:0] = [str(ROOT), str(ROOT / "tests")]
    from support.cluster import Cluster
    from support.rankjob import IFNAME, Job, steps

    c = Cluster(tmp, ["A", "B", "C", "D"], ifname=IFNAME)
    try:
        for node in c.nodes.values():
            node.start_agent(rewire_timeout="300")
        job = Job(c, tmp, extra=("--aware", "--width", str(width)))
        try:
            job.at_step(1, 10)
            aware = _move(job, "D", "aware")
            job.at_step(1, steps(job.logs, 1) + 5)
            image = _move(job, "B", "transparent")
        finally:
            job.close()
    finally:
        c.close()
    return {
        "aware_stood_still_s": aware["total"] - aware["boundary"],
        "aware_handover_s": aware["handover"],
        "aware_warmup_s": aware["warmup"],
        "aware_bytes": aware["rank1_state_bytes"],
        "transparent_stood_still_s": image["total"] - image["boundary"],
        "transparent_bytes": sum(v for k, v in image.items() if k.endswith("_sent_bytes")),
        "transparent_image_bytes": sum(v for k, v in image.items() if k.endswith("_image_bytes")),
    }


def run(widths: list[int], repeats: int) -> list[dict[str, Any]]:
    """Medians over ``repeats`` at each width; prints the table."""
    rows = []
    with tempfile.TemporaryDirectory(prefix="bench-aware-moves-") as d:
        for width in widths:
            runs = [once(width, Path(tempfile.mkdtemp(dir=d))) for _ in range(repeats)]
            med = {k: round(statistics.median(r[k] for r in runs), 4) for k in runs[0]}
            ratio = med["transparent_stood_still_s"] / med["aware_stood_still_s"] if med["aware_stood_still_s"] else 0.0
            rows.append({"width": width, **med, "transparent_over_aware": round(ratio, 2)})
    print(f"\nrank 1 of 3 moved between agents, aware then transparent, medians of {repeats} (seconds; MiB)")
    print(
        f"{'width':>8} {'state':>8} {'sent':>8} {'image':>8} {'warmup':>7} {'hand':>7} {'aware':>7} {'transp':>7} ratio"
    )
    for r in rows:
        print(
            f"{r['width']:>8} {r['aware_bytes'] / 2**20:>8.2f} {r['transparent_bytes'] / 2**20:>8.1f} "
            f"{r['transparent_image_bytes'] / 2**20:>8.1f} {r['aware_warmup_s']:>7.2f} {r['aware_handover_s']:>7.3f} "
            f"{r['aware_stood_still_s']:>7.3f} {r['transparent_stood_still_s']:>7.3f} {r['transparent_over_aware']:>5}"
        )
    return rows
