"""Each rank's step as its node's reports give it, and when it changed: whether a job went on
without a node that fell silent (:mod:`tpagent.orchestrator.lost`)."""

from __future__ import annotations

import threading
from collections.abc import Iterable

from tpagent.orchestrator.api import NodeSeen, job_name

#: Steps a job's ranks must have gone on by, past the last moment a silent node's ranks could have
#: died, for those to be taken as running (one may be the step a rank in no collective with a
#: dead one was finishing; a second needs every rank of a job that all-reduces once a step).
WENT_ON = 2


class Steps:
    """Each rank's step as its node's reports gave it, and when it changed: whether a job went on
    without a node.  The changes of the last ``horizon`` seconds are kept, and the one before them."""

    def __init__(self, horizon: float) -> None:
        self.horizon = horizon
        self.lock = threading.Lock()
        self.changes: dict[tuple[str, int], list[tuple[float, int]]] = {}  # (job, rank) -> [(when, step)]
        self.heard: dict[tuple[str, int], float] = {}
        self.forgot = 0.0

    def note(self, seen: NodeSeen) -> None:
        """A report: its ranks' steps (a rank not heard of for ``horizon`` s forgotten)."""
        now = seen.seen
        with self.lock:
            for r in seen.ranks:
                key = (r.job, r.rank)
                self.heard[key] = now
                changes = self.changes.setdefault(key, [])
                if not changes or changes[-1][1] != r.step:
                    changes.append((now, r.step))
                    old = sum(t < now - self.horizon for t, _ in changes)
                    del changes[: max(old - 1, 0)]
            if now - self.forgot > self.horizon:
                self.forgot = now
                for key in [k for k, t in self.heard.items() if t < now - self.horizon]:
                    del self.heard[key], self.changes[key]

    def went_on(self, job: str, ranks: Iterable[int], since: float) -> str | None:
        """Which of ``ranks`` of ``job`` went on by :data:`WENT_ON` steps or more from the first
        step it was seen at after ``since`` (a clause), or None: a node whose ranks of the job
        had died by ``since`` stops every such rank within a step.  (A step seen to fall, its
        agent restarted or the rank restarted from a boundary, takes back none seen before it.)"""
        with self.lock:
            for r in sorted(ranks):
                after = [step for t, step in self.changes.get((job, r), []) if t > since]
                if after and max(after) - after[0] >= WENT_ON:
                    return f"rank {r} of job {job_name(job)} went on from step {after[0]} to {max(after)}"
        return None

    def pace(self, job: str, ranks: Iterable[int], before: float) -> float | None:
        """How long the slowest of ``ranks`` of ``job`` took a step, as seen until ``before``
        (seconds); None if none was seen to step."""
        paces = []
        with self.lock:
            for r in ranks:
                seen = [(t, step) for t, step in self.changes.get((job, r), []) if t <= before]
                if len(seen) > 1 and seen[-1][1] > seen[0][1]:
                    paces.append((seen[-1][0] - seen[0][0]) / (seen[-1][1] - seen[0][1]))
        return max(paces, default=None)
