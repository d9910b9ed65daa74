"""What every benchmark here takes on its command line."""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent


def arguments(doc: str, sizes_mib: str, gpu: bool = False) -> argparse.ArgumentParser:
    """--sizes-mib, --repeats, --dir (where images live), --json-out, and --gpu where it applies."""
    ap = argparse.ArgumentParser(description=doc.splitlines()[0])
    ap.add_argument("--sizes-mib", default=sizes_mib)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--dir", type=Path, default=Path("/dev/shm"))
    ap.add_argument("--json-out", type=Path)
    if gpu:
        ap.add_argument("--gpu", action="store_true")
    return ap


def emit(args: argparse.Namespace, doc: dict[str, Any]) -> None:
    """The result as one JSON line on stdout (the last line), and in --json-out if given."""
    print(json.dumps(doc))
    if args.json_out:
        args.json_out.write_text(json.dumps(doc, indent=2))


def cpu_seconds() -> float:
    """CPU time of this process and of its children that ended, so far."""
    me = resource.getrusage(resource.RUSAGE_SELF)
    kids = resource.getrusage(resource.RUSAGE_CHILDREN)
    return me.ru_utime + me.ru_stime + kids.ru_utime + kids.ru_stime


def workload(kind: str, size_mib: int, log: Path) -> tuple[list[str], str]:
    """The command of a workload holding ``size_mib`` of state ("cpu": tests/workloads/stateful.py;
    "gpu": gpu_hold.py, GPU memory), and what its log ``log`` says once it runs."""
    if kind == "gpu":
        return [sys.executable, str(ROOT / "tests/workloads/gpu_hold.py"), str(log), str(size_mib / 1024)], "step "
    return [sys.executable, str(ROOT / "tests/workloads/stateful.py"), str(log), str(size_mib)], "tick "


def start(kind: str, size_mib: int, log: Path) -> subprocess.Popen[bytes]:
    """The :func:`workload`, started, once it says it runs."""
    from support.helpers import wait_until  # (tests/ is on the path of the benches that start workloads)

    cmd, ready = workload(kind, size_mib, log)
    p = subprocess.Popen(
        cmd, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True
    )
    wait_until(lambda: log.exists() and ready in log.read_text(), "the workload to start", 600)
    return p


def floor(nbytes: int, directory: Path) -> tuple[float, float]:
    """Seconds to write then read ``nbytes`` in 64 MiB blocks to/from a new file in ``directory``."""
    block = os.urandom(64 << 20)
    path = directory / "floor.bin"
    t0 = time.monotonic()
    with open(path, "wb") as f:
        for _ in range(max(1, nbytes // len(block))):
            f.write(block)
    t_write = time.monotonic() - t0
    t0 = time.monotonic()
    with open(path, "rb") as f:
        while f.readinto(bytearray(len(block))):  # a fresh buffer each time: first-touch like restore
            pass
    t_read = time.monotonic() - t0
    path.unlink()
    return t_write, t_read
