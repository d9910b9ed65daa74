"""The stand-in's channel to its node's agent when it does not run as root (Slurm's tasks, most
pods): an abstract unix socket of the node's network namespace, ``@<rank_socket>-standin``.  The
kernel says who connected (``SO_PEERCRED``); nothing else identifies a caller, and a caller acts
only as itself:

* ``start`` — the agent launches the rank (:func:`tpagent.workload.launch.start`) as the
  caller's user, group and supplementary groups, in the caller's directory, with the caller's
  environment (given to the rank alone: the namespace's init and ``unshare``, root's, run with
  none of it) and the rank runtime on its ``PYTHONPATH``; the rank's stdout and stderr files are
  opened as that user.  A rank of the job already run by another user is refused.
* ``rank`` — one of the rank protocol's ``locate``, ``signal`` and ``output`` requests about a rank
  this caller's user started here, answered here or passed on to the agent the rank moved to
  (only an agent this one learned it moved to: a caller names no other address).

    LINE     ::= JSON-OBJECT "\\n"          a request at most REQUEST_MAX bytes, an answer ANSWER_MAX
    REQUEST  ::= {"op": "start", "job", "rank", "cmd": [...], "env": {...}, "cwd", "umask", "stdout", "stderr"}
               | {"op": "rank", "via": "" | "HOST:PORT", "job", "rank", "request": {"op", ...}}
    ANSWER   ::= {"ok": true, "pid"} | {"ok": true, "answer": {...}} | {"ok": false, "error": SENTENCE}

A connection asks one request at a time.  At most :data:`CONNECTIONS` are served at once
(:data:`PER_USER` of one user), each read with a deadline.
"""

from __future__ import annotations

import contextlib
import enum
import errno
import json
import logging
import math
import os
import socket
import sys
import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

from host import cgroups, peers
from host.api import UsageError
from tpagent.common.threads import Threads
from tpagent.jobs.rankentry import Owned
from tpagent.migration.api import AgentError, PeerUnreachable, Refused, Why
from tpagent_rank import codec
from tpagent_rank import protocol as P

log = logging.getLogger(__name__)

A = TypeVar("A", bound=P.Answer)
REQUEST_MAX = 1 << 20
ANSWER_MAX = 4 << 20  # (an output's MiB, in base64)
#: Connections served at once, and of one user (:func:`host.peers.account`: their subordinate
#: UIDs counted as theirs); a newcomer past either is never turned away: the connection idle
#: longest of the user who holds most (or of its own user, at theirs) is cut.
CONNECTIONS = 256
PER_USER = 64
#: A connection must ask its first request this soon (a stand-in asks as it connects).
FIRST_WITHIN = 10.0
#: Ranks one user's stand-ins may have running on a node at once (each costs root two processes).
RANKS_PER_USER = 256
#: A request must arrive whole within this long of its first byte (a stand-in idles between them).
READ_WITHIN = 10.0
#: A connection that asks nothing this long is closed (a stand-in asks twice a second).
IDLE_MAX = 600.0
#: What a caller may ask about a rank (the rest of the rank protocol is the agents' own).
RELAYED = frozenset({P.Op.LOCATE, P.Op.SIGNAL, P.Op.OUTPUT})
ARGS_MAX = 4096
#: The most bytes of one argument or variable (the kernel's MAX_ARG_STRLEN, 32 pages, its NUL too).
ARG_MOST = 131072
ENV_MAX = 4096


class Op(str, enum.Enum):
    START = "start"
    RANK = "rank"


@dataclass(frozen=True)
class Start:
    job: str
    rank: int
    cmd: tuple[str, ...]
    env: dict[str, str]
    cwd: str
    umask: int
    stdout: str
    stderr: str


@dataclass(frozen=True)
class Caller:
    """Who asks, as the kernel said when it connected (its groups too: never read later from a
    PID that may have been reused)."""

    pid: int
    uid: int
    gid: int
    groups: tuple[int, ...] = ()
    cgroups: tuple[str, ...] = ()  # its control groups' cgroup.procs files (host.cgroups)


def socket_name(rank_socket: str) -> str:
    return f"{rank_socket}-standin"


