"""The rank protocol's answers, and the kinds of value they and its requests carry (re-exported
by :mod:`tpagent_rank.protocol`, which says the wire).  Standard library only."""

from __future__ import annotations

import enum
from dataclasses import dataclass


class Unit(str, enum.Enum):
    """What a pause's ``at`` counts."""

    STEP = "step"  # optimizer steps (once any rank has taken one)
    COLLECTIVE = "collective"  # the default group's collectives (a job with no optimizer)


class RankState(str, enum.Enum):
    """Where a rank's runtime stands."""

    RUNNING = "running"
    PAUSED = "paused"
    TORN_DOWN = "torn_down"
    JOINING = "joining"  # a fresh process of a rank's command, warming up on its own (model-aware move)
    WAITING = "waiting"  # that process, warmed up, waiting at a step boundary for a rank's state


class Whereabouts(str, enum.Enum):
    """Where a rank is, as its agent knows (:class:`Located`)."""

    HERE = "here"  # it runs on this node (``pid``: its namespace's init)
    MOVED = "moved"  # it went to ``node`` (an agent address)
    EXITED = "exited"  # it ended here with ``code``
    MOVING = "moving"  # it ended here while its job is being rewired (its copy is not yet known)
    GONE = "gone"  # it ended without a status


# ---- answers ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class Answer:
    """Every answer: whether it was done, and if not, why (one clause)."""

    ok: bool = True
    error: str = ""


def failed(error: str) -> Answer:
    return Answer(ok=False, error=error)


@dataclass(frozen=True)
class Standing(Answer):
    step: int = 0
    collectives: int = 0
    gen: int = 0
    state: str = RankState.RUNNING.value
    rate: float = 0.0  # optimizer steps per second, lately
    collective_rate: float = 0.0
    groups: int = 0  # live delegating groups
    nccl_host: str = ""  # the host identity its NCCL read once ("": no NCCL)
    nccl_ras: bool = False  # its NCCL runs the RAS thread (it cannot move)
    host: str = ""  # the host it runs on (name|boot id)
    hosts_store: str = ""  # HOST:PORT of the job's store if it serves it itself ("": it does not)
    store_loopback: str = ""  # HOST:PORT of the store if reached at a loopback address
    aware: bool = False  # it registered its training state (tpagent_rank.register)
    replicas: tuple[int, ...] = ()  # the global ranks holding the same state, itself included (): none known
    no_replicas: str = ""  # why none are known
    held: int = -1  # the step boundary whose state it holds to recover from (-1: none; see Restart)
    broken: str = ""  # why a collective of its failed, held from its script while its job may recover
    store: str = ""  # HOST:PORT at which it reaches the job's store ("": not a TCP store)
    agreed: str = ""  # the value its job's identity was agreed on in the store (P.JOB_KEY; "": not yet)


@dataclass(frozen=True)
class Agents(Answer):
    agents: tuple[str, ...] = ()  # rank -> its agent's address ("": it has not said)
    key: str = ""  # the identity of the rank asked (its agent's word: its user, its JOB_KEY)


@dataclass(frozen=True)
class Paused(Answer):
    late: bool = False  # it is past the step asked for (then not ok)


@dataclass(frozen=True)
class AtBoundary(Answer):
    step: int = 0
    collectives: int = 0


@dataclass(frozen=True)
class TornDown(Answer):
    closed: int = 0  # store connections let go (leaving)


@dataclass(frozen=True)
class Saved(Answer):
    """The state (:func:`tpagent_rank.aware.write_state`), ``size`` bytes: offered at ``port``
    (:mod:`tpagent_rank.handover`), or, asked with no ``listen``, following the answer's line."""

    size: int = 0
    step: int = 0  # where it stands: its optimizer steps, its default group's collectives
    collectives: int = 0
    port: int = 0
    groups: int = 0  # its live process groups (a joiner must have made as many)


@dataclass(frozen=True)
class Located(Answer):
    state: str = Whereabouts.GONE.value
    pid: int = 0  # here: its namespace's init
    node: str = ""  # moved: the agent it went to
    code: int = 0  # exited: its status
    anew: bool = False  # moved: it runs there as a new process (rebuilt), its output read from the start


@dataclass(frozen=True)
class Written(Answer):
    data: bytes = b""
    size: int = 0  # the file's size now (-1: it is not read here, having moved on or ended)


@dataclass(frozen=True)
class RankRow:
    """One rank on a node, for ``tpagent node``."""

    job: str
    rank: int
    world: int = 0
    pid: int = 0
    gen: int = 0
    step: int = 0
    connected: bool = False
    moved_to: str = ""
    collectives: int = 0
    state: str = ""
    aware: bool = False  # it registered its training state
    replicas: tuple[int, ...] = ()  # the global ranks holding the same state, itself included (): none known


@dataclass(frozen=True)
class Ranks(Answer):
    ranks: tuple[RankRow, ...] = ()


@dataclass(frozen=True)
class Recovered(Answer):
    """The job runs on from optimizer step ``step`` (unplanned recovery), each stage's seconds."""

    step: int = 0
    gen: int = 0
    stages: tuple[str, ...] = ()  # "name=seconds"
    store: str = ""  # HOST:PORT at which the job's store is served from now on, if it was lost too
    ranks: tuple[int, ...] = ()  # the ranks rebuilt (those asked, and any lost with them)
    back: tuple[int, ...] = ()  # survivors at another boundary, given ``step``'s state from a replica
