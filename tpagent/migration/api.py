"""The migration protocol's contract: what a migration is, how it ends, how it fails, and what
one agent needs from the other (how long each wait may last: :class:`tpagent.common.config.Timeouts`).

Everything else in the protocol is written against this module: the source and the target
(:mod:`tpagent.migration.source`, :mod:`tpagent.migration.target`) and the journal
(:mod:`tpagent.migration.journal`) never see gRPC, and the gRPC side
(:mod:`tpagent.daemon.service`, :mod:`tpagent.daemon.client`) only translates.

Source (the node the process leaves)::

    CHECKING ──> FREEZING ──> HELD ──> RESTORING ──> COMMITTING ──> DONE
       │            │           │          │
       └> FAILED    └───────────┴──────────┴──> ROLLING_BACK ──> ROLLED_BACK

  CHECKING     both agents check versions, memory, CRIU, shared files; nothing is touched
               (a dry run ends here: DONE or FAILED, with what would fail).
  FREEZING     CUDA lock + checkpoint, CRIU dump; the images stream to the target as CRIU
               writes them.  CRIU's post-dump hook then *holds* the sealed, frozen tree.
  HELD         the target has the snapshot, verified; the original is frozen, resumable.
  RESTORING    the target restores its copy, held (READY), and says so.
  COMMITTING   decided (journaled first): the target starts its copy (STARTING, CONFIRMING)
               and watches it run for ``confirm_period``; only once it says DONE does the
               hook let CRIU end the original (frozen all along: never two running).  A copy
               that dies within that period is DISCARDED there, and the original runs on
               (ROLLING_BACK): the job is never left with no copy because its new node could
               not carry it (a peer left behind on the old one, a missing device, ...).
               A copy offered with ``hold`` (a rank of a distributed job) is confirmed by
               the source instead, once its job's communicators are rebuilt with it there;
               if they cannot be, the source has the copy dropped and the original runs on.
  ROLLING_BACK any failure before the copy is confirmed: the target drops its copy (kills it
               if it had started), then the hook makes CRIU roll back: the original runs on
               where it stood.  The original runs again only after the target said its copy
               is gone, and the copy runs only while the original is frozen and is ended
               before the original is let go.  If the target made its copy final meanwhile (a
               takeover, below), ROLLING_BACK turns into COMMITTING: the original is ended.

  The CRIU that holds the original is watched: if it exits without a decision (killed, or
  crashed), the original runs again, so the copy is dropped, unless it is already final
  (DONE): then the original is ended.  If the original is gone with it, the copy goes on.

Target::

    RECEIVING ──> RECEIVED ──> RESTORING ──> READY ──> STARTING ──> CONFIRMING ──> DONE
        └────────────┴─────────────┴───────────┴──────────┴─────────────┴──> DISCARDED

  READY: the copy is restored but held (stopped; a CUDA process: its GPU still locked); it
  starts only when the source commits, so a copy that is then dropped never ran.  A READY
  copy whose source agent cannot be reached (or no longer knows the migration) for
  ``takeover_after`` seconds starts on its own (its node is presumed lost with the frozen
  original): a source that asked for the restore never resumes its original unless the
  target says the copy is gone, so it can only commit.
  STARTING: decided and journaled; the copy is being let go (a restart of this agent lets it
  go again: letting go is idempotent).  CONFIRMING: the copy runs, watched for
  ``confirm_period``; DONE once it ran that long, DISCARDED if it died (or the source asked:
  its CRIU let the original go).  A held copy (``Offer.hold``) is DONE once the source
  confirms it, or once ``hold`` seconds passed without the source's word (as a takeover: its
  node is presumed lost with the frozen original).

After a reboot (every process of the node gone: the original or the copy, CRIU, the hook;
the journal is on persistent storage, snapshots may have been on tmpfs)::

  source  CHECKING                  FAILED: nothing was frozen.
          FREEZING, HELD            the original died with the node: if the target holds
                                    the whole snapshot, the migration goes on (RESTORING,
                                    COMMITTING); else ROLLED_BACK, naming what is left.
          RESTORING, COMMITTING     the copy (held or running there) goes on: COMMITTING.
          ROLLING_BACK              as COMMITTING while the target still has the copy; else
                                    ROLLED_BACK (the original is gone: said so).
  target  RECEIVING..READY          the copy died with the node, or never was: DISCARDED;
          STARTING, CONFIRMING      the source's original is still frozen: it runs on.
          DONE                      final (the job was on this node when it went down).

A source that is only restarted (the original still frozen, CRIU and its hook still
holding it) takes up each state where it stood; after a reboot "the original is gone" is
told from "someone ended it" by the node's boot id in the record.

Each transition is journaled (:mod:`tpagent.migration.journal`) before it takes effect, so an agent
that restarts finishes or rolls back each migration it finds there.
"""

