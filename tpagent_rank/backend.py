"""The delegating backend: every process group a rank creates is one of these, for the whole
run (DDP and FSDP keep the object), forwarding each collective to an inner gloo (CPU tensors)
or NCCL (CUDA tensors) backend that can be destroyed and rebuilt under a new generation.

PyTorch will not swap the backend under an existing group, so the group is ours and the
backends inside it are replaceable.  ``torch`` is imported here, and this module is imported
only once the user's own code has imported ``torch.distributed`` (see :mod:`tpagent_rank.boot`).
"""

from __future__ import annotations

import atexit
import contextlib
import datetime
import os
import sys
import threading
import weakref
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch._C import _distributed_c10d as c10d

from tpagent_rank import aware, env, nccladdr, owned, recover
from tpagent_rank.specs import device_specs

NAME = "tpagent"


def nccl_ras() -> bool:
    """Whether this process's NCCL runs its RAS thread (2.24+): started with the first
    communicator, listening on the node's address, never stopped (the rank cannot move).  As
    NCCL reads NCCL_RAS_ENABLE: on unless it is a number that is 0 (`tpagent rank` sets 0 where
    the user did not set it)."""
    if NCCL_HOST is None:  # (no communicator of NCCL's was made here)
        return False
    try:
        return int(os.environ.get("NCCL_RAS_ENABLE", "1").strip(), 0) != 0
    except ValueError:  # (NCCL then keeps its default: on)
        return True


#: The host identity this process's NCCL holds: read as its first NCCL backend was built, and
#: kept by NCCL for the process's life, wherever it is restored (NVIDIA/nccl issue 2348).  None:
#: no NCCL yet.
NCCL_HOST: str | None = None


