"""Test workload: an ordinary GPU training job of one shape, deterministic, for the GPU proof.

    python gpu_job.py SHAPE LOG [--steps N] [--pace S]

Writes ``step I LOSS`` (the loss's float as hex: bit for bit) to LOG after every optimizer step,
sleeping S seconds between steps (default 0.04), then ``final SHA256`` of every parameter's bytes,
and exits 0.  A shape that cannot run here writes ``skip WHY`` and exits 0.  Two runs of one
shape write the same lines unless something changed the job's state: a moved copy must match an
uninterrupted run line for line.  Shapes (see :data:`SHAPES`): DataLoader workers forked after
CUDA started (pinned, persistent or not, re-forked each epoch), spawned ones (queues on POSIX
semaphores, :class:`host.files.Relinked`), a fork pool, pinned ``non_blocking``
copies on side streams with events, CUDA graphs (captured by hand, and by
``torch.compile(mode="reduce-overhead")``), ``torch.compile`` with inductor's compile workers,
bf16 autocast and fp16 GradScaler, the caching allocator's expandable segments, a Hugging Face
model built from a config, and one process on two GPUs; and DataLoader workers reading a dataset
held in pinned memory allocated before they forked.
"""

from __future__ import annotations

import argparse
import hashlib
import multiprocessing
import os
import sys
import time
from pathlib import Path

ap = argparse.ArgumentParser()
ap.add_argument("shape")
ap.add_argument("log")
ap.add_argument("--steps", type=int, default=150)
ap.add_argument("--pace", type=float, default=0.04)
args = ap.parse_args()
os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
if args.shape == "expandable":
    os.environ["PYTORCH_CUDA_ALLOC_CONF"] = "expandable_segments:True"

import torch  # noqa: E402
from torch import nn  # noqa: E402

log = open(args.log, "a", buffering=1)  # noqa: SIM115
torch.manual_seed(0)
torch.use_deterministic_algorithms(True, warn_only=True)
dev = torch.device("cuda:0")


class Synthetic(torch.utils.data.Dataset[tuple[torch.Tensor, torch.Tensor]]):
    def __len__(self) -> int:
        return 256

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        g = torch.Generator().manual_seed(i)
        return torch.randn(64, generator=g), torch.randn(8, generator=g)


def mlp() -> nn.Module:
    return nn.Sequential(nn.Linear(64, 256), nn.GELU(), nn.Linear(256, 8)).to(dev)


def batches(loader: torch.utils.data.DataLoader[tuple[torch.Tensor, torch.Tensor]]):  # type: ignore[no-untyped-def]
    while True:  # epochs: non-persistent workers are forked again for each
        for x, y in loader:
            yield x.to(dev, non_blocking=True), y.to(dev, non_blocking=True)


def finish(params: list[torch.Tensor]) -> None:
    torch.cuda.synchronize()
    h = hashlib.sha256()
    for p in params:
        h.update(p.detach().float().cpu().numpy().tobytes())
    log.write(f"final {h.hexdigest()}\n")
    log.close()
    sys.exit(0)


def skip(why: str) -> None:
    log.write(f"skip {why}\n")
    log.close()
    sys.exit(0)


def simple(model: nn.Module, data, step_fn=None) -> None:  # type: ignore[no-untyped-def]
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    for i in range(args.steps):
        x, y = next(data)
        if step_fn is None:
            loss = nn.functional.mse_loss(model(x), y)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
        else:
            loss = step_fn(model, opt, x, y)
        log.write(f"step {i} {float(loss.item()).hex()}\n")
        time.sleep(args.pace)
    finish(list(model.parameters()))


def fixed():  # type: ignore[no-untyped-def]
    ds = Synthetic()
    i = 0
    while True:
        xs, ys = zip(*(ds[(i * 32 + j) % len(ds)] for j in range(32)), strict=True)
        yield torch.stack(xs).to(dev), torch.stack(ys).to(dev)
        i += 1


def loader(persistent: bool, context: str | None = None) -> None:
    dl = torch.utils.data.DataLoader(
        Synthetic(),
        batch_size=32,
        shuffle=True,
        generator=torch.Generator().manual_seed(1),
        num_workers=2,
        pin_memory=True,
        persistent_workers=persistent,
        multiprocessing_context=context,  # (spawn: fresh interpreters, their queues on POSIX semaphores)
    )
    simple(mlp(), batches(dl))


class PinnedRows(torch.utils.data.Dataset[tuple[torch.Tensor, torch.Tensor]]):
    """Rows kept in pinned host memory, allocated before the workers fork: they read it."""

    def __init__(self) -> None:
        self.rows = torch.randn(256, 72, generator=torch.Generator().manual_seed(3)).pin_memory()
        at = self.rows.data_ptr()
        for line in Path("/proc/self/maps").read_text().splitlines():  # (where pinned memory lies: said)
            span, *rest = line.split()
            lo, hi = (int(a, 16) for a in span.split("-"))
            if lo <= at < hi:
                log.write(f"pinned-in {rest[4] if len(rest) > 4 else '[anonymous]'}\n")

    def __len__(self) -> int:
        return 256

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        row = self.rows[i].clone()
        return row[:64], row[64:]


def pinned_dataset() -> None:
    dl = torch.utils.data.DataLoader(PinnedRows(), batch_size=32, num_workers=2, persistent_workers=True)
    simple(mlp(), batches(dl))


