"""This node's GPUs' health, as the agent reports it to the orchestrator: each GPU's readings
(through NVML, or an injected :class:`Source`) held against thresholds, giving the findings that
become pre-emptive taints.

A finding is one of :class:`Signal`:

* ``ecc``: the GPU's volatile uncorrectable ECC count rose by ``ecc_rise`` or more since the
  agent first read it (the count only resets with the driver: it stays a finding);
* ``retire_pending`` / ``remap_pending``: a page retirement or a row remapping waits for the
  next reset (the memory behind it is suspect now);
* ``temperature``: the GPU is at or over ``temperature_c`` (0: its own slowdown temperature less
  ``temperature_margin_c``), while it is;
* ``xid``: a critical XID event (NVML's event set, registered for the XID critical errors)
  named in ``xids``; it stays a finding for the agent's life (a reset is a person's call);
* ``lost``: the GPU fell off the bus (NVML says so, or it no longer answers by its UUID).
"""

from __future__ import annotations

import enum
import logging
import threading
from dataclasses import dataclass, field
from typing import Any, Protocol

from host.gpus import _optional, _text  # (NVML's answers read as host.gpus reads them)

log = logging.getLogger(__name__)

#: XIDs that mean the GPU (or its memory, or its link) needs to be taken out of service: double-bit
#: ECC (48, 63, 64, 94, 95), NVLink (74), fallen off the bus (79), high single-bit rate (92),
#: GSP (119, 120), uncontained memory errors and row remapping failures (140).
CRITICAL_XIDS = frozenset({48, 63, 64, 74, 79, 92, 94, 95, 119, 120, 140})


class Signal(str, enum.Enum):
    ECC = "ecc"
    RETIRE_PENDING = "retire_pending"
    REMAP_PENDING = "remap_pending"
    TEMPERATURE = "temperature"
    XID = "xid"
    LOST = "lost"


@dataclass(frozen=True)
class Reading:
    """One GPU, now (None: the GPU cannot say)."""

    uuid: str
    temperature_c: int | None = None
    slowdown_c: int | None = None  # the GPU's own slowdown temperature
    ecc_uncorrected: int | None = None  # volatile uncorrectable ECC errors since the driver loaded
    retire_pending: bool = False
    remap_pending: bool = False
    xids: tuple[int, ...] = ()  # XID events since the last reading
    lost: bool = False


@dataclass(frozen=True)
class Finding:
    gpu: str
    what: Signal
    reading: str  # in words, with the threshold


@dataclass(frozen=True)
class Thresholds:
    temperature_c: int = 0  # 0: the GPU's slowdown temperature less temperature_margin_c
    temperature_margin_c: int = 5
    ecc_rise: int = 1
    xids: frozenset[int] = CRITICAL_XIDS


class Source(Protocol):
    def readings(self) -> list[Reading]: ...


@dataclass
class Watch:
    """The findings of ``source`` against ``thresholds``, reading after reading."""

    source: Source
    thresholds: Thresholds = Thresholds()
    _ecc_first: dict[str, int] = field(default_factory=dict)
    _xids: dict[str, list[int]] = field(default_factory=dict)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def findings(self) -> list[Finding]:
        with self._lock:
            return [f for r in self.source.readings() for f in self._of(r)]

    def _of(self, r: Reading) -> list[Finding]:
        t = self.thresholds
        out: list[Finding] = []
        if r.lost:
            return [Finding(r.uuid, Signal.LOST, "the GPU fell off the bus (it no longer answers)")]
        if r.ecc_uncorrected is not None:
            first = self._ecc_first.setdefault(r.uuid, r.ecc_uncorrected)
            rise = r.ecc_uncorrected - first
            if rise >= t.ecc_rise:
                out.append(
                    Finding(r.uuid, Signal.ECC, f"uncorrectable ECC errors rose by {rise} (threshold {t.ecc_rise})")
                )
        if r.retire_pending:
            out.append(Finding(r.uuid, Signal.RETIRE_PENDING, "a page retirement is pending"))
        if r.remap_pending:
            out.append(Finding(r.uuid, Signal.REMAP_PENDING, "a row remapping is pending"))
        limit = t.temperature_c or (r.slowdown_c - t.temperature_margin_c if r.slowdown_c else 0)
        if limit and r.temperature_c is not None and r.temperature_c >= limit:
            out.append(Finding(r.uuid, Signal.TEMPERATURE, f"{r.temperature_c} C, at or over {limit} C"))
        seen = self._xids.setdefault(r.uuid, [])
        seen.extend(x for x in r.xids if x in t.xids and x not in seen)
        if seen:
            out.append(Finding(r.uuid, Signal.XID, "critical XID " + ", ".join(map(str, seen))))
        return out


