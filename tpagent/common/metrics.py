"""The agent's Prometheus metrics (text format, served on ``metrics_listen``)."""

from __future__ import annotations

from prometheus_client import Counter, Gauge, Histogram

MIGRATIONS = Counter("tpagent_migrations", "Migrations run by this agent as the source, by outcome.", ["outcome"])
BYTES = Counter("tpagent_transfer_bytes", "Snapshot bytes moved on the wire, by direction.", ["direction"])
REFUSED = Counter(
    "tpagent_refused",
    "Calls and transfer connections refused before they proved themselves, by plane and reason.",
    ["plane", "reason"],
)
STAGE = Histogram(
    "tpagent_stage_seconds",
    "Duration of each migration stage.",
    ["stage"],
    buckets=(0.1, 0.25, 0.5, 1, 2.5, 5, 10, 25, 60, 120, 300, 600),
)
# (Both read at each scrape: tpagent/daemon/serve.py hands them the node's journal.)
FROZEN = Gauge(
    "tpagent_frozen_seconds",
    "How long the longest-frozen original this node holds for a migration has been frozen (0: none).",
)
UNRESOLVED = Gauge(
    "tpagent_unresolved_migrations",
    "Unfinished migrations that wait on the peer agent: as source, those no migrate call drives any more "
    "(the agent keeps asking the target, the original frozen); as target, restored copies held for their "
    "source's word.",
)
