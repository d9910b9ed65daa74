"""The orchestrator's contract: what it holds (taints, moves, ranks away from home), what it
knows of each node (from the agents' reports), and its one refusal.

A job, to the orchestrator, is its name and its identity (``RankReport.identity``: a digest of its
user and its key, which the agents vouch for): anyone may name a job as another's, and two such
jobs must not share a move, a rebuild or a count of ranks.  Its key (:func:`job_key`) is the name,
``#`` and the identity's 16 hex digits (``-`` before the rank said hello); agents and schedulers
are given its name (:func:`job_name`)."""

from __future__ import annotations

import enum
import re
from dataclasses import dataclass, field

IDENTITY = re.compile(r"[0-9a-f]{16}")
_KEYED = re.compile(r"#(?:[0-9a-f]{16}|-{16})")


def job_key(name: str, identity: str) -> str:
    """The orchestrator's key of a job: ``name``, of ``identity`` ("": not yet known)."""
    return f"{name}#{identity or '-' * 16}"


def job_name(key: str) -> str:
    """The job's name (a key of no identity, as a schedule from before keys, is one)."""
    return key[:-17] if _KEYED.fullmatch(key[-17:]) else key


def is_key(job: str) -> bool:
    """Whether ``job`` is a key (:func:`job_key`), not a bare name (a row from before keys)."""
    return bool(_KEYED.fullmatch(job[-17:]))


def job_identity(key: str) -> str:
    """The job's identity ("": not known)."""
    return key[-16:] if _KEYED.fullmatch(key[-17:]) and IDENTITY.fullmatch(key[-16:]) else ""


class TaintKind(str, enum.Enum):
    PLANNED = "planned"  # an operator's (maintenance)
    PREEMPTIVE = "preemptive"  # a health signal's, or a site's alert


class MoveKind(str, enum.Enum):
    AWAY = "away"  # off a tainted node, to a spare
    HOME = "home"  # back to where the ranks ran before, once it is untainted


class MoveState(str, enum.Enum):
    """PLANNED -> RUNNING -> DONE | FAILED | INTERRUPTED; PLANNED -> CANCELLED (its taint went
    first).  A planned or running move holds its spare: no other move is planned onto it."""

    PLANNED = "planned"
    RUNNING = "running"
    DONE = "done"
    FAILED = "failed"  # the source agent rolled it back: the ranks run where they were
    INTERRUPTED = "interrupted"  # the orchestrator stopped (or lost its call) mid-move; rolled back as FAILED,
    # but not the spare's doing: a try counted against retries, not a spare to avoid
    CANCELLED = "cancelled"


ACTIVE = frozenset({MoveState.PLANNED, MoveState.RUNNING})


class Why(str, enum.Enum):
    INVALID = "invalid"
    NOT_FOUND = "not_found"
    PRECONDITION = "precondition"


class Refused(Exception):
    """A request the orchestrator will not carry out; ``str()`` is one sentence, nothing changed."""

    def __init__(self, sentence: str, why: Why = Why.INVALID) -> None:
        super().__init__(sentence)
        self.why = why


@dataclass(frozen=True)
class Taint:
    id: int
    node: str
    gpu: str  # "": the whole node
    kind: TaintKind
    reason: str
    source: str  # "operator", "health", "alert:FINGERPRINT"
    created: float  # Unix seconds
    waiting: str = ""  # why its ranks did not move (yet)

    def covers(self, node: str, gpus: tuple[str, ...]) -> bool:
        """Whether a rank on ``node`` using ``gpus`` is on what this taints."""
        return node == self.node and (not self.gpu or self.gpu in gpus)


@dataclass(frozen=True)
class Move:
    id: int
    job: str
    ranks: tuple[int, ...]
    source: str  # node names
    target: str
    kind: MoveKind
    state: MoveState
    taint: int | None  # what it moves the ranks away from (or back after)
    attempt: int = 1
    message: str = ""
    migration: str = ""  # the source agent's id of it, once it said
    created: float = 0.0
    started: float | None = None
    ended: float | None = None


@dataclass(frozen=True)
class Away:
    """A rank moved away from ``home`` because of ``taint``, now on ``on``."""

    job: str
    rank: int
    home: str
    on: str
    taint: int


@dataclass(frozen=True)
class Gpu:
    uuid: str
    name: str
    memory_total: int


