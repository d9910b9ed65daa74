"""Model-aware mode: what a training script registers of its training state (issue 27, item 1).

One import and one call, once the model and optimizer exist::

    import tpagent_rank

    tpagent_rank.register(
        save=lambda: {"model": model.state_dict(), "opt": opt.state_dict(), "step": step},
        load=lambda state: ...,  # puts such a value back in place
        replicas=model,          # optional: see below
    )

``save`` returns the rank's training state as it stands at a step boundary; ``load`` takes such
a value (from this rank or from a replica of it) and puts it in place.  A lost rank is rebuilt
from a replica's (unplanned recovery, :mod:`tpagent_rank.recover`), so the state is what the
replicas share (model, optimizer, step): the rank's own data position and RNG draw from its step
and its rank, as after a checkpoint rank 0 wrote (a rank's RNG state in it would be given to
another rank, its replica, and that rank's draws would be the lost one's).  The runtime calls both on
the training thread, at a step boundary only.  The state is made of tensors, numbers, strings,
``None``, numpy arrays, and lists, tuples and dicts of them: what torch's safe loader reads (a
state from another process is never unpickled as arbitrary objects).  The first state ``save``
returns is checked for that (:func:`check`): a rank whose state holds anything else is said, once,
to move only as its process image.

``warmup`` is how many optimizer steps a fresh process of the script runs on its own before it
takes a rank's state in a model-aware move (:mod:`tpagent_rank.join`): enough for the wrappers
it builds to set themselves up as they are in the running job (DDP rebuilds its buckets in its
second step).  The script's loop must run on what it registers (its step, its data position), as
it would to resume from a checkpoint: the state is taken at an optimizer step's post-hook, and
the rest of that step runs on it (so it issues no collective on what the step computed, such as
an all-reduce of its loss, before the next step's first).

``replicas`` says which ranks hold the same training state as this one (its data-parallel
replicas, itself included): a process group; a ``DistributedDataParallel`` module (its group); a
``(DeviceMesh, dimension name)`` pair, the dimension it replicates over; or the global ranks.
Left out, the runtime derives it: from the ``DistributedDataParallel`` module of the process, or
from a ``fully_shard``-ed (FSDP2) module's mesh (HSDP's replicate dimension; plain FSDP keeps no
replica).  Where it cannot, the rank has no replicas the runtime knows of, and says so.

A script that registers nothing runs as before; so does one that registers while no agent runs
(the runtime off, or this package imported outside ``tpagent rank``): the registration is checked
and kept, and nothing calls it.  Standard library only at import, as all of :mod:`tpagent_rank`.
"""

from __future__ import annotations

import gc
import io
import os
import re
import sys
import threading
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, BinaryIO

from tpagent_rank.notice import say
from tpagent_rank.protocol import UNREADABLE

#: The value ``save`` returns and ``load`` takes.
State = Any
#: The optimizer steps a fresh process runs on its own, by default, before it takes a rank's
#: state in a model-aware move (DDP rebuilds its buckets in its second).
WARMUP = 2
#: GPU ordinals a saved state's CUDA tensors may name (each is mapped to this process's device).
_CUDA_DEVICES = 64


@dataclass
class Registration:
    save: Callable[[], State]
    load: Callable[[State], None]
    replicas: Any = None  # as given (resolved by replica_ranks)
    warmup: int = 2  # the steps a joiner runs on its own before it takes a state
    resolved: tuple[int, ...] | None = field(default=None, repr=False)
    why_none: str = ""  # why no replicas are known ("" once resolved to some)
    lookup: str = ""  # why none were found when last asked (asked again: they may exist later)
    unreadable: str | None = None  # why a state it saved cannot be read back ("": it can; None: not yet seen)


_lock = threading.Lock()
_REGISTERED: Registration | None = None


