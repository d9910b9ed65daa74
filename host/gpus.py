"""GPU inventory through NVML (the ``pynvml`` module of nvidia-ml-py).

On a node without NVIDIA hardware or driver every function returns an empty result: the
inventory is informational and never the reason a command fails.
"""

from __future__ import annotations

import logging
from collections.abc import Collection
from dataclasses import asdict, dataclass
from typing import Any

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class GpuInfo:
    index: int
    uuid: str
    name: str
    memory_total: int
    memory_used: int
    temperature_c: int | None
    ecc_uncorrected: int | None
    pids: tuple[int, ...]
    pci_bus_id: str = ""  # domain:bus:device.function, as NVML writes it ("": not known)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def _nvml() -> Any | None:
    try:
        import pynvml

        pynvml.nvmlInit()
    except Exception as e:  # NVMLError_LibraryNotFound, DriverNotLoaded, ImportError...
        log.debug("NVML unavailable: %s", e)
        return None
    return pynvml


def driver_version() -> str | None:
    nv = _nvml()
    if nv is None:
        return None
    try:
        return _text(nv.nvmlSystemGetDriverVersion())
    except Exception as e:
        log.warning("NVML could not report the driver version: %s", e)
        return None
    finally:
        nv.nvmlShutdown()


def cuda_version() -> str:
    """The CUDA version the driver supports ("12.8"; "" without NVML)."""
    nv = _nvml()
    if nv is None:
        return ""
    try:
        v = int(nv.nvmlSystemGetCudaDriverVersion())
    except Exception as e:
        log.warning("NVML could not report the CUDA version: %s", e)
        return ""
    finally:
        nv.nvmlShutdown()
    return f"{v // 1000}.{v % 1000 // 10}"


def inventory() -> list[GpuInfo]:
    nv = _nvml()
    if nv is None:
        return []
    try:
        out = []
        for i in range(nv.nvmlDeviceGetCount()):
            try:
                out.append(_one(nv, i))
            except Exception as e:  # NVMLError: this GPU fell off the bus...: the others are still listed
                log.warning("NVML could not read GPU %d: %s", i, e)
        return out
    except Exception as e:  # the driver is wedged...
        log.warning("NVML could not list the GPUs: %s", e)
        return []
    finally:
        nv.nvmlShutdown()


def _optional(fn: Any, *args: Any) -> Any:
    try:
        return fn(*args)
    except Exception:  # not supported on this board (ECC off, no sensor...)
        return None


def _one(nv: Any, index: int) -> GpuInfo:
    h = nv.nvmlDeviceGetHandleByIndex(index)
    mem = nv.nvmlDeviceGetMemoryInfo(h)
    procs = _optional(nv.nvmlDeviceGetComputeRunningProcesses, h) or []
    return GpuInfo(
        index=index,
        uuid=_text(nv.nvmlDeviceGetUUID(h)),
        name=_text(nv.nvmlDeviceGetName(h)),
        memory_total=int(mem.total),
        memory_used=int(mem.used),
        temperature_c=_optional(nv.nvmlDeviceGetTemperature, h, nv.NVML_TEMPERATURE_GPU),
        ecc_uncorrected=_optional(
            nv.nvmlDeviceGetTotalEccErrors, h, nv.NVML_MEMORY_ERROR_TYPE_UNCORRECTED, nv.NVML_VOLATILE_ECC
        ),
        pids=tuple(int(p.pid) for p in procs),
        pci_bus_id=_text(getattr(_optional(nv.nvmlDeviceGetPciInfo, h), "busId", "")),
    )


def pair(old: list[tuple[str, str]], ours: list[GpuInfo], taken: Collection[str] = ()) -> dict[str, str]:
    """Each source GPU, (UUID, PCI bus id), onto one of ``ours``: the one at the same bus id
    where there is one that no process uses, else the emptiest left (one no process uses
    first).  A restored process's CUDA may go on reporting the bus ids of the GPUs it was dumped
    on (cuda-checkpoint issue 48), and NCCL, among others, finds its GPU in NVML by bus id: on
    the same bus id, that stale answer is the right one.  ``taken``: GPUs that copies restored
    here soon will use (counted as used: NCCL refuses two ranks of a job on one GPU)."""
    busy = {g.uuid for g in ours if g.pids} | set(taken)
    left = sorted(ours, key=lambda g: (g.uuid in busy, g.memory_used))  # (free ones first)
    out: dict[str, str] = {}
    for uuid, bus in old:
        same = next((g for g in left if bus and g.uuid not in busy and g.pci_bus_id.lower() == bus.lower()), None)
        if same is not None:
            out[uuid] = same.uuid
            left.remove(same)
    for uuid, _bus in old:
        if uuid not in out and left:
            out[uuid] = left.pop(0).uuid
    return out


def gpus_of(pids: set[int]) -> list[GpuInfo]:
    """The GPUs on which any of ``pids`` runs."""
    return [g for g in inventory() if pids & set(g.pids)]


@dataclass(frozen=True)
class GpuModes:
    """What decides, per GPU, whether and how fast a checkpoint works (``tpagent doctor``)."""

    uuid: str
    persistence: bool | None  # persistence mode on (None: NVML cannot say)
    mig: bool | None  # MIG mode on (None: not a MIG-capable board)
    mps_pids: tuple[int, ...]  # processes that are clients of an MPS server on it


def modes() -> list[GpuModes]:
    nv = _nvml()
    if nv is None:
        return []
    try:
        out = []
        for i in range(nv.nvmlDeviceGetCount()):
            h = nv.nvmlDeviceGetHandleByIndex(i)
            pm = _optional(nv.nvmlDeviceGetPersistenceMode, h)
            mig = _optional(nv.nvmlDeviceGetMigMode, h)
            mps = _optional(nv.nvmlDeviceGetMPSComputeRunningProcesses, h) or []
            out.append(
                GpuModes(
                    _text(nv.nvmlDeviceGetUUID(h)),
                    None if pm is None else bool(pm),
                    None if mig is None else bool(mig[0]),
                    tuple(int(p.pid) for p in mps),
                )
            )
        return out
    except Exception as e:
        log.warning("NVML could not read the GPUs' modes: %s", e)
        return []
    finally:
        nv.nvmlShutdown()
