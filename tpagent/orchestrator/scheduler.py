"""The orchestrator's scheduler port: what a cluster's scheduler (Slurm, Kubernetes) must agree
to, and the static scheduler of clusters that run none.

The orchestrator asks its scheduler four things:

* :meth:`Scheduler.pool` — where a job's ranks may go: the dedicated spares (in order), the
  floating capacity the scheduler sees free, and nodes it can free by giving lower-priority work way;
* :meth:`Scheduler.hold` — before a move starts, hold the target for it (Slurm: a placeholder job
  on the spare), so that the scheduler places nothing else there while the moved ranks run;
* :meth:`Scheduler.reconcile` — bring the scheduler in step with what the orchestrator holds:
  tainted nodes drained (and only those it drained resumed), holds kept exactly while their ranks
  run there (released when the ranks go home or the job ends; ranks moved by hand outside their
  job's nodes held too), each job's record saying where
  its ranks run.  Level-triggered: called again and again, it repairs whatever a failure missed;
* :meth:`Scheduler.check` — at start, whether the configuration names what the scheduler has.

A scheduler that does not answer raises :class:`SchedulerError`; nothing the orchestrator holds
changes, and no move starts until it answers again.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

from tpagent.orchestrator.api import Move
from tpagent.orchestrator.config import OrchestratorConfig


class SchedulerError(Exception):
    """The scheduler refused, or did not answer (``down``); ``str()`` is one sentence."""

    def __init__(self, sentence: str, down: bool = False) -> None:
        super().__init__(sentence)
        self.down = down


@dataclass(frozen=True)
class Pool:
    """Where the scheduler lets one job's ranks go."""

    #: Dedicated spares, in the order they are used: node -> the GPUs of it reserved (empty: all).
    dedicated: dict[str, frozenset[str]] = field(default_factory=dict)
    #: Nodes with free capacity the job may use (None: any node whose agent reports free capacity).
    floating: frozenset[str] | None = None
    #: Nodes that can be had by requeueing lower-priority work: taken only when nothing else fits.
    taken: frozenset[str] = frozenset()
    why: str = ""  # why no spare is given at all (the scheduler does not answer)


@dataclass(frozen=True)
class Held:
    """A target held for a move: the scheduler's handle of the hold ("": none was needed), and
    what the scheduler did for it that operators should read (jobs requeued to free it)."""

    handle: str = ""
    said: tuple[str, ...] = ()


@dataclass(frozen=True)
class Wanted:
    """What the scheduler must be brought in step with (see :meth:`Scheduler.reconcile`)."""

    drains: dict[str, str] = field(default_factory=dict)  # node -> why it is tainted
    #: (job, node): ranks of the job away from home there (held while the job runs) ...
    away: frozenset[tuple[str, str]] = frozenset()
    #: ... and moves under way there (held whatever else).
    moving: frozenset[tuple[str, str]] = frozenset()
    where: dict[str, dict[int, str]] = field(default_factory=dict)  # job -> rank -> node, ranks away from home
    #: job -> the UIDs its ranks run as (root's aside), for every job whose ranks the agents report.
    users: dict[str, frozenset[int]] = field(default_factory=dict)
    #: (job, node): every node the agents report ranks of the job on (moved there by hand, too).
    runs: frozenset[tuple[str, str]] = frozenset()

    @property
    def running(self) -> frozenset[str]:
        """The jobs whose ranks the agents report."""
        return frozenset(self.users)


class Scheduler(Protocol):
    name: str

    def check(self) -> None:
        """Raise :class:`host.api.UsageError` if the configuration names what the scheduler lacks."""

    def pool(self, job: str, users: frozenset[int]) -> Pool:
        """Where ``job``'s ranks may go; ``users``: the UIDs its ranks run as, root's aside (a job
        of the scheduler's is the tpagent job only if it is those users')."""

    def hold(self, move: Move, gpus: int, users: frozenset[int]) -> Held:
        """Hold ``move``'s target for it (``gpus``: how many GPUs its ranks use); raises
        :class:`SchedulerError` if the scheduler does not give it."""

    def reconcile(self, want: Callable[[], Wanted]) -> list[str]:
        """Bring the scheduler in step with ``want()`` (asked once the scheduler has been read: a
        hold made before that belongs to a move under way); what it changed, as sentences."""


class Static:
    """No scheduler: the spares are the configuration's, nothing is held, drained or recorded."""

    name = "static"

    def __init__(self, cfg: OrchestratorConfig) -> None:
        self.cfg = cfg

    def check(self) -> None:
        return None

    def pool(self, job: str, users: frozenset[int]) -> Pool:
        return Pool(self.cfg.dedicated())

    def hold(self, move: Move, gpus: int, users: frozenset[int]) -> Held:
        return Held()

    def reconcile(self, want: Callable[[], Wanted]) -> list[str]:
        return []