def _start_of(d: dict[str, Any]) -> Start:
    """The ``start`` request in ``d``, checked; :class:`Refused` in one sentence."""
    fields: dict[str, Any] = {name: d.get(name) for name in Start.__dataclass_fields__}
    cmd = fields["cmd"]
    env = fields["env"]
    texts = ("job", "cwd", "stdout", "stderr")
    if not all(isinstance(fields[f], str) for f in texts) or not all(_whole(fields[f]) for f in ("rank", "umask")):
        raise Refused(
            "a start request names its job, cwd, stdout and stderr in text, its rank and umask in numbers", Why.INVALID
        )
    if not isinstance(cmd, list) or not isinstance(env, dict):
        raise Refused("a start request gives its command as a list and its environment as an object", Why.INVALID)
    s = Start(**{**fields, "cmd": tuple(cmd), "env": dict(env)})
    if not P.valid_job(s.job) or not 0 <= s.rank < 1 << 20 or not s.cmd or len(s.cmd) > ARGS_MAX:
        raise Refused("give a job's name, a rank from 0 and a command", Why.INVALID)
    if len(s.env) > ENV_MAX or not all(
        _argument(t) for t in (*s.cmd, *s.env, *s.env.values(), s.cwd, s.stdout, s.stderr)
    ):
        raise Refused(
            f"the command, environment and paths must be text (no NUL, no lone surrogate), each below {ARG_MOST} bytes",
            Why.INVALID,
        )
    if not all(name and "=" not in name for name in s.env):
        raise Refused("an environment variable's name must not be empty nor hold '='", Why.INVALID)
    if not all(os.path.isabs(p) for p in (s.cwd, s.stdout, s.stderr)) or not 0 <= s.umask <= 0o777:
        raise Refused("the working directory and output files must be absolute paths", Why.INVALID)
    return s


