"""Benchmark: the training state a model-aware move hands over (issue 27), against the naive
route and the floor, at a few model sizes.

    python bench/aware.py [--sizes-mib 16,128,512] [--repeats 3] [--dir /var/tmp] [--json-out F] [--gpu]
    python bench/aware.py --agents [--widths 64,65536,1048576] [--repeats 3]   (as root)
    python bench/aware.py --lost [--widths 64,65536,1048576] [--repeats 3] [--lost-nodes C,A,C/quiet]  (as root)

For a model of about SIZE MiB of fp32 parameters (Linear layers) with its Adam state (twice as
much again, taken after one step), registered as a script registers it (tpagent_rank.register),
in this process (the leaving rank's model, and a second one as the joiner's):

* **aware** (ours): ``save`` (the registered state serialized in memory, GPU tensors copied to
  host as they are written), ``hand-over`` (offered once on loopback TCP and fetched by proving
  the move's secret, MAC checked: tpagent_rank.handover), ``load`` (torch's safe loader, then
  the script's load_state_dict).  The part of a move's downtime that grows with the model.
* **naive**: the checkpoint route: torch.save to a file in --dir, fsync, the file copied through a
  loopback socket to another file there (the target's disk), fsync, torch.load, load_state_dict.
* **floor**: the same bytes copied once in memory, and sent through a loopback socket unframed:
  the least any hand-over of them does.

With ``--agents``: whole moves between agents on namespace nodes instead, model-aware beside
transparent, of the same rank of a running torchrun job (``bench/aware_moves.py`` says how).
With ``--lost``: unplanned recovery, a node of a running job killed outright and the job rebuilt
from its replicas, its time split into stages beside the naive relaunch (``bench/aware_lost.py``).

Bytes: the state handed over, beside what a transparent move of the same rank would carry at
the least: the process's anonymous memory as it holds the model (smaps_rollup ``Anonymous``;
GPU memory on top with --gpu).  Medians over --repeats.  Prints a table, then one JSON object.
"""

from __future__ import annotations

import mmap
import os
import secrets
import socket
import statistics
import sys
import threading
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.common import arguments, emit  # noqa: E402
from tpagent_rank import aware, handover  # noqa: E402


def _model(size_mib: int, device: str) -> tuple[Any, Any]:
    """A stack of square Linear layers of about ``size_mib`` of parameters, and its Adam, stepped once."""
    import torch

    width = 1024
    layers = max(1, round(size_mib * (1 << 20) / (4 * width * (width + 1))))
    torch.manual_seed(0)
    net = torch.nn.Sequential(*[torch.nn.Linear(width, width) for _ in range(layers)]).to(device)
    opt = torch.optim.Adam(net.parameters(), lr=1e-3)
    net(torch.randn(4, width, device=device)).sum().backward()
    opt.step()
    return net, opt


def _register(net: Any, opt: Any) -> None:
    def load(state: dict[str, Any]) -> None:
        net.load_state_dict(state["model"])
        opt.load_state_dict(state["opt"])

    aware.register(save=lambda: {"model": net.state_dict(), "opt": opt.state_dict(), "step": 1}, load=load)


def _sync(device: str) -> None:
    if device == "cuda":
        import torch

        torch.cuda.synchronize()


def _anonymous() -> int:
    for line in Path("/proc/self/smaps_rollup").read_text().splitlines():
        if line.startswith("Anonymous:"):
            return int(line.split()[1]) * 1024
    return 0


def _aware(device: str) -> dict[str, float]:
    """As the ranks do it (tpagent_rank.join): saved into a file in memory, offered from a map
    of it, fetched into another, loaded from that one mapped."""
    t0 = time.perf_counter()
    with aware.memory_file() as out:
        n = aware.write_state(out)
        out.flush()
        data = mmap.mmap(out.fileno(), n, prot=mmap.PROT_READ)
    t1 = time.perf_counter()
    secret = secrets.token_hex(32)
    offer = handover.Offer(data, "127.0.0.1", secret, timeout=600)
    with aware.memory_file() as got:
        handover.fetch(f"127.0.0.1:{offer.port}", secret, n, got, timeout=600)
        got.flush()
        t2 = time.perf_counter()
        aware.read_state(got)
    _sync(device)
    t3 = time.perf_counter()
    return {"save": t1 - t0, "hand-over": t2 - t1, "load": t3 - t2, "total": t3 - t0, "bytes": float(n)}


def _naive(device: str, where: Path, net: Any, opt: Any) -> dict[str, float]:
    """A checkpoint written to disk, copied to the target's disk through a socket, read there."""
    import torch

    path = where / f"aware-bench-{os.getpid()}.pt"
    there = where / f"aware-bench-{os.getpid()}-there.pt"
    try:
        t0 = time.perf_counter()
        torch.save({"model": net.state_dict(), "opt": opt.state_dict(), "step": 1}, path)
        with open(path, "rb+") as f:
            os.fsync(f.fileno())
        t1 = time.perf_counter()
        a, b = _loopback_pair()
        with a, b, open(path, "rb") as src, open(there, "wb") as dst:
            reader = threading.Thread(target=lambda: _drain_into(b, dst))
            reader.start()
            a.sendfile(src)
            a.shutdown(socket.SHUT_WR)
            reader.join()
            dst.flush()
            os.fsync(dst.fileno())
        t2 = time.perf_counter()
        state = torch.load(there, map_location=device, weights_only=True)
        net.load_state_dict(state["model"])
        opt.load_state_dict(state["opt"])
        _sync(device)
        t3 = time.perf_counter()
    finally:
        path.unlink(missing_ok=True)
        there.unlink(missing_ok=True)
    return {"save": t1 - t0, "copy": t2 - t1, "load": t3 - t2, "total": t3 - t0}


