"""From a taint to the job running again at step S+1: the orchestrator's move of a rank, split.

    .venv/bin/python bench/orchestrator.py --repeats 3

Four network-namespace nodes (the 3-rank CPU torchrun job of the rewire tests on A, B, C; D a
dedicated spare), every agent reporting to `tpagent orchestrator` every 0.5 s.  Each repeat taints
B (`tpagent taint`), waits for rank 1 to take its first step on D, then untaints B and waits for it
home.  Printed beside it, in the same run: the same move typed by a person (`tpagent migrate
--job`, the floor: no detection, no planning, no dry run) and the naive route (the whole job
started again, to its first step).  Stages, from the orchestrator's records (`tpagent cluster`):

  request    the `tpagent taint` call, until the taint is written down
  planning   the taint written -> its move planned (a spare reserved)
  dispatch   planned -> asked of the source agent
  dry_run    the source agent's dry run (both agents' checks; nothing stops)
  boundary, teardown, migrate, rebuild: the rewire's own stages (bench/rewire.py)
  resumed    `tpagent taint` -> rank 1's first step on the spare

The orchestrator's own share is planning + dispatch.  Medians; a table, then JSON.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
STAGES = ("request", "planning", "dispatch", "dry_run", "boundary", "teardown", "migrate", "rebuild")


def _watch(logs: Path, rank: int, seen: dict[int, float], stop: threading.Event) -> None:
    from support.rankjob import steps

    while not stop.is_set():
        seen.setdefault(steps(logs, rank), time.monotonic())
        time.sleep(0.005)


def _first_step_after(seen: dict[int, float], resumed: int, since: float) -> float:
    from support.helpers import wait_until

    wait_until(lambda: any(n >= resumed for n in list(seen)), f"step {resumed} to be seen", 30, 0.005)
    return min(t for n, t in list(seen.items()) if n >= resumed) - since


def run(tmp: Path, repeats: int) -> dict[str, object]:
    sys.path[:0] = [str(ROOT), str(ROOT / "tests")]
    from support.cluster import Cluster
    from support.orchestrator import Orchestrator
    from support.rankjob import IFNAME, RUN, Job, steps

    c = Cluster(tmp, ["A", "B", "C", "D"], ifname=IFNAME)
    o = Orchestrator(c, tmp, dedicated_spares=[c.nodes["D"].name])
    rows: list[dict[str, float]] = []
    floor: list[float] = []
    try:
        o.start()
        for node in c.nodes.values():
            node.start_agent(rewire_timeout="60", orchestrator=o.address, report_period="0.5")
        t0 = time.monotonic()
        job = Job(c, tmp, step_time=0.2)
        try:
            job.at_step(0, 1)
            cold = time.monotonic() - t0
            seen: dict[int, float] = {}
            stop = threading.Event()
            threading.Thread(target=_watch, args=(job.logs, 1, seen, stop), daemon=True).start()
            for _ in range(repeats):
                job.at_step(1, steps(job.logs, 1) + 5)
                o.wait_rank_on(RUN, 1, c.nodes["B"].name, 60)
                t_request = time.monotonic()
                wall = time.time()
                o.ok("taint", c.nodes["B"].name, "--reason", "bench")
                o.wait_rank_on(RUN, 1, c.nodes["D"].name, 120)
                m = [m for m in o.cluster()["moves"] if m["kind"] == "away"][-1]
                resumed = int(m["message"].split("resumed at step ")[1].split()[0])
                job.at_step(1, resumed)
                t = m["timings"]
                rows.append(
                    {
                        "request": m["tainted"] - wall,
                        "planning": m["created"] - m["tainted"],
                        "dispatch": m["started"] - m["created"],
                        **{k: t.get(k, 0.0) for k in STAGES[3:]},
                        "resumed": _first_step_after(seen, resumed, t_request),
                    }
                )
                o.ok("untaint", c.nodes["B"].name)
                o.wait_rank_on(RUN, 1, c.nodes["B"].name, 120)
                job.at_step(1, steps(job.logs, 1) + 5)
                t_request = time.monotonic()
                done = c.migrate(0, "B", "D", "--job", RUN, "--rank", "1", "--json", timeout=300)
                doc = json.loads(done.stdout)
                resumed = int(doc["message"].split("resumed at step ")[1].split()[0])
                job.at_step(1, resumed)
                floor.append(_first_step_after(seen, resumed, t_request))
                back = c.migrate(0, "D", "B", "--job", RUN, "--rank", "1", timeout=300)
                assert back.returncode == 0, back.stdout + back.stderr
            stop.set()
        except Exception:  # (what the orchestrator saw, for whoever reads the failure)
            print(o.cli("events").stdout[-4000:], o.log()[-4000:], sep="\n", file=sys.stderr)
            raise
        finally:
            job.close()
    finally:
        o.close()
        c.close()
    med = {k: statistics.median(r[k] for r in rows) for k in rows[0]}
    return {
        "repeats": repeats,
        "median": med,
        "orchestrator_share_s": med["planning"] + med["dispatch"],
        "floor_typed_migrate_s": statistics.median(floor),
        "naive_cold_start_s": cold,
        "rounds": rows,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--json-out", type=Path)
    a = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="tpagent-bench-") as d:
        doc = run(Path(d), a.repeats)
    med = doc["median"]
    assert isinstance(med, dict)
    print(f"taint -> rank 1 running again on the spare, median of {a.repeats} (seconds):")
    for k in (*STAGES, "resumed"):
        print(f"  {k:<44} {med[k]:8.3f}")
    print(f"  {'the orchestrator own share (planning + dispatch)':<44} {doc['orchestrator_share_s']:8.3f}")
    print(f"  {'floor: `tpagent migrate` typed, to the step':<44} {doc['floor_typed_migrate_s']:8.3f}")
    print(f"  {'naive: the whole job started again':<44} {doc['naive_cold_start_s']:8.3f}")
    print(json.dumps(doc))
    if a.json_out:
        a.json_out.write_text(json.dumps(doc, indent=2))


if __name__ == "__main__":
    main()
