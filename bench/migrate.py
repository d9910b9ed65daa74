"""Benchmark: downtime of a migration between two agents, beside the naive route.

    python bench/migrate.py [--sizes-mib 1024,4096] [--repeats 3] [--dir /dev/shm] [--gpu] [--json-out F]

Two nodes, each a network namespace of this machine with its agent (`tpagent serve`) and
its work directory under --dir, joined by a bridge (tests/support/cluster.py).  For each size a fresh
workload holding that much state is started on A under `tpagent launch` and moved to B with
`tpagent migrate` (two agents in one namespace cannot move a CUDA process: it holds an
abstract socket named after itself, which its copy cannot bind there while the original is
held).  The downtime is from the freeze until the copy runs on the target (the agent's
``downtime`` timing), next to each stage.  ``tpagent``: CRIU's images streamed straight into
the transfer (``stream_buffer_mib`` 256 on A and B); ``files``: the same between two more nodes
C and D whose agents write them on the source first (``stream_buffer_mib`` 0, the default).
In the same run, the naive route on the same workload: bare `criu dump` into a directory,
`cp -a` of that directory, bare `criu restore` (its downtime is the sum).  Medians over
--repeats, each route after the same memory warm-up (see ``warm``).  Beside the times, each
route's CPU seconds (``*_cpu``): both agents' own and their finished children's (CRIU, the
post-dump hook) for tpagent, which also checksums, authenticates, encrypts and verifies every
byte; this process's and its children's (CRIU, cp) for the naive route.  Where both nodes
share a few cores, the overlap of dump, transfer and verification cannot pay, and the CPU
seconds say why.  --gpu: the state is GPU memory (tests/workloads/gpu_hold.py), sizes in MiB
of GPU memory.  Must run as root.  Prints a table, then one JSON object.
"""

from __future__ import annotations

import contextlib
import json
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]

import common  # noqa: E402

from snapshot.api import CudaError  # noqa: E402
from snapshot.criu import Criu, DumpOptions, RestoreOptions  # noqa: E402
from snapshot.cuda import CudaDriver  # noqa: E402
from support.cluster import Cluster, Node  # noqa: E402
from support.helpers import kill_and_wait, wait_until  # noqa: E402


def launch(kind: str, size: int, work: Path, node: Node | None = None) -> int:
    """A fresh workload of ``size`` MiB under `tpagent launch` (on ``node``, or here): its PID."""
    log = work / "w.log"
    log.unlink(missing_ok=True)
    cmd, ready = common.workload(kind, size, log)
    if node is not None:
        pid = node.launch(work / "w.out", *cmd, timeout=600)
    else:
        argv = [sys.executable, "-m", "cli.main", "launch", "--stdout", str(work / "w.out"), "--", *cmd]
        out = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=600)
        assert out.returncode == 0, out.stderr
        pid = int(out.stdout)
    wait_until(lambda: log.exists() and ready in log.read_text(), "the workload to start", 900)
    return pid


def warm(size: int) -> None:
    """Touch and free, first, what a round of ``size`` MiB holds at its peak, and more.  In a
    VM, memory the guest has not touched yet comes several times slower than memory it freed
    a moment ago (the first touch goes to the hypervisor): without this, whichever route
    reaches new memory pays for it.  tpagent's peak is the larger: while the copy is restored
    the original is still held (nothing is lost if the restore fails), beside both nodes'
    images (with four times ``size``, its restore ran 1.7 times slower than a naive one that
    had killed its original first; with eight, as fast).  Up to three quarters of what is free."""
    mib = min(8 * size, int(psutil.virtual_memory().available * 0.75) >> 20)
    subprocess.run([sys.executable, "-c", f"b = bytearray({mib} << 20); b[::4096] = bytes(len(b) // 4096)"], check=True)


def tree_cpu_seconds(p: psutil.Process) -> float:
    """CPU time of ``p`` and of its children that ended (CRIU, the post-dump hook)."""
    t = p.cpu_times()
    return t.user + t.system + t.children_user + t.children_system


STREAM_BUFFER_MIB = 256


def tpagent_round(kind: str, size: int, work: Path, c: Cluster, route: str = "tpagent") -> dict[str, float]:
    """A migration from A to B (``route`` "tpagent": the images streamed from CRIU), or from C to
    D ("files": agents with ``stream_buffer_mib`` 0, the images written on the source first)."""
    src, dst = ("A", "B") if route == "tpagent" else ("C", "D")
    pid = launch(kind, size, work, c.nodes[src])
    agents = [psutil.Process(c.nodes[n].agent.pid) for n in (src, dst)]  # type: ignore[union-attr]
    before = sum(map(tree_cpu_seconds, agents))
    out = c.migrate(pid, src, dst, "--json", timeout=3600)
    cpu = sum(map(tree_cpu_seconds, agents)) - before
    assert out.returncode == 0, out.stderr + out.stdout
    doc = json.loads(out.stdout)
    kill_and_wait(doc["new_pid"])
    return {f"{route}_{k}": v for k, v in doc["timings"].items()} | {
        f"{route}_total": doc["seconds"],
        f"{route}_cpu": cpu,
    }


