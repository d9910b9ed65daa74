"""The Kubernetes adapter's reading of the API's objects (as JSON, the shape the official client's
``sanitize_for_serialization`` gives) and the spares it gives from them.  Only this is tested:
the adapter has run against no API server yet (see tpagent/orchestrator/kubernetes.py)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from tpagent.orchestrator.api import job_key
from tpagent.orchestrator.config import OrchestratorConfig
from tpagent.orchestrator.kubernetes import KNode, KPod, hold_name, node_of, pod_of, pool_of, taint_value


def cfg(**kw: object) -> OrchestratorConfig:
    return OrchestratorConfig(secret_file=Path("/dev/null"), scheduler="kubernetes", **kw)  # type: ignore[arg-type]


def knode(name: str, gpus: int = 8, ready: bool = True, spare: bool = False, **spec: Any) -> KNode:
    return node_of(
        {
            "metadata": {"name": name, "labels": {"tpagent.io/spare": "true"} if spare else {}},
            "spec": spec,
            "status": {
                "allocatable": {"nvidia.com/gpu": str(gpus), "cpu": "64"},
                "conditions": [{"type": "Ready", "status": "True" if ready else "False"}],
            },
        }
    )


def kpod(name: str, node: str, gpus: int, priority: int = 0, job: str = "", phase: str = "Running") -> KPod:
    return pod_of(
        {
            "metadata": {"name": name, "namespace": "ml", "labels": {"tpagent.io/job": job} if job else {}},
            "spec": {
                "nodeName": node,
                "priority": priority,
                "containers": [{"name": "c", "resources": {"requests": {"nvidia.com/gpu": str(gpus), "cpu": "4"}}}],
            },
            "status": {"phase": phase},
        }
    )


def test_nodes_and_pods_are_read_from_the_apis_objects() -> None:
    n = knode("g1", taints=[{"key": "tpagent.io/tainted", "value": "fan", "effect": "NoSchedule"}], unschedulable=True)
    assert (n.name, n.ready, n.schedulable, n.gpus, n.taint) == ("g1", True, False, 8, "fan")
    p = kpod("r0", "g1", 4, priority=7, job="j")
    assert (p.node, p.gpus, p.priority, p.labels, p.active) == ("g1", 4, 7, {"tpagent.io/job": "j"}, True)
    assert not kpod("old", "g1", 1, phase="Succeeded").active


def test_spares_are_labelled_nodes_first_then_nodes_with_free_gpus_and_pods_of_low_priority_last() -> None:
    nodes = [
        knode("a"),
        knode("s1", spare=True),
        knode("s2", spare=True),
        knode("b"),
        knode("c"),
        knode("down", ready=False),
        knode("cordoned", unschedulable=True),
        knode("low"),
    ]
    pods = [
        kpod("r0", "a", 8, job="j"),
        kpod("x", "s2", 8, priority=60),  # (someone's pod has all of s2's GPUs)
        kpod("y", "b", 4),
        kpod("z", "c", 8, priority=100),
        kpod("batch", "low", 8, priority=1),
    ]
    p = pool_of(cfg(kubernetes_preempt_below=50), "j", nodes, pods)
    assert list(p.dedicated) == ["s1"]
    assert p.floating == frozenset({"b"})  # (4 of its 8 GPUs free)
    assert p.taken == frozenset({"low"})  # (c's pod is above the threshold; the job's own pods never give way)
    assert pool_of(cfg(), "j", nodes, pods).taken == frozenset()


def test_a_placeholders_name_is_a_dns_label() -> None:
    name = hold_name("Job_1.with/odd chars" + "x" * 80, "gpu-node-07.cluster.local")
    assert len(name) <= 63 and name.startswith("tpagent-hold-job-1-with-odd-chars")
    assert all(ch.isalnum() and ch.islower() or ch.isdigit() or ch == "-" for ch in name)
    # Each hold its own, however long the names: another node, or another job of that name.
    long = "j" * 60
    names = {hold_name(job_key(long, i), n) for i in ("0" * 16, "1" * 16) for n in ("node-a", "node-b")}
    assert len(names) == 4 and all(len(n) <= 63 for n in names)


def test_a_taints_value_is_a_label_value() -> None:
    assert taint_value("GPU GPU-8a1f: 91 C, at or over 85 C") == "GPU_GPU-8a1f__91_C__at_or_over_85_C"
    assert taint_value("::") == "tainted" and len(taint_value("x" * 200)) == 63
