"""A rank's backend specs, as the user gives them to ``init_process_group`` and ``new_group``
("gloo", "nccl", "cpu:gloo,cuda:nccl", none), and which of them a delegating group rebuilds."""

from __future__ import annotations

import torch

#: The backends that exist for each device type (what the user's spec named).
KNOWN = ("gloo", "nccl")


def device_specs(spec: str | None) -> dict[str, str]:
    """The user's backend spec ("gloo", "nccl", "cpu:gloo,cuda:nccl", None) as device -> backend."""
    if spec is None or spec in ("", "undefined"):
        return {"cpu": "gloo", "cuda": "nccl"} if torch.cuda.is_available() else {"cpu": "gloo"}
    spec = str(spec).lower()
    if ":" in spec:
        return dict(part.split(":", 1) for part in spec.split(","))
    if spec == "nccl":
        return {"cuda": "nccl"}
    return {"cpu": spec, "cuda": spec} if spec == "gloo" else {"cpu": spec}


def unsupported(spec: str | None) -> str | None:
    """Why a spec cannot be delegated (a backend we do not rebuild), else None."""
    for backend in device_specs(spec).values():
        if backend not in KNOWN:
            return f"backend {backend!r} is not one tpagent can rebuild (gloo, nccl)"
    return None
