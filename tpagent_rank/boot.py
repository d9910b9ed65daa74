"""Installed by the rank's ``sitecustomize`` when ``TPAGENT_RANK_SOCKET`` is set: once the
user's code has imported ``torch.distributed``, its ``init_process_group``, ``new_group`` and
``split_group`` use the delegating backend (:mod:`tpagent_rank.backend`), and a store its stand-in hosts is
joined as a client (:func:`tpagent_rank.store.patch_rendezvous`).  Nothing is imported here but the
standard library; a process that never imports torch.distributed is untouched."""

from __future__ import annotations

import functools
import importlib.abc
import importlib.machinery
import importlib.util
import sys
import threading
from collections.abc import Callable, Sequence
from types import ModuleType
from typing import Any

from tpagent_rank import env, join

TARGET = "torch.distributed"
_DEFAULT_SPEC: list[Any] = [None]
_lock = threading.Lock()


def _with_backend(fn: Callable[..., Any], index: int, default: bool) -> Callable[..., Any]:
    """``fn`` (init_process_group, new_group) with its backend argument (at ``index``) made
    the delegating one, the user's own remembered as the inner backend's spec."""

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        from tpagent_rank import backend as b
        from tpagent_rank import owned, specs

        args_l = list(args)
        spec = args_l[index] if len(args_l) > index else kwargs.get("backend")
        if not default and spec is None:
            spec = _DEFAULT_SPEC[0]
        if spec is not None and str(spec).lower() == b.NAME:
            return fn(*args, **kwargs)
        why = specs.unsupported(spec)
        if why is not None:
            from tpagent_rank.notice import say

            say(f"{why}: this process group cannot be rewired")
            return fn(*args, **kwargs)
        args_l, kwargs = _nccl_timeout(fn, args_l, kwargs, spec)
        b.register()
        if not b.ON_GROUP:
            from tpagent_rank import hooks

            b.ON_GROUP.append(hooks.group_created)
        if len(args_l) > index:
            args_l[index] = b.NAME
        else:
            kwargs["backend"] = b.NAME
        with _lock:
            b.PENDING_SPEC.spec = spec
            if default:
                _DEFAULT_SPEC[0] = spec
            try:
                with owned.noting():  # (the store's connection, the group's communicators)
                    made = fn(*args_l, **kwargs)
            finally:
                b.PENDING_SPEC.spec = None
            b.name_groups()
            return made

    wrapper.__tpagent__ = True  # type: ignore[attr-defined]
    return wrapper


def _nccl_timeout(
    fn: Callable[..., Any], args: list[Any], kwargs: dict[str, Any], spec: Any
) -> tuple[list[Any], dict[str, Any]]:
    """``fn``'s arguments, with NCCL's default timeout where the spec is "nccl" and none is given:
    torch picks it by the backend's name (10 minutes, not the 30 of others), which it now reads as ours."""
    import inspect

    from torch.distributed import distributed_c10d as c10d

    if spec is None or str(spec).lower() != "nccl":
        return args, kwargs
    try:
        signature = inspect.signature(fn)
        bound = signature.bind_partial(*args, **kwargs)
    except (TypeError, ValueError):  # (arguments torch itself refuses: it says so)
        return args, kwargs
    if "timeout" in signature.parameters and bound.arguments.get("timeout") is None:
        bound.arguments["timeout"] = c10d._get_default_timeout(c10d.Backend(c10d.Backend.NCCL))
    return list(bound.args), dict(bound.kwargs)


def _split_with_backend(fn: Callable[..., Any]) -> Callable[..., Any]:
    """``split_group``, of a delegating group: made by ``new_group`` (see
    :func:`tpagent_rank.splits.split_group`); of any other, torch's own."""

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:

        from tpagent_rank import splits

        return splits.split_group(fn, *args, **kwargs)

    wrapper.__tpagent__ = True  # type: ignore[attr-defined]
    return wrapper


def _no_split_source(fn: Callable[..., Any]) -> Callable[..., Any]:
    """torch's ``_get_split_source``, which finds no communicator to split from in a delegating
    group: its subgroups build their own (a split would tie them to a generation a rewire
    destroys, and ranks outside a subgroup would join a split its members never make)."""

    @functools.wraps(fn)
    def wrapper(pg: Any) -> Any:
        from tpagent_rank import backend as b

        return None if isinstance(pg, b.DelegatingGroup) else fn(pg)

    wrapper.__tpagent__ = True  # type: ignore[attr-defined]
    return wrapper


def _rebind(name: str, old: Any, new: Any) -> None:
    """``new`` in place of ``old`` wherever torch's modules hold it by ``name``: those that
    imported it by name while torch.distributed was being imported (its device_mesh: a
    DeviceMesh makes its groups, and the default group when there is none, with its own copy)."""
    for mod_name, mod in list(sys.modules.items()):
        if (mod_name == "torch" or mod_name.startswith("torch.")) and getattr(mod, "__dict__", {}).get(name) is old:
            setattr(mod, name, new)


def patch(module: ModuleType) -> None:
    c10d = sys.modules.get("torch.distributed.distributed_c10d")
    if c10d is None or not getattr(module, "is_available", lambda: False)():
        return
    wrappers: list[tuple[str, Callable[[Callable[..., Any]], Callable[..., Any]]]] = [
        ("init_process_group", functools.partial(_with_backend, index=0, default=True)),
        ("new_group", functools.partial(_with_backend, index=2, default=False)),
        ("split_group", _split_with_backend),
        ("_get_split_source", _no_split_source),
    ]
    for name, wrap in wrappers:
        fn = getattr(c10d, name, None)
        if fn is None or getattr(fn, "__tpagent__", False):
            continue  # (a torch without it, or patched already)
        _rebind(name, fn, wrap(fn))
    rendezvous = sys.modules.get("torch.distributed.rendezvous")
    if rendezvous is not None:
        from tpagent_rank import store

        store.patch_rendezvous(rendezvous)


class _Finder(importlib.abc.MetaPathFinder):
    """Finds torch.distributed as usual, and patches it once it has run."""

    def __init__(self) -> None:
        self.busy = False

    def find_spec(
        self, fullname: str, path: Sequence[str] | None, target: ModuleType | None = None
    ) -> importlib.machinery.ModuleSpec | None:
        if fullname != TARGET or self.busy:
            return None
        self.busy = True
        try:
            spec = importlib.util.find_spec(fullname)
        finally:
            self.busy = False
        loader = spec.loader if spec is not None else None
        if spec is None or loader is None or not hasattr(loader, "exec_module"):
            return None
        run = loader.exec_module

        def exec_module(module: ModuleType) -> None:
            run(module)
            patch(module)

        loader.exec_module = exec_module  # type: ignore[method-assign]
        return spec


def install() -> None:
    if TARGET in sys.modules:  # (imported before us: patch it as it is)
        patch(sys.modules[TARGET])
    elif not any(isinstance(f, _Finder) for f in sys.meta_path):
        sys.meta_path.insert(0, _Finder())


install()
if env.JOIN:  # (a joiner: its output is not the job's until it is in)
    join.quiet()
