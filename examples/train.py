"""A small, deterministic training job: the workload the demo and the tests checkpoint.

Logs one line per step to --log: ``step N loss L`` (L printed with repr(), so equal lines
mean bit-identical losses), then ``done``.  Uses the GPU when there is one, else the CPU.
Nothing in it knows about tpagent: checkpointing it is transparent.
"""

from __future__ import annotations

import argparse
import time

import torch


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--log", required=True)
    parser.add_argument("--step-time", type=float, default=0.05, help="seconds to idle per step")
    parser.add_argument("--width", type=int, default=512)
    args = parser.parse_args()

    torch.manual_seed(0)
    torch.set_num_threads(1)
    torch.use_deterministic_algorithms(True)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    model = torch.nn.Sequential(
        torch.nn.Linear(args.width, args.width), torch.nn.Tanh(), torch.nn.Linear(args.width, 1)
    ).to(device)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    data = torch.randn(256, args.width, device=device)
    target = data.sum(dim=1, keepdim=True).sin()

    with open(args.log, "a", buffering=1) as log:
        log.write(f"start device {device}\n")
        for step in range(args.steps):
            opt.zero_grad()
            loss = torch.nn.functional.mse_loss(model(data), target)
            loss.backward()
            opt.step()
            log.write(f"step {step} loss {loss.item()!r}\n")
            time.sleep(args.step_time)
        log.write("done\n")


if __name__ == "__main__":
    main()