from __future__ import annotations

import enum
import re
from abc import ABC, abstractmethod
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import TypeVar

from tpagent.common.config import port_of
from tpagent_rank import protocol as P

A = TypeVar("A", bound=P.Answer)


class Role(str, enum.Enum):
    SOURCE = "source"
    TARGET = "target"


class SourceState(str, enum.Enum):
    CHECKING = "checking"
    FREEZING = "freezing"
    HELD = "held"
    RESTORING = "restoring"
    COMMITTING = "committing"
    DONE = "done"
    ROLLING_BACK = "rolling_back"
    ROLLED_BACK = "rolled_back"
    FAILED = "failed"


class TargetState(str, enum.Enum):
    RECEIVING = "receiving"
    RECEIVED = "received"
    RESTORING = "restoring"
    READY = "ready"
    STARTING = "starting"
    CONFIRMING = "confirming"
    DONE = "done"
    DISCARDED = "discarded"


#: The target's states in which a whole copy exists there: held, being let go, running, final.
#: A source that hears one of these never rolls back (that would end a copy that may run).
HAS_COPY = frozenset(
    {TargetState.READY.value, TargetState.STARTING.value, TargetState.CONFIRMING.value, TargetState.DONE.value}
)

State = SourceState | TargetState

_S = SourceState
_T = TargetState
SOURCE_TRANSITIONS: Mapping[SourceState, frozenset[SourceState]] = MappingProxyType(
    {
        _S.CHECKING: frozenset({_S.FREEZING, _S.DONE, _S.FAILED}),
        _S.FREEZING: frozenset({_S.HELD, _S.ROLLING_BACK}),
        _S.HELD: frozenset({_S.RESTORING, _S.ROLLING_BACK}),
        _S.RESTORING: frozenset({_S.COMMITTING, _S.ROLLING_BACK}),
        _S.COMMITTING: frozenset({_S.DONE, _S.ROLLING_BACK}),  # back only if the target says its copy is gone
        _S.ROLLING_BACK: frozenset({_S.ROLLED_BACK, _S.COMMITTING}),  # forward only if the target's copy is final
        _S.DONE: frozenset(),
        _S.ROLLED_BACK: frozenset(),
        _S.FAILED: frozenset(),
    }
)
TARGET_TRANSITIONS: Mapping[TargetState, frozenset[TargetState]] = MappingProxyType(
    {
        _T.RECEIVING: frozenset({_T.RECEIVED, _T.DISCARDED}),
        _T.RECEIVED: frozenset({_T.RESTORING, _T.DISCARDED}),
        _T.RESTORING: frozenset({_T.READY, _T.DISCARDED}),
        _T.READY: frozenset({_T.STARTING, _T.DISCARDED}),
        _T.STARTING: frozenset({_T.CONFIRMING, _T.DISCARDED}),
        _T.CONFIRMING: frozenset({_T.DONE, _T.DISCARDED}),
        _T.DONE: frozenset(),
        _T.DISCARDED: frozenset(),
    }
)
SOURCE_FINAL = frozenset(s for s, nxt in SOURCE_TRANSITIONS.items() if not nxt)
TARGET_FINAL = frozenset(s for s, nxt in TARGET_TRANSITIONS.items() if not nxt)


def allowed(state: State, to: State) -> bool:
    """Whether the protocol allows ``state -> to`` (both of one role)."""
    if isinstance(state, SourceState):
        return isinstance(to, SourceState) and to in SOURCE_TRANSITIONS[state]
    return isinstance(to, TargetState) and to in TARGET_TRANSITIONS[state]


def is_final(state: State) -> bool:
    return state in SOURCE_FINAL or state in TARGET_FINAL


def is_agent_address(text: str) -> bool:
    """Whether ``text`` may be an agent's address (HOST:PORT, a host named, the port 1 to 65535, the
    rules of :func:`tpagent.daemon.rpc.channel`): checked before it is used."""
    return 0 < len(text) <= 300 and port_of(text, at_least=1) is not None


