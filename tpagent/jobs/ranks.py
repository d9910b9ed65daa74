"""Where the ranks of distributed jobs on this node reach their agent, and what it knows of them.

A rank started by ``tpagent rank`` (its stand-in) runs :mod:`tpagent_rank`, which connects to
this agent on an abstract unix socket (``rank_socket``; abstract names belong to a network
namespace, so a rank restored on another node reaches that node's agent under the same name).
The wire is the rank protocol's line protocol (:mod:`tpagent_rank.protocol`): the rank says
hello first, the agent welcomes it, then the agent sends requests and the rank answers each
once, matched by id.  The init of a launched namespace says exit, with its status, as it ends.

Nobody is believed on their word: a connection counts only if its peer (the kernel's, as a
pidfd: :mod:`host.peers`) still runs and lives in a ``tpagent launch`` namespace whose init a
stand-in (or a migration that restored it here) registered for that job and rank, with
:meth:`Ranks.expect`; both come through the agent's authenticated API.  Until then a
connection is the door's (:mod:`tpagent.jobs.door`: one thread for all, bounded in number and
time); a hello that arrives before its registration waits there for it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import logging
import os
import socket
import threading
import time
from collections import Counter
from pathlib import Path
from typing import Any, BinaryIO, TypeVar

from host import paths, peers, proc
from host.api import UsageError
from host.safefs import private_dir
from tpagent.common.threads import Threads
from tpagent.jobs import door, rankentry
from tpagent.jobs.connection import Connection, RankGone
from tpagent.jobs.rankentry import RankEntry, close_outputs, died, identity_of, open_output
from tpagent.migration.api import Refused, Why
from tpagent.migration.journal import write_durably
from tpagent.workload import launch
from tpagent_rank import codec, lines
from tpagent_rank import protocol as P

log = logging.getLogger(__name__)
A = TypeVar("A", bound=P.Answer)

#: How long such an end is held before the orchestrator says its rebuild runs.
DIED_HOLD = 60.0


class NotTheJob(Exception):
    """The rank asked for is of another job of the same name (:meth:`Ranks.identity`)."""


def digest_of(identity: str) -> str:
    """An identity (:func:`identity_of`) as the agent tells the orchestrator of it (16 hex digits):
    jobs of one name and two identities are two jobs; the job's key itself stays on its nodes."""
    return hashlib.sha256(identity.encode()).hexdigest()[:16]


def _read_line(f: BinaryIO) -> dict[str, Any] | None:
    data = f.readline(P.LINE_MAX + 1)
    return codec.parse_line(data) if data else None