@dataclass(frozen=True)
class RankSeen:
    job: str
    rank: int
    world: int = 0
    step: int = 0
    gen: int = 0
    gpus: tuple[str, ...] = ()
    users: tuple[int, ...] = ()  # the UIDs its processes run as, root's aside
    broke: str = ""  # why a collective of it failed, as it told its agent ("": none did)


@dataclass(frozen=True)
class Finding:
    gpu: str
    what: str
    reading: str


@dataclass(frozen=True)
class NodeSeen:
    """A node as its agent last reported it."""

    name: str
    agent: str  # HOST:PORT
    seen: float  # monotonic time of the last report
    reports: int = 1  # since this orchestrator started
    gpus: tuple[Gpu, ...] = ()
    ranks: tuple[RankSeen, ...] = ()
    died: tuple[RankSeen, ...] = ()  # ranks killed there by a signal, their ends held for a rebuild
    busy: frozenset[str] = frozenset()  # jobs (keys) the agent moves ranks of now
    migrations: tuple[str, ...] = ()
    incoming: tuple[str, ...] = ()  # the migrations it receives, not yet settled
    findings: tuple[Finding, ...] = ()
    #: GPUs with processes that are no rank of a job there: another workload uses them (no spare).
    foreign: frozenset[str] = frozenset()
    driver: str = ""
    cuda: str = ""


@dataclass(frozen=True)
class View:
    """What the policy decides on: every node's last report, and which of them answer."""

    nodes: dict[str, NodeSeen] = field(default_factory=dict)
    unreachable: frozenset[str] = frozenset()
    #: Nodes a move just ended on, whose last report may be older than the move's end: not acted on.
    stale: frozenset[str] = frozenset()
    #: Spares a rebuild of lost ranks under way holds: given to nothing else.
    held: frozenset[str] = frozenset()
    #: Every node known has reported since the orchestrator started, or could have: one that has
    #: not is silent (a move to or from it is never started), and a job not seen has ended.
    heard: bool = True
    #: Jobs whose lost ranks a rebuild under way makes again: no move of them starts.
    rebuilding: frozenset[str] = frozenset()

    def gone(self, node: str) -> bool:
        """Whether ``node`` stopped reporting, or has not reported though it could have."""
        return node in self.unreachable or (self.heard and node not in self.nodes)

    def reachable(self, node: str) -> bool:
        return node in self.nodes and node not in self.unreachable

    def users(self) -> dict[str, frozenset[int]]:
        """job -> the UIDs its ranks run as (root's aside), as the agents report them."""
        out: dict[str, set[int]] = {}
        for n in self.nodes.values():
            for r in n.ranks:
                out.setdefault(r.job, set()).update(r.users)
        return {job: frozenset(u) for job, u in out.items()}

    def current(self, node: str) -> bool:
        """Reachable, and its last report is newer than any move's end there."""
        return self.reachable(node) and node not in self.stale

    def busy(self) -> frozenset[str]:
        """The jobs a rewire is under way of, as the nodes that still report say: a gone node's last
        report is no move under way (it may have died in one, and says so for ever)."""
        return frozenset(j for name, n in self.nodes.items() if not self.gone(name) for j in n.busy)

    def rebuilt(self, job: str) -> bool:
        """Whether lost ranks of ``job`` are being rebuilt, or ranks of it died (killed by a signal,
        reported by their agents): they are rebuilt before any move of the job starts (a rewire
        needs every rank)."""
        return job in self.rebuilding or any(r.job == job for n in self.nodes.values() for r in n.died)

    def lost_with(self, job: str) -> list[str]:
        """The nodes that stopped reporting with ranks of ``job`` that run nowhere else: no move of it
        starts (a rewire needs every rank), its lost ranks are rebuilt first (:mod:`.lost`).  A rank
        rebuilt on a spare, reported there, is no longer lost with the node it ran on."""
        alive = {r.rank for name, n in self.nodes.items() if not self.gone(name) for r in n.ranks if r.job == job}
        return sorted(
            name
            for name, n in self.nodes.items()
            if self.gone(name) and any(r.job == job and r.rank not in alive for r in n.ranks)
        )


def printable(text: str, limit: int | None = 500) -> str:
    """``text`` at most ``limit`` characters long (None: whole), each one that does not print (a
    newline, an escape sequence's ESC, bytes of no encoding) shown as "?": what comes from the
    network, or names another user chose, is shown to operators as is."""
    return "".join(c if c.isprintable() else "?" for c in text[:limit])
