"""Test workload: a trainer whose worker processes exit at every epoch's end, as DataLoader's do.

    python epoch_workers.py LOG HOLD

Every 20 ms it writes ``tick N reaped R`` to LOG (N counts up by one, R is how many workers
it has reaped).  At the end of each epoch (every 10 ticks, when no worker is left) it starts a
worker process whose main thread exits first (the raw exit syscall: only that thread ends)
while its other thread lives on: until the worker is gone, the kernel shows a zombie
that still has a thread, which CRIU refuses to dump ("Zombies with threads are not
supported").  That thread lingers while the file HOLD exists (without it, a few
milliseconds, as a DataLoader worker's last thread does), then ends the worker.
"""

import subprocess
import sys
import time

WORKER = """
import ctypes, os, sys, threading, time

def last_thread():
    while os.path.exists(sys.argv[1]):
        time.sleep(0.01)
    os._exit(0)

threading.Thread(target=last_thread).start()
ctypes.CDLL(None).syscall(60, 0)  # SYS_exit: the main thread alone ends; the process becomes a zombie with a thread
"""

log_path = sys.argv[1]
hold = sys.argv[2]
worker: subprocess.Popen[bytes] | None = None
reaped = 0
with open(log_path, "a", buffering=1) as log:
    tick = 0
    while True:
        if worker is not None and worker.poll() is not None:
            worker = None
            reaped = reaped + 1
        if worker is None and tick % 10 == 9:
            worker = subprocess.Popen([sys.executable, "-c", WORKER, hold], stdin=subprocess.DEVNULL)
        log.write(f"tick {tick} reaped {reaped}\n")
        tick += 1
        time.sleep(0.02)
