"""The orchestrator's configuration: a TOML file, then ``TPAGENT_ORCHESTRATOR_*`` variables, then flags.

# /etc/tpagent/orchestrator.toml (every key optional but secret_file)
node = "orchestrator"             # its name: agents and the CLI sign their calls for it (and
                                  # for advertise); also in logs
listen = "0.0.0.0:7410"           # its gRPC API: the agents' reports, taints, the cluster's view
advertise = ""                    # the address agents and the CLI reach it by (signed for)
secret_file = "/etc/tpagent/secret"  # the cluster secret, as on every agent
tls_dir = "/etc/tpagent/tls"      # ca.crt, tls.crt, tls.key: mutual TLS, the cluster's CA
state = "/var/lib/tpagent-orchestrator/state.db"  # SQLite (WAL): taints, moves, events
health_listen = ""                # plain-text gRPC health Check only (probes); "" turns it off
metrics_listen = "127.0.0.1:9410" # Prometheus text format; "" turns it off
webhook_listen = ""               # Alertmanager's webhook (HTTPS with tls_dir's certificate); "" off
webhook_token_file = ""           # the bearer token it must send (mode 600); needed with webhook_listen
webhook_plaintext = false         # HTTP instead of HTTPS (behind a TLS proxy only)
alert_node_labels = ["node", "hostname", "Hostname", "instance"]  # an alert's label naming the node
alert_gpu_labels = ["gpu_uuid", "UUID", "uuid"]  # and the GPU (none: the whole node)
dedicated_spares = []             # "NODE" or "NODE/GPU-UUID": reserved, used before floating ones
return_home = true                # ranks moved off a taint go back once it is removed
return_home_jobs = {}             # per job: { "job1" = false }
max_parallel = 4                  # moves of different jobs at once
max_connections = 8192            # held at once by its API (TLS handshakes too): more than the nodes
retries = 2                       # a failed move is tried again on another spare this many times
unreachable_after = 30.0          # a node silent this long is unreachable (its ranks are not moved);
                                  # sooner, where ranks of its jobs elsewhere saw a collective fail
                                  # and its agent does not answer (2 s, twice)
quiet_after = 6.0                 # a node running ranks silent this long (and two report periods)
                                  # whose host takes no connection (2 s, twice) is unreachable then
                                  # (a power loss, a panic: its peers hear nothing); 0: never
lost_grace = 60.0                 # then the other ranks of its jobs that make no progress this long
                                  # break off the collective they wait in (the job ends at once
                                  # rather than at its collectives' timeout); 0: never
recover_lost = true               # a job whose ranks registered their training state is rebuilt
                                  # instead: its lost ranks on a free spare, from their replicas
report_period = 2.0               # what agents are told: report this often
move_timeout = 1800.0             # one move, its dry run included, at most this long
scheduler = "static"              # "static" (spares from dedicated_spares), "slurm" or "kubernetes"
slurm_spare_partition = ""        # Slurm: its idle nodes are dedicated spares (after dedicated_spares')
slurm_preempt_below = 0           # Slurm: with no spare free, a node whose jobs all have a priority
                                  # below this (and below the moving job's) is taken, its jobs
                                  # requeued; 0: never
spare_hold_timeout = 120.0        # how long a spare's placeholder (job, pod) may wait to run
kubernetes_namespace = "tpagent"  # Kubernetes (not yet proven): where placeholder pods go
kubernetes_spare_label = "tpagent.io/spare"  # nodes with this label are dedicated spares
kubernetes_hold_priority_class = "tpagent-hold"  # the placeholder pods' PriorityClass
kubernetes_hold_image = "registry.k8s.io/pause:3.10"
kubernetes_preempt_below = 0      # pods below this priority give way (the placeholder preempts them)
"""

from __future__ import annotations

