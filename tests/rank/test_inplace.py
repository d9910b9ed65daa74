"""The buffers a step's forward pass changes in place (BatchNorm's running statistics) kept in a
rank's held state as they stood at the boundary (:mod:`tpagent_rank.inplace`), on a real model and
optimizer in this process; what the optimizer steps and what changes between two steps (an EMA's
average) stay live.  (A job killed mid-step and rebuilt: tests/orchestrator/test_recover_lost.py.)"""

from __future__ import annotations

import os
import threading
from dataclasses import dataclass, field
from typing import Any

import pytest

torch = pytest.importorskip("torch")

from tpagent_rank import inplace  # noqa: E402  (after torch is known to be there)
from tpagent_rank.recover import Held  # noqa: E402


@dataclass
class _Rank:
    """The little of a :class:`tpagent_rank.agent.Rank` the boundary and a step's start use."""

    pid: int = field(default_factory=os.getpid)
    cond: threading.Condition = field(default_factory=threading.Condition)
    held: Held | None = None


def test_a_steps_forward_pass_leaves_the_held_buffers_as_they_stood_at_the_boundary() -> None:
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.BatchNorm1d(8), torch.nn.Linear(8, 1))
    opt = torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9)
    ema = {"average": torch.zeros(1)}  # (kept beside the model, changed between two steps)
    rank = _Rank()

    def boundary() -> dict[str, Any]:
        loss = net(torch.randn(16, 4)).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        state = {"model": net.state_dict(), "opt": opt.state_dict(), **ema}
        rank.held = Held(0, 0, 1, state)
        inplace.boundary(rank)
        return {k: v.clone() for k, v in net.state_dict().items()}

    try:
        for _ in range(3):
            was = boundary()
        ema["average"].add_(1.0)  # (after the boundary, before the next step: its value of the boundary)
        net(torch.randn(16, 4))  # (the next step's forward pass: the live statistics move on)
        assert rank.held is not None
        held = rank.held.state["model"]
        for name in ("1.running_mean", "1.running_var", "1.num_batches_tracked"):
            assert torch.equal(held[name], was[name]), name
            assert not torch.equal(net.state_dict()[name], was[name]), name
        assert held["0.weight"].data_ptr() == net[0].weight.data_ptr()  # (a parameter: live, no copy)
        assert rank.held.state["average"] is ema["average"] and ema["average"].item() == 1.0

        was = boundary()
        inplace.step_starts(rank)  # (a step that starts with a collective: the last step's module's buffers)
        net(torch.randn(16, 4))
        assert torch.equal(rank.held.state["model"]["1.running_mean"], was["1.running_mean"])
    finally:
        with inplace.LEARNED.lock:
            inplace.LEARNED.armed = False
            if inplace.LEARNED.hook is not None:
                inplace.LEARNED.hook.remove()
                inplace.LEARNED.hook = None
