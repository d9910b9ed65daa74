"""The jobs layer's contract: the phases of a rewire and their transition table, what the journal
keeps of a rewire, how a rewire fails, and what it needs from the agent it runs in.

A rewire moves ranks of a running job (:mod:`tpagent.jobs.rewire`)::

    CHECKING ──> PAUSING ──> TEARDOWN ──> DONE
        │           │ ↺      │    ↺
        └───────────┴────────┴──────> ROLLED_BACK, FAILED

  CHECKING   every rank is asked where it stands; nothing is stopped.
  PAUSING    every rank is asked to stop at one step boundary, and waited for there: a failure
             (or a restart of the agent) cancels the pause, and the job goes on untouched.  Written
             again (the same phase) as a model-aware move starts each joiner (they are dropped).
  TEARDOWN   the communicators are torn down (or being): the moving ranks migrate, every rank
             builds new ones where it runs.  Written again (the same phase) as each move starts and
             as the generation changes; after a restart the journal of each move settles where its
             rank runs, and every rank rebuilds there.
  DONE, ROLLED_BACK, FAILED   final: every rank moved; none did (the job goes on where it was);
             the rewire failed (said in its message).

Each phase is written down (:mod:`tpagent.jobs.journal`) before it takes effect.
"""

from __future__ import annotations

import enum
import queue
import threading
import uuid
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, Protocol, TypeVar

from tpagent.migration.api import Event, MigrationResult
from tpagent_rank import protocol as P

A = TypeVar("A", bound=P.Answer)


class Phase(str, enum.Enum):
    CHECKING = "checking"
    PAUSING = "pausing"
    TEARDOWN = "teardown"
    DONE = "done"
    ROLLED_BACK = "rolled_back"
    FAILED = "failed"


_P = Phase
REWIRE_TRANSITIONS: Mapping[Phase, frozenset[Phase]] = MappingProxyType(
    {
        _P.CHECKING: frozenset({_P.PAUSING, _P.ROLLED_BACK, _P.FAILED}),
        _P.PAUSING: frozenset({_P.PAUSING, _P.TEARDOWN, _P.ROLLED_BACK, _P.FAILED}),
        _P.TEARDOWN: frozenset({_P.TEARDOWN, _P.DONE, _P.ROLLED_BACK, _P.FAILED}),
        _P.DONE: frozenset(),
        _P.ROLLED_BACK: frozenset(),
        _P.FAILED: frozenset(),
    }
)
REWIRE_FINAL = frozenset(p for p, nxt in REWIRE_TRANSITIONS.items() if not nxt)


def phase_allowed(phase: Phase, to: Phase) -> bool:
    return to in REWIRE_TRANSITIONS[phase]


class RewireFailed(Exception):
    """A rewire cannot go on; the message says why, in one sentence for the user."""


