"""Test workload: a trainer whose batch workers are forked (no exec) after it opened and mapped
a device, as DataLoader workers are forked after CUDA started.

    python forked_workers.py LOG LIB DEVICE [--own] [--workers N]

It maps LIB (a file named like the CUDA driver library, so that tpagent's detection takes it
for a CUDA process), opens DEVICE and maps 1 MiB of it shared (the stand-in of the driver's
mappings), fills it, and forks N workers (default 2; each runs a second thread).  Every 20 ms it
asks worker ``k % N`` for batch ``k`` over a pipe and writes ``tick K batch HEX from PID`` to
LOG, having checked the batch (the SHA-256 of ``batch K``); a wrong or missing batch writes
``broken K ...`` and exits 1.
With ``--own`` each worker also opens DEVICE itself (as a process driving the GPU through NVML
would).
SIGUSR1 makes it fork one more worker at its next batch (``forked N`` in LOG), as a DataLoader
forks its next epoch's.
"""

import argparse
import hashlib
import io
import mmap
import os
import signal
import sys
import threading
import time

ap = argparse.ArgumentParser()
ap.add_argument("log")
ap.add_argument("lib")
ap.add_argument("device")
ap.add_argument("--own", action="store_true")
ap.add_argument("--workers", type=int, default=2)
args = ap.parse_args()

with open(args.lib, "rb") as f:
    lib = mmap.mmap(f.fileno(), 0, prot=mmap.PROT_READ)
dev_fd = os.open(args.device, os.O_RDWR | os.O_CREAT, 0o600)
os.ftruncate(dev_fd, 1 << 20)
dev = mmap.mmap(dev_fd, 1 << 20, mmap.MAP_SHARED)
dev[:] = bytes(range(256)) * 4096


def batch(k: int) -> str:
    return hashlib.sha256(f"batch {k}".encode()).hexdigest()[:16]


def ticking() -> None:
    while True:
        time.sleep(0.002)


def serve(requests: int, replies: int) -> None:
    threading.Thread(target=ticking, daemon=True).start()  # (a worker of two threads, both seized)
    with os.fdopen(requests, "rb", buffering=0) as inp, os.fdopen(replies, "wb", buffering=0) as out:
        while line := inp.readline():
            k = int(line)
            out.write(f"{batch(k)} {os.getpid()}\n".encode())


def start_worker() -> None:
    req_r, req_w = os.pipe()
    rep_r, rep_w = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(req_w)
        os.close(rep_r)
        if args.own:
            os.open(args.device, os.O_RDONLY)  # (kept open: the worker's own descriptor)
        serve(req_r, rep_w)
        os._exit(0)
    os.close(req_r)
    os.close(rep_w)
    workers.append((os.fdopen(req_w, "wb", buffering=0), os.fdopen(rep_r, "rb", buffering=0)))


workers: list[tuple[io.RawIOBase, io.RawIOBase]] = []
for _ in range(args.workers):
    start_worker()
more = threading.Event()
signal.signal(signal.SIGUSR1, lambda *_: more.set())  # one more worker, forked at once (a new epoch's)

with open(args.log, "a", buffering=1) as log:
    k = 0
    while True:
        if more.is_set():
            more.clear()
            start_worker()
            log.write(f"forked {len(workers)}\n")
        ask, answer = workers[k % len(workers)]
        ask.write(f"{k}\n".encode())
        reply = answer.readline().split()
        want = batch(k)
        if len(reply) != 2 or reply[0].decode() != want:
            log.write(f"broken {k} {reply}\n")
            sys.exit(1)
        log.write(f"tick {k} batch {want} from {int(reply[1])}\n")
        k += 1
        time.sleep(0.02)