import dataclasses
import os
import re
import socket
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from host.api import UsageError, unbracketed
from tpagent.common.config import check_hosts, check_ports, convert_setting, is_name, read_toml
from tpagent.common.credentials import Credentials
from tpagent.orchestrator.api import job_name
from tpagent.orchestrator.state import DEFAULT_STATE
from transfer.api import DEFAULT_TLS_DIR

DEFAULT_FILE = Path("/etc/tpagent/orchestrator.toml")
ENV = "TPAGENT_ORCHESTRATOR_"
SCHEDULERS = ("static", "slurm", "kubernetes")


@dataclass(frozen=True)
class OrchestratorConfig:
    secret_file: Path
    node: str = field(default_factory=socket.gethostname)
    listen: str = "0.0.0.0:7410"
    advertise: str = ""
    tls_dir: Path = DEFAULT_TLS_DIR
    state: Path = DEFAULT_STATE
    health_listen: str = ""
    metrics_listen: str = "127.0.0.1:9410"
    webhook_listen: str = ""
    webhook_token_file: Path | None = None
    webhook_plaintext: bool = False
    alert_node_labels: tuple[str, ...] = ("node", "hostname", "Hostname", "instance")
    alert_gpu_labels: tuple[str, ...] = ("gpu_uuid", "UUID", "uuid")
    dedicated_spares: tuple[str, ...] = ()
    return_home: bool = True
    return_home_jobs: dict[str, bool] = field(default_factory=dict)
    max_parallel: int = 4
    max_connections: int = 8192
    retries: int = 2
    unreachable_after: float = 30.0
    quiet_after: float = 6.0
    lost_grace: float = 60.0
    recover_lost: bool = True
    report_period: float = 2.0
    move_timeout: float = 1800.0
    scheduler: str = "static"
    slurm_spare_partition: str = ""
    slurm_preempt_below: int = 0
    spare_hold_timeout: float = 120.0
    kubernetes_namespace: str = "tpagent"
    kubernetes_spare_label: str = "tpagent.io/spare"
    kubernetes_hold_priority_class: str = "tpagent-hold"
    kubernetes_hold_image: str = "registry.k8s.io/pause:3.10"
    kubernetes_preempt_below: int = 0

    def __post_init__(self) -> None:
        check_hosts(self, ("listen", "health_listen"), http=("metrics_listen", "webhook_listen"))
        check_ports(self, ("listen", "health_listen", "metrics_listen", "webhook_listen"))
        if self.webhook_listen and not self.webhook_token_file:
            raise UsageError("webhook_listen needs webhook_token_file: the bearer token Alertmanager sends.")
        if not self.alert_node_labels:
            raise UsageError("alert_node_labels must name an alert's label, or no alert names a node.")
        if not 1 <= self.max_parallel <= 1000 or not 0 <= self.retries <= 100:
            raise UsageError("max_parallel must be 1 to 1000 and retries 0 to 100.")
        if not 64 <= self.max_connections <= 1 << 20:
            raise UsageError("max_connections must be 64 to 1048576 (more than the cluster's nodes).")
        if not 0.1 <= self.report_period < self.unreachable_after:
            raise UsageError("report_period must be at least 0.1 s and shorter than unreachable_after.")
        if not 0 <= self.quiet_after <= 3600:
            raise UsageError("quiet_after must be 0 (never) to 3600 seconds.")
        if not 0 <= self.lost_grace <= 3600:
            raise UsageError("lost_grace must be 0 (never) to 3600 seconds.")
        if self.move_timeout <= 0 or self.spare_hold_timeout <= 0:
            raise UsageError("move_timeout and spare_hold_timeout must be positive numbers of seconds.")
        if self.scheduler not in SCHEDULERS:
            raise UsageError(
                f"the setting scheduler = {self.scheduler!r} is not valid: give one of {', '.join(SCHEDULERS)}."
            )
        if not 0 <= self.kubernetes_preempt_below <= 1 << 31:
            raise UsageError("kubernetes_preempt_below must be 0 (never) to 2147483648, a pod priority.")
        if not 0 <= self.slurm_preempt_below <= 1 << 32:
            raise UsageError("slurm_preempt_below must be 0 (never) to 4294967296, a job priority.")
        if not re.fullmatch(r"[A-Za-z0-9_.-]{0,64}", self.slurm_spare_partition):
            raise UsageError("slurm_spare_partition must be a partition's name.")
        for spare in self.dedicated_spares:
            node, slash, gpu = spare.partition("/")
            if not is_name(node) or "/" in gpu or (slash and not is_name(gpu)):
                raise UsageError(f"dedicated_spares: {spare!r} is not a node's name, nor NODE/GPU-UUID.")

    def returns_home(self, job: str) -> bool:
        """Whether ranks of ``job`` (its key or name) moved off a taint return once it is gone."""
        return self.return_home_jobs.get(job_name(job), self.return_home)

    def dedicated(self) -> dict[str, frozenset[str]]:
        """node -> the GPUs of it reserved as spares (empty: the whole node)."""
        out: dict[str, set[str]] = {}
        for s in self.dedicated_spares:
            node, _, gpu = s.partition("/")
            out.setdefault(node, set()).update({gpu} if gpu else set())
        return {n: frozenset(g) for n, g in out.items()}

    @property
    def audiences(self) -> set[str]:
        host = unbracketed(self.listen.rpartition(":")[0])
        names = {self.node, self.advertise, host, socket.gethostname(), "localhost", "127.0.0.1", "::1"}
        return {h.lower() for h in names if h and h not in ("0.0.0.0", "::")}

    def credentials(self) -> Credentials:
        return Credentials.load(self.secret_file, self.tls_dir)


