"""Benchmark: dump a process and move its snapshot to a peer — send after the dump, or while it runs.

    python bench/pipeline.py [--sizes-mib 1024] [--repeats 3] [--dir /dev/shm] [--json-out F]

For each size a fresh workload (tests/workloads/stateful.py holding that much state) is
dumped by each route in turn (interleaved, so drift hits every route alike), to a receiver on
loopback; each time is from the start of the dump until the receiver has verified the snapshot:
  * dump-only:   dump.checkpoint alone (no transfer): the floor of any route;
  * sequential:  the dump, then transfer.stream's send (the `tpagent dump` + `tpagent send` route);
  * overlapped:  the send follows the images while CRIU writes them (`tpagent dump --send-to`);
  * naive:       bare `criu dump`, then `tar | zstd -1 -T0` over one socket into `zstd -d | tar -x`.
Medians over --repeats.  Must run as root.  Prints a table, then one JSON object.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]


def _bench(name: str):  # type: ignore[no-untyped-def]
    """A sibling benchmark as a module (its name would clash with the package of that name)."""
    spec = importlib.util.spec_from_file_location(f"bench_{name}", ROOT / "bench" / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


import common  # noqa: E402

from snapshot.criu import Criu, DumpOptions  # noqa: E402
from snapshot.dump import checkpoint  # noqa: E402
from snapshot.manifest import load  # noqa: E402
from transfer.api import TransferConfig  # noqa: E402
from transfer.pipeline import dump_and_send  # noqa: E402
from transfer.receiver import Receiver  # noqa: E402
from transfer.sender import Sender  # noqa: E402
from transfer.tcp import TcpTransport  # noqa: E402

naive = _bench("transfer").naive

CFG = TransferConfig(secret=os.urandom(32))


def receiving(dst: Path) -> tuple[str, Callable[[], None]]:
    receiver = Receiver(TcpTransport(), CFG, "127.0.0.1:0")
    t = threading.Thread(target=receiver.receive, args=(dst, 600), daemon=True)
    t.start()

    def join() -> None:
        t.join()
        receiver.close()
        load(dst)  # it arrived, verified, under its name

    return receiver.address, join


def route(name: str, size: int, work: Path) -> float:
    p = common.start("cpu", size, work / "w.log")
    snap = work / "snap"
    dst = work / "dst"
    t0 = time.monotonic()
    if name == "dump-only":
        checkpoint(p.pid, snap)
    elif name == "naive":
        snap.mkdir()
        Criu().dump(p.pid, snap, snap, DumpOptions(), 3600)
        naive(snap, dst)
    else:
        address, join = receiving(dst)
        t0 = time.monotonic()
        dump_and_send(p.pid, snap, address, Sender(TcpTransport(), CFG), overlap=name == "overlapped")
        join()
    seconds = time.monotonic() - t0
    p.wait()
    for d in (snap, dst, work / "w.log"):
        shutil.rmtree(d, ignore_errors=True) if d.is_dir() else d.unlink(missing_ok=True)
    return seconds


def main() -> None:
    ap = common.arguments(__doc__, "1024", gpu=False)
    args = ap.parse_args()
    names = ["dump-only", "sequential", "overlapped", "naive"]
    results = []
    for size in (int(x) for x in args.sizes_mib.split(",")):
        runs: dict[str, list[float]] = {n: [] for n in names}
        with tempfile.TemporaryDirectory(dir=args.dir, prefix="tpagent-bench-") as d:
            for _ in range(args.repeats):
                for n in names:
                    runs[n].append(route(n, size, Path(d)))
        floor = statistics.median(runs["dump-only"])
        for n in names:
            sec = statistics.median(runs[n])
            results.append({"size_mib": size, "route": n, "seconds": sec, "x_dump_only": sec / floor, "runs": runs[n]})
    print(f"{'size':>7} {'route':<12} {'seconds':>8} {'x dump-only':>12}")
    for r in results:
        print(f"{r['size_mib']:>5}Mi {r['route']:<12} {r['seconds']:>8.2f} {r['x_dump_only']:>12.2f}")
    doc = {"benchmark": "pipeline", "dir": str(args.dir), "repeats": args.repeats, "results": results}
    common.emit(args, doc)


if __name__ == "__main__":
    main()
