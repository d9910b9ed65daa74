"""The rank protocol, typed once for both of its sides: what an agent asks of a rank's runtime,
and what stand-ins and agents ask of the agent a rank runs under.

Standard library only (it is loaded into users' training processes); the agent
(:mod:`tpagent.jobs`) imports it too.  Each operation is an :class:`Op`; each request is a
frozen dataclass (:class:`Request`, its ``OP``), each answer one too (:class:`Answer`: ``ok``
and ``error``, and the fields of its kind).  :data:`RUNTIME_OPS` are answered by the rank's
runtime (:mod:`tpagent_rank.agent`; its agent passes them on); the others by the agent itself
(:mod:`tpagent.jobs.calls`).

Two wires carry it, each field for field:

* the line protocol between a rank's runtime and its node's agent, on the abstract unix socket
  ``rank_socket`` (an abstract name belongs to a network namespace: a rank restored on another
  node reaches that node's agent under the same name)::

      LINE     ::= JSON-OBJECT "\\n"                       at most LINE_MAX bytes
      rank  -> agent  ::= HELLO { ANSWER }                  a runtime; or EXIT, once, from a
                                                            launched namespace's init as it ends
      agent -> rank   ::= (WELCOME | REFUSED) { REQUEST }
      HELLO    ::= {"op": "hello", FIELDS of Hello}
      WELCOME  ::= {"op": "welcome", "node": AGENT}      REFUSED ::= {"op": "refused", "error": STR}
      EXIT     ::= {"op": "exit", "code": INT}
      REQUEST  ::= {"id": INT, "op": OP, FIELDS of its request}
      ANSWER   ::= {"id": INT, "ok": BOOL, "error": STR, FIELDS of its answer}

  where ``bytes`` travel as base64 text and an answer is matched to its request by ``id``
  (HELLO, WELCOME, REFUSED and EXIT are :mod:`tpagent_rank.lines`'); a training state (``save``,
  ``load``) follows its line as raw bytes, or goes from rank to rank (:mod:`tpagent_rank.handover`);

* the agents' gRPC ``Rank`` call (``tpagent/daemon/proto/agent.proto``): a ``RankRequest``
  holds one message per op, a ``RankReply`` one per kind of answer, with these names and fields.

Encoding and checked decoding are :mod:`tpagent_rank.codec`'s: whatever arrives is decoded
against these classes, every field's type checked (integers within 64 bits, numbers finite,
the line bounded), so that a peer's mistake is a :class:`ProtocolError`, never a value of the
wrong type in the agent; what a value means is for its handler to check.
"""

from __future__ import annotations

import enum
import hashlib
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, ClassVar, Generic, TypeVar

# isort: off
from tpagent_rank.answers import (  # the answers, re-exported
    Agents as Agents,
    Answer as Answer,
    AtBoundary as AtBoundary,
    Located as Located,
    Paused as Paused,
    RankRow as RankRow,
    Ranks as Ranks,
    RankState as RankState,
    Recovered as Recovered,
    Saved as Saved,
    Standing as Standing,
    TornDown as TornDown,
    Unit as Unit,
    Whereabouts as Whereabouts,
    Written as Written,
    failed as failed,
)
# isort: on

