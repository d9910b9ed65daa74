"""What of a rank's held state (:mod:`tpagent_rank.recover`) a step changes in place other than by
its optimizer step: the buffers its forward pass updates (BatchNorm's running statistics and count).

The held state keeps the live tensors, which the optimizer changes only in its step.  A buffer
the next step's forward pass changes too: a survivor caught mid-step took it back changed, and the
step done again counted twice in it (the losses and parameters bit-identical, the statistics
not).  So as each step starts, at its first module call (the model, or its DDP or FSDP wrapper),
before anything of it runs, the held state's tensors that are buffers of that module (and of its
modules) are copied into it as they stand: a few small tensors.  A step that starts with a
collective instead copies those of the module the last step started with.  The version counters
of tensors cannot tell these apart: BatchNorm's kernel updates its statistics without counting.
What changes after a boundary and before the next step (an average kept by an EMA, updated after
the optimizer step) is no buffer of the model: it stays live, as it was left.  A tensor without
storage of its own (a DTensor's shard, a sparse one) is left live.

Standard library only at import.
"""

from __future__ import annotations

import os
import threading
from typing import Any

#: A rank is a :class:`tpagent_rank.agent.Rank` (not imported: that module imports this one).
Rank = Any
#: A tensor as its storage, offset and size tell it (a state's tensors are new views each save).
Key = tuple[int, int, int]


class _Learned:
    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.armed = False  # (set at a boundary: the next step's start copies)
        self.moving: set[Key] = set()  # the buffers of the module the last step started with
        self.hook: Any = None


LEARNED = _Learned()


def boundary(rank: Rank) -> None:
    """(The training thread, once this boundary's state is held.)  Its buffers are copied as the
    next step starts (:func:`step_starts`)."""
    from torch.nn.modules.module import register_module_forward_pre_hook

    with LEARNED.lock:
        LEARNED.armed = True
        if LEARNED.hook is None:
            LEARNED.hook = register_module_forward_pre_hook(lambda module, _args: step_starts(rank, module))


def step_starts(rank: Rank, module: Any = None) -> None:
    """(The training thread, at its first module call, ``module``, or collective after a boundary.)
    The buffers of ``module`` (else of the last step's) copied into the held state as they stand."""
    with LEARNED.lock:
        if not LEARNED.armed or rank.pid != os.getpid():  # (a forked worker's inherited hook)
            return
        LEARNED.armed = False
        hook = LEARNED.hook
        LEARNED.hook = None
    if hook is not None:
        hook.remove()
    if module is not None:
        LEARNED.moving = {k for b in module.buffers() if (k := _key(b)) is not None}
    held = rank.held
    if held is None or not LEARNED.moving:
        return
    copied = _copied(held.state, LEARNED.moving)
    with rank.cond:
        if rank.held is held:
            held.state = copied


def _copied(state: Any, moving: set[Key]) -> Any:
    """``state`` with each tensor of ``moving`` a copy of itself (its containers new, of their kind)."""
    import copy

    import torch

    if isinstance(state, torch.Tensor):
        return state.detach().clone() if _key(state) in moving else state
    if isinstance(state, dict):
        out = copy.copy(state)  # (an OrderedDict's _metadata, which load_state_dict reads, kept)
        for k, v in state.items():
            out[k] = _copied(v, moving)
        return out
    if isinstance(state, list | tuple) and not hasattr(state, "_fields"):
        return type(state)(_copied(v, moving) for v in state)
    return state


def _key(t: Any) -> Key | None:
    try:
        if t.is_sparse or type(t).__name__ == "DTensor":
            return None
        return (t.untyped_storage().data_ptr(), t.storage_offset(), t.numel())
    except (RuntimeError, NotImplementedError, AttributeError):
        return None