def _value(name: str, kind: Any, value: Any) -> Any:
    if "dict" in str(kind):
        if isinstance(value, dict) and all(isinstance(v, bool) for v in value.values()):
            return {str(k): v for k, v in value.items()}
        raise UsageError(f"the setting {name} is not valid: give a table of job = true/false.")
    if "bool" in str(kind):
        if isinstance(value, bool):
            return value
        if str(value).lower() in ("1", "true", "yes", "on", "0", "false", "no", "off"):
            return str(value).lower() in ("1", "true", "yes", "on")
        raise UsageError(f"the setting {name} = {value!r} is not valid: give true or false.")
    if "Path | None" in str(kind):
        return Path(value) if value else None
    return convert_setting(name, kind, value)


def load(path: Path | None = None, env: dict[str, str] | None = None, **overrides: Any) -> OrchestratorConfig:
    """The file (``path``, else TPAGENT_ORCHESTRATOR_CONFIG, else /etc/tpagent/orchestrator.toml if
    present), then ``TPAGENT_ORCHESTRATOR_<KEY>`` variables, then ``overrides`` (flags)."""
    env = dict(os.environ) if env is None else env
    values = read_toml(path or (Path(env[ENV + "CONFIG"]) if ENV + "CONFIG" in env else None), DEFAULT_FILE)
    kinds = {f.name: f.type for f in dataclasses.fields(OrchestratorConfig)}
    unknown = set(values) - set(kinds)
    if unknown:
        raise UsageError(f"unknown setting(s) in the configuration: {', '.join(sorted(unknown))}.")
    for name in kinds:
        if ENV + name.upper() in env and name != "return_home_jobs":
            values[name] = env[ENV + name.upper()]
    values.update({k: v for k, v in overrides.items() if v is not None})
    if "secret_file" not in values:
        raise UsageError("no cluster secret: set secret_file in the configuration or TPAGENT_ORCHESTRATOR_SECRET_FILE.")
    try:
        return OrchestratorConfig(**{k: _value(k, kinds[k], v) for k, v in values.items()})
    except TypeError as e:
        raise UsageError(f"the configuration is not valid: {e}.") from e
