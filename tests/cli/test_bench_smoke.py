"""The benchmarks still run end to end (tiny sizes; their timings are not asserted)."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import needs_criu
from support.helpers import ROOT


def _run(*args: str) -> dict[str, object]:
    """What a benchmark printed last (its JSON); one that runs too long is interrupted, so what it
    says on its way out (a bench of jobs: their logs, its agents') shows why."""
    bench = subprocess.Popen(
        [sys.executable, *args], cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    try:
        out, err = bench.communicate(timeout=240)  # (the test's own bound: 300 s)
    except subprocess.TimeoutExpired:
        bench.send_signal(signal.SIGINT)
        try:
            out, err = bench.communicate(timeout=40)
        finally:
            bench.kill()
        pytest.fail(f"{args[0]} ran past 240 s: {err[-20000:]}")
    assert bench.returncode == 0, err[-6000:]
    return json.loads(out.strip().splitlines()[-1])  # type: ignore[no-any-return]


@needs_criu
def test_snapshot_benchmark_runs(tmp_path: object) -> None:
    doc = _run("bench/snapshot.py", "--sizes-mib", "16", "--repeats", "1")
    (row,) = doc["results"]  # type: ignore[misc]
    assert row["image_bytes"] > 16 << 20 and row["tpagent_dump_s"] > 0 and row["naive_restore_s"] > 0
    assert row["tpagent_dump_gbps"] > 0 and row["naive_restore_gbps"] > 0


def test_transfer_benchmark_runs() -> None:
    doc = _run("bench/transfer.py", "--sizes-mib", "8", "--repeats", "1", "--streams", "2")
    routes = {r["route"] for r in doc["results"]}  # type: ignore[attr-defined]
    assert routes == {
        "floor",
        "tpagent-none",
        "tpagent-auto",
        "tpagent-zstd",
        "tpagent-tls-none",
        "tpagent-tls-auto",
        "tpagent-ucx-none",
        "tpagent-ucx-auto",
        "naive-tar-zstd",
    }


def test_rewire_benchmark_measures_the_runtime_it_loaded() -> None:
    """The overhead half (the move needs root and namespaces: tests/agent covers that path): the
    job and the single process run with and without the rank runtime, and each knows which."""
    doc = _run("bench/rewire.py", "--skip-move", "--rounds", "1", "--steps", "40", "--width", "64")
    cost = doc["overhead"]
    assert isinstance(cost, dict) and cost["ranks"] == 3 and cost["backend"] == "gloo"
    assert cost["plain_step_s"] > 0 and cost["runtime_step_s"] > 0 and cost["collectives_per_step"] > 0


@needs_criu
def test_pipeline_benchmark_runs() -> None:
    doc = _run("bench/pipeline.py", "--sizes-mib", "16", "--repeats", "1")
    rows = {r["route"]: r for r in doc["results"]}  # type: ignore[attr-defined]
    assert set(rows) == {"dump-only", "sequential", "overlapped", "naive"} and all(
        r["seconds"] > 0 for r in rows.values()
    )


@needs_criu
def test_migrate_benchmark_runs() -> None:
    doc = _run("bench/migrate.py", "--sizes-mib", "16", "--repeats", "1")
    (row,) = doc["results"]  # type: ignore[misc]
    assert row["tpagent_downtime"] > 0 and row["naive_downtime"] > 0 and row["tpagent_restore"] > 0
    assert row["files_downtime"] > 0  # (the same migration with the images written on the source)


@needs_criu
def test_stream_benchmark_runs() -> None:
    doc = _run("bench/stream.py", "--sizes-mib", "16", "--repeats", "1")
    rows = {r["route"]: r for r in doc["results"]}  # type: ignore[attr-defined]
    assert set(rows) == {"files", "stream", "page-server"}
    assert all(r["total_s"] > 0 and r["bytes"] > 16 << 20 for r in rows.values())


def test_gpu_proof_says_what_it_could_not_check(tmp_path: Path) -> None:
    """Without a GPU: one sentence, exit 0, every check skipped and none passed; the report's
    tables are written either way (with a GPU the same command runs the tests and benches)."""
    from host import gpus

    proc = subprocess.run(
        ["bash", "scripts/gpu-proof.sh", "--out", str(tmp_path), "--sizes-gib", "1,8"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=900,
    )
    doc = json.loads((tmp_path / "gpu-proof.json").read_text())
    rows = doc["tests"] + doc["benchmarks"]
    assert {(b["bench"], b["size_gib"]) for b in doc["benchmarks"]} == {
        (b, s) for b in ("snapshot", "migrate") for s in (1, 8)
    } | {("rewire", 0)}
    report = (tmp_path / "gpu-proof.md").read_text()
    assert "## Snapshot" in report and "## Migration" in report and "## The rank runtime's cost" in report
    if not gpus.inventory():
        assert proc.returncode == 0, proc.stderr
        assert proc.stdout.splitlines()[0] == "No NVIDIA GPU on this machine: every GPU check was skipped, none passed."
        assert all(r["outcome"] == "skipped" for r in rows), rows
    else:  # (on a GPU node: each row has an outcome, and the exit code says whether any failed)
        assert proc.returncode == (1 if any(r["outcome"] == "failed" for r in rows) else 0)


def test_gpu_proof_packs_the_text_its_runs_left_and_no_snapshot(tmp_path: Path) -> None:
    """A device hands back few files: the logs travel in one archive, never a snapshot's images."""
    import importlib.util
    import tarfile

    spec = importlib.util.spec_from_file_location("tpagent_gpu_proof", ROOT / "bench" / "gpu_proof.py")
    assert spec is not None and spec.loader is not None
    gpu_proof = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gpu_proof)  # (not by sys.path: bench/snapshot.py would shadow the package)
    pack = gpu_proof.pack

    work = tmp_path / "work"
    (work / "tests" / "t0" / "A").mkdir(parents=True)
    (work / "tests" / "t0" / "A" / "agent.log").write_text("serving\n")
    (work / "snapshot-1g.json").write_text("{}")
    (work / "tests" / "t0" / "pages-1.img").write_bytes(b"\0" * 1024)
    (work / "tests" / "t0" / "huge.log").write_bytes(b"x" * ((4 << 20) + 1))
    pack(work, tmp_path / "logs.tar.gz")
    with tarfile.open(tmp_path / "logs.tar.gz") as t:
        assert sorted(t.getnames()) == ["snapshot-1g.json", "tests/t0/A/agent.log"]


@needs_criu
def test_orchestrator_benchmark_runs() -> None:
    doc = _run("bench/orchestrator.py", "--repeats", "1")
    med = doc["median"]
    assert isinstance(med, dict) and med["resumed"] > med["migrate"] > 0 and med["planning"] >= 0
    assert doc["floor_typed_migrate_s"] > 0 and doc["naive_cold_start_s"] > 0  # type: ignore[operator]


def test_aware_benchmark_hands_the_whole_state_over(tmp_path: Path) -> None:
    doc = _run("bench/aware.py", "--sizes-mib", "8", "--repeats", "1", "--dir", str(tmp_path))
    (row,) = doc["rows"]  # type: ignore[misc]
    assert row["state_bytes"] > 3 * (8 << 20) * 0.9  # (the parameters and Adam's two moments)
    assert row["process_anonymous_bytes"] > row["state_bytes"]
    assert row["aware_s"]["hand-over"] > 0 and row["naive_s"]["total"] > 0 and row["floor_s"]["socket"] > 0


@needs_criu
def test_aware_benchmark_moves_a_rank_between_agents_both_ways() -> None:
    doc = _run("bench/aware.py", "--agents", "--widths", "64", "--repeats", "1")
    (row,) = doc["rows"]  # type: ignore[misc]
    assert 0 < row["aware_bytes"] < row["transparent_image_bytes"]
    assert row["aware_stood_still_s"] > 0 and row["transparent_stood_still_s"] > 0 and row["aware_warmup_s"] > 0


@needs_criu
def test_aware_benchmark_rebuilds_a_job_that_lost_a_node() -> None:
    doc = _run("bench/aware.py", "--lost", "--widths", "64", "--repeats", "1", "--lost-nodes", "A")
    (row,) = doc["rows"]  # type: ignore[misc]
    assert row["state_bytes"] > 0 and row["detection"] > 0 and row["replacement"] > 0
    assert row["node"] == "A" and row["store"] > 0  # (the store, lost with rank 0's node, served anew)
    assert row["stood_still"] > row["total"] >= row["replacement"] + row["state"] + row["rebuild"]