class Groups:
    """Every delegating group of this process, in creation order."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.all: list[weakref.ref[DelegatingGroup]] = []
        self.gen = 0

    def add(self, g: DelegatingGroup) -> None:
        with self.lock:
            self.all.append(weakref.ref(g))

    def live(self) -> list[DelegatingGroup]:
        """Those not destroyed (destroy_process_group): a rewire rebuilds each of them, in order."""
        with self.lock:
            return [g for r in self.all if (g := r()) is not None and not g.destroyed]


GROUPS = Groups()
#: The spec the next group is created with (set around init_process_group/new_group).
PENDING_SPEC = threading.local()


_ProcessGroup: Any = dist.ProcessGroup  # (its stubs overload each collective; ours forward any of them)


class DelegatingGroup(_ProcessGroup):  # type: ignore[misc]
    def __init__(self, store: Any, rank: int, size: int, timeout: datetime.timedelta, spec: dict[str, str]) -> None:
        super().__init__(rank, size)
        self._store = store
        self._rank = rank
        self._size = size
        self._timeout = timeout
        self._spec = spec
        self._inner: dict[str, Any] = {}
        self._only: Any = None  # the one inner backend, when every device has the same (no lookup then)
        self._front: Any = None  # a plain ProcessGroup over the inner backends (see _front_over)
        self._first: dict[int, int] | None = None  # the sockets before an NCCL backend's first collective
        self._armed = False  # the collective being forwarded is NCCL's (then _first is used)
        self._gloo = False  # the collective being forwarded is gloo's (a failure is held: recover)
        self._works: weakref.WeakSet[Any] = weakref.WeakSet()
        self.p2p: weakref.WeakSet[Any] = weakref.WeakSet()  # (its sends' and receives': see rewire.boundary)
        self._lock = threading.Lock()
        self._wanted = GROUPS.gen  # the generation its inner backends are to be (-1: none, torn down)
        self._solo: Any = None  # a joiner's, while it warms up: its collectives are its own alone
        self.destroyed = False  # (torch's destroy_process_group: shutdown)
        self._go = threading.Event()  # (cleared from a rewire's teardown until its rebuild: see _inner_for)
        self._go.set()
        if SOLO:
            from tpagent_rank.solo import Solo

            self._solo = Solo(rank, size)
            self._wanted = -1
        else:
            self._build(GROUPS.gen)
        GROUPS.add(self)

    # ---- the inner backends ------------------------------------------------------------------

    def _build(self, gen: int) -> None:
        with owned.noting():  # (a forked child lets go of them: :mod:`tpagent_rank.owned`)
            store = self._store if gen == 0 else c10d.PrefixStore(f"tpagent/{gen}/", _own_connection(self._store))
            inner: dict[str, Any] = {}
            made: dict[str, Any] = {}
            for device, backend in self._spec.items():
                if backend not in made:
                    if backend == "gloo":
                        made[backend] = c10d.ProcessGroupGloo(store, self._rank, self._size, self._timeout)
                    else:  # nccl (no GPU where this was written: see the GPU tests)
                        global NCCL_HOST
                        NCCL_HOST = NCCL_HOST or nccladdr.host_identity(as_nccl=True)
                        opts = c10d.ProcessGroupNCCL.Options()
                        opts._timeout = self._timeout
                        made[backend] = c10d.ProcessGroupNCCL(store, self._rank, self._size, opts)
                inner[device] = made[backend]
        front = _front_over(self._rank, self._size, inner, self._spec)
        with self._lock:
            if self._wanted == gen:
                self._go.set()
                self._inner = inner
                self._only = next(iter(made.values())) if len(made) == 1 else None
                self._front = front
                # NCCL connects at its first collective: the sockets it opens then are noted too
                self._first = owned.sockets() if "nccl" in made else None
                return
        # Torn down, or rebuilt under a later generation, while this one was being built (a build
        # that waited for a peer past the rewire's deadline): never put back.
        _shut(made.values())
        raise RuntimeError(f"tpagent_rank: generation {gen} was given up while it was being built")

    def teardown(self) -> None:
        """Wait for what is in flight, then destroy the inner backends (their sockets close)."""
        for w in list(self._works):
            with contextlib.suppress(RuntimeError):
                w.wait()
        if torch.cuda.is_available() and "cuda" in self._inner:
            torch.cuda.synchronize()
        self.release(rewiring=True)

    def release(self, rewiring: bool = False) -> None:
        """Destroy the inner backends, waiting for nothing (:meth:`teardown` waits first; at exit
        nothing is); ``rewiring``: until a rebuild, a collective of another thread waits."""
        with self._lock:
            inner = self._inner
            self._inner = {}
            self._go.clear() if rewiring else self._go.set()  # (let go for good: a collective now raises)
            self._only = None
            self._wanted = -1
            self._front = None  # (it holds the inner backends too)
            # (a timeout set on them since, by torch's _set_pg_timeout, is the next generation's too)
            self._timeout = next((b.options._timeout for b in inner.values() if hasattr(b, "options")), self._timeout)
        _shut({id(b): b for b in inner.values()}.values())
        del inner

    def shutdown(self) -> None:
        """torch's ``destroy_process_group`` (ours has no backend registered for torch's to shut)."""
        self.destroyed = True
        self.release()

    def rebuild(self, gen: int) -> None:
        """Build the inner backends under ``gen``.  An NCCL communicator connects only at its
        first collective: one is run here on each (every member rebuilds its groups in the same
        order), so that a rank that cannot join its peers (NCCL cannot start on its new node)
        fails now, while its original can still run on, and not at the job's next step."""
        with self._lock:
            self._wanted = gen
        self._build(gen)
        for b in {id(b): b for b in self._inner.values()}.values():
            if "NCCL" in type(b).__name__:
                one = torch.zeros(1, device=torch.device("cuda", torch.cuda.current_device()))
                work = b.allreduce([one], c10d.AllreduceOptions())
                if work is not None:
                    work.wait()
                torch.cuda.synchronize()

    def _pick(self, tensors: Any, p2p: bool = False) -> Any:
        if BEFORE:  # (each collective starts here: the rank may park before it)
            BEFORE[0](self, p2p)
        if self._solo is not None:
            self._gloo = False
            return self._solo
        only = self._only  # (one reference read: swapped whole by _build and teardown)
        if only is not None:
            self._armed = self._first is not None
            self._gloo = "gloo" in self._spec.values()  # (one backend for all: gloo, or NCCL)
            return only
        t = tensors
        while isinstance(t, list | tuple):
            if not t:
                break
            t = t[0]
        kind = t.device.type if isinstance(t, torch.Tensor) else "cpu"
        self._armed = self._first is not None and kind == "cuda"
        self._gloo = self._spec.get(kind, self._spec.get("cpu")) == "gloo"
        return self._inner_for(kind)

    def _inner_for(self, kind: str, what: str = "a collective") -> Any:
        """The inner backend for device type ``kind``: its own, else the CPU one, else any.  Torn
        down, it waits (up to its timeout) for them to be rebuilt: another thread's collective
        (the training thread parks before its own) goes on under the new generation."""
        self._go.wait(self._timeout.total_seconds())
        with self._lock:
            inner = self._inner.get(kind) or self._inner.get("cpu") or next(iter(self._inner.values()), None)
        inner = inner or self._solo
        if inner is None:
            raise RuntimeError(f"tpagent_rank: {what} was called while the communicators were torn down")
        return inner

    def _coalesced(self, name: str, tensors: Any, *args: Any) -> Any:
        """An op that no inner backend offers to Python (the coalesced ones): run by a plain
        ProcessGroup over the inner backends, as torch would run it."""
        self._pick(tensors)  # (the boundary, and torn down?)
        with self._lock:
            front = self._solo or self._front
        if front is None or not hasattr(front, name):
            raise RuntimeError(f"tpagent_rank: {name} cannot be forwarded with this torch")
        return self._track(getattr(front, name)(*args))

    def _track(self, work: Any, p2p: bool = False) -> Any:
        if work is not None:  # (NCCL's ops with async_op=False give none: they run on the current stream)
            self._works.add(work)
            if p2p:
                self.p2p.add(work)
        if self._first is not None and self._armed:  # (once per generation: NCCL's first collective)
            first = self._first
            self._first = None
            self._armed = False
            owned.note_since(first)
        if work is not None and self._gloo and aware.usable():
            return recover.holding(work)  # (its failure is held from the script while the job may recover)
        return work

    # ---- collectives: each forwarded as it is -------------------------------------------------

    @property
    def _device_types(self) -> list[Any]:
        """The devices of the user's spec, as torch's own group of that spec has them (torch
        picks the device of object collectives and barriers by them)."""
        return [torch.device(d) for d in self._spec]

    def _get_backend(self, device: Any) -> Any:
        """This generation's inner backend for ``device`` (torch asks for it by the group's
        devices: to set a timeout, to allocate a tensor for FSDP); a warming joiner's: its own."""
        if self._solo is not None:
            return self._solo
        kind = torch.device(device).type
        with self._lock:
            inner = self._inner.get(kind)
        if inner is None:
            raise RuntimeError(f"No backend type associated with device type {kind}")
        return inner

    # torch keeps a group's name and description on its backends, and ours has none of its own
    def _set_group_name(self, name: str) -> None:
        self._group_name = name

    @property
    def group_name(self) -> str:
        return getattr(self, "_group_name", "")

    def _set_group_desc(self, desc: str) -> None:
        self._group_desc = desc

    @property
    def group_desc(self) -> str:
        return getattr(self, "_group_desc", "")

    def user_backend(self) -> str:
        """What ``torch.distributed.get_backend`` says of a group of the user's spec."""
        names = set(self._spec.values())
        return names.pop() if len(names) == 1 else ",".join(f"{d}:{b}" for d, b in self._spec.items())

    def getBackendName(self) -> str:  # noqa: N802 (torch's name)
        return NAME

    def name(self) -> str:
        return NAME

    def allreduce(self, tensors: Any, opts: Any = None) -> Any:
        return self._track(self._pick(tensors).allreduce(tensors, opts or c10d.AllreduceOptions()))

    def allreduce_coalesced(self, tensors: Any, opts: Any = None) -> Any:
        return self._track(self._pick(tensors).allreduce_coalesced(tensors, opts or c10d.AllreduceCoalescedOptions()))

    def broadcast(self, tensors: Any, opts: Any = None) -> Any:
        return self._track(self._pick(tensors).broadcast(tensors, opts or c10d.BroadcastOptions()))

    def reduce(self, tensors: Any, opts: Any = None) -> Any:
        return self._track(self._pick(tensors).reduce(tensors, opts or c10d.ReduceOptions()))

    def allgather(self, outputs: Any, inputs: Any, opts: Any = None) -> Any:
        return self._track(self._pick(inputs).allgather(outputs, inputs, opts or c10d.AllgatherOptions()))

    def _allgather_base(self, output: Any, input: Any, opts: Any = None) -> Any:  # noqa: A002
        return self._track(self._pick(input)._allgather_base(output, input, opts or c10d.AllgatherOptions()))

    def allgather_coalesced(self, outputs: Any, inputs: Any, opts: Any = None) -> Any:
        return self._track(self._pick(inputs).allgather_coalesced(outputs, inputs, opts or c10d.AllgatherOptions()))

    def allgather_into_tensor_coalesced(self, outputs: Any, inputs: Any, opts: Any = None) -> Any:
        opts = opts or c10d.AllgatherOptions()
        return self._coalesced("allgather_into_tensor_coalesced", inputs, outputs, inputs, opts)

    # (torch's later names for _allgather_base and allgather_into_tensor_coalesced: what
    # all_gather_into_tensor, FSDP's all-gather, calls there)
    def all_gather_single(self, output: Any, input: Any, opts: Any = None) -> Any:  # noqa: A002
        return self._allgather_base(output, input, opts)

    def all_gather_single_coalesced(self, outputs: Any, inputs: Any, opts: Any = None) -> Any:
        opts = opts or c10d.AllgatherOptions()
        return self._coalesced("all_gather_single_coalesced", inputs, outputs, inputs, opts)

    def reduce_scatter(self, outputs: Any, inputs: Any, opts: Any = None) -> Any:
        return self._track(self._pick(outputs).reduce_scatter(outputs, inputs, opts or c10d.ReduceScatterOptions()))

    def _reduce_scatter_base(self, output: Any, input: Any, opts: Any = None) -> Any:  # noqa: A002
        inner = self._pick(output)
        return self._track(inner._reduce_scatter_base(output, input, opts or c10d.ReduceScatterOptions()))

    def reduce_scatter_tensor_coalesced(self, outputs: Any, inputs: Any, opts: Any = None) -> Any:
        opts = opts or c10d.ReduceScatterOptions()
        return self._coalesced("reduce_scatter_tensor_coalesced", outputs, outputs, inputs, opts)

    def reduce_scatter_single(self, output: Any, input: Any, opts: Any = None) -> Any:  # noqa: A002
        return self._reduce_scatter_base(output, input, opts)

    def reduce_scatter_single_coalesced(self, outputs: Any, inputs: Any, opts: Any = None) -> Any:
        opts = opts or c10d.ReduceScatterOptions()
        return self._coalesced("reduce_scatter_single_coalesced", outputs, outputs, inputs, opts)

    def alltoall(self, outputs: Any, inputs: Any, opts: Any = None) -> Any:
        return self._track(self._pick(inputs).alltoall(outputs, inputs, opts or c10d.AllToAllOptions()))

    def alltoall_base(self, output: Any, input: Any, out_splits: Any, in_splits: Any, opts: Any = None) -> Any:  # noqa: A002
        inner = self._pick(input)
        return self._track(inner.alltoall_base(output, input, out_splits, in_splits, opts or c10d.AllToAllOptions()))

    def all_to_all_single(self, output: Any, input: Any, out_splits: Any, in_splits: Any, opts: Any = None) -> Any:  # noqa: A002
        if not isinstance(opts, c10d.AllToAllOptions):  # (its other form takes a timeout)
            timeout = opts
            opts = c10d.AllToAllOptions()
            if timeout is not None:
                opts.timeout = timeout
        return self.alltoall_base(output, input, out_splits, in_splits, opts)

    def _start_coalescing(self, device: Any) -> None:
        if BEFORE:
            BEFORE[0](self, False)
        self._inner_for(torch.device(device).type)._start_coalescing()

    def _end_coalescing(self, device: Any) -> Any:
        return self._track(self._inner_for(torch.device(device).type)._end_coalescing())

    def gather(self, outputs: Any, inputs: Any, opts: Any = None) -> Any:
        return self._track(self._pick(inputs).gather(outputs, inputs, opts or c10d.GatherOptions()))

    def scatter(self, outputs: Any, inputs: Any, opts: Any = None) -> Any:
        return self._track(self._pick(outputs).scatter(outputs, inputs, opts or c10d.ScatterOptions()))

    def send(self, tensors: Any, dst: int, tag: int = 0) -> Any:
        return self._track(self._pick(tensors, p2p=True).send(tensors, dst, tag), p2p=True)

    def recv(self, tensors: Any, src: int, tag: int = 0) -> Any:
        return self._track(self._pick(tensors, p2p=True).recv(tensors, src, tag), p2p=True)

    def recv_anysource(self, tensors: Any, tag: int = 0) -> Any:
        return self._track(self._pick(tensors, p2p=True).recv_anysource(tensors, tag), p2p=True)

    def set_timeout(self, timeout: datetime.timedelta) -> None:
        """(torch's walks the backends registered on the group, of which ours has none.)"""
        with self._lock:
            self._timeout = timeout
            inner = list(self._inner.values())
        for b in inner:
            b._set_default_timeout(timeout)

    def barrier(self, opts: Any = None) -> Any:
        if BEFORE:
            BEFORE[0](self, False)
        device = getattr(opts, "device", None)  # (torch says which: by the group's devices)
        inner = self._inner_for(device.type if device is not None else "cpu", "a barrier")
        return self._track(inner.barrier(opts or c10d.BarrierOptions()))

    def monitored_barrier(self, timeout: Any = None, wait_all_ranks: bool = False) -> Any:
        return self._pick([]).monitored_barrier(timeout, wait_all_ranks)


