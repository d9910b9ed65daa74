"""The buffers a step's forward pass changes in place (BatchNorm's running statistics) kept in a
rank's held state as they stood at the boundary (:mod:`tpagent_rank.inplace`), on a real model and
optimizer in this process; what the optimizer steps and what changes between two steps (an EMA's
average) stay live.  (A job killed mid-step and rebuilt:
tests/orchestrator/test_recover_lost.py.)"""

from __future__ import annotations

from typing import Any

import pytest

torch = pytest.importorskip("torch")

from tpagent_rank import inplace  # noqa: E402  (after torch is known to be there)


def test_a_steps_forward_pass_leaves_the_held_buffers_as_they_stood_at_the_boundary() -> None:
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.BatchNorm1d(8), torch.nn.Linear(8, 1))
    opt = torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9)
    ema = {"average": torch.zeros(1)}  # (kept beside the model, changed between two steps)

    def boundary() -> tuple[dict[str, Any], dict[str, Any]]:
        loss = net(torch.randn(16, 4)).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        held = inplace.held_copy({"model": net.state_dict(), "opt": opt.state_dict(), **ema})
        return held, {k: v.clone() for k, v in net.state_dict().items()}

    for _ in range(3):
        held, was = boundary()
    ema["average"].add_(1.0)  # (after the boundary, before the next step: its value of the boundary)
    net(torch.randn(16, 4))  # (the next step's forward pass: the live statistics move on)
    for name in ("1.running_mean", "1.running_var", "1.num_batches_tracked"):
        assert torch.equal(held["model"][name], was[name]), name
        assert not torch.equal(net.state_dict()[name], was[name]), name
    assert held["model"]["0.weight"].data_ptr() == net[0].weight.data_ptr()  # (a parameter: live, no copy)
    momentum = held["opt"]["state"][0]["momentum_buffer"]
    assert momentum is opt.state[net[0].weight]["momentum_buffer"]  # (the optimizer's state: live)
    assert held["average"] is ema["average"] and ema["average"].item() == 1.0
    assert held["model"]._metadata == net.state_dict()._metadata  # (what load_state_dict reads)
    net.load_state_dict(held["model"])
    assert torch.equal(net[1].running_mean, was["1.running_mean"])
