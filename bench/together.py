"""Benchmark: N ranks of one node moved together, beside one rank moved alone, in the same job.

    python bench/together.py [--ranks 2,4] [--repeats 3] [--json-out F]

For each N: a torchrun job (tests/workloads/ddp_job.py under `tpagent rank`, gloo) of N ranks on
node A and N on node B, spares C and D, every node a network namespace with its agent.  Rounds
alternate the two routes:
  * one:      rank N (B's first) moves to C alone, then back to B (two moves of one rank);
  * together: ranks N..2N-1 (all of B's) move to D in one command, then back to B.
A move's downtime is the job's, as its agent times the rewire: from every rank parked at the
boundary until every rank runs again (teardown + migrate + rebuild); the boundary (waiting for
the ranks to reach the step) is given beside it.  Medians over --repeats rounds (each round: two
moves per route); the ratio is together's downtime over one's (target: at most 1.5).  Must run
as root.  Prints a table, then one JSON object.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]

from support.cluster import Cluster  # noqa: E402
from support.rankjob import IFNAME, RUN, Job, steps  # noqa: E402


def move(c: Cluster, job: Job, ranks: list[int], src: str, dst: str) -> dict[str, float]:
    """One rewire moving ``ranks`` from ``src`` to ``dst``: its stages and the job's downtime."""
    for r in ranks:  # (a few steps since the last move: the job runs)
        job.at_step(r, steps(job.logs, r) + 5)
    picked = [arg for r in ranks for arg in ("--rank", str(r))]
    done = c.migrate(0, src, dst, "--job", RUN, *picked, "--json", timeout=600)
    doc = json.loads(done.stdout) if done.stdout.startswith("{") else {}
    if done.returncode != 0 or doc.get("state") != "done":
        raise RuntimeError(f"moving ranks {ranks} from {src} to {dst} failed: {done.stdout}{done.stderr}")
    t = doc["timings"]
    return {
        "boundary": t["boundary"],
        "teardown": t["teardown"],
        "migrate": t["migrate"],
        "rebuild": t["rebuild"],
        "downtime": t["teardown"] + t["migrate"] + t["rebuild"],
    }


def measure(n: int, repeats: int, tmp: Path) -> dict[str, object]:
    c = Cluster(tmp, ["A", "B", "C", "D"], ifname=IFNAME)
    one: list[dict[str, float]] = []
    together: list[dict[str, float]] = []
    try:
        for node in c.nodes.values():
            node.start_agent(rewire_timeout="120")
        job = Job(c, tmp, names="AB", per_node=n, extra=("--steps", "1000000"))
        try:
            job.at_step(2 * n - 1, 10)
            mine = list(range(n, 2 * n))
            for i in range(repeats):
                routes = [("one", [n], "C"), ("together", mine, "D")]
                for name, ranks, spare in routes if i % 2 == 0 else routes[::-1]:
                    into = one if name == "one" else together
                    into.append(move(c, job, ranks, "B", spare))
                    into.append(move(c, job, ranks, spare, "B"))
        finally:
            job.close()
    finally:
        c.close()
    med_one = {k: statistics.median(m[k] for m in one) for k in one[0]}
    med_together = {k: statistics.median(m[k] for m in together) for k in together[0]}
    return {
        "ranks_together": n,
        "one": med_one,
        "together": med_together,
        "ratio": med_together["downtime"] / med_one["downtime"],
        "moves": {"one": one, "together": together},
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ranks", default="2,4", help="how many ranks of one node move together (comma-separated)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--json-out", type=Path)
    a = ap.parse_args()
    sys.path.insert(0, str(ROOT / "bench"))
    import common

    results = []
    with tempfile.TemporaryDirectory(prefix="bench-together-") as d:
        for n in (int(x) for x in a.ranks.split(",")):
            results.append(measure(n, a.repeats, Path(tempfile.mkdtemp(dir=d))))
    cols = ("boundary", "teardown", "migrate", "rebuild", "downtime")
    print(f"{'N':>3} {'route':<9} " + " ".join(f"{c:>9}" for c in cols) + "   (seconds, medians)")
    for r in results:
        for route in ("one", "together"):
            row = r[route]
            assert isinstance(row, dict)
            print(f"{r['ranks_together']:>3} {route:<9} " + " ".join(f"{row[c]:>9.3f}" for c in cols))
        print(f"{'':>3} together / one: x{r['ratio']:.2f}   (target: at most x1.5)")
    common.emit(a, {"bench": "together", "repeats": a.repeats, "results": results})


if __name__ == "__main__":
    main()