def name_groups() -> None:
    """Have ``torch.distributed.get_backend`` name each delegating group's backend as the user
    did (their script may branch on it; torch's monitored_barrier takes only "gloo")."""
    world = getattr(sys.modules.get("torch.distributed.distributed_c10d"), "_world", None)
    pg_map = getattr(world, "pg_map", None)
    if not isinstance(pg_map, dict):
        return
    for pg, entry in list(pg_map.items()):
        if isinstance(pg, DelegatingGroup) and isinstance(entry, tuple) and entry and entry[0] == NAME:
            pg_map[pg] = (pg.user_backend(), *entry[1:])


def _shut(backends: Any) -> None:
    for b in backends:
        if hasattr(b, "shutdown") and "NCCL" in type(b).__name__:
            b.shutdown()


def _front_over(rank: int, size: int, inner: dict[str, Any], spec: dict[str, str]) -> Any:
    """A plain ProcessGroup with ``inner``'s backends registered for their devices (of ``spec``'s
    kinds), as torch registers them on a group of its own: it runs what no backend offers
    Python.  None where this torch cannot make one."""
    types = c10d.ProcessGroup.BackendType
    try:
        front = _ProcessGroup(rank, size)
        for device, b in inner.items():
            front._register_backend(torch.device(device), types.NCCL if spec[device] == "nccl" else types.GLOO, b)
        if inner:
            first = "cpu" if "cpu" in inner else next(iter(inner))
            front._set_default_backend(types.NCCL if spec[first] == "nccl" else types.GLOO)
    except Exception:  # (only the coalesced ops need it: they say so, the rest runs on)
        return None
    return front