#: The most GPUs a move may name on its target (:attr:`Offer.target_gpus`).
MOST_GPUS = 64
_GPU_UUID = re.compile(r"GPU-[0-9A-Za-z-]{1,90}")


def gpu_uuids(names: Iterable[str]) -> tuple[str, ...]:
    """``names`` (from the network) as GPU UUIDs, each once: Refused for more than
    :data:`MOST_GPUS`, or for one that is no GPU's UUID as NVML writes it (GPU-...)."""
    given = list(names)
    if len(given) > MOST_GPUS:
        raise Refused(f"a move names at most {MOST_GPUS} GPUs of its target; this one names more", Why.INVALID)
    for name in given:
        if not _GPU_UUID.fullmatch(name):
            raise Refused(f"{ascii(name[:60])} is not a GPU's UUID (GPU-..., as nvidia-smi -L lists them)", Why.INVALID)
    return tuple(dict.fromkeys(given))


class Outcome(str, enum.Enum):
    """How a migration run ended, as the source saw it (also the metrics label)."""

    DONE = "done"  # the copy runs on the target; the original is ended
    DRY_RUN = "dry_run"  # checked only
    FAILED = "failed"  # refused before anything was frozen
    ROLLED_BACK = "rolled_back"  # the original runs on where it stood
    UNRESOLVED = "unresolved"  # the original stays frozen until the target answers (the agent keeps asking)


@dataclass(frozen=True)
class Event:
    """One step of a migration, as the source reports it to whoever asked for it."""

    migration_id: str
    state: str  # a SourceState value
    message: str = ""
    seconds: float = 0.0  # since the migration started
    timings: Mapping[str, float] = field(default_factory=dict)
    problems: tuple[str, ...] = ()  # a dry run: what would fail
    bytes_done: int = 0
    bytes_total: int = 0
    new_pid: int = 0


@dataclass(frozen=True)
class MigrationResult:
    migration_id: str
    outcome: Outcome
    message: str
    new_pid: int = 0
    timings: Mapping[str, float] = field(default_factory=dict)


# ---- the node ----------------------------------------------------------------------------


@dataclass(frozen=True)
class GpuInfo:
    uuid: str
    name: str
    memory_total: int
    memory_used: int
    temperature_c: int
    ecc_uncorrected: int


@dataclass(frozen=True)
class NodeInfo:
    node: str
    hostname: str
    gpus: tuple[GpuInfo, ...]
    memory_available: int
    agent_version: str
    criu_version: str
    driver_version: str
    problems: tuple[str, ...]
    clock: float = 0.0  # the agent's wall clock when it answered (Unix seconds; 0: not said)


@dataclass(frozen=True)
class ProcessInfo:
    """A process this agent would migrate, and why (what a user cannot forge)."""

    pid: int
    cmdline: tuple[str, ...]
    rss: int
    uses_gpu: bool
    why: str  # "gpu" (NVML sees it), "launched" (tpagent launch's record), "operator" (allow_executables)
    uid: int
    owner: int  # launched: the user who launched it; -1: unknown


# ---- errors ------------------------------------------------------------------------------


class AgentError(Exception):
    """Base of the agent layer's errors; the message is one sentence for the user."""


class Why(str, enum.Enum):
    """Why an agent refused (the gRPC side maps each onto a status code and back)."""

    INVALID = "invalid"  # the request is malformed
    NOT_FOUND = "not_found"  # no such process or migration here
    DENIED = "denied"  # not allowed (not a migratable process)
    CONFLICT = "conflict"  # already being done
    PRECONDITION = "precondition"  # cannot be done in this state
    UNAUTHENTICATED = "unauthenticated"  # the call was not accepted as ours
    INTERNAL = "internal"  # the agent failed (an unreadable journal): never a "no"


class Refused(AgentError):
    """An agent (this one, or the peer) answered: it will not do this."""

    def __init__(self, message: str, why: Why = Why.PRECONDITION) -> None:
        super().__init__(message)
        self.why = why


class PeerUnreachable(AgentError):
    """The peer gave no answer (no connection, or none in time): it may or may not have acted."""


class JournalError(AgentError):
    """A journal record exists but cannot be read or written."""


