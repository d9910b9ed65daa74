"""Benchmark: time of each checkpoint/restore stage per state size, beside the floor and naive CRIU.

    python bench/snapshot.py [--sizes-mib 256,1024] [--repeats 3] [--dir /dev/shm] [--gpu] [--json-out F]

For each size a workload holding that much state is started, then, in one run:
  * tpagent: dump.checkpoint (CUDA lock+checkpoint, criu dump, checksums+manifest) and
    restore.restore (verify, criu restore, CUDA restore+unlock), per stage;
  * naive:   bare `criu dump` / `criu restore` of the same workload, no manifest, no checks
             (a GPU workload: the driver's lock+checkpoint before, restore+unlock after, as
             `cuda-checkpoint` and criu run by hand would do);
  * floor:   writing / reading the same number of bytes to / from the same directory;
  * the seal: the same images hashed again with SHA-256 (what format 1 sealed with) and with
             BLAKE3 (what the checkpoint's own ``checksum`` stage uses now), side by side.
Medians over --repeats, after one untimed warm-up round, tpagent and naive taking turns at
going first; the table's ratios are tpagent's time over the naive and floor times.
--gpu holds the state on the GPU (tests/workloads/gpu_hold.py, sizes in GiB of GPU memory).
Must run as root.  Prints a table, then one JSON object.
"""

from __future__ import annotations

import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]

import common  # noqa: E402

from snapshot import manifest, restore  # noqa: E402
from snapshot.criu import Criu, DumpOptions, RestoreOptions  # noqa: E402
from snapshot.cuda import CudaDriver  # noqa: E402
from snapshot.dump import checkpoint  # noqa: E402
from support.helpers import kill_and_wait  # noqa: E402


def one_round(kind: str, size: int, work: Path, naive_first: bool) -> dict[str, float]:
    out: dict[str, float] = {}
    if naive_first:
        naive_round(kind, size, work, out)
    tpagent_round(kind, size, work, out)
    if not naive_first:
        naive_round(kind, size, work, out)
    out["floor_write_s"], out["floor_read_s"] = common.floor(int(out["image_bytes"]), work)
    return out


def tpagent_round(kind: str, size: int, work: Path, out: dict[str, float]) -> None:
    log = work / "w.log"
    p = common.start(kind, size, log)
    t0 = time.monotonic()
    m = checkpoint(p.pid, work / "snap")
    out["tpagent_dump_s"] = time.monotonic() - t0
    p.wait()
    t0 = time.monotonic()
    r = restore.restore(work / "snap")
    out["tpagent_restore_s"] = time.monotonic() - t0
    out.update({f"{k}_s": v for k, v in {**m.timings, **r.timings}.items()})
    out["image_bytes"] = m.total_bytes
    for digest in ("sha256", manifest.DIGEST):  # (the same images sealed as format 1 did, and as now)
        t0 = time.monotonic()
        manifest.checksum_files(work / "snap", digest=digest)
        out[f"seal_{digest}_s"] = time.monotonic() - t0
    kill_and_wait(r.pid)
    shutil.rmtree(work / "snap")
    log.unlink()


def naive_round(kind: str, size: int, work: Path, out: dict[str, float]) -> None:
    """The same workload, bare criu (and, on a GPU, the driver's calls) with no checks."""
    log = work / "w.log"
    criu = Criu()
    p = common.start(kind, size, log)
    images = work / "naive"
    images.mkdir()
    cuda = CudaDriver() if kind == "gpu" else None
    t0 = time.monotonic()
    if cuda is not None:
        cuda.lock(p.pid, 30)
        cuda.checkpoint(p.pid)
    criu.dump(p.pid, images, images, DumpOptions(), 3600)
    out["naive_dump_s"] = time.monotonic() - t0
    p.wait()
    t0 = time.monotonic()
    pid = criu.restore(images, images, RestoreOptions(), 3600)
    if cuda is not None:
        cuda.restore(pid)
        cuda.unlock(pid)
    out["naive_restore_s"] = time.monotonic() - t0
    kill_and_wait(pid)
    shutil.rmtree(images)
    log.unlink()


def main() -> None:
    ap = common.arguments(__doc__, "256,1024", gpu=True)
    args = ap.parse_args()
    kind = "gpu" if args.gpu else "cpu"
    results = []
    for size in (int(s) for s in args.sizes_mib.split(",")):
        rounds = []
        # A first, untimed round: this VM hands out never-touched memory slowly, and whichever
        # route ran first would pay for it.  Then the routes take turns at going first.
        for i in range(args.repeats + 1):
            with tempfile.TemporaryDirectory(dir=args.dir) as d:
                r = one_round(kind, size, Path(d), naive_first=i % 2 == 0)
            if i:
                rounds.append(r)
        med = {k: statistics.median(r.get(k, 0.0) for r in rounds) for k in rounds[0]}
        gb = med["image_bytes"] / 1e9
        rates = {
            f"{who}_{op}_gbps": round(gb / med[f"{who}_{op}_s"], 3)
            for who in ("tpagent", "naive")
            for op in ("dump", "restore")
        }
        results.append({"kind": kind, "size_mib": size, "repeats": args.repeats, **med, **rates})

    cols = [
        "cuda_checkpoint_s",
        "criu_dump_s",
        "checksum_s",
        "seal_sha256_s",
        "seal_blake3_s",
        "tpagent_dump_s",
        "naive_dump_s",
        "floor_write_s",
        "verify_s",
        "criu_restore_s",
        "cuda_restore_s",
        "tpagent_restore_s",
        "naive_restore_s",
        "floor_read_s",
    ]
    head = f"{'size':>8} {'image GiB':>9} " + " ".join(f"{c[:-2]:>17}" for c in cols)
    print(head)
    for r in results:
        print(
            f"{r['size_mib']:>6}Mi {r['image_bytes'] / 2**30:>9.2f} "
            + " ".join(f"{r.get(c, 0.0):>17.2f}" for c in cols)
        )
    print()
    for r in results:
        gb = r["image_bytes"] / 1e9
        print(
            f"{r['size_mib']:>6}Mi  dump {gb / r['tpagent_dump_s']:.2f} GB/s "
            f"(x{r['tpagent_dump_s'] / r['naive_dump_s']:.2f} naive, "
            f"x{r['tpagent_dump_s'] / r['floor_write_s']:.2f} floor)   restore {gb / r['tpagent_restore_s']:.2f} GB/s "
            f"(x{r['tpagent_restore_s'] / r['naive_restore_s']:.2f} naive, "
            f"x{r['tpagent_restore_s'] / r['floor_read_s']:.2f} floor)"
        )
    doc = {"benchmark": "snapshot", "dir": str(args.dir), "results": results}
    common.emit(args, doc)


if __name__ == "__main__":
    main()