def _own_connection(store: Any) -> Any:
    """``store`` over a connection of its own.  A store client does one request at a time, so a
    build that never completes (a peer gone: it waits for keys that never come, up to the store's
    timeout) would otherwise hold up every later use of the rank's store, its next build included."""
    try:
        return store.clone()
    except (AttributeError, NotImplementedError):  # (a torch without Store.clone, a store that cannot be cloned)
        return store


def create(store: Any, rank: int, size: int, timeout: datetime.timedelta) -> DelegatingGroup:
    """The creator registered with torch.distributed."""
    spec = getattr(PENDING_SPEC, "spec", None)
    group = DelegatingGroup(store, rank, size, timeout, device_specs(spec))
    if ON_GROUP:  # (the default group is the first: the rank says hello then)
        ON_GROUP[0](group, store, rank, size, spec)
    return group


#: Whether the groups made now are a joiner's while it warms up (:mod:`tpagent_rank.join`).
SOLO: list[bool] = [True] if env.JOIN else []


def joined() -> None:
    """The joiner took a rank's state: its groups are torn down, to be built (``rebuild``) with
    the job's other ranks; those it makes from now on are the job's."""
    SOLO.clear()
    for g in GROUPS.live():
        g._solo = None


#: Called with the group as each collective starts, before it is forwarded (and whether it is a
#: send or a receive: each rank issues its own, so they are not counted as the job's collectives).
BEFORE: list[Callable[[DelegatingGroup, bool], None]] = []
#: Called with each group created: (group, store, rank, size, the user's spec).
ON_GROUP: list[Callable[[DelegatingGroup, Any, int, int, str | None], None]] = []