#: The longest line either side sends or reads.
LINE_MAX = 64 * 1024
#: The most of a rank's output one ``output`` request reads.
OUTPUT_MAX = 1 << 20
#: The longest job id.
JOB_MAX = 200
#: The highest rank (and world size) a job may have.
RANK_MAX = 1 << 20
#: Where an agent says "come back" to a rank that let go of it to be frozen: a file named by
#: :func:`go_name` (while it may be frozen, the rank must hold no socket to the agent, so it
#: looks for the file instead).
GO_DIR = "/run/tpagent/rank-go"
#: Where a job's rank keeps its agent's address in the job's store (``KEY + str(rank)``).
AGENT_KEY = "tpagent/agent/"
#: Where the job's identity is agreed in its store: the first rank to connect to its agent puts a
#: fresh random value there, every rank reads the one that stands (see :data:`ASKED_FREELY`).
JOB_KEY = "tpagent/job-key"
#: How a registered rank whose state another process could not read back (``Standing.aware``
#: false) begins to say why in ``Standing.no_replicas``.
UNREADABLE = "its training state cannot be read safely"
#: Set to "1" in the environment of a fresh process of a rank's command that is to take the
#: rank's place with its training state (a model-aware move: :mod:`tpagent_rank.join`).
JOIN_VARIABLE = "TPAGENT_RANK_JOIN"
#: Set by a rank restarting in its own process (:class:`Restart`) for the process it becomes: where
#: the state it held is (a descriptor it keeps open across ``exec``) and where it stood.
STATE_VARIABLE = "TPAGENT_RANK_STATE"
#: ``HOST:PORT`` at which a job's store is served since the node that served it was lost (unplanned
#: recovery): a ``tcp://`` or ``env://`` rendezvous is made a client of it, whatever address the
#: script names, and the job's identity is still agreed with the address the script names.
STORE_VARIABLE = "TPAGENT_RANK_STORE"
#: The environment variables a job's id is read from, in order (else :data:`DEFAULT_JOB`).
JOB_VARIABLES = ("TPAGENT_JOB", "TORCHELASTIC_RUN_ID", "SLURM_JOB_ID")
DEFAULT_JOB = "job"


def go_name(job: str, rank: int) -> str:
    return hashlib.sha256(f"{job}\0{rank}".encode()).hexdigest()[:32]


def job_id(env: Mapping[str, str]) -> str:
    """The id of the job a rank belongs to, the same for its stand-in and its runtime."""
    return next((env[key] for key in JOB_VARIABLES if env.get(key)), DEFAULT_JOB)


def valid_job(job: str) -> bool:
    return 0 < len(job) <= JOB_MAX and job.isprintable()


class ProtocolError(ValueError):
    """What arrived is not a message of this protocol (its kind, a field, its size)."""


class Op(str, enum.Enum):
    # Answered by the rank's runtime (its agent passes them on).
    WHERE = "where"  # where it stands: its step, collectives, generation, rates, what it runs
    PEERS = "peers"  # where every rank's agent is (each rank keeps its own in the job's store)
    PAUSE = "pause"  # stop after optimizer step (or default-group collective) ``at``
    BOUNDARY = "boundary"  # wait until stopped there
    CANCEL = "cancel"  # forget the pause and go on (refused once torn down)
    TEARDOWN = "teardown"  # destroy the communicators; ``leaving``: also let go of the store and the agent
    REBUILD = "rebuild"  # build them again under generation ``gen``, where it now runs
    RESUME = "resume"  # go on after a rebuild
    END = "end"  # the job cannot go on: end with ``why`` (``grace``: also break off a collective stalled that long)
    SAVE = "save"  # a parked rank's registered training state: ``size`` bytes follow the answer's line
    LOAD = "load"  # a joining rank takes that state (``size`` bytes follow the request's line) as step ``step``
    RETIRE = "retire"  # a rank whose joiner took its place: finish the step, end at its next collective
    RESTART = "restart"  # a rank whose job lost a rank: its command again, in its process, from its last boundary
    SETTLE = "settle"  # a rank whose job lost a rank: no new optimizer step; where it stands once out of its own
    # Answered by the agent.
    EXPECT = "expect"  # the rank's launched namespace here has its init at ``pid`` (registers it)
    MOVED = "moved"  # the rank went to the agent at ``to``
    RELEASE = "release"  # tell a rank that let go of this agent to come back
    LOCATE = "locate"  # where the rank is now (for its stand-in)
    SIGNAL = "signal"  # pass ``signum`` on to the rank
    OUTPUT = "output"  # what the rank wrote to ``fd`` from ``offset``
    JOBS = "jobs"  # every rank of every job on the node
    LOST = "lost"  # a node running ranks of the job is lost: each rank of it here ends if it waits on it
    JOIN = "join"  # start a fresh process of the rank's command here, to take its state (model-aware move)
    RECOVER = "recover"  # ranks of the job were lost with a node: rebuild them on a spare from their replicas
    REBUILT = "rebuilt"  # a rank that died here: rebuilt at ``to`` ("": its rebuild runs ``hold`` s more, or failed)


