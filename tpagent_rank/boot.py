"""Installed by the rank's ``sitecustomize`` when ``TPAGENT_RANK_SOCKET`` is set: once the
user's code has imported ``torch.distributed``, its ``init_process_group`` and ``new_group``
use the delegating backend (:mod:`tpagent_rank.backend`), and a store its stand-in hosts is
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

TARGET = "torch.distributed"
_DEFAULT_SPEC: list[Any] = [None]
_lock = threading.Lock()


def _with_backend(fn: Callable[..., Any], index: int, default: bool) -> Callable[..., Any]:
    """``fn`` (init_process_group, new_group) with its backend argument (at ``index``) made
    the delegating one, the user's own remembered as the inner backend's spec."""

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        from tpagent_rank import backend as b
        from tpagent_rank import owned

        args_l = list(args)
        spec = args_l[index] if len(args_l) > index else kwargs.get("backend")
        if not default and spec is None:
            spec = _DEFAULT_SPEC[0]
        if spec is not None and str(spec).lower() == b.NAME:
            return fn(*args, **kwargs)
        why = b.unsupported(spec)
        if why is not None:
            from tpagent_rank.agent import say

            say(f"{why}: this process group cannot be rewired")
            return fn(*args, **kwargs)
        b.register()
        if not b.ON_GROUP:
            from tpagent_rank import agent

            b.ON_GROUP.append(agent.group_created)
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


def patch(module: ModuleType) -> None:
    c10d = sys.modules.get("torch.distributed.distributed_c10d")
    if c10d is None or not getattr(module, "is_available", lambda: False)():
        return
    for name, index, default in (("init_process_group", 0, True), ("new_group", 2, False)):
        fn = getattr(c10d, name)
        if getattr(fn, "__tpagent__", False):
            continue
        wrapped = _with_backend(fn, index, default)
        setattr(c10d, name, wrapped)
        if getattr(module, name, None) is fn:
            setattr(module, name, wrapped)
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