def cuda_processes(cuda: CudaDriver, root: int) -> list[int]:
    """The processes of ``root``'s tree that the driver knows (the workload, not its init)."""
    found: list[int] = []
    top = psutil.Process(root)
    for p in [top, *top.children(recursive=True)]:
        with contextlib.suppress(CudaError):
            cuda.state(p.pid)
            found.append(p.pid)
    return found


def naive_round(kind: str, size: int, work: Path) -> dict[str, float]:
    """By hand, with no checks: (on a GPU, the driver's lock and checkpoint of the workload,)
    criu dump, cp to the other node's directory, criu restore (and the driver's restore)."""
    pid = launch(kind, size, work)
    criu = Criu()
    a = work / "naive-a"
    b = work / "naive-b"
    a.mkdir()
    cuda = CudaDriver() if kind == "gpu" else None
    gpu_pids = cuda_processes(cuda, pid) if cuda is not None else []
    before = common.cpu_seconds()
    t0 = time.monotonic()
    for p in gpu_pids:
        assert cuda is not None
        cuda.lock(p, 30)
        cuda.checkpoint(p)
    criu.dump(pid, a, a, DumpOptions(mounts=True), 3600)
    t1 = time.monotonic()
    subprocess.run(["cp", "-a", str(a), str(b)], check=True)
    t2 = time.monotonic()
    new = criu.restore(b, b, RestoreOptions(mounts=True), 3600)
    if cuda is not None:
        for p in cuda_processes(cuda, new):
            cuda.restore(p)
            cuda.unlock(p)
    t3 = time.monotonic()
    cpu = common.cpu_seconds() - before
    kill_and_wait(new)
    shutil.rmtree(a)
    shutil.rmtree(b)
    return {
        "naive_dump": t1 - t0,
        "naive_copy": t2 - t1,
        "naive_restore": t3 - t2,
        "naive_downtime": t3 - t0,
        "naive_cpu": cpu,
    }


def main() -> None:
    ap = common.arguments(__doc__, "1024,4096", gpu=True)
    args = ap.parse_args()
    kind = "gpu" if args.gpu else "cpu"
    results = []
    with tempfile.TemporaryDirectory(dir=args.dir, prefix="tpagent-bench-") as d:
        work = Path(d)
        # (a GPU job's images are never streamed: no "files" route beside it)
        c = Cluster(work, ["A", "B", "C", "D"] if kind == "cpu" else ["A", "B"])
        try:
            for name, node in c.nodes.items():
                node.start_agent(stream_buffer_mib="0" if name in "CD" else str(STREAM_BUFFER_MIB))
            for size in (int(x) for x in args.sizes_mib.split(",")):
                rounds = []
                for _ in range(args.repeats):  # interleaved: drift hits both routes alike
                    warm(size)
                    t = tpagent_round(kind, size, work, c)
                    if kind == "cpu":
                        warm(size)
                        t |= tpagent_round(kind, size, work, c, "files")
                    warm(size)
                    rounds.append(t | naive_round(kind, size, work))
                keys = sorted({k for r in rounds for k in r})
                med = {k: statistics.median(r.get(k, 0.0) for r in rounds) for k in keys}
                results.append(
                    {
                        "kind": kind,
                        "size_mib": size,
                        "repeats": args.repeats,
                        **med,
                        "downtime_ratio_to_naive": med["tpagent_downtime"] / med["naive_downtime"],
                        "files_ratio_to_naive": med.get("files_downtime", 0.0) / med["naive_downtime"],
                    }
                )
        finally:
            c.close()
    cols = [
        "tpagent_freeze",
        "tpagent_freeze_and_send",
        "tpagent_restore",
        "tpagent_downtime",
        "files_freeze",
        "files_downtime",
        "naive_dump",
        "naive_copy",
        "naive_restore",
        "naive_downtime",
        "tpagent_cpu",
        "files_cpu",
        "naive_cpu",
    ]
    print(f"{'size':>8} " + " ".join(f"{c:>24}" for c in cols) + f" {'x naive':>8} {'files x naive':>14}")
    for r in results:
        print(
            f"{r['size_mib']:>6}Mi "
            + " ".join(f"{r.get(c, 0.0):>24.2f}" for c in cols)
            + f" {r['downtime_ratio_to_naive']:>8.2f} {r['files_ratio_to_naive']:>14.2f}"
        )
    doc = {"benchmark": "migrate", "dir": str(args.dir), "results": results}
    common.emit(args, doc)


if __name__ == "__main__":
    main()