def _whole(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _argument(text: object) -> bool:
    """Whether ``text`` can be one argument (or variable) of a program's: text, no NUL, bytes as
    Python makes them of it (a byte that is no UTF-8 was read as a surrogate escape, which gives it
    back; any other lone surrogate names none), within the kernel's bound of one."""
    if not isinstance(text, str) or "\0" in text:
        return False
    try:
        return len(os.fsencode(text)) < ARG_MOST
    except UnicodeEncodeError:
        return False


#: How many agents a rank is followed through to check an address a stand-in names.
HOPS_MAX = 8


class StandInDoor:
    """The agent's end.  ``launch(start, caller)`` starts the rank as the caller (and registers it
    as theirs) and returns its init's PID; ``owner_of(job, rank)`` says whose stand-in had a rank
    started here, where it moved, and whether it runs here (the rank registry's word, kept across
    restarts); ``ask(agent, job, rank, request, timeout, key)`` asks the agent at ``agent`` ("": this
    one) about a rank, of the job whose identity is ``key`` ("": any)."""

    def __init__(
        self,
        name: str,
        threads: Threads,
        launch: Callable[[Start, Caller], int],
        owner_of: Callable[[str, int], Owned | None],
        ask: Callable[[str, str, int, P.Request[Any], float, str], Any],
    ) -> None:
        self.name = name
        self.threads = threads
        self.launch = launch
        self.owner_of = owner_of
        self.ask = ask
        self.lock = threading.Lock()
        self.starting: dict[tuple[str, int], int] = {}  # (job, rank) -> the UID whose start is under way
        self.started: dict[int, set[tuple[str, int]]] = {}  # UID -> the ranks started for it here
        self.learned: dict[tuple[str, int], set[str]] = {}  # (job, rank) -> agents it moved on to
        self.open: dict[socket.socket, list[Any]] = {}  # connection -> [its user (peers.account), when it last asked]
        self.sock: socket.socket | None = None

    def start(self) -> None:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            sock.bind("\0" + self.name)
        except OSError as e:
            sock.close()
            raise UsageError(
                f"cannot listen for stand-ins on @{self.name}: {e.strerror}; is another agent running?"
            ) from e
        sock.listen(64)
        self.sock = sock
        self.threads.spawn("stand-ins", "stand-in door", self._accept)

    def close(self) -> None:
        if self.sock is not None:
            sock = self.sock
            self.sock = None
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)
            sock.close()

    def _accept(self) -> None:
        while self.sock is not None:
            try:
                conn, _ = self.sock.accept()
            except OSError as e:
                if self.sock is None or e.errno not in (errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM):
                    return
                log.error("the stand-in door takes no connection now (%s); it tries again in a second", e.strerror)
                if self.threads.sleep(1.0):
                    return
                continue
            try:
                self._admit(conn)
            except Exception as e:  # (one caller's trouble is never the door's: it is dropped, the door stays)
                log.warning("a stand-in's connection was dropped: %r", e)
                conn.close()

    def _admit(self, conn: socket.socket) -> None:
        pid, uid, gid = peers.credentials(conn)
        try:
            groups = peer_groups(conn)
            cgroups = _cgroups_of(conn)
        except (OSError, peers.PeerGone) as e:
            log.info("a stand-in's connection from PID %d (UID %d) was dropped: %s", pid, uid, e)
            conn.close()
            return
        user = peers.account(uid)
        with self.lock:
            held = Counter(u for u, _ in self.open.values())
            if (len(self.open) >= CONNECTIONS or held[user] >= PER_USER) and not self._cut(
                user if held[user] >= PER_USER else held.most_common(1)[0][0]
            ):
                log.warning("a stand-in's connection of UID %d was refused: every place is busy with a request", uid)
                conn.close()
                return
            self.open[conn] = [user, time.monotonic()]
        caller = Caller(pid, uid, gid, groups, cgroups)
        self.threads.spawn("stand-ins", f"stand-in {pid}", self._serve, conn, caller)

    def _cut(self, user: int) -> bool:
        """(With the lock held.)  Cut ``user``'s connection that asked nothing for longest: its
        thread sees its end and forgets it (a stand-in connects again at its next request).  None
        is cut while it is answered (False): its thread runs on, and the place is not free."""
        conn = min((c for c, (u, _) in self.open.items() if u == user), key=lambda c: self.open[c][1])
        if self.open[conn][1] == math.inf:
            return False
        log.warning("a stand-in's connection of UID %d was cut for a newcomer: too many", user)
        del self.open[conn]
        with contextlib.suppress(OSError):
            conn.shutdown(socket.SHUT_RDWR)
        return True

    def _serve(self, conn: socket.socket, caller: Caller) -> None:
        try:
            wait = FIRST_WITHIN
            while (line := _read_line(conn, REQUEST_MAX, first_wait=wait)) is not None:
                with self.lock:
                    if conn not in self.open:  # (cut meanwhile)
                        return
                    self.open[conn][1] = math.inf  # (busy: never the one cut)
                answer = _line(self._answer(line, caller))
                with self.lock:
                    if conn in self.open:
                        self.open[conn][1] = time.monotonic()
                conn.sendall(answer)
                wait = IDLE_MAX
        except (OSError, ValueError) as e:
            log.info("a stand-in's connection (PID %d, UID %d) ended: %s", caller.pid, caller.uid, e)
        finally:
            with self.lock:
                self.open.pop(conn, None)
            conn.close()

    def _answer(self, line: bytes, caller: Caller) -> dict[str, Any]:
        try:
            d = json.loads(line)
            if not isinstance(d, dict):
                raise Refused("a request is a JSON object", Why.INVALID)
            if d.get("op") == Op.START.value:
                return {"ok": True, "pid": self._start(_start_of(d), caller)}
            if d.get("op") == Op.RANK.value:
                return {"ok": True, "answer": codec.fields_of(self._rank(d, caller))}
            raise Refused(f"{str(d.get('op'))[:40]!r} is not a stand-in's request", Why.INVALID)
        except (ValueError, P.ProtocolError) as e:
            return {"ok": False, "error": f"the request is not valid: {e}"}
        except PeerUnreachable as e:  # (the agent asked gave no answer: its stand-in may ask again)
            return {"ok": False, "error": str(e).rstrip("."), "unreachable": True}
        except (AgentError, UsageError) as e:
            return {"ok": False, "error": str(e).rstrip(".")}
        except (RecursionError, OverflowError, TypeError, AttributeError, KeyError) as e:  # (JSON of another shape)
            return {"ok": False, "error": f"the request is not valid: {type(e).__name__}: {str(e)[:200]}"}
        except OSError as e:
            return {"ok": False, "error": f"the agent could not do it: {e.strerror or e}"}
        except Exception as e:  # (a bug of ours: logged whole, and the stand-in still told, never cut off)
            log.exception("a stand-in's request failed")
            return {"ok": False, "error": f"the agent failed on the request ({type(e).__name__})"}

    def _start(self, s: Start, caller: Caller) -> int:
        key = (s.job, s.rank)
        known = self.owner_of(*key)
        with self.lock:
            if key in self.starting or known is not None and known.claimed and known.owner != caller.uid:
                raise Refused(f"rank {s.rank} of job {s.job} was started here by another user", Why.PRECONDITION)
            if known is not None and known.here:
                raise Refused(f"rank {s.rank} of job {s.job} runs here already", Why.PRECONDITION)
            mine = self.started.setdefault(caller.uid, set())
            mine -= {k for k in mine if not ((o := self.owner_of(*k)) and o.here)}
            if len(mine) + sum(u == caller.uid for u in self.starting.values()) >= RANKS_PER_USER:
                raise Refused(f"you have {RANKS_PER_USER} ranks running on this node already", Why.PRECONDITION)
            self.starting[key] = caller.uid  # (two callers racing: one starts it)
        try:
            pid = self.launch(s, caller)
            with self.lock:
                self.started.setdefault(caller.uid, set()).add(key)
            return pid
        finally:
            with self.lock:
                self.starting.pop(key, None)

    def _rank(self, d: dict[str, Any], caller: Caller) -> P.Answer:
        job = str(d.get("job", ""))
        rank = d.get("rank")
        via = str(d.get("via", ""))
        request = codec.decode_request(d.get("request") or {})
        if request.OP not in RELAYED or not isinstance(rank, int) or isinstance(rank, bool):
            raise Refused(f"a stand-in may only ask {', '.join(sorted(o.value for o in RELAYED))}", Why.INVALID)
        key = (job, rank)
        known = self.owner_of(job, rank)
        if known is None or known.owner != caller.uid or caller.uid < 0:
            raise Refused(f"rank {rank} of job {job} was not started here by you", Why.NOT_FOUND)
        if via and not self._followed(key, known, via):
            raise Refused(f"rank {rank} of job {job} never moved to {via}", Why.NOT_FOUND)
        if via and not known.identity:  # (its name alone may be another user's rank's there by now)
            raise Refused(
                f"rank {rank} of job {job} never said which job it is here, so it is not followed", Why.NOT_FOUND
            )
        timeout = d.get("timeout", 10.0)
        timeout = min(max(float(timeout), 0.1), 60.0) if isinstance(timeout, int | float) else 10.0
        answer = self.ask(via, job, rank, request, timeout, known.identity)
        self._learn(key, answer)
        return answer  # type: ignore[no-any-return]

    def _learn(self, key: tuple[str, int], answer: Any) -> None:
        if isinstance(answer, P.Located) and answer.state == P.Whereabouts.MOVED.value and answer.node:
            with self.lock:
                self.learned.setdefault(key, set()).add(answer.node)

    def _followed(self, key: tuple[str, int], known: Owned, via: str) -> bool:
        """Whether the rank went to ``via``: from here to where it moved first, then as each agent
        says (of its job's rank: ``known.identity``)."""
        first = known.moved_to
        with self.lock:
            if via == first or via in self.learned.get(key, set()):
                return True
        at = first
        for _ in range(HOPS_MAX if first and known.identity else 0):  # (restarted: it knew the first hop only)
            try:
                answer = self.ask(at, key[0], key[1], P.Locate(), 10.0, known.identity)
            except AgentError:
                return False
            self._learn(key, answer)
            if answer.state != P.Whereabouts.MOVED.value or not answer.node:
                return False
            if answer.node == via:
                return True
            at = answer.node
        return False


