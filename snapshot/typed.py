"""Reading a snapshot's JSON fields (:mod:`snapshot.manifest`): each of the type it must have, a
number one a file, a PID or a clock can hold, and the manifest's tables each as they must be
(their rows of the processes listed, their paths absolute); ValueError naming the field otherwise."""

from __future__ import annotations

import math
import os
from dataclasses import MISSING, fields
from typing import Any, TypeVar

from host import reopened
from host.files import LINK_REMAP
from host.proc import ProcInfo
from host.reopened import Reopened
from snapshot.affinity import Binding
from snapshot.affinity import parse as parse_cpus

T = TypeVar("T")


def typed(d: Any, key: str, typ: type[T], where: str) -> T:
    """Field ``key`` of ``d``, a ``typ`` (ValueError naming it otherwise); a number one a file, a
    PID or a clock can hold: an integer in 64 bits, a float finite."""
    value = d.get(key) if isinstance(d, dict) else None
    if typ is float and isinstance(value, int) and not isinstance(value, bool) and abs(value) < 2**64:
        value = float(value)
    if not isinstance(value, typ) or (typ is int and isinstance(value, bool)) or not _held(value):
        raise ValueError(f"{where}.{key}")
    return value


def _held(value: object) -> bool:
    """Whether a number is one a field can hold (anything else is: its type is checked apart)."""
    if isinstance(value, int):
        return -(2**63) <= value < 2**64
    return math.isfinite(value) if isinstance(value, float) else True


def typed_list(d: Any, key: str, typ: type[T], where: str) -> list[T]:
    """Field ``key`` of ``d``, a list of ``typ`` (ValueError naming it otherwise)."""
    values = typed(d, key, list, where)
    if not all(isinstance(x, typ) and not (typ is int and isinstance(x, bool)) and _held(x) for x in values):
        raise ValueError(f"{where}.{key}[]")
    return values


def typed_rows(data: Any, key: str, cls: type[T]) -> list[T]:
    """The optional list ``key`` of ``data``, each item made a ``cls`` (a dataclass of int and
    str fields) from its fields of those names and types (a field with a default may be missing:
    one added since)."""
    types: dict[str, type[Any]] = {"int": int, "str": str}
    named = [(f.name, types[str(f.type)], f.default) for f in fields(cls)]  # type: ignore[arg-type]
    found = typed_list(data, key, dict, "manifest") if key in data else []
    return [cls(**{n: typed(x, n, t, f"{key}[]") for n, t, d in named if n in x or d is MISSING}) for x in found]


def processes(data: Any) -> list[ProcInfo]:
    """``processes``: each row a :class:`host.proc.ProcInfo`, its fields checked."""
    return [
        ProcInfo(
            pid=typed(p, "pid", int, "processes[]"),
            ppid=typed(p, "ppid", int, "processes[]"),
            cmdline=tuple(typed_list(p, "cmdline", str, "processes[]")),
            ns_pids=tuple(typed_list(p, "ns_pids", int, "processes[]")),
            uses_cuda=typed(p, "uses_cuda", bool, "processes[]"),
            tids=tuple(typed_list(p, "tids", int, "processes[]")) if "tids" in p else (),
            stopped=typed(p, "stopped", bool, "processes[]") if "stopped" in p else False,
        )
        for p in typed_list(data, "processes", dict, "manifest")
    ]


def cuda_table(data: Any, pids: set[int]) -> dict[str, Any]:
    """The ``cuda`` table: its processes among ``pids``, each forked child's row as described."""
    cuda = typed(data, "cuda", dict, "manifest")
    if not set(typed_list(cuda, "pids", int, "cuda")) <= pids:
        raise ValueError("cuda.pids names a process not in processes")
    for f in typed_list(cuda, "forked", dict, "cuda") if "forked" in cuda else []:
        typed(f, "pid", int, "cuda.forked[]"), typed(f, "name", str, "cuda.forked[]")
        typed_list(f, "mappings", list, "cuda.forked[]"), typed_list(f, "fds", list, "cuda.forked[]")
    return dict(cuda)


def root_pid(data: Any, procs: list[ProcInfo]) -> int:
    """The root's PID: one of ``procs`` (whose copy still running here a restore looks for),
    each of which has its PIDs in its namespaces."""
    root_pid = typed(data, "root_pid", int, "manifest")
    if root_pid not in {p.pid for p in procs}:
        raise ValueError("root_pid names a process not in processes")
    if not all(p.ns_pids for p in procs):
        raise ValueError("processes[].ns_pids is empty")
    return int(root_pid)


def bindings(data: Any, procs: list[ProcInfo]) -> list[Binding]:
    """``bindings``: threads of the processes, each to a list of CPUs."""
    bindings = typed_rows(data, "bindings", Binding)
    if not {b.pid for b in bindings} <= {p.pid for p in procs}:
        raise ValueError("bindings names a process not in processes")
    for b in bindings:
        parse_cpus(b.cpus)  # (ValueError: not a list of CPUs)
    return bindings


def links(data: Any, carried: list[str]) -> dict[str, str]:
    """``links``: only ever CRIU's name of a relinked file (``link_remap.N``) to a carried file
    beside it, which is all a restore makes of it (a hard link, as root)."""
    links = typed(data, "links", dict, "manifest") if "links" in data else {}
    for path, other in links.items():
        if not (
            isinstance(other, str)
            and other in carried
            and absolute(path)
            and path not in carried
            and os.path.dirname(path) == os.path.dirname(other)
            and LINK_REMAP.fullmatch(os.path.basename(path))
        ):
            raise ValueError("links: not a link_remap.N beside a carried file")
    return {str(k): str(v) for k, v in links.items()}


def reopened_rows(data: Any) -> list[Reopened]:
    rows = typed_rows(data, "reopened", Reopened)
    if len(rows) > reopened.MOST or not all(absolute(r.path) and r.valid() for r in rows):
        raise ValueError("reopened: not a normalised absolute path, a user, a group, a mode or locks")
    return rows


def absolute(path: str) -> bool:
    return path.startswith("/") and os.path.normpath(path) == path and "\0" not in path