class Ranks:
    """The ranks on this node, by (job, rank)."""

    def __init__(self, name: str, node_address: str, threads: Threads, saved: Path | None = None) -> None:
        self.name = name
        self.node_address = node_address
        self.threads = threads
        self.lock = threading.Lock()
        self.entries: dict[tuple[str, int], RankEntry] = {}
        self.server: socket.socket | None = None
        self.door: door.Door | None = None
        self.hold_deaths = False  # (an agent reporting to an orchestrator: it may rebuild them)
        self.report_soon = threading.Event()  # a rank said a collective of it failed: report now
        #: Where the registrations outlive the agent (a restart must not orphan running ranks).
        self.saved = saved
        if saved is not None:
            self._load(saved)

    # ---- kept across restarts ----------------------------------------------------------------

    def _load(self, path: Path) -> None:
        """The registrations a previous run of this agent saved (:func:`rankentry.load`)."""
        self.entries.update(((e.job, e.rank), e) for e in rankentry.load(path))

    def _save(self) -> None:
        """(Called with the lock held.)  Entries beyond :data:`~rankentry.KEEP_ENDED` that no longer run go first."""
        if self.saved is None:
            return
        ended = [k for k, e in self.entries.items() if e.exit_code is not None or e.moved_to]
        for k in self._forgotten(ended, len(ended) - rankentry.KEEP_ENDED):
            close_outputs(self.entries.pop(k))
            _spend(*k)  # (a word to come back left from before: gone with it)
        try:
            write_durably(self.saved, {"format": 1, "ranks": rankentry.rows(self.entries.values())})
        except OSError as e:
            log.error("the ranks of this node cannot be saved in %s: %s", self.saved, e.strerror)

    def _forgotten(self, ended: list[tuple[str, int]], n: int) -> list[tuple[str, int]]:
        """Which ``n`` of the ``ended`` ranks (oldest first) to forget: those whose name no user
        holds any more, then the oldest of the user who holds most.  A user who starts and ends
        ranks by the thousand forgets their own, never another's a stand-in still asks about."""
        now = time.monotonic()
        out = [k for k in ended if not self.entries[k].claimed(now)][: max(0, n)]
        forgotten = set(out)
        rest = [k for k in ended if k not in forgotten]
        held = Counter(self.entries[k].owner for k in rest)
        while len(out) < n:
            most = max(held.values())
            k = next(k for k in rest if held[self.entries[k].owner] == most)
            rest.remove(k)
            held[self.entries[k].owner] -= 1
            out.append(k)
        return out

    # ---- serving ---------------------------------------------------------------------------

    def start(self) -> None:
        """Listen (if a name is set).  A name already taken in this network namespace is an
        error: whoever holds it would be the agent to every rank (their runtime believes only
        root or their own user there, but ranks of root would believe it), so the agent does not
        start without it."""
        if not self.name:
            return
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
        try:
            s.bind("\0" + self.name)
            s.listen(64)
        except OSError as e:
            s.close()
            raise UsageError(
                f"the rank socket @{self.name} is taken ({e.strerror}): another agent, or a process posing "
                "as one, serves it in this network namespace; stop it, or set rank_socket to another name."
            ) from e
        self.server = s
        self.door = door.Door(s, self.name, self.threads, self._admit, self._exited)
        self.threads.spawn("server", "ranks-door", self.door.run)

    def close(self) -> None:
        if self.server is not None:
            with contextlib.suppress(OSError):
                self.server.shutdown(socket.SHUT_RDWR)
            self.server.close()
        with self.lock:
            for e in self.entries.values():
                if e.conn is not None:
                    e.conn.close()

    def _admit(self, caller: door.Caller) -> bool:
        """(The door's.)  True once the caller is the connection of its registered rank: its
        process, alive, lives in the namespace registered for that job and rank; False while
        no such registration is here."""
        sock = caller.sock
        peer = caller.peer
        hello = caller.hello
        assert hello is not None
        if "init" not in caller.known:  # (once: the door asks at every tick while it waits)
            caller.known["init"] = proc.namespace_init(peer.pid)
            if not peer.alive():
                raise door.Refuse("the process that connected has exited")
        init = caller.known["init"]
        key = (hello.job, hello.rank)
        conn = Connection(sock, peer, hello)
        # Its welcome is the first line on it: a call already waiting for the rank (a rebuild asked
        # of a rank told to come back) finds it once it is the entry's, and waits for this lock.  A
        # rank whose first line is anything else takes itself as not registered and hangs up.
        with conn.lock:
            with self.lock:
                entry = self.entries.get(key)
                if entry is None or init != entry.init or not entry.alive():
                    return False
                if not peer.alive():  # (what was found of it is the word of a process gone since)
                    raise door.Refuse("the process that connected has exited")
                if entry.conn is not None:
                    entry.conn.close()
                entry.conn = conn
                entry.seen = hello
                entry.uid = peer.uid
                entry.identity = identity_of(peer.uid, hello)
                entry.world = hello.world
                entry.exit_code = None
                entry.moved_to = ""
                entry.broke = ""
                entry.step = hello.step
                _hold_outputs(entry)
                self._save()
            try:
                sock.settimeout(10)
                conn.send(codec.said(lines.Welcome(self.node_address)))
                sock.settimeout(None)
                welcomed = True
            except OSError:
                welcomed = False
        if not welcomed:
            self._gone(conn)
            return True
        log.info("rank %s of job %s (PID %d) is connected", hello.rank, hello.job, peer.pid)
        try:
            self.threads.spawn("server", "rank-conn", self._read_answers, conn)
        except BaseException:  # (no thread to be had: never left as if it were connected)
            self._gone(conn)
            raise
        return True

    def _read_answers(self, conn: Connection) -> None:
        f = conn.sock.makefile("rb")
        try:
            while (body := _read_line(f)) is not None:
                if codec.is_said(body, lines.LineOp.BROKE):
                    self._broke(conn, codec.decode(lines.Broke, body).why)
                elif codec.is_said(body, lines.LineOp.STEPPED):
                    self._stepped(conn, codec.decode(lines.Stepped, body).step)
                else:
                    conn.answered(body)
        except (OSError, ValueError) as e:
            log.warning("rank %s of job %s: its connection broke: %s", conn.hello.rank, conn.hello.job, e)
        finally:
            with contextlib.suppress(OSError):
                f.close()
            self._gone(conn)

    def _broke(self, conn: Connection, why: str) -> None:
        """A rank said a collective of it failed: reported at once (its node's report says it)."""
        with self.lock:
            entry = self.entries.get((conn.hello.job, conn.hello.rank))
            if entry is None or entry.conn is not conn or entry.broke:
                return  # (said once a connection: again, it changes nothing, nor hurries a report)
            entry.broke = why[:500] or "a collective failed"
        log.warning("rank %s of job %s: a collective failed: %s", conn.hello.rank, conn.hello.job, why[:500])
        self.report_soon.set()

    def _stepped(self, conn: Connection, step: int) -> None:
        with self.lock:
            entry = self.entries.get((conn.hello.job, conn.hello.rank))
            if entry is not None and entry.conn is conn:
                entry.step = step

    def broken(self) -> dict[tuple[str, int], str]:
        """(job, rank) -> why a collective of it failed, for each rank here connected that said so."""
        with self.lock:
            return {k: e.broke for k, e in self.entries.items() if e.broke and e.conn is not None}

    def _gone(self, conn: Connection) -> None:
        conn.close()
        with self.lock:
            for entry in self.entries.values():
                if entry.conn is conn:  # (never left as if it were connected)
                    entry.conn = None

    def _exited(self, peer: peers.Peer, said: lines.Exit) -> None:
        """(The door's.)  The init of a launched namespace says its workload ended: believed
        only from that init, still alive as it says so (it reports, waits for the word to be taken,
        then exits)."""
        if launch.launched(peer.pid) is None or not peer.alive():
            raise door.Refuse(f"an exit report from PID {peer.pid}, which is no launched workload's init")
        with self.lock:
            for e in self.entries.values():
                if e.init == peer.pid and not e.moved_to:  # (one that moved on ends here: not the rank)
                    e.exit_code = said.code
                    e.ended_at = time.monotonic()
                    _spend(e.job, e.rank)  # (a word to come back that nobody will take)
                    log.info("rank %s of job %s exited with status %d", e.rank, e.job, said.code)
                    if self.hold_deaths and died(said.code, e.world):
                        e.held_until = time.monotonic() + DIED_HOLD
            self._save()

    # ---- what the agent asks ---------------------------------------------------------------

    def expect(self, job: str, rank: int, init: int, owner: int = -1) -> None:
        """Register the rank of ``job`` whose namespace's init is ``init`` (here); ``owner``: the
        user whose stand-in had it started (through the local channel)."""
        if not P.valid_job(job) or not 0 <= rank < P.RANK_MAX:
            raise Refused(f"job {job!r} rank {rank} is not a valid job and rank.", Why.INVALID)
        if launch.launched(init) is None:
            raise Refused(f"PID {init} is not the init of a `tpagent launch` namespace on this node.", Why.INVALID)
        entry = RankEntry(job, rank, init, proc.start_ticks(init), owner=owner)
        with self.lock:
            old = self.entries.get((job, rank))
            if old is not None and owner < 0 and old.owner >= 0 and old.moved_to:
                entry.owner = old.owner  # (a user's rank come back, restored here: still its stand-in's)
            if old is not None and old.init == init and old.init_start == entry.init_start and not old.moved_to:
                return  # (said again, e.g. by a rewire finishing after a restart: nothing changes)
            if old is not None and old.alive() and old.init != init and not old.moved_to:
                raise Refused(f"rank {rank} of job {job} already runs here (PID {old.init}).", Why.CONFLICT)
            if old is not None and old.conn is not None:
                old.conn.close()
            if old is not None:
                close_outputs(old)
            self.entries[(job, rank)] = entry
            self._save()

    def of_pid(self, pid: int) -> RankEntry | None:
        """The rank whose namespace holds ``pid`` (its init, or a process inside)."""
        init = proc.namespace_init(pid) or pid
        with self.lock:
            return next((e for e in self.entries.values() if e.init == init and e.alive()), None)

    def entry(self, job: str, rank: int) -> RankEntry:
        with self.lock:
            e = self.entries.get((job, rank))
        if e is None:
            raise Refused(f"rank {rank} of job {job} is not known on this node.", Why.NOT_FOUND)
        return e

    def owner_of(self, job: str, rank: int) -> rankentry.Owned | None:
        """Whose stand-in had ``rank`` of ``job`` started here, and whether its name is still that
        user's (it runs here or moved, or ended here less than :data:`~rankentry.ENDED_CLAIM` ago
        or its end is held: its stand-in may yet ask of it); None if it is not known here."""
        now = time.monotonic()
        with self.lock:
            e = self.entries.get((job, rank))
            if e is None:
                return None
            here = e.alive() and e.exit_code is None
            return rankentry.Owned(e.owner, e.moved_to, here, here or e.claimed(now), e.identity)

    def identity(self, job: str, rank: int) -> str:
        """Which job the rank here is, across nodes: its user and the job's key (P.JOB_KEY), as it
        last said hello ("" before it has)."""
        e = self.entry(job, rank)
        with self.lock:  # (both as one hello left them)
            return identity_of(e.uid, e.seen) if e.seen is not None else ""

    def of_job(self, job: str, rank: int, key: str) -> bool:
        return self.entry(job, rank).of_job(key)

    def digests(self) -> dict[tuple[str, int], str]:
        """(job, rank) -> its identity's digest (:func:`digest_of`), of each that said hello."""
        with self.lock:
            return {k: digest_of(identity_of(e.uid, e.seen)) for k, e in self.entries.items() if e.seen is not None}

    def call(self, job: str, rank: int, request: P.Request[A], timeout: float, key: str | None = None) -> A:
        """Ask the rank's runtime; its answer.  Waits (up to ``timeout``) for a rank that is
        reconnecting (a restored copy, a rolled-back original).  ``key``: the job's identity the
        rank must have (:meth:`identity`), or NotTheJob; None: any."""
        if request.OP not in P.RUNTIME_OPS | P.STATE_OPS:
            raise Refused(f"{request.OP.value!r} is not something a rank is asked.", Why.INVALID)
        deadline = time.monotonic() + timeout
        while True:
            conn = self._connected(job, rank, deadline, timeout)
            if key is not None and identity_of(conn.peer.uid, conn.hello) != key:
                raise NotTheJob(f"rank {rank} of job {job} here is of another job")
            if request.OP not in P.ASKED_FREELY:
                return self._ask(job, rank, conn, request, deadline)
            try:
                return conn.call(request, max(0.1, deadline - time.monotonic()))
            except RankGone:
                # A read is asked again of the rank's next connection: one restored (or let go
                # for a freeze and told to come back) may connect, be refused until registered
                # here, and connect again, while it is asked.
                if not conn.closed.is_set() or time.monotonic() >= deadline:
                    raise

    def _connected(self, job: str, rank: int, deadline: float, timeout: float) -> Connection:
        """The rank's connection, once it has one (up to ``deadline``)."""
        while True:
            e = self.entry(job, rank)
            conn = e.conn
            if conn is not None and not conn.closed.is_set():
                return conn
            if e.exit_code is not None or not e.alive():
                raise RankGone(f"rank {rank} of job {job} is no longer running on this node")
            if time.monotonic() > deadline:
                raise RankGone(f"rank {rank} of job {job} did not connect to this agent within {timeout:.0f} s")
            time.sleep(0.05)

    def _ask(self, job: str, rank: int, conn: Connection, request: P.Request[A], deadline: float) -> A:
        leaving = isinstance(request, P.Teardown) and request.leaving
        if leaving:  # (it comes back only once told again)
            _spend(job, rank)
        answer = conn.call(request, max(0.1, deadline - time.monotonic()))
        # It is about to be frozen: it must hold no connection to us by then.
        if leaving and answer.ok and not conn.closed.wait(max(1.0, deadline - time.monotonic())):
            return dataclasses.replace(answer, ok=False, error="it did not let go of its connection to the agent")
        return answer

    def release(self, job: str, rank: int) -> None:
        """Tell a rank that let go of its agent (to be frozen) to connect again (to this one)."""
        self.entry(job, rank)
        go = private_dir(paths.RANK_GO)
        os.chmod(go, 0o711)  # (ranks run as their users: they may look for their file, not list the others)
        path = go / P.go_name(job, rank)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o644)
        os.close(fd)

    def moved(self, job: str, rank: int, to: str) -> None:
        with self.lock:
            e = self.entries.get((job, rank))
            if e is not None:
                e.moved_to = to
                close_outputs(e)  # (it writes on there: everything it wrote here went with it)
                _spend(job, rank)  # (nothing here is to come back)
                self._save()

    def died(self) -> list[RankEntry]:
        """The ranks that died here whose ends are held (for the orchestrator: to rebuild)."""
        now = time.monotonic()
        with self.lock:
            return [e for e in self.entries.values() if not e.moved_to and now < e.held_until]

    def rebuilt(self, job: str, rank: int, to: str, hold: float) -> None:
        """(The orchestrator's word on a rank that died here, :class:`~tpagent_rank.protocol.Rebuilt`.)"""
        e = self.entry(job, rank)
        with self.lock:
            if e.exit_code is None or e.moved_to:
                raise Refused(f"rank {rank} of job {job} did not die on this node.", Why.PRECONDITION)
            e.held_until = time.monotonic() + hold if hold > 0 and not to else 0.0
            if to:
                e.moved_to = to
                e.anew = True
                close_outputs(e)
            self._save()

    def output(self, job: str, rank: int, which: int, offset: int, size: int) -> P.Written:
        """Up to ``size`` bytes from ``offset`` of the rank's stdout (1) or stderr (2) file, and
        the file's size now (-1: it is not read here, having moved on or ended unread)."""
        e = self.entry(job, rank)
        with self.lock:  # (a descriptor is never closed under a read)
            fd = e.outputs.get(which)
            if fd is None:
                if e.moved_to or e.exit_code is not None or not e.alive():
                    return P.Written(size=-1)
                fd = open_output(e.init, which)
                if not e.alive():  # (its PID another's by the time it was opened: not its file)
                    os.close(fd)
                    return P.Written(size=-1)
                e.outputs[which] = fd
            return P.Written(data=os.pread(fd, min(size, P.OUTPUT_MAX), offset), size=os.fstat(fd).st_size)

    def locate(self, job: str, rank: int) -> P.Located:
        """For a stand-in: where its rank is."""
        e = self.entry(job, rank)
        with self.lock:  # (an end and its hold, a rebuild's hold and its move: each seen whole)
            if e.moved_to:
                return P.Located(state=P.Whereabouts.MOVED.value, node=e.moved_to, anew=e.anew)
            if e.exit_code is not None and time.monotonic() < e.held_until:
                return P.Located(state=P.Whereabouts.MOVING.value)
            if e.exit_code is not None:
                return P.Located(state=P.Whereabouts.EXITED.value, code=e.exit_code)
            if e.alive():
                return P.Located(state=P.Whereabouts.HERE.value, pid=e.init)
            return P.Located(state=P.Whereabouts.GONE.value)

    def jobs(self) -> list[P.RankRow]:
        """The ranks that run here or moved away (as each last said hello)."""
        with self.lock:
            out = []
            for e in sorted(self.entries.values(), key=lambda e: (e.job, e.rank)):
                here = e.exit_code is None and not e.moved_to and e.alive()
                if not here and not e.moved_to:
                    continue
                row = P.RankRow(
                    e.job,
                    e.rank,
                    world=e.world,
                    pid=e.init,
                    gen=e.seen.gen if e.seen else 0,
                    step=e.step,
                    connected=e.conn is not None,
                    moved_to=e.moved_to,
                )
                out.append(row)
            return out


def _hold_outputs(e: RankEntry) -> None:
    """Open the rank's stdout and stderr files now, while it runs (at its hello): a rank that
    ends before its stand-in first asks for its output here (it came back and finished its last
    steps at once) is read all the same.  A file not to be read is left to the stand-in's ask,
    which then says why."""
    for which in (1, 2):
        if which not in e.outputs:
            with contextlib.suppress(Refused):
                e.outputs[which] = open_output(e.init, which)


def _spend(job: str, rank: int) -> None:
    """Take back the word that lets a rank that let go of its agent connect again (made by
    :meth:`Ranks.release`).  Only its leaving again, or its move away, spends it, never its
    coming back: a line broken before its welcome then costs it a reconnection, not its job
    (it would wait for a word already spent, and never come back)."""
    with contextlib.suppress(FileNotFoundError):
        os.unlink(paths.RANK_GO / P.go_name(job, rank))