class Nvml:
    """:class:`Source` of this node's GPUs, through NVML (none where NVML cannot start).  It
    registers one event set for the XID critical errors of every GPU at its first reading."""

    def __init__(self) -> None:
        self._nv: Any | None = None
        self._events: Any | None = None
        self._uuids: list[str] = []
        self.registered: list[str] = []  # the GPUs whose XID events are watched

    def _start(self) -> Any | None:
        if self._nv is not None:
            return self._nv
        try:
            import pynvml as nv

            nv.nvmlInit()
        except Exception:  # noqa: BLE001 (no driver, no GPU: nothing to read)
            return None
        self._nv = nv
        for i in range(_optional(nv.nvmlDeviceGetCount) or 0):
            uuid = _optional(lambda i=i: _text(nv.nvmlDeviceGetUUID(nv.nvmlDeviceGetHandleByIndex(i))))
            if uuid is None:
                log.warning("GPU %d does not answer NVML: its health is not watched", i)
            else:
                self._uuids.append(uuid)
        try:
            self._events = nv.nvmlEventSetCreate()
        except nv.NVMLError as e:
            log.warning("XID events cannot be watched: %s", e)
            return nv
        for uuid in self._uuids:
            try:
                handle = nv.nvmlDeviceGetHandleByUUID(uuid)
                nv.nvmlDeviceRegisterEvents(handle, nv.nvmlEventTypeXidCriticalError, self._events)
                self.registered.append(uuid)
            except nv.NVMLError as e:
                log.warning("XID events of GPU %s cannot be watched: %s", uuid, e)
        return nv

    def readings(self) -> list[Reading]:
        nv = self._start()
        if nv is None:
            return []
        xids = self._drain(nv)
        return [self._one(nv, uuid, tuple(xids.get(uuid, ()))) for uuid in self._uuids]

    def _drain(self, nv: Any) -> dict[str, list[int]]:
        out: dict[str, list[int]] = {}
        while self._events is not None:
            try:
                e = nv.nvmlEventSetWait_v2(self._events, 0)
            except nv.NVMLError:  # (NVML_ERROR_TIMEOUT: none waiting)
                break
            uuid = _optional(lambda e=e: _text(nv.nvmlDeviceGetUUID(e.device)))
            for u in [uuid] if uuid else self._uuids:  # (a GPU that no longer says its UUID: each may be it)
                out.setdefault(u, []).append(int(e.eventData))
        return out

    def _one(self, nv: Any, uuid: str, xids: tuple[int, ...]) -> Reading:
        try:
            h = nv.nvmlDeviceGetHandleByUUID(uuid)
            nv.nvmlDeviceGetTemperature(h, nv.NVML_TEMPERATURE_GPU)
        except nv.NVMLError:
            return Reading(uuid, lost=True)
        remap = _optional(nv.nvmlDeviceGetRemappedRows, h)
        return Reading(
            uuid,
            temperature_c=_optional(nv.nvmlDeviceGetTemperature, h, nv.NVML_TEMPERATURE_GPU),
            slowdown_c=_optional(nv.nvmlDeviceGetTemperatureThreshold, h, nv.NVML_TEMPERATURE_THRESHOLD_SLOWDOWN),
            ecc_uncorrected=_optional(
                nv.nvmlDeviceGetTotalEccErrors, h, nv.NVML_MEMORY_ERROR_TYPE_UNCORRECTED, nv.NVML_VOLATILE_ECC
            ),
            retire_pending=bool(_optional(nv.nvmlDeviceGetRetiredPagesPendingStatus, h)),
            remap_pending=bool(remap[2]) if remap else False,
            xids=xids,
        )
