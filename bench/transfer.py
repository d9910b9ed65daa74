"""Benchmark: moving a snapshot between two nodes, beside the raw floor and the naive route.

    python bench/transfer.py [--sizes-mib 1024,4096] [--repeats 3] [--dir /dev/shm] [--streams 4] [--json-out F]

In one run, for each size of model-like data (3/8 float32 and bf16 weights drawn like
randn*0.02, 3/8 Adam-like moments, 1/4 zeros), sender and receiver on loopback:
  * floor:   plain sockets (as many as tpagent's streams) moving the same bytes, no framing,
             read from the snapshot files and written into files on the receiving side;
  * tpagent: transfer.stream over TCP with --compress none / auto / zstd, over TCP in mutual
             TLS (none / auto: what encryption costs), and over UCX (none / auto), end to end
             (authentication, chunk CRCs, the receiver's SHA-256 verification);
  * naive:   `tar -c | zstd -1 -T0` over one socket into `zstd -d | tar -x`.
Prints GB/s (raw bytes / wall time), the wire ratio, CPU seconds per GB (this process and its
children: sender and receiver run in it) and the ratio to the floor, medians over --repeats,
as a table and then one JSON object.
"""

from __future__ import annotations

import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]

import common  # noqa: E402

from host.proc import ProcInfo  # noqa: E402
from snapshot.manifest import Manifest, checksum_files  # noqa: E402
from support.certs import node_certs  # noqa: E402
from transfer.api import Compress, TlsFiles, TransferConfig, Transport  # noqa: E402
from transfer.receiver import Receiver  # noqa: E402
from transfer.sender import Sender  # noqa: E402
from transfer.tcp import TcpTransport  # noqa: E402
from transfer.ucx import UcxTransport  # noqa: E402

os.environ.setdefault("UCX_TLS", "tcp")  # RDMA where present: run with UCX_TLS unset there

SECRET = os.urandom(32)


