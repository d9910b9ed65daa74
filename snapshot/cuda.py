"""The CUDA driver's checkpoint API (``cuCheckpointProcess*``), called through cuda-python.

The driver moves a process's GPU memory into its own host memory (checkpoint) and back
(restore), after which the process holds no ``/dev/nvidia*`` descriptors and CRIU can dump it.
States, as the driver reports them::

    RUNNING --lock--> LOCKED --checkpoint--> CHECKPOINTED --restore--> LOCKED --unlock--> RUNNING

Needs driver >= 570 (CUDA 12.8, where the API appeared) and ``cuda-python``.
"""

from __future__ import annotations

import ctypes
import enum
import uuid
from collections.abc import Mapping
from typing import Any

from host.api import UsageError
from snapshot.api import CudaError

MIN_DRIVER_CUDA_VERSION = 12080  # driver branch 570


class CudaState(str, enum.Enum):
    RUNNING = "running"
    LOCKED = "locked"
    CHECKPOINTED = "checkpointed"
    FAILED = "failed"
    CHECKPOINTING = "checkpointing"
    RESTORING = "restoring"


def uuid_bytes(text: str) -> bytes:
    """``GPU-8e8a3c4b-...`` (NVML's spelling) or a bare UUID -> its 16 bytes."""
    bare = text.strip().removeprefix("GPU-").removeprefix("gpu-")
    try:
        return uuid.UUID(bare).bytes
    except ValueError as e:
        raise UsageError(f"{text!r} is not a GPU UUID (expected GPU-xxxxxxxx-xxxx-...).") from e


def uuid_text(raw: bytes) -> str:
    return f"GPU-{uuid.UUID(bytes=bytes(raw))}"


class CudaDriver:
    """One initialised CUDA driver.  Construct it only when a process actually uses CUDA."""

    def __init__(self) -> None:
        try:
            from cuda.bindings import driver
        except ImportError as e:
            raise UsageError(
                "the process uses the GPU but cuda-python is not installed; "
                "install it (pip install cuda-python) to checkpoint GPU processes."
            ) from e
        self._d: Any = driver
        try:
            (err,) = driver.cuInit(0)
        except Exception as e:  # the bindings raise when libcuda.so cannot be loaded
            raise UsageError(
                "the process uses the GPU, but the NVIDIA driver library (libcuda.so) cannot be "
                "loaded on this node: install the NVIDIA driver (570 or newer) to checkpoint it."
            ) from e
        self._check(err, "initialisation")
        err, version = driver.cuDriverGetVersion()
        self._check(err, "version query")
        self.driver_cuda_version = int(version)
        if version < MIN_DRIVER_CUDA_VERSION or not hasattr(driver, "cuCheckpointProcessLock"):
            raise UsageError(
                f"this node's NVIDIA driver supports CUDA {version // 1000}.{version % 1000 // 10}; "
                "the checkpoint API needs driver 570 or newer (CUDA 12.8): upgrade the driver."
            )

    def _check(self, err: Any, what: str, pid: int | None = None) -> None:
        if err == self._d.CUresult.CUDA_SUCCESS:
            return
        _, name = self._d.cuGetErrorName(err)
        whose = f" of PID {pid}" if pid is not None else ""
        raise CudaError(
            f"CUDA {what}{whose} failed",
            detail=name.decode() if isinstance(name, bytes) else str(name),
            code=int(err),
        )

    def state(self, pid: int) -> CudaState:
        err, st = self._d.cuCheckpointProcessGetState(pid)
        self._check(err, "state query", pid)
        states = list(CudaState)
        if not 0 <= int(st) < len(states):
            raise CudaError(f"the driver reports an unknown checkpoint state for PID {pid}", code=int(st))
        return states[int(st)]

    def lock(self, pid: int, timeout: float) -> None:
        args = self._d.CUcheckpointLockArgs()
        args.timeoutMs = max(1, int(timeout * 1000))
        (err,) = self._d.cuCheckpointProcessLock(pid, args)
        self._check(err, "lock", pid)

    def checkpoint(self, pid: int) -> None:
        (err,) = self._d.cuCheckpointProcessCheckpoint(pid, None)
        self._check(err, "checkpoint", pid)

    def restore(self, pid: int, gpu_map: Mapping[str, str] | None = None) -> None:
        """Bring GPU memory back; ``gpu_map`` maps the snapshot's GPU UUIDs to this node's."""
        args = None
        if gpu_map:
            pairs = []
            for old, new in gpu_map.items():
                pair = self._d.CUcheckpointGpuPair()
                pair.oldUuid = self._cuuuid(old)
                pair.newUuid = self._cuuuid(new)
                pairs.append(pair)
            args = self._d.CUcheckpointRestoreArgs()
            args.gpuPairs = pairs
            args.gpuPairsCount = len(pairs)
        (err,) = self._d.cuCheckpointProcessRestore(pid, args)
        self._check(err, "restore", pid)

    def unlock(self, pid: int) -> None:
        (err,) = self._d.cuCheckpointProcessUnlock(pid, None)
        self._check(err, "unlock", pid)

    def restore_thread_id(self, pid: int) -> int:
        err, tid = self._d.cuCheckpointProcessGetRestoreThreadId(pid)
        self._check(err, "restore-thread query", pid)
        return int(tid)

    def _cuuuid(self, text: str) -> Any:
        # CUuuid's ``bytes`` is read-only in the bindings: fill the struct through its pointer.
        value = self._d.CUuuid()
        ctypes.memmove(value.getPtr(), uuid_bytes(text), 16)
        return value


def has_context(cuda: CudaDriver, pid: int) -> bool:
    """Whether the driver knows the process: a forked worker that merely maps libcuda is not."""
    try:
        cuda.state(pid)
    except CudaError:
        return False
    return True