def _line(d: dict[str, Any]) -> bytes:
    return json.dumps(d, separators=(",", ":")).encode() + b"\n"


def _read_line(conn: socket.socket, limit: int, first_wait: float | None) -> bytes | None:
    """One line (None: the other end closed); ValueError past ``limit`` bytes, or if the line is
    not whole :data:`READ_WITHIN` seconds after its first byte (however it trickles)."""
    data = bytearray()
    conn.settimeout(first_wait)
    deadline = 0.0
    while not data.endswith(b"\n"):
        chunk = conn.recv(65536)
        if not chunk:
            if data:
                raise ValueError("the connection closed mid-line")
            return None
        data += chunk
        deadline = deadline or time.monotonic() + READ_WITHIN
        left = deadline - time.monotonic()
        if left <= 0:
            raise ValueError(f"a line not whole within {READ_WITHIN:g} s")
        conn.settimeout(left)
        if len(data) > limit:
            raise ValueError(f"a line longer than {limit} bytes")
    return bytes(data)


class LocalAgent:
    """The stand-in's end: its node's agent, or (``via``) the agent its rank moved to, asked
    through its node's agent."""

    def __init__(self, name: str, via: str = "", conn: socket.socket | None = None) -> None:
        self.name = name
        self.address = via or "this node's agent"
        self.via = via
        self.lock = threading.Lock()
        self.conn = conn

    def to(self, via: str) -> LocalAgent:
        """The agent at ``via``, on the same connection."""
        other = LocalAgent(self.name, via, self._conn())
        other.lock = self.lock
        return other

    def _conn(self) -> socket.socket:
        if self.conn is None:
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            try:
                sock.connect("\0" + self.name)
                _, uid, _ = peers.credentials(sock)
            except OSError as e:
                sock.close()
                raise PeerUnreachable(f"no agent listens for stand-ins here (@{self.name}): {e.strerror}") from e
            if uid != 0:  # (an abstract name anyone may bind while the agent is down: never told a thing)
                sock.close()
                raise PeerUnreachable(f"@{self.name} is held by UID {uid}, not by root's agent")
            self.conn = sock
        return self.conn

    def _ask(self, d: dict[str, Any], timeout: float) -> dict[str, Any]:
        with self.lock:
            conn = self._conn()
            try:
                conn.sendall(_line(d))
                line = _read_line(conn, ANSWER_MAX, first_wait=timeout)
            except (OSError, ValueError) as e:
                self.conn = None
                conn.close()
                raise PeerUnreachable(f"this node's agent did not answer: {e}") from e
        if line is None:
            self.conn = None
            raise PeerUnreachable("this node's agent closed the connection")
        answer = json.loads(line)
        if not answer.get("ok"):
            if answer.get("unreachable") is True:
                raise PeerUnreachable(str(answer.get("error", "unreachable")))
            raise Refused(str(answer.get("error", "refused")), Why.PRECONDITION)
        return dict(answer)

    def start(self, s: Start, timeout: float = 60.0) -> int:
        d = {"op": Op.START.value, **{k: getattr(s, k) for k in Start.__dataclass_fields__}}
        return int(self._ask(d, timeout)["pid"])

    def rank(self, job: str, rank: int, request: P.Request[A], timeout: float, key: str = "") -> A:
        fields = {"op": request.OP.value, **codec.fields_of(request)}
        d = {"op": Op.RANK.value, "via": self.via, "job": job, "rank": rank, "request": fields, "timeout": timeout}
        return codec.decode_answer(request, self._ask(d, timeout + 5)["answer"])


