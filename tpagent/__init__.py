"""tpagent: model-transparent checkpoint/restore of GPU training processes."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    #: The installed distribution's version (:func:`snapshot.api.producer_version`).
    __version__: str


def __getattr__(name: str) -> str:
    # __version__ is looked up on first use, not at import: a launched workload's PID 1
    # (``python -I -m tpagent.workload.nsinit``, checkpointed with it) imports this package, never
    # needs the version, and should not carry importlib.metadata in its memory.
    if name == "__version__":
        from snapshot.api import producer_version

        return producer_version()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