def register() -> None:
    if getattr(dist.Backend, NAME.upper(), None) is None:
        devices = ["cpu", "cuda"] if torch.cuda.is_available() else ["cpu"]
        dist.Backend.register_backend(NAME, create, devices=devices)
        atexit.register(release_all)


def break_off(keep: int = -1) -> None:
    """Make every collective in flight raise now, never to complete: NCCL's communicators are
    aborted; every connected socket of the communicators and the store (as noted: :mod:`owned`)
    is shut but ``keep`` (a listener is left: gloo's own thread would fail on it, and abort the
    process)."""
    for g in GROUPS.live():
        for b in {id(b): b for b in list(g._inner.values())}.values():
            if "NCCL" in type(b).__name__ and hasattr(b, "abort"):
                with contextlib.suppress(Exception):
                    b.abort()
    owned.shut_connections(keep)


def release_all() -> None:
    """At exit, while the interpreter is whole: every delegating group lets go of its inner
    backends.  torch's destroy_process_group (or none, if the script never calls it) leaves them
    to the interpreter's finalization, where a gloo backend's worker thread may still hold a
    tensor whose release needs the GIL, and the process aborts ("terminate called without an
    active exception", seen once here; pytorch/pytorch#179291).  Nothing in flight is waited for."""
    for g in GROUPS.live():
        g.release()