def _drain_into(s: socket.socket, dst: Any) -> None:
    while chunk := s.recv(1 << 22):
        dst.write(chunk)


def _floor(n: int) -> dict[str, float]:
    data = os.urandom(1 << 20) * max(1, n >> 20)
    t0 = time.perf_counter()
    copy = bytearray(data)
    t1 = time.perf_counter()
    a, b = _loopback_pair()
    got = bytearray()

    def drain() -> None:
        while len(got) < len(data):
            chunk = b.recv(1 << 22)
            if not chunk:
                return
            got.extend(chunk)

    reader = threading.Thread(target=drain)
    reader.start()
    a.sendall(data)
    reader.join()
    t2 = time.perf_counter()
    a.close()
    b.close()
    del copy
    return {"copy": t1 - t0, "socket": t2 - t1}


def _loopback_pair() -> tuple[socket.socket, socket.socket]:
    with socket.create_server(("127.0.0.1", 0)) as server:
        a = socket.create_connection(server.getsockname())
        b, _ = server.accept()
    return a, b


def _median(runs: list[dict[str, float]]) -> dict[str, float]:
    return {k: round(statistics.median(r[k] for r in runs), 4) for k in runs[0]}


def main() -> None:
    ap = arguments(__doc__ or "", "16,128,512", gpu=True)
    ap.set_defaults(dir=Path("/var/tmp"))
    ap.add_argument("--agents", action="store_true", help="whole moves between agents, aware beside transparent")
    ap.add_argument("--lost", action="store_true", help="unplanned recovery: a node killed, the job rebuilt")
    ap.add_argument("--widths", default="64,65536,1048576", help="with --agents, --lost: the job's MLP widths")
    ap.add_argument(
        "--lost-nodes",
        default="C",
        help=(
            "with --lost: the nodes killed, each in runs of its own (A: the store's; "
            "C/quiet: its link cut first; C/silent: so, and quiet_after 0)"
        ),
    )
    args = ap.parse_args()
    if args.lost:
        from bench import aware_lost

        rows = aware_lost.run([int(w) for w in args.widths.split(",")], args.repeats, args.lost_nodes.split(","))
        emit(args, {"bench": "aware-lost", "repeats": args.repeats, "rows": rows})
        return
    if args.agents:
        from bench import aware_moves

        rows = aware_moves.run([int(w) for w in args.widths.split(",")], args.repeats)
        emit(args, {"bench": "aware-moves", "repeats": args.repeats, "rows": rows})
        return
    device = "cuda" if args.gpu else "cpu"
    rows = []
    for size in (int(s) for s in args.sizes_mib.split(",")):
        net, opt = _model(size, device)
        _register(net, opt)
        anonymous = _anonymous()
        ours = _median([_aware(device) for _ in range(args.repeats)])
        naive = _median([_naive(device, args.dir, net, opt) for _ in range(args.repeats)])
        floor = _median([_floor(int(ours["bytes"])) for _ in range(args.repeats)])
        gpu_bytes = 0
        if device == "cuda":
            import torch

            gpu_bytes = torch.cuda.memory_reserved()
        rows.append(
            {
                "size_mib": size,
                "state_bytes": int(ours.pop("bytes")),
                "process_anonymous_bytes": anonymous,
                "gpu_reserved_bytes": gpu_bytes,
                "aware_s": ours,
                "naive_s": naive,
                "floor_s": floor,
                "aware_over_naive": round(ours["total"] / naive["total"], 3) if naive["total"] else None,
                "aware_over_floor": round(ours["total"] / (floor["copy"] + floor["socket"]), 2),
            }
        )
        del net, opt
    print(f"model-aware hand-over on {device}, medians of {args.repeats} (seconds; MiB)")
    heads = ("size", "state", "anon", "save", "hand", "load", "aware", "naive", "floor")
    print(" ".join(f"{h:>{6 if i == 0 else 8 if i < 3 else 7}}" for i, h in enumerate(heads)))
    for r in rows:
        a, n, f = r["aware_s"], r["naive_s"], r["floor_s"]
        print(
            f"{r['size_mib']:>6} {r['state_bytes'] / 2**20:>8.1f} {r['process_anonymous_bytes'] / 2**20:>8.1f} "
            f"{a['save']:>7.3f} {a['hand-over']:>7.3f} {a['load']:>7.3f} {a['total']:>7.3f} {n['total']:>7.3f} "
            f"{f['copy'] + f['socket']:>7.3f}"
        )
    emit(args, {"bench": "aware", "device": device, "repeats": args.repeats, "rows": rows})


if __name__ == "__main__":
    main()
