"""The line protocol's own messages (:mod:`tpagent_rank.protocol` says the wire): those that are
not requests or answers.  Standard library only."""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import ClassVar

from tpagent_rank.protocol import RankState


class LineOp(str, enum.Enum):
    """The line protocol's messages that are not requests (each says its ``op``)."""

    HELLO = "hello"
    WELCOME = "welcome"
    REFUSED = "refused"
    EXIT = "exit"
    BROKE = "broke"
    STEPPED = "stepped"


@dataclass(frozen=True)
class Hello:
    """A rank's runtime, as it connects: who it is and where it stands."""

    OP: ClassVar[LineOp] = LineOp.HELLO
    job: str
    rank: int
    world: int
    v: int = 1
    pid: int = 0
    gen: int = 0
    step: int = 0
    state: str = RankState.RUNNING.value
    backend: str = ""
    key: str = ""  # the value agreed at JOB_KEY ("": it could not be)


@dataclass(frozen=True)
class Welcome:
    """The agent took the rank's hello (it is registered here)."""

    OP: ClassVar[LineOp] = LineOp.WELCOME
    node: str = ""  # the agent's own address


@dataclass(frozen=True)
class Refusal:
    """The agent did not take the rank's hello."""

    OP: ClassVar[LineOp] = LineOp.REFUSED
    error: str = ""


@dataclass(frozen=True)
class Exit:
    """The init of a launched namespace, as it ends: the workload's status.  It is the
    connection's only line; the init ends once the agent closes it (having taken the word)."""

    OP: ClassVar[LineOp] = LineOp.EXIT
    code: int


@dataclass(frozen=True)
class Broke:
    """A collective of the rank failed (a peer's process, or its node, is gone): said once, unasked,
    so that its agent reports it at once and a lost node is looked for now, not after its silence."""

    OP: ClassVar[LineOp] = LineOp.BROKE
    why: str = ""


@dataclass(frozen=True)
class Stepped:
    """The rank's optimizer steps so far: said unasked, at most every :data:`STEPPED_EVERY` s, so that
    its agent's reports show its job going on (a silent node whose jobs go on still runs its ranks)."""

    OP: ClassVar[LineOp] = LineOp.STEPPED
    step: int = 0


#: How often a rank says how far it stepped (seconds).
STEPPED_EVERY = 1.0
