"""The Kubernetes adapter of the scheduler port (:mod:`.scheduler`), written against the official
Python client (``pip install 'tpagent[kubernetes]'``; in-cluster config, else ``KUBECONFIG``).
NOT YET PROVEN: it has run against no API server (no cluster can run where this project is
built); only its reading of the API's objects is tested (tests/unit/test_kubernetes_adapter.py).

* Spares: Ready, schedulable nodes labelled ``kubernetes_spare_label`` (dedicated), then any
  Ready, schedulable node with ``nvidia.com/gpu`` allocatable that no pod requests (floating).
  Nodes running only pods of a priority below ``kubernetes_preempt_below`` are taken last: the
  placeholder's priority class preempts them, as the scheduler does.
* A hold is a placeholder pod ``tpagent-hold-<job>-<node>`` in ``kubernetes_namespace``, pinned
  to the spare by a ``nodeSelector`` on its hostname (kube-scheduler places it, and so preempts),
  requesting the GPUs the ranks use, of priority class
  ``kubernetes_hold_priority_class`` (cluster-wide, created by the operator), labelled
  ``tpagent.io/hold`` and ``tpagent.io/hold-node``, the job's key (its name and identity,
  :mod:`~tpagent.orchestrator.api`) in its annotation ``tpagent.io/job``;
  the move starts once it runs.
* A taint is the node taint ``tpagent.io/tainted=<reason>:NoSchedule`` (running pods stay); an
  untaint removes only that key, tpagent's own.
* The record: each pod of the job (label ``tpagent.io/job=<job>``) is annotated
  ``tpagent.io/moved-ranks`` with where its moved ranks run.

How it is to be proven, where a cluster exists: a kind cluster (or k3s) with the fake GPU
device plugin advertising ``nvidia.com/gpu`` on its workers, the agents as a DaemonSet
(deploy/kubernetes-sidecar.yaml's image), the orchestrator as deploy/kubernetes-orchestrator.yaml
with ``scheduler = "kubernetes"``, and the test of tests/orchestrator/test_slurm.py repeated:
a taint gives a NoSchedule node taint, a placeholder pod holds the spare's GPU while the rank
runs there, and everything is released when the rank returns or the job's pods end.
"""

from __future__ import annotations

import hashlib
import importlib
import logging
import re
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from host.api import UsageError, is_whole
from tpagent.orchestrator.api import Move, MoveKind, job_name
from tpagent.orchestrator.config import OrchestratorConfig
from tpagent.orchestrator.scheduler import Held, Pool, SchedulerError, Wanted

log = logging.getLogger(__name__)

GPU = "nvidia.com/gpu"
TAINT = "tpagent.io/tainted"
JOB_LABEL = "tpagent.io/job"
HOLD = "tpagent.io/hold"
HOLD_NODE = "tpagent.io/hold-node"
RECORD = "tpagent.io/moved-ranks"
FRESH_FOR = 10.0


@dataclass(frozen=True)
class KNode:
    name: str
    ready: bool
    schedulable: bool
    labels: dict[str, str]
    gpus: int  # allocatable nvidia.com/gpu
    taints: tuple[dict[str, Any], ...]  # every taint of it, as the API listed it

    @property
    def taint(self) -> str:
        """tpagent's taint's value ("": none)."""
        return next((t.get("value") or "" for t in self.taints if t.get("key") == TAINT), "")


@dataclass(frozen=True)
class KPod:
    name: str
    namespace: str
    node: str
    phase: str
    priority: int
    gpus: int  # requested by its containers
    labels: dict[str, str]
    annotations: dict[str, str]

    @property
    def active(self) -> bool:
        return self.phase in ("Pending", "Running")


def node_of(d: dict[str, Any]) -> KNode:
    """A node from its API object (as JSON: ``ApiClient.sanitize_for_serialization``)."""
    meta = d.get("metadata") or {}
    spec = d.get("spec") or {}
    status = d.get("status") or {}
    ready = any(c.get("type") == "Ready" and c.get("status") == "True" for c in status.get("conditions") or ())
    return KNode(
        str(meta.get("name", "")),
        ready,
        not spec.get("unschedulable", False),
        dict(meta.get("labels") or {}),
        _count((status.get("allocatable") or {}).get(GPU)),
        tuple(spec.get("taints") or ()),
    )