def register(
    save: Callable[[], State], load: Callable[[State], None], *, replicas: Any = None, warmup: int = WARMUP
) -> None:
    """Register how this rank's training state is saved and loaded (see the module's text).  A
    second call replaces the first (a script that rebuilds its model registers again)."""
    global _REGISTERED
    if not callable(save):
        raise TypeError(f"tpagent_rank.register: save must be a function returning the training state, not {save!r}")
    if not callable(load):
        raise TypeError(f"tpagent_rank.register: load must be a function taking a training state, not {load!r}")
    if isinstance(replicas, str | bytes):
        raise TypeError(f"tpagent_rank.register: replicas {replicas!r} are not global ranks (a list of them)")
    # (a mesh and its dimension is checked as it is resolved, once the mesh's groups exist)
    mesh = isinstance(replicas, tuple) and len(replicas) == 2 and isinstance(replicas[1], str)
    ranks = isinstance(replicas, Sequence) and not mesh
    if ranks and not (replicas and all(isinstance(r, int) and not isinstance(r, bool) and r >= 0 for r in replicas)):
        raise TypeError(f"tpagent_rank.register: replicas {replicas!r} are not global ranks")
    if not isinstance(warmup, int) or isinstance(warmup, bool) or not 1 <= warmup <= 1000:
        raise TypeError(f"tpagent_rank.register: warmup {warmup!r} is not a number of steps (1 to 1000)")
    with _lock:
        _REGISTERED = Registration(save, load, replicas, warmup)


def registration() -> Registration | None:
    with _lock:
        return _REGISTERED


def replica_ranks() -> tuple[int, ...] | None:
    """The global ranks holding the same training state as this one, itself included, in order;
    None where none are known (nothing registered, or nothing to derive them from: see
    :func:`why_no_replicas`).  Resolved once, on first asking, once groups exist."""
    reg = registration()
    if reg is None or reg.unreadable:
        return None
    if reg.resolved is None and not reg.why_none:
        try:
            reg.resolved = _resolve(reg.replicas)
        except LookupError as e:  # (not yet: a model wrapped after register; asked again later)
            reg.lookup = f"its replicas could not be found: {e}"
            return None
        except Exception as e:  # (the user's objects: whatever they raise is said, once)
            reg.why_none = f"its replicas could not be found: {e}"
        if reg.resolved is not None and len(reg.resolved) < 2:
            reg.why_none = "no other rank holds its training state"
    return reg.resolved if not reg.why_none else None


def why_no_replicas() -> str:
    reg = registration()
    if reg is None:
        return "it registered no training state (tpagent_rank.register)"
    replica_ranks()
    return reg.unreadable or reg.why_none or reg.lookup


def usable() -> bool:
    """Whether this rank registered a training state that another process can read back (as far
    as the first one it saved shows: see :func:`check`)."""
    reg = registration()
    return reg is not None and not reg.unreadable


def check(reg: Registration, state: State) -> str:
    """(Once, with the first state ``save`` returns.)  Why a fresh process could not read such a
    state back, or "": ``state`` written and read with torch's safe loader, every tensor in it
    emptied first (no data is copied).  Said once on standard error: such a rank moves only as
    its process image, and is rebuilt from no replica."""
    if reg.unreadable is None:
        import torch

        out = io.BytesIO()
        try:
            torch.save(_emptied(torch, state, 0), out)
            _load(torch, out, device_table(torch))  # (read as a replica's state would be)
            reg.unreadable = ""
        except Exception as e:  # (the user's objects: whatever torch says of them)
            reg.unreadable = f"{UNREADABLE}: {_why(e)}"
            say(f"{reg.unreadable}: it can move only as its process image, and cannot be rebuilt from a replica")
    return reg.unreadable


