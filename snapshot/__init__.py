"""Freeze a process tree and capture it as images (CRIU + the CUDA driver's checkpoint API)."""

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
    UsageError,
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
