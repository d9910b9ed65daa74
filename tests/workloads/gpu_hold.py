"""GPU test workload: holds GIB GiB on the GPU, keeps stepping, and can prove its data intact.

    python gpu_hold.py LOG GIB

LOG gets ``ready`` once the tensor is filled, ``step N`` lines as it computes on the GPU,
and on SIGUSR1 ``verify ok`` or ``verify BAD`` after comparing the whole GPU tensor with
the host shadow copy it took at start.
"""

import signal
import sys
import threading
import time

import torch

log_path = sys.argv[1]
gib = float(sys.argv[2])
n = int(gib * 2**30) // 4
gen = torch.Generator(device="cuda").manual_seed(1234)
data = torch.randint(-(2**31), 2**31 - 1, (n,), dtype=torch.int32, device="cuda", generator=gen)
shadow = data.cpu()
small = torch.ones(1024, device="cuda")
asked = threading.Event()
signal.signal(signal.SIGUSR1, lambda *_: asked.set())
with open(log_path, "a", buffering=1) as log:
    log.write("ready\n")
    step = 0
    while True:
        if asked.is_set():
            asked.clear()
            ok = torch.equal(data.cpu(), shadow)
            log.write(f"verify {'ok' if ok else 'BAD'}\n")
        small.mul_(1.0001)
        torch.cuda.synchronize()
        log.write(f"step {step}\n")
        step += 1
        time.sleep(0.05)