#: ``SO_PEERGROUPS`` (Linux 4.13): the supplementary groups of a unix socket's peer, as it connected.
SO_PEERGROUPS = getattr(socket, "SO_PEERGROUPS", 59)


def _cgroups_of(sock: socket.socket) -> tuple[str, ...]:
    """The control groups of the process that connected: read from /proc by its PID, which is
    then checked, through a pidfd, to be that process still (not its PID's next owner)."""
    peer = peers.peer(sock)
    try:
        found = cgroups.of_process(peer.pid)
        if not peer.alive():
            raise peers.PeerGone(f"PID {peer.pid}, which connected, has exited")
        return found
    finally:
        peer.close()


def peer_groups(sock: socket.socket) -> tuple[int, ...]:
    """The supplementary groups the peer of ``sock`` had when it connected (no more than its own;
    at most 256: Python reads 1024 bytes at most, and more groups are refused with ERANGE)."""
    data = sock.getsockopt(socket.SOL_SOCKET, SO_PEERGROUPS, 1024)
    return tuple(int.from_bytes(data[i : i + 4], sys.byteorder) for i in range(0, len(data), 4))


def runtime_readable(root: Path) -> None:
    """Let every user reach ``root`` (the rank runtime, 0755) through its parent: 0711, no listing."""
    parent = root.parent
    st = parent.stat()
    if st.st_uid == 0 and st.st_mode & 0o011 != 0o011:
        os.chmod(parent, (st.st_mode & 0o7777) | 0o011)