#: Answered by the agent itself (the rest by the rank's runtime, or its state's: :data:`STATE_OPS`).
AGENT_OPS = frozenset(
    {
        Op.EXPECT,
        Op.MOVED,
        Op.RELEASE,
        Op.LOCATE,
        Op.SIGNAL,
        Op.OUTPUT,
        Op.JOBS,
        Op.LOST,
        Op.JOIN,
        Op.RECOVER,
        Op.REBUILT,
    }
)
RUNTIME_OPS = frozenset(Op) - AGENT_OPS - {Op.SAVE, Op.LOAD}
#: Answered by the rank's runtime, asked only by the rank's own agent on its line, where the
#: training state follows the line as raw bytes (:data:`STATE_MAX` at most); between agents the
#: state travels by a stream of its own, never inside a Rank call.
STATE_OPS = frozenset({Op.SAVE, Op.LOAD})
#: The largest training state one rank hands over (a bound on what a line's tail may announce).
STATE_MAX = 1 << 40
#: What an agent asks of a rank without naming the job's identity (only reads).  Every other
#: request of a rank names it (``RankRequest.job_key``: its user and the value agreed at
#: :data:`JOB_KEY`, as the moving rank's own agent saw them), and a rank whose identity differs
#: refuses it: a job's store, which anyone who reaches it may write, says where each rank's
#: agent is, and must not be able to steer a rewire onto an unrelated job of the same name.
ASKED_FREELY = frozenset({Op.WHERE, Op.PEERS})
#: What a move asks of a rank naming itself (``by``: its id): a rank one move stopped takes these
#: from that move alone, while it stays stopped (two moves of a job, started at once on two nodes,
#: would stop, tear down and let go on each other's ranks, each at its own generation).
MOVER_OPS = frozenset({Op.PAUSE, Op.CANCEL, Op.TEARDOWN, Op.REBUILD, Op.RESUME})


# ---- requests --------------------------------------------------------------------------------

A = TypeVar("A", bound=Answer)
A_co = TypeVar("A_co", bound=Answer, covariant=True)


@dataclass(frozen=True)
class Request(Generic[A_co]):
    """A request whose answer is an ``A``; ``OP`` names it on the wires, ``ANSWER`` is ``A``."""

    OP: ClassVar[Op]
    ANSWER: ClassVar[type[Answer]] = Answer


@dataclass(frozen=True)
class Where(Request[Standing]):
    OP = Op.WHERE
    ANSWER = Standing


@dataclass(frozen=True)
class Peers(Request[Agents]):
    OP = Op.PEERS
    ANSWER = Agents


@dataclass(frozen=True)
class Pause(Request[Paused]):
    """Stop at ``at`` (of ``unit``), for the move ``by``: a rank it stopped is stopped, torn down,
    rebuilt and let go on by that move alone (the same ``by``): another move of the job, from
    another node, is refused until then (:data:`MOVER_OPS`)."""

    OP = Op.PAUSE
    ANSWER = Paused
    at: int
    unit: str = Unit.STEP.value
    by: str = ""


@dataclass(frozen=True)
class Boundary(Request[AtBoundary]):
    OP = Op.BOUNDARY
    ANSWER = AtBoundary
    timeout: float = 60.0


@dataclass(frozen=True)
class Cancel(Request[Answer]):
    OP = Op.CANCEL
    by: str = ""


@dataclass(frozen=True)
class Teardown(Request[TornDown]):
    OP = Op.TEARDOWN
    ANSWER = TornDown
    leaving: bool = False
    by: str = ""


@dataclass(frozen=True)
class Rebuild(Request[Answer]):
    OP = Op.REBUILD
    gen: int
    timeout: float = 60.0
    by: str = ""