def _cpu_features(seed: int) -> list[float]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(64, generator=g).tolist()


def fork_pool() -> None:
    model = mlp()
    torch.cuda.synchronize()  # (CUDA started before the pool forks)
    pool = multiprocessing.get_context("fork").Pool(2)

    def data():  # type: ignore[no-untyped-def]
        i = 0
        while True:
            rows = pool.map(_cpu_features, range(i * 32, i * 32 + 32))
            x = torch.tensor(rows, device=dev)
            yield x, x[:, :8].sin()
            i += 1

    simple(model, data())


def streams() -> None:
    model = mlp()
    side = torch.cuda.Stream()
    host = fixed()

    def data():  # type: ignore[no-untyped-def]
        while True:
            x, y = next(host)
            pinned_x = x.cpu().pin_memory()
            pinned_y = y.cpu().pin_memory()
            with torch.cuda.stream(side):
                gx = pinned_x.to(dev, non_blocking=True)
                gy = pinned_y.to(dev, non_blocking=True)
                done = torch.cuda.Event()
                done.record(side)
            torch.cuda.current_stream().wait_event(done)
            gx.record_stream(torch.cuda.current_stream())
            gy.record_stream(torch.cuda.current_stream())
            yield gx, gy

    simple(model, data())


def graph() -> None:
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    host = fixed()
    sx, sy = next(host)
    warm = torch.cuda.Stream()
    warm.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(warm):
        for _ in range(3):
            opt.zero_grad(set_to_none=True)
            nn.functional.mse_loss(model(sx), sy).backward()
            opt.step()
    torch.cuda.current_stream().wait_stream(warm)
    g = torch.cuda.CUDAGraph()
    opt.zero_grad(set_to_none=True)
    with torch.cuda.graph(g):
        sloss = nn.functional.mse_loss(model(sx), sy)
        sloss.backward()
        opt.step()
    for i in range(args.steps):
        x, y = next(host)
        sx.copy_(x)
        sy.copy_(y)
        g.replay()
        log.write(f"step {i} {float(sloss.item()).hex()}\n")
        time.sleep(args.pace)
    finish(list(model.parameters()))


def compiled(mode: str | None) -> None:
    model = mlp()
    fwd = torch.compile(model, mode=mode)

    def step(m, opt, x, y):  # type: ignore[no-untyped-def]
        loss = nn.functional.mse_loss(fwd(x), y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        return loss.detach().clone()

    simple(model, fixed(), step)


def amp() -> None:
    bf16 = mlp()
    fp16 = mlp()
    scaler = torch.amp.GradScaler("cuda")
    opt16 = torch.optim.SGD(fp16.parameters(), lr=0.05)

    def step(m, opt, x, y):  # type: ignore[no-untyped-def]
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = nn.functional.mse_loss(m(x).float(), y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        with torch.autocast("cuda", dtype=torch.float16):
            loss16 = nn.functional.mse_loss(fp16(x).float(), y)
        opt16.zero_grad(set_to_none=True)
        scaler.scale(loss16).backward()
        scaler.step(opt16)
        scaler.update()
        return loss + loss16.detach()

    simple(bf16, fixed(), step)


def hugging_face() -> None:
    try:
        import transformers
    except ImportError:
        skip("transformers is not installed")
    cfg = transformers.GPT2Config(n_layer=2, n_head=4, n_embd=128, vocab_size=512, n_positions=64)
    model = transformers.GPT2LMHeadModel(cfg).to(dev)
    g = torch.Generator(device="cpu").manual_seed(2)

    def data():  # type: ignore[no-untyped-def]
        while True:
            ids = torch.randint(0, 512, (8, 64), generator=g).to(dev)
            yield ids, ids

    def step(m, opt, x, y):  # type: ignore[no-untyped-def]
        loss = m(input_ids=x, labels=y).loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        return loss.detach()

    simple(model, data(), step)


def two_gpus() -> None:
    if torch.cuda.device_count() < 2:
        skip(f"this machine has {torch.cuda.device_count()} GPU")
    a = nn.Linear(64, 256).to("cuda:0")
    b = nn.Linear(256, 8).to("cuda:1")
    params = [*a.parameters(), *b.parameters()]
    opt = torch.optim.SGD(params, lr=0.05)
    host = fixed()
    for i in range(args.steps):
        x, y = next(host)
        loss = nn.functional.mse_loss(b(a(x).relu().to("cuda:1")), y.to("cuda:1"))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        log.write(f"step {i} {float(loss.item()).hex()}\n")
        time.sleep(args.pace)
    finish(params)


SHAPES = {
    "dataloader": lambda: loader(persistent=False),
    "dataloader-persistent": lambda: loader(persistent=True),
    "dataloader-spawn": lambda: loader(persistent=True, context="spawn"),
    "fork-pool": fork_pool,
    "streams": streams,
    "graph": graph,
    "compile": lambda: compiled(None),
    "compile-graphs": lambda: compiled("reduce-overhead"),
    "amp": amp,
    "expandable": lambda: simple(mlp(), fixed()),
    "hf": hugging_face,
    "two-gpus": two_gpus,
    "pinned-dataset": pinned_dataset,  # (its workers read pinned memory allocated before they forked)
}

if __name__ == "__main__":
    if not torch.cuda.is_available():
        skip("no CUDA GPU")
    SHAPES[args.shape]()
