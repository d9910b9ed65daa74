"""The GPU proof: on a GPU node, in one command, whether tpagent's GPU path works and how fast.

    scripts/gpu-proof.sh [--out DIR] [--sizes-gib 1,8,16] [--budget-s 540] [--jobs-s S] [--tests-s S]

0. the jobs (bench/gpu_jobs.py): ordinary training jobs, one shape each (DataLoader workers
   first), dumped, restored and moved between two nodes, each bit-identical to an uninterrupted run;
1. the GPU tests (tests/snapshot/test_gpu.py: dump/restore of 1 and 8 GiB bit-exact, a
   `tpagent launch` workload, a migration between two agents; tests/agent/test_rewire_gpu.py:
   a world-size-1 NCCL job and a rank with an NCCL group beside a CPU rank, each moved with
   its job rewired, bit-identical; tests/agent/test_aware_rewire_gpu.py and
   tests/orchestrator/test_recover_lost_gpu.py: ranks each with an NCCL group and GPU state of its
   own, one moved as its training state, one rebuilt from a replica once its node is killed,
   bit-identical; tests/orchestrator/test_gpu_health_nvml.py: GPU health read
   from NVML, XID events registered, a low temperature threshold a finding);
2. bench/rewire.py --gpu: what the rank runtime adds to the steps of a job that never moves
   (one NCCL rank, DDP on the GPU, with and without the runtime; target < 1 %);
3. bench/snapshot.py --gpu and bench/migrate.py --gpu, one round per size that fits (GPU memory
   free and host memory for the images; sizes dropped in order once the time budget would be
   passed: each is said, with why).

Writes five files to DIR (default ./gpu-proof; a GPU machine that hands back few files takes
them all): gpu-proof.json, gpu-proof.md, gpu-jobs.log and gpu-tests.log (the jobs' and the
tests' output, as they run) and
gpu-proof-logs.tar.gz (every bench's JSON and output, the tests' JUnit XML, and the small text
files the tests' runs left: agents' logs, ranks' output, CRIU's logs).  The JSON:
``{"machine": {...}, "jobs": [{"shape", "outcome", "detail", "image_bytes", "dump_s", "restore_s",
"downtime_s", ...}], "tests": [{"name", "outcome": passed|failed|skipped, "detail"}],
"benchmarks": [{"bench", "size_gib", "outcome", "detail", "result"}], "summary": {...}}``.
A benchmark's ``result`` is the bench's own JSON row plus, for the snapshot bench, ``floor_s`` =
the driver's checkpoint + restore alone, ``tpagent_s`` = tpagent's dump + restore, their ratio,
and GB/s.  A test that passed checked its GPU memory bit for bit (see each test).  On a machine
with no NVIDIA GPU it says so in one sentence, marks every check skipped (never passed) and
exits 0; otherwise it exits 1 if anything failed.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import json
import os
import platform
import shutil
import signal
import subprocess
import sys
import tarfile
import tempfile
import time
import xml.etree.ElementTree as ET
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT)]


from host import gpus  # noqa: E402


def _beside(name: str) -> Any:
    """The module ``name`` of bench/ (by its file: bench/ on sys.path would shadow the packages)."""
    spec = importlib.util.spec_from_file_location(f"bench_{name}", Path(__file__).with_name(f"{name}.py"))
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


gpu_jobs = _beside("gpu_jobs")

# (the snapshot path on the GPU; a rank with NCCL and GPU memory moved with its job rewired,
# moved as its training state, and rebuilt from a replica once its node is lost)
TESTS = (
    "tests/orchestrator/test_gpu_health_nvml.py",
    "tests/agent/test_rewire_gpu.py",
    "tests/agent/test_aware_rewire_gpu.py",
    "tests/orchestrator/test_recover_lost_gpu.py",
    "tests/snapshot/test_gpu.py",
)
NAMED = " ".join(TESTS)


def machine() -> dict[str, Any]:
    found = gpus.inventory()
    thp = Path("/sys/kernel/mm/transparent_hugepage/enabled")
    criu = shutil.which("criu") or "/opt/tpagent/criu/bin/criu"
    try:
        criu_version = subprocess.run([criu, "--version"], capture_output=True, text=True, timeout=30).stdout.split()
    except OSError:
        criu_version = []
    return {
        "host": platform.node(),
        "kernel": platform.release(),
        "python": platform.python_version(),
        "driver": gpus.driver_version(),
        "gpus": [
            {"name": g.name, "uuid": g.uuid, "memory_total": g.memory_total, "memory_used": g.memory_used}
            for g in found
        ],
        "criu": criu_version[1] if len(criu_version) > 1 else None,
        "transparent_hugepages": thp.read_text().split("[")[1].split("]")[0] if thp.exists() else None,
        "memory_available": _mem_available(),
    }


def _mem_available() -> int:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) * 1024
    return 0


def _env() -> dict[str, str]:
    """The environment of what the proof runs: the venv's bin first on PATH (where
    scripts/setup.sh --bundle puts ip and nft for a node without them: the tests and
    bench/migrate.py make their nodes with ip)."""
    path = os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", os.defpath)])
    return {**os.environ, "TPAGENT_TESTS_NEED_CRIU": "1", "PYTHONUNBUFFERED": "1", "PATH": path}


def pack(work: Path, tar: Path) -> None:
    """The text files under ``work`` (4 MiB each at most: never a snapshot's images) into ``tar``."""
    with tarfile.open(tar, "w:gz") as t:
        for f in sorted(work.rglob("*")):
            if f.is_file() and not f.is_symlink() and f.suffix in _TEXT and f.stat().st_size <= 4 << 20:
                t.add(f, arcname=str(f.relative_to(work)))


_TEXT = {".log", ".out", ".err", ".json", ".xml", ".txt"}


def run_tests(
    out: Path,
    work: Path,
    budget: float,
    tests: tuple[str, ...] = TESTS,
    name: str = "gpu-tests",
    env: dict[str, str] | None = None,
) -> list[dict[str, Any]]:
    """The GPU tests, their output written to DIR/NAME.log as they run.  Past ``budget`` they
    are interrupted as Ctrl-C would (each test's clean-up runs, finished tests keep their outcome,
    the one running fails); a minute later whatever is left of them (agents, workloads) is killed."""
    xml = work / f"{name}.xml"
    log = out / f"{name}.log"
    named = " ".join(tests)
    interrupted = False
    cmd = [
        sys.executable,
        "-m",
        "pytest",
        "-q",
        "-p",
        "no:cacheprovider",
        *tests,
        f"--junitxml={xml}",
        "-rA",
        f"--basetemp={work / name}",  # (one per run: pytest empties its basetemp as it starts)
    ]
    with log.open("w") as sink:
        proc = subprocess.Popen(
            cmd, cwd=ROOT, env={**_env(), **(env or {})}, stdout=sink, stderr=subprocess.STDOUT, start_new_session=True
        )
        try:
            proc.wait(timeout=budget)
        except subprocess.TimeoutExpired:
            interrupted = True
            proc.send_signal(signal.SIGINT)
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        with contextlib.suppress(ProcessLookupError):  # (what it started and left, in its session)
            os.killpg(proc.pid, signal.SIGKILL)
    if interrupted and not xml.exists():
        return [{"name": named, "outcome": "failed", "detail": f"the GPU tests ran past {budget:.0f} s"}]
    if not xml.exists():
        return [{"name": named, "outcome": "failed", "detail": log.read_text()[-500:]}]
    rows = []
    for case in ET.parse(xml).getroot().iter("testcase"):
        if not case.get("name"):  # (what an interrupt during collection leaves: no test)
            continue
        name = case.get("name", "?")
        outcome = "passed"
        detail = f"{float(case.get('time', 0)):.1f} s"
        for child in case:
            if child.tag in ("failure", "error"):
                outcome = "failed"
                detail = (child.get("message") or "")[:300]
            elif child.tag == "skipped":
                outcome = "skipped"
                detail = (child.get("message") or "")[:300]
        rows.append({"name": name, "outcome": outcome, "detail": detail})
    if interrupted:
        why = f"interrupted at {budget:.0f} s: the test then running and those after it did not end"
        rows.append({"name": named, "outcome": "failed", "detail": why})
    return rows


def _fits(size_gib: int) -> str | None:
    """Why ``size_gib`` cannot be benchmarked here, or None."""
    free = min((g.memory_total - g.memory_used for g in gpus.inventory()), default=0)
    if free < size_gib * 2**30 * 1.1:
        return f"{size_gib} GiB does not fit in the GPU's {free / 2**30:.1f} GiB free"
    if _mem_available() < size_gib * 2**30 * 3:  # the images, the driver's host copy, the restored copy
        return f"{size_gib} GiB needs ~{3 * size_gib} GiB of host memory; {_mem_available() / 2**30:.0f} GiB free"
    return None


def run_bench(bench: str, size_gib: int, work: Path, timeout: float) -> dict[str, Any]:
    """One round of bench/snapshot.py or bench/migrate.py at ``size_gib``, or (size 0) the
    overhead half of bench/rewire.py (3 rounds of 300 steps): its row."""
    row: dict[str, Any] = {"bench": bench, "size_gib": size_gib, "outcome": "failed", "detail": "", "result": {}}
    result = work / f"{bench}-{size_gib}g.json"
    how = (
        ["--rounds", "3", "--steps", "300"]
        if bench == "rewire"
        else ["--sizes-mib", str(size_gib * 1024), "--repeats", "1"]
    )
    cmd = [sys.executable, f"bench/{bench}.py", "--gpu", *how, "--json-out", str(result)]
    t0 = time.monotonic()
    try:
        proc = subprocess.run(cmd, cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        row["detail"] = f"ran past its {timeout:.0f} s"
        return row
    (work / f"{bench}-{size_gib}g.log").write_text(proc.stdout + proc.stderr)
    if proc.returncode != 0 or not result.exists():
        row["detail"] = (proc.stderr or proc.stdout)[-300:].strip()
        return row
    doc = json.loads(result.read_text())
    r = dict(doc["overhead"] if bench == "rewire" else doc["results"][0])
    if bench == "snapshot":
        gb = r["image_bytes"] / 1e9
        r["floor_s"] = r.get("cuda_checkpoint_s", 0.0) + r.get("cuda_restore_s", 0.0)
        r["tpagent_s"] = r["tpagent_dump_s"] + r["tpagent_restore_s"]
        r["ratio_to_floor"] = r["tpagent_s"] / r["floor_s"] if r["floor_s"] else None
        r["dump_gbps"] = gb / r["tpagent_dump_s"]
        r["restore_gbps"] = gb / r["tpagent_restore_s"]
    row.update(outcome="passed", detail=f"{time.monotonic() - t0:.0f} s", result=r)
    return row


def _table(
    doc: dict[str, Any], bench: str, title: str, columns: list[str], cells: Callable[[dict[str, Any]], list[str]]
) -> list[str]:
    """A bench's section of the report: a row per round, its figures if it passed, else why not."""
    lines = ["", f"## {title}", "", "| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    for b in (b for b in doc["benchmarks"] if b["bench"] == bench):
        lead = [str(b["size_gib"])] if columns[0] == "GiB" else []
        if b["outcome"] == "passed":
            row = [*lead, "passed", *cells(b["result"])]
        else:
            row = [*lead, f"{b['outcome']}: {b['detail']}", *[""] * (len(columns) - len(lead) - 1)]
        lines.append("| " + " | ".join(row) + " |")
    return lines


def markdown(doc: dict[str, Any]) -> str:
    m = doc["machine"]
    gpu = ", ".join(g["name"] for g in m["gpus"]) or "none"
    lines = [
        "# tpagent GPU proof",
        "",
        f"{doc['summary']['sentence']}",
        "",
        f"Machine: {gpu}; driver {m['driver']}; kernel {m['kernel']}; CRIU {m['criu']}; "
        f"transparent huge pages {m['transparent_hugepages']}; Python {m['python']}.",
        "",
        *gpu_jobs.table(doc["jobs"])[1:],
        "",
        "## Tests",
        "",
        "| test | outcome | detail |",
        "|---|---|---|",
        *(f"| {t['name']} | {t['outcome']} | {t['detail']} |" for t in doc["tests"]),
    ]
    lines += _table(
        doc,
        "snapshot",
        "Snapshot (dump + restore on this node)",
        [
            "GiB",
            "outcome",
            "CUDA checkpoint s",
            "criu dump s",
            "tpagent dump s",
            "dump GB/s",
            "criu restore s",
            "CUDA restore s",
            "tpagent restore s",
            "restore GB/s",
            "floor (driver alone) s",
            "x floor",
        ],
        lambda r: [
            f"{v:.2f}"
            for v in (
                r.get("cuda_checkpoint_s", 0),
                r.get("criu_dump_s", 0),
                r["tpagent_dump_s"],
                r["dump_gbps"],
                r.get("criu_restore_s", 0),
                r.get("cuda_restore_s", 0),
                r["tpagent_restore_s"],
                r["restore_gbps"],
                r["floor_s"],
                r["ratio_to_floor"] or 0,
            )
        ],
    )
    lines += _table(
        doc,
        "rewire",
        "The rank runtime's cost to a job that never moves (one NCCL rank, DDP)",
        ["outcome", "plain step ms", "with the runtime ms", "overhead", "from its parts", "added per collective us"],
        lambda r: [
            f"{r['plain_step_s'] * 1e3:.3f}",
            f"{r['runtime_step_s'] * 1e3:.3f}",
            f"{r['overhead'] * 100:+.2f} %",
            f"{r['overhead_from_parts'] * 100:+.3f} %",
            f"{r['one_process_added_per_collective_s'] * 1e6:+.1f}",
        ],
    )
    lines += _table(
        doc,
        "migrate",
        "Migration between two agents on this node",
        ["GiB", "outcome", "freeze s", "freeze+send s", "restore s", "downtime s", "naive downtime s", "x naive"],
        lambda r: [
            f"{r.get(k, 0):.2f}"
            for k in (
                "tpagent_freeze",
                "tpagent_freeze_and_send",
                "tpagent_restore",
                "tpagent_downtime",
                "naive_downtime",
                "downtime_ratio_to_naive",
            )
        ],
    )
    return "\n".join(lines) + "\n"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=Path("gpu-proof"))
    ap.add_argument("--sizes-gib", default="1,8,16")
    ap.add_argument("--budget-s", type=float, default=540.0, help="the whole proof's time (default: 9 minutes)")
    ap.add_argument("--jobs-s", type=float, help="the jobs section's share of it (default: 50%%)")
    ap.add_argument("--tests-s", type=float, help="the tests' share of it (default: 30%%)")
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    t0 = time.monotonic()
    sizes = [int(s) for s in args.sizes_gib.split(",")]
    doc: dict[str, Any] = {"machine": machine(), "jobs": [], "tests": [], "benchmarks": []}
    if not doc["machine"]["gpus"] or not Path("/dev/nvidiactl").exists():
        sentence = "No NVIDIA GPU on this machine: every GPU check was skipped, none passed."
        doc["jobs"] = gpu_jobs.skipped("no NVIDIA GPU")
        doc["tests"] = [{"name": NAMED, "outcome": "skipped", "detail": "no NVIDIA GPU"}]
        doc["benchmarks"] = [
            {"bench": b, "size_gib": s, "outcome": "skipped", "detail": "no NVIDIA GPU", "result": {}}
            for s in sizes
            for b in ("snapshot", "migrate")
        ]
        doc["benchmarks"].append(
            {"bench": "rewire", "size_gib": 0, "outcome": "skipped", "detail": "no NVIDIA GPU", "result": {}}
        )
    else:
        work = Path(tempfile.mkdtemp(prefix="tpagent-gpu-proof-"))  # (the tests' snapshots too: not in DIR)
        try:
            run_all(doc, args, sizes, work, t0)
        finally:
            pack(work, args.out / "gpu-proof-logs.tar.gz")
            shutil.rmtree(work, ignore_errors=True)
        counts = {
            o: sum(r["outcome"] == o for r in doc["jobs"] + doc["tests"] + doc["benchmarks"])
            for o in ("passed", "failed", "skipped")
        }
        sentence = (
            f"{counts['passed']} passed, {counts['failed']} failed, {counts['skipped']} skipped "
            f"in {time.monotonic() - t0:.0f} s."
        )
    doc["summary"] = {"sentence": sentence, "seconds": round(time.monotonic() - t0, 1)}
    (args.out / "gpu-proof.json").write_text(json.dumps(doc, indent=2))
    (args.out / "gpu-proof.md").write_text(markdown(doc))
    print(sentence)
    print(f"report: {args.out / 'gpu-proof.md'} and {args.out / 'gpu-proof.json'}")
    return 1 if any(r["outcome"] == "failed" for r in doc["jobs"] + doc["tests"] + doc["benchmarks"]) else 0


def run_all(doc: dict[str, Any], args: argparse.Namespace, sizes: list[int], work: Path, t0: float) -> None:
    """The jobs, the tests, then each bench at each size while the budget lasts, into ``doc``."""
    doc["jobs"] = gpu_jobs.run_jobs(run_tests, args.out, work, args.jobs_s or args.budget_s * 0.5)
    left = args.budget_s - (time.monotonic() - t0)
    doc["tests"] = run_tests(args.out, work, min(left, args.tests_s or args.budget_s * 0.3))
    left = args.budget_s - (time.monotonic() - t0)
    if left < 120:  # (six jobs started under torchrun and six single processes, each importing torch)
        doc["benchmarks"].append(
            {
                "bench": "rewire",
                "size_gib": 0,
                "outcome": "skipped",
                "detail": f"the time budget: {left:.0f} s left",
                "result": {},
            }
        )
    else:
        doc["benchmarks"].append(run_bench("rewire", 0, work, min(left, 240.0)))
    for size in sizes:
        for bench in ("snapshot", "migrate"):
            left = args.budget_s - (time.monotonic() - t0)
            # (a round of each bench: roughly 10 s per GiB here, and the driver's own setup)
            why = _fits(size) or (f"the time budget: {left:.0f} s left" if left < 20 + 10 * size else None)
            if why:
                doc["benchmarks"].append(
                    {"bench": bench, "size_gib": size, "outcome": "skipped", "detail": why, "result": {}}
                )
                continue
            doc["benchmarks"].append(run_bench(bench, size, work, left))


if __name__ == "__main__":
    sys.exit(main())
