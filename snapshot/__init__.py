"""Freeze a process tree and capture it as images (CRIU + the CUDA driver's checkpoint API)."""

from host.api import UsageError
from snapshot.api import (
    CriuError,
    CudaError,
    DumpMode,
    SnapshotConfig,
    SnapshotError,
    SnapshotInvalid,
    Stage,
    Timeouts,
    ToolError,
)

__all__ = [
    "CriuError",
    "CudaError",
    "DumpMode",
    "SnapshotConfig",
    "SnapshotError",
    "SnapshotInvalid",
    "Stage",
    "Timeouts",
    "ToolError",
    "UsageError",
]
