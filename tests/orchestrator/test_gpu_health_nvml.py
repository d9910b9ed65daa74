"""GPU health from NVML itself (skipped on machines without an NVIDIA GPU): every GPU is read,
its XID critical-error events are registered, and a temperature threshold under its current
temperature is a finding naming it and the reading."""

from __future__ import annotations

import pytest

from host import gpus
from host.gpuhealth import Nvml, Signal, Thresholds, Watch

HAS_GPU = bool(gpus.inventory())
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not HAS_GPU, reason="no NVIDIA GPU on this machine")]


def test_nvml_readings_xid_events_and_a_low_threshold_taint() -> None:
    source = Nvml()
    readings = source.readings()
    uuids = [g.uuid for g in gpus.inventory()]
    assert [r.uuid for r in readings] == uuids
    assert sorted(source.registered) == sorted(uuids)  # (the XID event set watches every GPU)
    for r in readings:
        assert not r.lost and r.temperature_c is not None and r.temperature_c > 0, r
        assert r.slowdown_c is None or r.slowdown_c > r.temperature_c, r
    found = Watch(source, Thresholds(temperature_c=1)).findings()
    assert sorted(f.gpu for f in found if f.what is Signal.TEMPERATURE) == sorted(uuids)
    assert all("at or over 1 C" in f.reading for f in found if f.what is Signal.TEMPERATURE)
    assert not [f for f in Watch(source).findings() if f.what is Signal.TEMPERATURE]  # (a healthy, idle GPU)