def pod_of(d: dict[str, Any]) -> KPod:
    meta = d.get("metadata") or {}
    spec = d.get("spec") or {}
    status = d.get("status") or {}
    gpus = sum(
        _count(((c.get("resources") or {}).get("requests") or {}).get(GPU)) for c in spec.get("containers") or ()
    )
    return KPod(
        str(meta.get("name", "")),
        str(meta.get("namespace", "")),
        str(spec.get("nodeName") or ""),
        str(status.get("phase") or ""),
        int(spec.get("priority") or 0),
        gpus,
        dict(meta.get("labels") or {}),
        dict(meta.get("annotations") or {}),
    )


def _count(value: Any) -> int:
    return int(value) if isinstance(value, int | str) and is_whole(str(value)) else 0


def taint_value(reason: str) -> str:
    """A taint's value (a label value: 63 characters of [A-Za-z0-9_.-], alphanumeric at both ends)."""
    value = re.sub(r"[^A-Za-z0-9_.-]", "_", reason)[:63].strip("_.-")
    return value or "tainted"


def hold_name(job: str, node: str) -> str:
    """A pod name (a DNS label) for the hold of ``job`` (its key) on ``node``: its name, cut
    short, and a digest of the key and the node (each hold its own, however long the names)."""
    readable = re.sub(r"[^a-z0-9-]", "-", f"tpagent-hold-{job_name(job)}".lower())[:46].rstrip("-")
    digest = hashlib.sha256(f"{job}\n{node}".encode()).hexdigest()[:16]
    return f"{readable}-{digest}"


def pool_of(cfg: OrchestratorConfig, job: str, nodes: list[KNode], pods: list[KPod]) -> Pool:
    used: dict[str, int] = {}
    busy: dict[str, list[KPod]] = {}
    for p in pods:
        if p.active and p.node:
            used[p.node] = used.get(p.node, 0) + p.gpus
            busy.setdefault(p.node, []).append(p)
    open_ = [n for n in nodes if n.ready and n.schedulable and not n.taint]
    free = {n.name for n in open_ if n.gpus > used.get(n.name, 0) or (not n.gpus and n.name not in busy)}
    label = cfg.kubernetes_spare_label
    dedicated = {n.name: frozenset[str]() for n in sorted(open_, key=lambda n: n.name) if label in n.labels}
    dedicated = {n: g for n, g in dedicated.items() if n in free}
    below = cfg.kubernetes_preempt_below
    taken = {
        n.name
        for n in open_
        if below and n.name in busy and all(p.priority < below and JOB_LABEL not in p.labels for p in busy[n.name])
    }
    return Pool(dedicated, frozenset(free - set(dedicated)), frozenset(taken - free))