class BadTransition(AgentError):
    """A move the protocol does not allow (a bug, never a user's doing)."""


# ---- what one agent needs from the other ---------------------------------------------------


#: The longest a source may leave its started copy without a word (Offer.hold).
HOLD_MAX = 6 * 3600.0


@dataclass(frozen=True)
class Offer:
    """The source asks the target to take a migration (or, ``dry_run``, only to check it)."""

    migration_id: str
    source_node: str
    source_agent: str  # where the target reaches the source's agent (HOST:PORT)
    bytes_estimate: int
    gpu_uuids: tuple[str, ...] = ()
    shared_files: tuple[str, ...] = ()  # "PATH:SIZE" (or "PATH:*": it grows) of files expected on shared paths
    dry_run: bool = False
    carried_files: tuple[str, ...] = ()  # "PATH:SIZE" of the node-local files the snapshot takes along
    #: (LOCAL, REMOTE) HOST:PORT of the tree's TCP sockets only the target can judge (their
    #: address must exist there; a listening one, REMOTE "", needs its port free there).
    tcp: tuple[tuple[str, str], ...] = ()
    #: > 0: the copy, once started, is confirmed by the source (a rank: once its job's
    #: communicators are rebuilt with it) rather than by running ``confirm_period``; once the
    #: source has said nothing for this many seconds, it is final.
    hold: float = 0.0
    gpu_bus_ids: tuple[str, ...] = ()  # each of gpu_uuids's PCI bus id, in order ("": not known)
    #: The abstract names ("@NAME") the tree's unix sockets are bound to: none may be bound on the target.
    abstract_sockets: tuple[str, ...] = ()
    #: The mount points of the tree's namespace (a `tpagent launch` workload's; :mod:`host.mounts`).
    mounts: tuple[str, ...] = ()
    #: The target's GPUs (UUIDs) the copy may be placed on (the orchestrator's: free, no taint on them); none: any.
    target_gpus: tuple[str, ...] = ()


@dataclass(frozen=True)
class Acceptance:
    """The target's answer: where to stream the snapshot, and what would not work there."""

    transfer_address: str = ""
    gpu_map: Mapping[str, str] = field(default_factory=dict)
    problems: tuple[str, ...] = ()
    reserved: str = ""  # what the target sets aside for it (work dir, memory), in words
    clock: float = 0.0  # the target's wall clock when it answered (Unix seconds; 0: not said)
    missing_mounts: tuple[str, ...] = ()  # those of the offer's mounts the target lacks


@dataclass(frozen=True)
class PeerStatus:
    """Where a migration stands on one agent (``state`` is that agent's role's state value)."""

    migration_id: str
    state: str
    message: str = ""
    pid: int = 0


@dataclass(frozen=True)
class Restored:
    pid: int
    timings: Mapping[str, float] = field(default_factory=dict)


@dataclass(frozen=True)
class Versions:
    agent: str
    criu: str


class Peer(ABC):
    """The other agent of a migration: what a source needs from its target, and what a target
    asks of its source (``status``).  Each call raises :class:`Refused` when the peer answered
    no, and :class:`PeerUnreachable` when it gave no answer (it may or may not have acted).
    Implemented over gRPC (:class:`tpagent.daemon.client.GrpcPeer`) and in memory for tests."""

    address: str

    @abstractmethod
    def receive(self, offer: Offer, timeout: float) -> Acceptance: ...

    @abstractmethod
    def restore(self, migration_id: str, timeout: float) -> Restored: ...

    @abstractmethod
    def finish(self, migration_id: str, commit: bool, timeout: float, confirmed: bool = False) -> PeerStatus:
        """Start (``commit``) or drop the copy; ``confirmed``: a held copy works, final now."""

    @abstractmethod
    def status(self, migration_id: str, timeout: float) -> PeerStatus: ...

    @abstractmethod
    def versions(self, timeout: float) -> Versions: ...

    def rank(self, job: str, rank: int, request: P.Request[A], timeout: float, key: str = "") -> A:
        """Ask the peer about (or pass on to) a rank of a distributed job on its node (the rank
        protocol: :mod:`tpagent_rank.protocol`; ``key``: the job's identity, ``RankRequest.job_key``);
        its answer.  Only agents over gRPC have ranks."""
        raise Refused("this peer has no ranks", Why.PRECONDITION)
