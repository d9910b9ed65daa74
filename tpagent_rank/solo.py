"""The collectives of a joiner's groups while it warms up (:mod:`tpagent_rank.join`): each
completes at once, on this process alone, with outputs of the right shapes (an all-gather fills
every slot with its own input, a reduce-scatter keeps its own chunk, a reduction or a broadcast
leaves its tensors as they are).  What they compute is thrown away with the warm-up; only that
the script's wrappers set themselves up as they would in the job matters.  ``torch`` is imported
here (like :mod:`tpagent_rank.backend`, which alone uses this module)."""

from __future__ import annotations

from typing import Any

import torch
from torch._C import _distributed_c10d as c10d


def _done(result: Any) -> Any:
    """A Work already complete, its future holding ``result`` (tensors, as DDP's hook reads them)."""
    future: torch.futures.Future[Any] = torch.futures.Future()
    future.set_result(result)
    return c10d._create_work_from_future(future)  # type: ignore[attr-defined]  # (not in torch's stubs)


def _fill(output: Any, value: Any) -> None:
    """``output`` (a flat multiple of ``value``) filled with copies of ``value``."""
    flat = output.view(-1)
    n = value.numel()
    for i in range(0, flat.numel() - n + 1, max(n, 1)):
        flat[i : i + n].copy_(value.reshape(-1))


class Solo:
    """The inner backend of every group of a joiner while it warms up: it answers each
    collective a delegating group forwards (:class:`tpagent_rank.backend.DelegatingGroup`)."""

    #: What torch asks of a group's backend beside its collectives (a split, a tensor of its own).
    supports_splitting = False

    def __init__(self, rank: int, size: int) -> None:
        self.rank = rank
        self.size = size

    def name(self) -> str:
        return "tpagent-solo"

    def supports_tensor_alloc(self, _device: Any) -> bool:
        return False

    def _set_default_timeout(self, _timeout: Any) -> None:
        return None

    def eager_connect_single_device(self, _device: Any) -> None:
        return None

    # the reductions, broadcasts, point to point and barriers: tensors as they are
    def allreduce(self, tensors: Any, _opts: Any = None) -> Any:
        return _done(tensors)

    def allreduce_coalesced(self, tensors: Any, _opts: Any = None) -> Any:
        return _done(tensors)

    def broadcast(self, tensors: Any, _opts: Any = None) -> Any:
        return _done(tensors)

    def reduce(self, tensors: Any, _opts: Any = None) -> Any:
        return _done(tensors)

    def send(self, tensors: Any, _dst: int, _tag: int = 0) -> Any:
        return _done(tensors)

    def recv(self, tensors: Any, _src: int, _tag: int = 0) -> Any:
        return _done(tensors)

    def recv_anysource(self, tensors: Any, _tag: int = 0) -> Any:
        return _done(tensors)

    def barrier(self, _opts: Any = None) -> Any:
        return _done([])

    def monitored_barrier(self, _timeout: Any = None, _wait_all_ranks: bool = False) -> None:
        return None

    def _start_coalescing(self) -> None:
        return None

    def _end_coalescing(self) -> Any:
        return _done([])

    # the gathers: every slot its own input
    def allgather(self, outputs: Any, inputs: Any, _opts: Any = None) -> Any:
        for slots, value in zip(outputs, inputs, strict=False):
            for slot in slots:
                slot.copy_(value)
        return _done(outputs)

    def allgather_coalesced(self, outputs: Any, inputs: Any, _opts: Any = None) -> Any:
        for slots in outputs:  # (one list per rank, of one slot per input)
            for slot, value in zip(slots, inputs, strict=False):
                slot.copy_(value)
        return _done(outputs)

    def _allgather_base(self, output: Any, input: Any, _opts: Any = None) -> Any:  # noqa: A002
        _fill(output, input)
        return _done([output])

    def allgather_into_tensor_coalesced(self, outputs: Any, inputs: Any, _opts: Any = None) -> Any:
        for output, value in zip(outputs, inputs, strict=False):
            _fill(output, value)
        return _done(list(outputs))

    all_gather_single_coalesced = allgather_into_tensor_coalesced

    def gather(self, outputs: Any, inputs: Any, _opts: Any = None) -> Any:
        for slot in outputs[0] if outputs else ():
            slot.copy_(inputs[0])
        return _done(outputs)

    # the scatters: its own chunk
    def reduce_scatter(self, outputs: Any, inputs: Any, _opts: Any = None) -> Any:
        for output, chunks in zip(outputs, inputs, strict=False):
            output.copy_(chunks[self.rank])
        return _done(outputs)

    def _reduce_scatter_base(self, output: Any, input: Any, _opts: Any = None) -> Any:  # noqa: A002
        output.view(-1).copy_(input.reshape(-1).chunk(self.size)[self.rank])
        return _done([output])

    def reduce_scatter_tensor_coalesced(self, outputs: Any, inputs: Any, opts: Any = None) -> Any:
        for output, value in zip(outputs, inputs, strict=False):
            self._reduce_scatter_base(output, value, opts)
        return _done(list(outputs))

    reduce_scatter_single_coalesced = reduce_scatter_tensor_coalesced

    def scatter(self, outputs: Any, inputs: Any, _opts: Any = None) -> Any:
        if inputs and outputs:
            outputs[0].copy_(inputs[0][self.rank])
        return _done(outputs)

    def alltoall(self, outputs: Any, inputs: Any, _opts: Any = None) -> Any:
        for output, value in zip(outputs, inputs, strict=False):
            output.copy_(value) if output.shape == value.shape else output.zero_()
        return _done(outputs)

    def alltoall_base(self, output: Any, input: Any, *_splits_and_opts: Any) -> Any:  # noqa: A002
        output.copy_(input) if output.shape == input.shape else output.zero_()
        return _done([output])
