"""The GPU proof's jobs section: ordinary training jobs, one shape each, dumped and restored on the
node and moved between two namespace nodes, each ending bit-identical to an uninterrupted run
(tests/snapshot/test_gpu_jobs.py runs them and reports a row per shape); a table of shape,
processes, image size, dump s, restore s, move downtime s and outcome.

Shapes run in the test's order (DataLoader workers first); those the time budget leaves out are
said as skipped, with why.  Imported by bench/gpu_proof.py (not run on its own).
"""

from __future__ import annotations

import ast
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
JOBS = "tests/snapshot/test_gpu_jobs.py"
COLUMNS = ["shape", "outcome", "processes", "image GiB", "dump s", "restore s", "move downtime s", "detail"]


def shapes() -> list[str]:
    """The shapes, in order, as the test lists them (its ``SHAPES``)."""
    tree = ast.parse((ROOT / JOBS).read_text())
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(getattr(t, "id", "") == "SHAPES" for t in node.targets):
            return [str(s) for s in ast.literal_eval(node.value)]
    raise LookupError(f"{JOBS} lists no SHAPES")


def skipped(why: str) -> list[dict[str, Any]]:
    return [{"shape": s, "outcome": "skipped", "detail": why} for s in shapes()]


def run_jobs(
    run_tests: Callable[..., list[dict[str, Any]]], out: Path, work: Path, budget: float
) -> list[dict[str, Any]]:
    """The jobs test within ``budget`` seconds (``run_tests`` is the proof's): a row per shape."""
    report = work / "gpu-jobs.jsonl"
    outcomes = run_tests(out, work, budget, (JOBS,), "gpu-jobs", {"TPAGENT_JOBS_REPORT": str(report)})
    said = {}
    if report.exists():
        for line in report.read_text().splitlines():
            row = json.loads(line)
            said[row["shape"]] = row
    rows = []
    ran = {t["name"].partition("[")[2].rstrip("]"): t for t in outcomes if "[" in t["name"]}
    for shape in shapes():
        test = ran.get(shape)
        row = {**said.get(shape, {}), "shape": shape}
        if test is None:
            row |= {"outcome": "skipped", "detail": f"not reached within the jobs' {budget:.0f} s"}
        else:
            row |= {"outcome": test["outcome"], "detail": test["detail"]}
        rows.append(row)
    rows += [t for t in outcomes if "[" not in t["name"]]  # (an interruption, a collection error)
    return rows


def table(rows: list[dict[str, Any]]) -> list[str]:
    lines = ["", "## Ordinary jobs (dump + restore on the node, then a move between two nodes)", ""]
    lines += ["| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    for r in rows:
        image = f"{r['image_bytes'] / 2**30:.2f}" if "image_bytes" in r else ""
        figures = [str(r.get("processes", "")), image, *(_s(r.get(k)) for k in ("dump_s", "restore_s", "downtime_s"))]
        detail = str(r.get("detail", "")).replace("|", "/").replace("\n", " ")[:200]
        lines.append(f"| {r.get('shape', r.get('name'))} | {r['outcome']} | " + " | ".join(figures) + f" | {detail} |")
    return lines


def _s(v: object) -> str:
    return f"{v:.2f}" if isinstance(v, int | float) else ""