@dataclass
class RewireRecord:
    """What the journal keeps of one rewire (:mod:`tpagent.jobs.journal` says the format)."""

    rewire_id: str
    job: str
    here: str  # the agent that runs it (the moving ranks' source)
    moving: dict[int, tuple[int, str]]  # rank -> (its namespace's init PID here, the target agent)
    phase: Phase = Phase.CHECKING
    message: str = ""
    agents: list[str] = field(default_factory=list)  # rank -> its agent, as the rewire began
    gen: int = 0  # the generation being built
    step: int = 0  # the boundary
    unit: str = P.Unit.STEP.value  # what ``step`` counts
    moves: dict[int, str] = field(default_factory=dict)  # rank -> its migration's id
    key: str = ""  # the job's identity, as the first moving rank's agent (this one) vouches for it
    mode: str = "transparent"  # the moving ranks' process images move, or ("aware") their training state
    joiners: dict[int, int] = field(default_factory=dict)  # aware: rank -> its joiner's init on the target
    kept: list[int] = field(default_factory=list)  # aware: the ranks whose joiners took their places
    gpus: list[str] = field(default_factory=list)  # the targets' GPUs the copies may be placed on ([]: any)

    @classmethod
    def new(cls, job: str, here: str, moving: dict[int, tuple[int, str]]) -> RewireRecord:
        """The record of a new rewire (its id a fresh one)."""
        return cls(uuid.uuid4().hex, job, here, moving)

    def to_json(self) -> dict[str, Any]:
        return {
            "format": 1,
            "rewire_id": self.rewire_id,
            "job": self.job,
            "here": self.here,
            "phase": self.phase.value,
            "message": self.message,
            "agents": self.agents,
            "gen": self.gen,
            "step": self.step,
            "unit": self.unit,
            "moving": {str(r): [init, target] for r, (init, target) in self.moving.items()},
            "moves": {str(r): m for r, m in self.moves.items()},
            "key": self.key,
            "mode": self.mode,
            "joiners": {str(r): pid for r, pid in self.joiners.items()},
            "kept": self.kept,
            "gpus": self.gpus,
        }

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> RewireRecord:
        """ValueError (KeyError, TypeError) for what is not a record this agent can finish."""
        if data.get("format", 1) != 1:
            raise ValueError(f"format {data.get('format')!r} is not one this tpagent reads (it reads 1)")
        moving = {int(r): (int(v[0]), str(v[1])) for r, v in dict(data["moving"]).items()}
        r = cls(str(data["rewire_id"]), str(data["job"]), str(data["here"]), moving, Phase(str(data["phase"])))
        r.message = str(data.get("message", ""))
        r.agents = [str(a) for a in data["agents"]]
        r.gen = int(data["gen"])
        r.step = int(data["step"])
        r.unit = P.Unit.COLLECTIVE.value if data.get("unit") == P.Unit.COLLECTIVE.value else P.Unit.STEP.value
        r.moves = {int(rank): str(m) for rank, m in dict(data.get("moves", {})).items()}
        r.key = str(data.get("key", ""))
        r.mode = "aware" if data.get("mode") == "aware" else "transparent"
        r.joiners = {int(rank): int(pid) for rank, pid in dict(data.get("joiners", {})).items()}
        r.kept = [int(rank) for rank in data.get("kept", [])]
        r.gpus = [str(g) for g in data.get("gpus", [])]
        if not r.moving or len(r.agents) <= max(r.moving):
            raise ValueError(f"rewire {r.rewire_id}: not a record this agent can finish")
        return r


class RewireLog(Protocol):
    """Where a rewire writes down where it stands (the journal; in memory for a dry run)."""

    def move(self, record: RewireRecord, to: Phase, message: str = "") -> None:
        """Write ``to`` down (if the table allows it from ``record.phase``), then apply it."""


class Ask(Protocol):
    """Ask the agent at ``agent`` (this one: directly) a request of the rank protocol about a rank."""

    def __call__(self, agent: str, job: str, rank: int, request: P.Request[A], timeout: float, key: str = "") -> A: ...


class Moving(Protocol):
    """One rank's migration, as a rewire follows it (:class:`tpagent.migration.source.SourceMigration`)."""

    pid: int
    events: queue.Queue[Event | None]  # (None ends them)
    result: MigrationResult | None
    copy_runs: threading.Event  # its copy runs on the target, its original still frozen here
    new_pid: int
    problems: list[str]  # a dry run's findings

    @property
    def migration_id(self) -> str: ...

    def run(self) -> MigrationResult: ...

    def cancel(self, reason: str) -> bool: ...


class StartMove(Protocol):
    """Admit the ordinary migration of one rank's namespace (its init ``pid`` here) to ``target``.
    ``hold`` > 0: its copy, once started there, waits for ``verdict`` (True: kept, False: dropped,
    None: not decided yet) rather than for the confirmation period; ``target_gpus``: the target's GPUs
    its copy may be placed on (none: any)."""

    def __call__(
        self,
        pid: int,
        target: str,
        *,
        dry_run: bool = False,
        hold: float = 0.0,
        verdict: Callable[[], bool | None] | None = None,
        target_gpus: tuple[str, ...] = (),
    ) -> Moving: ...


class Leaving(Protocol):
    """The moving ranks of a model-aware move, on their source node (:mod:`tpagent.jobs.joiners`)."""

    def spec(self, job: str, rank: int) -> P.Join:
        """How the rank runs here, as the request that starts its joiner elsewhere."""

    def gone(self, job: str, rank: int, timeout: float) -> bool:
        """Wait until the rank's process here has ended (True); past ``timeout`` it is killed (False)."""

    def here(self, job: str) -> bool:
        """Whether a rank of ``job`` runs on this node, or left it for another."""


class Settled(Protocol):
    """After a restart: the copy's PID on ``target`` once migration ``migration_id`` is done, 0
    once it rolled back (or never was); RewireFailed if it stays unsettled for ``timeout``."""

    def __call__(self, migration_id: str, target: str, timeout: float) -> int: ...