class Kubernetes:
    name = "Kubernetes"

    def __init__(self, cfg: OrchestratorConfig) -> None:
        self.cfg = cfg
        self.lock = threading.Lock()
        self.read: tuple[float, list[KNode], list[KPod]] | None = None
        self._api: Any = None

    def api(self) -> Any:
        """The client's CoreV1Api (imported only here: the package is an optional extra)."""
        if self._api is None:
            try:
                client = importlib.import_module("kubernetes.client")
                config = importlib.import_module("kubernetes.config")
            except ImportError as e:
                raise UsageError(
                    "scheduler = kubernetes needs the official client: pip install 'tpagent[kubernetes]'."
                ) from e
            try:
                config.load_incluster_config()
            except Exception:  # noqa: BLE001 (not in a pod: the kubeconfig, as kubectl reads it)
                config.load_kube_config()
            self._api = client.CoreV1Api()
        return self._api

    def _call(self, what: str, fn: Any, *args: Any, **kw: Any) -> Any:
        try:
            return fn(*args, **kw)
        except Exception as e:  # noqa: BLE001 (the client's ApiException, urllib3's errors: one sentence)
            status = getattr(e, "status", None)
            raise SchedulerError(f"the Kubernetes API refused to {what}: {status or e}", down=status is None) from e

    def refresh(self) -> tuple[list[KNode], list[KPod]]:
        api = self.api()
        serialize = api.api_client.sanitize_for_serialization
        nodes = [node_of(serialize(n)) for n in self._call("list nodes", api.list_node).items]
        pods = [pod_of(serialize(p)) for p in self._call("list pods", api.list_pod_for_all_namespaces).items]
        with self.lock:
            self.read = (time.monotonic(), nodes, pods)
        return nodes, pods

    def check(self) -> None:
        self.api()

    def pool(self, job: str, users: frozenset[int]) -> Pool:
        with self.lock:
            read = self.read
        if read is None or time.monotonic() - read[0] > FRESH_FOR:
            return Pool(floating=frozenset(), why="the Kubernetes API has not answered lately: no spare is taken")
        return pool_of(self.cfg, job, read[1], read[2])

    def hold(self, move: Move, gpus: int, users: frozenset[int]) -> Held:
        if move.kind is MoveKind.HOME:
            return Held()
        nodes, pods = self.refresh()
        if move.target in {p.node for p in pods if p.labels.get(JOB_LABEL) == job_name(move.job) and p.active}:
            return Held()  # (a node of the job's own pods)
        name = hold_name(move.job, move.target)
        ns = self.cfg.kubernetes_namespace
        if not any(p.name == name and p.namespace == ns and p.active for p in pods):
            self._call("create a placeholder pod", self.api().create_namespaced_pod, ns, self._pod(name, move, gpus))
        deadline = time.monotonic() + self.cfg.spare_hold_timeout
        while time.monotonic() < deadline:
            if any(p.name == name and p.namespace == ns and p.phase == "Running" for p in self.refresh()[1]):
                return Held(f"{ns}/{name}")
            time.sleep(1.0)
        self._delete(ns, name)
        raise SchedulerError(f"the placeholder pod {ns}/{name} did not run on {move.target} in time.")

    def _pod(self, name: str, move: Move, gpus: int) -> dict[str, Any]:
        resources = {"limits": {GPU: str(gpus)}, "requests": {GPU: str(gpus)}} if gpus else {}
        labels = {HOLD: "true", HOLD_NODE: move.target}
        return {
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": {"name": name, "labels": labels, "annotations": {"tpagent.io/job": move.job}},
            "spec": {  # (placed by kube-scheduler, not nodeName: so that its priority preempts lower pods)
                "nodeSelector": {"kubernetes.io/hostname": move.target},
                "priorityClassName": self.cfg.kubernetes_hold_priority_class,
                "restartPolicy": "Always",
                "tolerations": [{"key": TAINT, "operator": "Exists", "effect": "NoSchedule"}],
                "containers": [{"name": "hold", "image": self.cfg.kubernetes_hold_image, "resources": resources}],
            },
        }

    def _delete(self, ns: str, name: str) -> None:
        try:
            self._call("delete a placeholder pod", self.api().delete_namespaced_pod, name, ns)
        except SchedulerError as e:
            log.warning("%s", e)

    def reconcile(self, wanted: Callable[[], Wanted]) -> list[str]:
        nodes, pods = self.refresh()
        want = wanted()
        api = self.api()
        said = []
        for n in nodes:
            reason = taint_value(want.drains.get(n.name, ""))
            if n.name in want.drains and not n.taint:
                taints = [*n.taints, {"key": TAINT, "value": reason, "effect": "NoSchedule"}]
                self._call("taint a node", api.patch_node, n.name, {"spec": {"taints": taints}})
                said.append(f"{n.name} tainted NoSchedule in Kubernetes")
            elif n.name not in want.drains and n.taint:
                taints = [t for t in n.taints if t.get("key") != TAINT]
                self._call("untaint a node", api.patch_node, n.name, {"spec": {"taints": taints}})
                said.append(f"{n.name}'s NoSchedule taint removed in Kubernetes (tpagent's own)")
        # (by name: a pod's label names its job)
        running = {job_name(j) for j in want.running} | {
            p.labels[JOB_LABEL] for p in pods if JOB_LABEL in p.labels and p.active
        }
        where: dict[str, dict[int, str]] = {}
        for job, ranks in want.where.items():
            where.setdefault(job_name(job), {}).update(ranks)
        for p in pods:
            if HOLD_NODE not in p.labels or not p.active:
                continue
            key = (p.annotations.get("tpagent.io/job", ""), p.labels[HOLD_NODE])
            if key in want.moving or key in want.away and job_name(key[0]) in running:
                continue
            self._delete(p.namespace, p.name)
            said.append(f"placeholder pod {p.namespace}/{p.name} deleted: job {job_name(key[0])}'s ranks left {key[1]}")
        for p in pods:
            job = p.labels.get(JOB_LABEL, "")
            text = "; ".join(f"rank {r} on {n}" for r, n in sorted(where.get(job, {}).items()))
            if job and p.active and p.annotations.get(RECORD, "") != text:
                body = {"metadata": {"annotations": {RECORD: text or None}}}
                self._call("annotate a pod", api.patch_namespaced_pod, p.name, p.namespace, body)
        return said
