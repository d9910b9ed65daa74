"""GPU health from NVML itself (skipped on machines without an NVIDIA GPU): every GPU is read,
its XID critical-error events are registered, and a temperature threshold under its current
temperature is a finding naming it and the reading; in an agent, that finding taints the GPU and
the orchestrator moves the rank on it to a spare (issue 24)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from conftest import needs_criu, needs_gpu
from host import gpus
from host.gpuhealth import Nvml, Signal, Thresholds, Watch
from support.cluster import Cluster
from support.helpers import wait_until
from support.orchestrator import Orchestrator
from support.rankjob import IFNAME, RUN, Job, _reference

pytestmark = needs_gpu


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


@needs_criu
@pytest.mark.timeout(900)
def test_a_gpu_over_its_temperature_threshold_moves_its_rank_to_the_spare(tmp_path: Path) -> None:
    """A's agent holds its GPU against a temperature threshold under the GPU's reading: the health
    taint names that GPU, and the world-size-1 NCCL job's rank on it moves to the spare namespace B
    (the same GPU, seen from another node: free there) without anyone asking; it ends bit-identical."""
    extra = ("--cuda", "--backend", "nccl")
    (tmp_path / "reference").mkdir()
    (tmp_path / "run").mkdir()
    reference = _reference(tmp_path / "reference", *extra, nproc=1)
    c = Cluster(tmp_path, ["A", "B"], ifname=IFNAME)
    o = Orchestrator(c, tmp_path, dedicated_spares=[c.nodes["B"].name])
    try:
        o.start()
        reporting = {"rewire_timeout": "120", "orchestrator": o.address, "report_period": "0.5"}
        c.nodes["A"].start_agent(**reporting, temperature_c="1")
        c.nodes["B"].start_agent(**reporting)
        job = Job(c, tmp_path / "run", extra=extra, names="A")
        try:
            job.at_step(0, 10)
            o.wait_rank_on(RUN, 0, c.nodes["B"].name, 300)
            taints = o.cluster()["taints"]
            assert [(t["node"], t["kind"], t["source"]) for t in taints] == [
                (c.nodes["A"].name, "preemptive", "health:temperature")
            ], taints
            assert taints[0]["gpu"] in {g.uuid for g in gpus.inventory()} and "at or over 1 C" in taints[0]["reason"]
            assert job.copies(0) == ["B"]
            job.finishes_as(reference)
        finally:
            job.close()
    finally:
        o.close()
        c.close()


@pytest.mark.timeout(300)
def test_a_gpu_another_workload_uses_is_reported_as_such(tmp_path: Path) -> None:
    """A CUDA process that is no rank's (started outside tpagent) is counted on its GPU in A's
    reports, which the orchestrator takes for no spare (tests/unit: the policy); once it ends, the
    GPU is free again.  (A rank's own processes are not counted: the test above moves a rank onto
    the same GPU seen from B.)"""
    c = Cluster(tmp_path, ["A"])
    o = Orchestrator(c, tmp_path)
    other = None
    try:
        o.start()
        c.nodes["A"].start_agent(orchestrator=o.address, report_period="0.5")

        def others() -> list[int]:
            nodes = [n for n in o.cluster()["nodes"] if n["name"] == c.nodes["A"].name]
            return [int(g.get("others", 0)) for n in nodes for g in n["gpus"]]

        wait_until(lambda: others() != [], "A to report its GPUs", 60)
        assert not any(others()), others()
        code = "import time, torch; torch.ones(1, device='cuda'); print('up', flush=True); time.sleep(600)"
        other = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
        assert other.stdout is not None and other.stdout.readline().strip() == "up"
        wait_until(lambda: any(others()), "A to report the other workload on its GPU", 60)
        assert "used by other workloads" in o.ok("cluster")
        other.kill()
        other.wait()
        wait_until(lambda: not any(others()), "its GPU to be free again", 60)
    finally:
        if other is not None:
            other.kill()
        o.close()
        c.close()
