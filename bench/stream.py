"""Benchmark: how CRIU's pages leave the source, three ways, for issue 29's item 1.

    python bench/stream.py [--sizes-mib 1024] [--repeats 5] [--dir /dev/shm] [--json-out F]

The same running workload (``tests/workloads/stateful.py``, dumped ``--leave-running``) is dumped
each round by every route, the routes taking turns at going first:

  * files:       today's route: ``criu dump`` writes every image into ``--dir``, then the seal
                 hashes them (BLAKE3, 8 MiB chunks, all cores: ``manifest.checksum_files``);
  * stream:      ``criu dump --stream``: CRIU hands each image over a pipe to
                 :class:`snapshot.streamer.Capture`, which reads each into a reused buffer and
                 hashes it chunk by chunk as it arrives; nothing is written;
  * page-server: ``criu dump --page-server`` to ``criu page-server`` on the same node (TCP on
                 loopback), which writes the pages into ``--dir``; not hashed.

What each route leaves is what a transfer would then send: files to read back, or chunks in
memory already hashed, or files on the page server's side.  The table gives the seconds from the
start of the dump until the images are hashed (or written), the CPU seconds of this process and
its children (CRIU, the page server; not the workload's), and the write floor (64 MiB blocks
into a new file in ``--dir``).  Must run as root.  Prints a table, then one JSON object.
"""

from __future__ import annotations

import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]

import common  # noqa: E402

from snapshot import manifest  # noqa: E402
from snapshot.criu import Criu  # noqa: E402
from snapshot.streamer import Capture  # noqa: E402
from support.helpers import kill_and_wait  # noqa: E402


def _dump_args(criu: Criu, pid: int, images: Path, work: Path) -> list[str]:
    return [str(criu.path), "dump", "-t", str(pid), "-D", str(images), "-W", str(work), "-o", "dump.log", "-v1"] + [
        "--leave-running",
        *Criu._common(False, False),
    ]


def _run(args: list[str]) -> None:
    subprocess.run(args, check=True, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)


def route_files(criu: Criu, pid: int, work: Path) -> dict[str, float]:
    (work / "images").mkdir(mode=0o700)
    t0 = time.monotonic()
    _run(_dump_args(criu, pid, work / "images", work))
    t1 = time.monotonic()
    sealed = manifest.checksum_files(work)
    t2 = time.monotonic()
    return {"dump_s": t1 - t0, "hash_s": t2 - t1, "bytes": sum(f["size"] for f in sealed.values())}


def route_stream(criu: Criu, pid: int, work: Path) -> dict[str, float]:
    (work / "images").mkdir(mode=0o700)
    capture = Capture(work / "images")  # hashes each chunk as it comes, hands it to no one
    t0 = time.monotonic()
    try:
        _run([*_dump_args(criu, pid, work / "images", work), "--stream"])
    finally:
        t1 = time.monotonic()
        images = capture.close(60)  # (CRIU has closed its pipes: the last chunks' hashes)
    t2 = time.monotonic()
    return {"dump_s": t1 - t0, "hash_s": t2 - t1, "bytes": sum(i.size for i in images.values())}


def route_page_server(criu: Criu, pid: int, work: Path) -> dict[str, float]:
    (work / "images").mkdir(mode=0o700)
    with socket.socket() as s:  # a free port (the page server binds it a moment later)
        s.bind(("127.0.0.1", 0))
        port = str(s.getsockname()[1])
    server = subprocess.Popen(
        [str(criu.path), "page-server", "-D", str(work / "images"), "--address", "127.0.0.1", "--port", port]
        + ["-W", str(work), "-o", "ps.log", "-v1"],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    deadline = time.monotonic() + 10
    while "listening" not in _read(work / "ps.log") and time.monotonic() < deadline:
        time.sleep(0.01)
    t0 = time.monotonic()
    try:
        _run([*_dump_args(criu, pid, work / "images", work), "--page-server", "--address", "127.0.0.1", "--port", port])
    finally:
        server.wait(30)
    t1 = time.monotonic()
    size = sum(p.stat().st_size for p in (work / "images").iterdir() if p.is_file())
    return {"dump_s": t1 - t0, "hash_s": 0.0, "bytes": size}


def _read(path: Path) -> str:
    try:
        return path.read_text(errors="replace").lower()
    except FileNotFoundError:
        return ""


ROUTES: dict[str, Callable[[Criu, int, Path], dict[str, float]]] = {
    "files": route_files,
    "stream": route_stream,
    "page-server": route_page_server,
}


def main() -> None:
    ap = common.arguments(__doc__, "1024")
    args = ap.parse_args()
    criu = Criu()
    results = []
    for size in (int(s) for s in args.sizes_mib.split(",")):
        runs: dict[str, list[dict[str, float]]] = {name: [] for name in ROUTES}
        floors = []
        with tempfile.TemporaryDirectory(dir=args.dir, prefix="tpagent-bench-") as d:
            log = Path(d) / "w.log"
            p = common.start("cpu", size, log)
            try:
                names = list(ROUTES)
                for i in range(args.repeats + 1):  # round 0: untimed, this VM's first touch
                    for name in names[i % len(names) :] + names[: i % len(names)]:
                        work = Path(tempfile.mkdtemp(dir=d, prefix=name + "-"))
                        c0 = common.cpu_seconds()
                        r = ROUTES[name](criu, p.pid, work)
                        r["cpu_s"] = common.cpu_seconds() - c0
                        shutil.rmtree(work)
                        if i:
                            runs[name].append(r)
                    if i:
                        floors.append(common.floor(size << 20, Path(d))[0])
            finally:
                kill_and_wait(p.pid)
        floor_s = statistics.median(floors)
        for name, rs in runs.items():
            med = {k: statistics.median(r[k] for r in rs) for k in rs[0]}
            total = med["dump_s"] + med["hash_s"]
            results.append(
                {"size_mib": size, "route": name, **med, "total_s": total, "of_floor": total / floor_s}
                | {"floor_write_s": floor_s, "repeats": args.repeats}
            )
    head = ("size", "route", "dump s", "+hash s", "total s", "CPU s", "x files", "x floor")
    print("{:>7} {:<12} {:>7} {:>8} {:>8} {:>6} {:>8} {:>8}".format(*head))
    for r in results:
        files = next(x for x in results if x["size_mib"] == r["size_mib"] and x["route"] == "files")
        print(
            f"{r['size_mib']:>5}Mi {r['route']:<12} {r['dump_s']:>7.2f} {r['hash_s']:>8.2f} {r['total_s']:>8.2f} "
            f"{r['cpu_s']:>6.2f} {r['total_s'] / files['total_s']:>8.2f} {r['of_floor']:>8.2f}"
        )
    floors_said = ", ".join(f"{r['size_mib']} MiB {r['floor_write_s']:.2f} s" for r in results[:: len(ROUTES)])
    print(f"write floor: {floors_said}")
    common.emit(args, {"benchmark": "stream", "dir": str(args.dir), "results": results})


if __name__ == "__main__":
    main()