@dataclass(frozen=True)
class Resume(Request[Answer]):
    OP = Op.RESUME
    by: str = ""


@dataclass(frozen=True)
class End(Request[Answer]):
    """A parked rank raises ``why``.  With ``grace`` > 0, a rank waiting in a collective (one it
    issued before this came, still not complete ``grace`` s later) breaks it off too: its
    communicators' connections are shut, the collective raises; a rank whose collectives complete
    is left alone (the job runs: whatever was believed lost is not what it waits on).  With
    ``hold``, a parked rank only says ``why`` on its stderr and keeps it: it raises at the next
    End, or at its park's deadline (one not parked is left as it is).  Every rank is told so
    first, then each is ended: one ending first may take the others down with its launcher
    before they have heard why."""

    OP = Op.END
    why: str = ""
    grace: float = 0.0
    hold: bool = False


@dataclass(frozen=True)
class Save(Request[Saved]):
    """A parked rank's state, offered once on ``listen`` (its node's address) to whoever proves
    ``secret`` (hex) within ``timeout``; no ``listen``: sent after the answer's line."""

    OP = Op.SAVE
    ANSWER = Saved
    listen: str = ""
    secret: str = ""
    timeout: float = 60.0
    held: bool = False  # the state held at its last step boundary (Standing.held), not parked: unplanned recovery


@dataclass(frozen=True)
class Load(Request[Answer]):
    """A state of ``size`` bytes, fetched from ``source`` (HOST:PORT, proving ``secret``), or
    following the request's line; the rank takes it with its own ``load`` once warmed up, and
    stands as the rank it replaces stood (``step``, ``collectives``): parked, its communicators
    to be built (``rebuild``)."""

    OP = Op.LOAD
    size: int
    step: int
    collectives: int = 0
    source: str = ""
    secret: str = ""
    groups: int = 0  # the rank's live process groups (0: not checked)


@dataclass(frozen=True)
class Retire(Request[Answer]):
    """A parked rank whose joiner has its place: it runs the rest of its step (what it prints
    stands), and ends at its next collective or step, before any of it runs."""

    OP = Op.RETIRE


@dataclass(frozen=True)
class Restart(Request[Answer]):
    """A rank whose job lost a rank (unplanned recovery, :mod:`tpagent_rank.recover`): its process
    runs its command again from its start (``exec``, the same PID), takes the state it held at its
    last step boundary (``Standing.held``) once warmed up, and stands there, its communicators to be
    built (``rebuild``): the step in flight is dropped, and done again.  ``store``: ``HOST:PORT``
    at which the job's store is served from now on (:data:`STORE_VARIABLE`; "": where it was).
    ``fresh``: a rank whose held state is of another boundary than the job's (a step further than
    others, or behind the only replicas of a lost rank): it drops what it holds and, warmed up,
    waits for the state of the job's boundary (``load``)."""

    OP = Op.RESTART
    store: str = ""
    fresh: bool = False


@dataclass(frozen=True)
class Settle(Request[Standing]):
    """A rank whose job lost a rank (unplanned recovery), asked first: its training thread enters
    no optimizer step from now on (as once its held state is taken for a :class:`Restart`), and it
    answers where it stands once out of the step it may be in.  So the boundary it says it holds
    (``Standing.held``) is the one it restarts from: a rank in no collective with the lost one,
    which trains on until it waits on a peer, moves no further once asked."""

    OP = Op.SETTLE
    ANSWER = Standing


@dataclass(frozen=True)
class Expect(Request[Answer]):
    OP = Op.EXPECT
    pid: int


@dataclass(frozen=True)
class Moved(Request[Answer]):
    OP = Op.MOVED
    to: str


@dataclass(frozen=True)
class Release(Request[Answer]):
    OP = Op.RELEASE


@dataclass(frozen=True)
class Locate(Request[Located]):
    OP = Op.LOCATE
    ANSWER = Located


@dataclass(frozen=True)
class Signal(Request[Answer]):
    OP = Op.SIGNAL
    signum: int