def _emptied(torch: Any, value: Any, depth: int) -> Any:
    """``value`` with each tensor (and numpy array of numbers) in its dicts, lists and tuples
    replaced by an empty one of its dtype."""
    if isinstance(value, torch.Tensor):
        return torch.empty(0, dtype=value.dtype)
    kind = type(value)
    np = sys.modules.get("numpy")
    if np is not None and kind is np.ndarray and not value.dtype.hasobject:
        return np.empty(0, dtype=value.dtype)
    if depth > 64:
        return value
    if kind is dict or kind is OrderedDict:
        return kind((k, _emptied(torch, v, depth + 1)) for k, v in value.items())
    if kind is list or kind is tuple:
        return kind(_emptied(torch, v, depth + 1) for v in value)
    return value


def _why(error: BaseException) -> str:
    """What torch's safe loader refused, in a few words."""
    text = str(error)
    found = re.search(r"GLOBAL ([\w.]+)", text)
    if found:
        return (
            f"it holds {found.group(1)}, which torch's safe loader does not read "
            "(a class of plain data may be allowed with torch.serialization.add_safe_globals)"
        )
    return text.splitlines()[0] if text else type(error).__name__


def _resolve(given: Any) -> tuple[int, ...]:
    import torch.distributed as dist

    me = dist.get_rank()
    if given is None:
        given = _derived()
    if isinstance(given, tuple) and len(given) == 2 and isinstance(given[1], str):
        mesh, dim = given
        given = mesh.get_group(dim)
    elif hasattr(given, "process_group") and not hasattr(given, "rank"):  # (a DDP module)
        given = given.process_group
    if isinstance(given, Sequence) and not isinstance(given, str | bytes):
        ranks = tuple(sorted(set(given)))
    else:
        ranks = tuple(sorted(dist.get_process_group_ranks(given)))
    if me not in ranks:
        raise ValueError(f"rank {me} is not among its replicas {list(ranks)}")
    return ranks


def _derived() -> Any:
    """This process's DistributedDataParallel module's group, or its FSDP2 modules' replicate
    group (HSDP), or its own rank alone (plain FSDP, or nothing found)."""
    import torch
    import torch.distributed as dist

    ddp = torch.nn.parallel.DistributedDataParallel
    fsdp = getattr(sys.modules.get("torch.distributed.fsdp"), "FSDPModule", None)
    found = None
    groups = []
    for o in gc.get_objects():  # (by type(o): an isinstance asks o.__class__, which some objects warn of)
        if issubclass(type(o), ddp):
            groups.append(o.process_group)
        elif found is None and fsdp is not None and issubclass(type(o), fsdp):
            found = o
    if groups:
        ranks = {tuple(dist.get_process_group_ranks(g)) for g in groups}
        if len(ranks) > 1:
            raise ValueError(f"its DistributedDataParallel modules are over different groups {sorted(ranks)}")
        return groups[0]
    if found is None:
        raise LookupError("no DistributedDataParallel or fully_shard module was found (say replicas=)")
    info = found._get_fsdp_state()._fsdp_param_group.mesh_info  # (torch's own, not public: checked)
    dim = getattr(info, "replicate_mesh_dim", None)
    if dim is None:
        return [dist.get_rank()]  # (sharded without replicas: the shard is this rank's alone)
    return info.mesh.get_group(dim)


def settling() -> bool:
    """Whether a DistributedDataParallel module of this process has yet to rebuild its buckets
    (it does so in its second step, over its group, unless it looks for unused parameters): a
    joiner warms up until none has, whatever its ``warmup`` says, as the job's ranks did."""
    ddp = getattr(sys.modules.get("torch.nn.parallel"), "DistributedDataParallel", None)
    if ddp is None:
        return False
    return any(
        isinstance(o, ddp)
        and not getattr(o, "_has_rebuilt_buckets", True)
        and (getattr(o, "static_graph", False) or not getattr(o, "find_unused_parameters", True))
        for o in gc.get_objects()
    )


def memory_file() -> BinaryIO:
    """A file in memory (a memfd), read and written from its start."""
    return os.fdopen(os.memfd_create("tpagent-state", os.MFD_CLOEXEC), "w+b")