def model_like(path: Path, nbytes: int) -> None:
    rng = np.random.default_rng(0)
    block = 64 << 20
    with open(path, "wb") as f:
        for off in range(0, nbytes, block):
            n = min(block, nbytes - off)
            part = off * 8 // nbytes  # eighths of the file: weights, bf16, moments, zeros
            if part < 2:
                f.write((rng.standard_normal(n // 4) * 0.02).astype(np.float32).tobytes())
            elif part < 3:
                f.write(
                    ((rng.standard_normal(n // 2) * 0.02).astype(np.float32).view(np.uint32) >> 16)
                    .astype(np.uint16)
                    .tobytes()
                )
            elif part < 6:
                f.write((np.abs(rng.standard_normal(n // 4)) * 1e-4).astype(np.float32).tobytes())
            else:
                f.write(bytes(n))


def make_snapshot(directory: Path, nbytes: int) -> None:
    (directory / "images").mkdir(parents=True)
    model_like(directory / "images" / "pages-1.img", nbytes)
    m = Manifest(
        root_pid=1,
        namespace=False,
        processes=[ProcInfo(1, 0, ("bench",), (1,), False)],
        gpus=[],
        criu={"version": "4.2.1", "shell_job": False, "tcp_established": False},
        cuda={"driver_version": None, "pids": []},
        tpagent_version="bench",
    )
    m.files = checksum_files(directory)
    m.write(directory)


def timed(fn: Callable[[], int]) -> dict[str, float]:
    c0 = common.cpu_seconds()
    t0 = time.monotonic()
    wire = fn()
    return {"seconds": time.monotonic() - t0, "cpu_seconds": common.cpu_seconds() - c0, "wire_bytes": wire}


def floor(src: Path, dst: Path, streams: int) -> int:
    """Each of ``streams`` connections moves an equal slice of every file, no framing at all."""
    files = sorted(p for p in src.rglob("*") if p.is_file())
    server = socket.create_server(("127.0.0.1", 0))
    port = server.getsockname()[1]
    total = sum(p.stat().st_size for p in files)
    for p in files:
        out = dst / p.relative_to(src)
        out.parent.mkdir(parents=True, exist_ok=True)
        with open(out, "wb") as f:
            f.truncate(p.stat().st_size)

    def slices(k: int) -> list[tuple[Path, int, int]]:
        out = []
        for p in files:
            size = p.stat().st_size
            per = -(-size // streams)
            if k * per < size:
                out.append((p, k * per, min(per, size - k * per)))
        return out

    def recv(k: int) -> None:
        conn, _ = server.accept()
        idx = int.from_bytes(conn.recv(1), "little")
        buf = memoryview(bytearray(8 << 20))
        for p, off, length in slices(idx):
            fd = os.open(dst / p.relative_to(src), os.O_WRONLY)
            while length:
                want = min(len(buf), length)
                got = 0
                while got < want:  # fill the buffer, then one large write, as tpagent does
                    got += conn.recv_into(buf[got:want])
                os.pwrite(fd, buf[:want], off)
                off += want
                length -= want
            os.close(fd)
        conn.close()

    def send(k: int) -> None:
        s = socket.create_connection(("127.0.0.1", port))
        s.sendall(bytes([k]))
        for p, off, length in slices(k):
            fd = os.open(p, os.O_RDONLY)
            for o in range(off, off + length, 8 << 20):
                s.sendall(os.pread(fd, min(8 << 20, off + length - o), o))
            os.close(fd)
        s.close()

    threads = [threading.Thread(target=recv, args=(k,)) for k in range(streams)]
    threads += [threading.Thread(target=send, args=(k,)) for k in range(streams)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    server.close()
    return total


def tpagent(
    src: Path, dst: Path, streams: int, compress: Compress, transport: Callable[[], Transport] = TcpTransport
) -> int:
    cfg = TransferConfig(secret=SECRET, streams=streams, compress=compress)
    receiver = Receiver(transport(), cfg, "127.0.0.1:0")
    got: list[object] = []
    t = threading.Thread(target=lambda: got.append(receiver.receive(dst, 600)))
    t.start()
    stats = Sender(transport(), cfg).send(src, receiver.address)
    t.join()
    receiver.close()
    return stats.bytes_wire


def naive(src: Path, dst: Path) -> int:
    dst.mkdir()
    server = socket.create_server(("127.0.0.1", 0))
    port = server.getsockname()[1]
    counted = [0]

    def recv() -> None:
        conn, _ = server.accept()
        with subprocess.Popen(
            "zstd -d -q | tar -x -C " + str(dst), shell=True, stdin=subprocess.PIPE
        ) as p:  # bench only, fixed paths
            assert p.stdin is not None
            while data := conn.recv(1 << 20):
                counted[0] += len(data)
                p.stdin.write(data)
            p.stdin.close()
        conn.close()

    t = threading.Thread(target=recv)
    t.start()
    s = socket.create_connection(("127.0.0.1", port))
    with subprocess.Popen(f"tar -c -C {src} . | zstd -1 -T0 -q", shell=True, stdout=subprocess.PIPE) as p:
        assert p.stdout is not None
        while data := p.stdout.read(1 << 20):
            s.sendall(data)
    s.close()
    t.join()
    server.close()
    return counted[0]


def main() -> None:
    ap = common.arguments(__doc__, "1024,4096", gpu=False)
    ap.add_argument("--streams", type=int, default=4)
    args = ap.parse_args()
    certs = Path(tempfile.mkdtemp(prefix="tpagent-bench-certs-"))
    tls = TlsFiles.in_dir(node_certs(certs, "bench"))  # both ends use it: one CA is what counts
    routes: dict[str, Callable[[Path, Path], int]] = {
        "floor": lambda s, d: floor(s, d, args.streams),
        "tpagent-none": lambda s, d: tpagent(s, d, args.streams, Compress.NONE),
        "tpagent-auto": lambda s, d: tpagent(s, d, args.streams, Compress.AUTO),
        "tpagent-zstd": lambda s, d: tpagent(s, d, args.streams, Compress.ZSTD),
        "tpagent-tls-none": lambda s, d: tpagent(s, d, args.streams, Compress.NONE, lambda: TcpTransport(tls=tls)),
        "tpagent-tls-auto": lambda s, d: tpagent(s, d, args.streams, Compress.AUTO, lambda: TcpTransport(tls=tls)),
        "tpagent-ucx-none": lambda s, d: tpagent(s, d, args.streams, Compress.NONE, UcxTransport),
        "tpagent-ucx-auto": lambda s, d: tpagent(s, d, args.streams, Compress.AUTO, UcxTransport),
        "naive-tar-zstd": naive,
    }
    results = []
    try:
        for size in (int(x) for x in args.sizes_mib.split(",")):
            work = Path(tempfile.mkdtemp(dir=args.dir, prefix="tpagent-bench-"))
            try:
                make_snapshot(work / "src", size << 20)
                raw = sum(p.stat().st_size for p in (work / "src").rglob("*") if p.is_file())
                routes["floor"](work / "src", work / "dst")  # untimed warm-up: the first pass after
                shutil.rmtree(work / "dst")  # making the data runs far slower, whatever the route
                runs: dict[str, list[dict[str, float]]] = {r: [] for r in routes}
                for _ in range(args.repeats):
                    for name, route in routes.items():  # interleaved: drift hits every route alike
                        # (timed() calls the lambda at once, in this iteration)
                        runs[name].append(timed(lambda: route(work / "src", work / "dst")))  # noqa: B023
                        shutil.rmtree(work / "dst")
                floor_s = statistics.median(r["seconds"] for r in runs["floor"])
                for name, rs in runs.items():
                    sec = statistics.median(r["seconds"] for r in rs)
                    results.append(
                        {
                            "size_mib": size,
                            "route": name,
                            "seconds": sec,
                            "gb_per_s": raw / sec / 1e9,
                            "ratio": raw / statistics.median(r["wire_bytes"] for r in rs),
                            "cpu_s_per_gb": statistics.median(r["cpu_seconds"] for r in rs) / (raw / 1e9),
                            "of_floor": floor_s / sec,
                            "repeats": args.repeats,
                        }
                    )
            finally:
                shutil.rmtree(work, ignore_errors=True)
    finally:
        shutil.rmtree(certs, ignore_errors=True)
    print(f"{'size':>7} {'route':<16} {'GB/s':>6} {'ratio':>6} {'CPU s/GB':>9} {'x floor':>8}")
    for r in results:
        print(
            f"{r['size_mib']:>5}Mi {r['route']:<16} {r['gb_per_s']:>6.2f} {r['ratio']:>6.2f} "
            f"{r['cpu_s_per_gb']:>9.2f} {r['of_floor']:>8.2f}"
        )
    doc = {"benchmark": "transfer", "streams": args.streams, "dir": str(args.dir), "results": results}
    common.emit(args, doc)


if __name__ == "__main__":
    main()