@dataclass(frozen=True)
class Output(Request[Written]):
    OP = Op.OUTPUT
    ANSWER = Written
    fd: int
    offset: int
    max: int = OUTPUT_MAX


@dataclass(frozen=True)
class Jobs(Request[Ranks]):
    OP = Op.JOBS
    ANSWER = Ranks


@dataclass(frozen=True)
class Lost(Request[Answer]):
    """(The orchestrator's.)  ``node`` (an agent's address), which ran ranks of the job, is lost:
    each rank of the job here, of one of ``users``, is told :class:`End` with ``why`` and
    ``grace``; unless that agent answers this one, or this one moves ranks of the job."""

    OP = Op.LOST
    node: str
    why: str
    grace: float
    users: tuple[int, ...] = ()  # the UIDs the job's ranks there ran as (none: root); only their ranks are told
    died: bool = False  # ranks of the job died on ``node``, whose agent lives (it said so): not a node lost
    identity: str = ""  # which job of that name (an agent's report's RankReport.identity): only its ranks are told


@dataclass(frozen=True)
class Join(Request[Located]):
    """(A moving rank's source agent's.)  Start, on this node, a fresh process of the rank's command
    (:data:`JOIN_VARIABLE` set) as the rank ran it: ``cmd`` with ``env`` (``NAME=value``; the rank
    runtime's own variables are this agent's), in ``cwd`` with ``umask``, as ``uid``/``gid`` with
    ``groups``, writing to ``stdout`` and ``stderr``; ``owner``: the user whose stand-in had the
    rank started (-1: root's).  Answered with its namespace's init, registered as the rank's."""

    OP = Op.JOIN
    ANSWER = Located
    cmd: tuple[str, ...]
    env: tuple[str, ...]
    cwd: str
    umask: int
    uid: int
    gid: int
    groups: tuple[int, ...]
    stdout: str
    stderr: str
    owner: int = -1
    #: (On the agents' wire: :mod:`tpagent.daemon.rankwire`.)  Each text is bytes, a character each.
    latin1: bool = False


@dataclass(frozen=True)
class Recover(Request[Recovered]):
    """(The orchestrator's, of the agent of a rank of the job.)  Ranks ``ranks`` of the job were
    lost with the node of agent ``node``: this agent rebuilds the job from their replicas
    (:mod:`tpagent.jobs.recovery`), each lost rank's command started on the agent at ``spare``.
    Answered once the job runs on; failed with why (then the job's ranks are told to end, as
    :class:`Lost` would have them: one stalled ``grace`` seconds breaks off)."""

    OP = Op.RECOVER
    ANSWER = Recovered
    node: str
    ranks: tuple[int, ...]
    spare: str
    grace: float
    agents: tuple[str, ...] = ()  # each rank's agent as the orchestrator saw it ("": not seen)
    died: bool = False  # the ranks died on ``node``, whose agent lives (it said so): not a node lost


@dataclass(frozen=True)
class Rebuilt(Request[Answer]):
    """(The orchestrator's, of the agent of a node where a rank died by a signal: its end is held
    from its stand-in, :meth:`tpagent.jobs.ranks.Ranks.locate`.)  ``to``: the rank was rebuilt at
    that agent, a new process (its stand-in follows it there, its output read from the start);
    "": its rebuild runs, its end held ``hold`` seconds more, or (0) it failed: its end stands."""

    OP = Op.REBUILT
    to: str = ""
    hold: float = 0.0


REQUESTS: Mapping[Op, type[Request[Any]]] = {
    cls.OP: cls
    for cls in (
        Where,
        Peers,
        Pause,
        Boundary,
        Cancel,
        Teardown,
        Rebuild,
        Resume,
        End,
        Save,
        Load,
        Retire,
        Restart,
        Settle,
        Expect,
        Moved,
        Release,
        Locate,
        Signal,
        Output,
        Jobs,
        Lost,
        Join,
        Recover,
        Rebuilt,
    )
}