def write_state(out: BinaryIO) -> int:
    """The registered state, as ``save`` returns it now, serialized into ``out`` (streamed: a
    GPU tensor is copied to host memory as it is written, never to a file unless ``out`` is one).
    The bytes written."""
    reg = registration()
    if reg is None:
        raise LookupError("this rank registered no training state (tpagent_rank.register)")
    return write_state_of(reg.save(), out)


def write_state_of(state: State, out: BinaryIO) -> int:
    """``state`` (as ``save`` returned it) serialized into ``out``; the bytes written."""
    import torch

    counted = _Counted(out)
    torch.save(state, counted)  # type: ignore[arg-type]  # (any writer will do)
    return counted.n


def read_state(inp: BinaryIO) -> None:
    """A state written by :func:`write_state` (this rank's or a replica's), loaded with torch's
    safe loader onto this process's device, then given to the registered ``load``."""
    reg = registration()
    if reg is None:
        raise LookupError("this rank registered no training state (tpagent_rank.register)")
    import torch

    try:
        state = _load(torch, inp, device_table(torch))
    except Exception as e:
        raise ValueError(f"the training state cannot be read safely: {_why(e)}") from None
    reg.load(state)


def device_table(torch: Any) -> dict[Any, str]:
    """Every CUDA device a saved state may name -> this process's device, as ``map_location``: a
    table, not a function (torch maps a tensor subclass's device, a DTensor's, only by a table,
    and looks it up by its ``torch.device``, a storage's by its name)."""
    device = f"cuda:{torch.cuda.current_device()}" if torch.cuda.is_available() else "cpu"
    names = ["cuda", *(f"cuda:{i}" for i in range(_CUDA_DEVICES))]
    return {key: device for name in names for key in (name, torch.device(name))}


def _load(torch: Any, inp: BinaryIO, here: dict[Any, str]) -> Any:
    """``torch.load`` of ``inp``, safely; a file in memory (a memfd, as a state handed over is
    kept) is mapped, not read and copied."""
    path = f"/proc/self/fd/{inp.fileno()}" if _a_file(inp) else None
    with torch.serialization.safe_globals(_numpy_globals()):
        if path is not None:
            try:
                return torch.load(path, map_location=here, weights_only=True, mmap=True)
            except RuntimeError as e:
                if "mmap" not in str(e):  # (an older format cannot be mapped: read below)
                    raise
        inp.seek(0)
        return torch.load(inp, map_location=here, weights_only=True)


def _numpy_globals() -> list[Any]:
    """What a numpy array, scalar or dtype is rebuilt with (a state often holds numpy's RNG
    state), and empty bytes (an empty array's data): data, not code; an array of objects holds
    only what the safe loader read itself."""
    np = sys.modules.get("numpy")  # (torch imports it where it is installed)
    if np is None:
        return [bytes]  # (as pickle's protocol 2 makes b"")
    core = getattr(np, "_core", None) or np.core  # (numpy 2 renamed it)
    dtypes = [t for t in vars(getattr(np, "dtypes", object)).values() if isinstance(t, type)]
    return [bytes, core.multiarray._reconstruct, core.multiarray.scalar, np.ndarray, np.dtype, *dtypes]


def _a_file(inp: BinaryIO) -> bool:
    try:
        return os.path.exists(f"/proc/self/fd/{inp.fileno()}") and inp.seekable()
    except (AttributeError, OSError, ValueError):  # (io.UnsupportedOperation is both)
        return False


class _Counted:
    """A writer that counts what passes (torch.save writes to any object with ``write``)."""

    def __init__(self, out: BinaryIO) -> None:
        self.out = out
        self.n = 0

    def write(self, data: bytes) -> int:
        self.out.write(data)
        self.n += len(data)
        return len(data)

    def flush(self) -> None:
        self.out.flush()
