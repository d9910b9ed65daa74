"""What of a rank's held state (:mod:`tpagent_rank.recover`) a step changes in place other than by
its optimizer step: the buffers of its modules, which a forward pass updates (BatchNorm's running
statistics and count).

The held state keeps the live tensors, which the optimizer changes only in its step.  A buffer
the next step's forward pass changes too: a survivor caught mid-step took it back changed, and the
step done again counted twice in it (the losses and parameters bit-identical, the statistics
not).  So at each boundary the held state's tensors that are buffers of a module of the process
are copied as they stand (a few small tensors: BatchNorm's), before the next step can change
them.  The buffers are found among the process's modules (the garbage collector's objects), once,
and again where the state holds another number of tensors than when they were: no hook in the
training step's code, none in its forward pass (a model compiled in place, ``fullgraph=True``,
fails on one).  A tensor without storage of its own (a DTensor's shard, a sparse one) is left live.

Standard library only at import.
"""

from __future__ import annotations

import copy
from typing import Any

#: A tensor as its storage, offset and size tell it (a state's tensors are new views each save).
Key = tuple[int, int, int]
_found: tuple[int, set[Key]] | None = None  # (the state's number of tensors then, every module's buffers)


def held_copy(state: Any) -> Any:
    """``state`` (saved at a boundary, by the training thread) with each of its tensors that is a
    module's buffer copied as it stands (its containers new, of their kind; the rest as it was)."""
    buffers = _buffers(_count(state))
    return _copied(state, buffers) if buffers else state


def _buffers(tensors: int) -> set[Key]:
    """The keys of the buffers of every module of the process, looked for again where the state
    holds another number of tensors (a model built, or grown, since)."""
    global _found
    if _found is None or _found[0] != tensors:
        import gc

        import torch

        modules = [o for o in gc.get_objects() if issubclass(type(o), torch.nn.Module)]  # (type: no __class__ asked)
        _found = (tensors, {k for m in modules for b in m.buffers(recurse=False) if (k := _key(b))})
    return _found[1]


def _count(state: Any) -> int:
    if isinstance(state, dict):
        return sum(map(_count, state.values()))
    if isinstance(state, list | tuple):
        return sum(map(_count, state))
    return int(type(state).__name__ in ("Tensor", "Parameter"))


def _copied(state: Any, buffers: set[Key]) -> Any:
    import torch

    if isinstance(state, torch.Tensor):
        return state.detach().clone() if _key(state) in buffers else state
    if isinstance(state, dict):
        out = copy.copy(state)  # (an OrderedDict's _metadata, which load_state_dict reads, kept)
        for k, v in state.items():
            out[k] = _copied(v, buffers)
        return out
    if isinstance(state, list | tuple) and not hasattr(state, "_fields"):
        return type(state)(_copied(v, buffers) for v in state)
    return state


def _key(t: Any) -> Key | None:
    try:
        if t.is_sparse or type(t).__name__ == "DTensor":
            return None
        return (t.untyped_storage().data_ptr(), t.storage_offset(), t.numel())
    except (RuntimeError, NotImplementedError, AttributeError):
        return None
