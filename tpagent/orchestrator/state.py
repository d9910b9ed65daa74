"""The orchestrator's state: one SQLite file in WAL mode, every decision committed (synchronous
FULL) before it is acted on, so that a killed orchestrator finds each of them after its restart.

    meta    (key, value)                          schema = 1
    nodes   name, agent, gpus (JSON)              every node that ever reported (a taint names one)
    taints  id, node, gpu, kind, reason, source, created, removed, waiting
    moves   id, job, ranks (JSON), source, target, kind, state, taint, attempt, message, migration,
            created, started, ended, timings (JSON)
    away    job, rank, home, on_node, taint       ranks moved off a taint, until they are home
    events  seq, ts, kind, text, job, node, move

Two indexes are the reservations: at most one planned or running move per job (never two moves
of one rank) and per target node (never a spare given twice); a second one is refused by
SQLite itself, whatever the orchestrator believed.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import sqlite3
import stat
import threading
import time
import urllib.parse
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from host.api import UsageError
from host.safefs import private_dir
from tpagent.orchestrator.api import (
    ACTIVE,
    Away,
    Gpu,
    Move,
    MoveKind,
    MoveState,
    Taint,
    TaintKind,
    is_key,
    job_identity,
    job_name,
)

SCHEMA = 1
_TABLES = """
CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS nodes (name TEXT PRIMARY KEY, agent TEXT NOT NULL, gpus TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS taints (
  id INTEGER PRIMARY KEY, node TEXT NOT NULL, gpu TEXT NOT NULL, kind TEXT NOT NULL, reason TEXT NOT NULL,
  source TEXT NOT NULL, created REAL NOT NULL, removed REAL, waiting TEXT NOT NULL DEFAULT '');
CREATE UNIQUE INDEX IF NOT EXISTS one_taint ON taints (node, gpu, source) WHERE removed IS NULL;
CREATE TABLE IF NOT EXISTS moves (
  id INTEGER PRIMARY KEY, job TEXT NOT NULL, ranks TEXT NOT NULL, source TEXT NOT NULL, target TEXT NOT NULL,
  kind TEXT NOT NULL, state TEXT NOT NULL, taint INTEGER, attempt INTEGER NOT NULL, message TEXT NOT NULL,
  migration TEXT NOT NULL, created REAL NOT NULL, started REAL, ended REAL, timings TEXT NOT NULL DEFAULT '{}');
CREATE UNIQUE INDEX IF NOT EXISTS one_move_a_job ON moves (job) WHERE state IN ('planned', 'running');
CREATE UNIQUE INDEX IF NOT EXISTS one_move_a_spare ON moves (target) WHERE state IN ('planned', 'running');
CREATE TABLE IF NOT EXISTS away (
  job TEXT NOT NULL, rank INTEGER NOT NULL, home TEXT NOT NULL, on_node TEXT NOT NULL, taint INTEGER NOT NULL,
  PRIMARY KEY (job, rank));
CREATE TABLE IF NOT EXISTS events (
  seq INTEGER PRIMARY KEY AUTOINCREMENT, ts REAL NOT NULL, kind TEXT NOT NULL, text TEXT NOT NULL,
  job TEXT NOT NULL, node TEXT NOT NULL, move INTEGER NOT NULL);
"""
_MOVE = "id, job, ranks, source, target, kind, state, taint, attempt, message, migration, created, started, ended"
_TAINT = "id, node, gpu, kind, reason, source, created, waiting"


def _move(row: Any) -> Move:
    mid, job, ranks, source, target, kind, state, taint, attempt, message, migration, created, started, ended = row
    return Move(
        mid,
        job,
        tuple(json.loads(ranks)),
        source,
        target,
        MoveKind(kind),
        MoveState(state),
        taint,
        attempt,
        message,
        migration,
        created,
        started,
        ended,
    )


def _taint(row: Any) -> Taint:
    tid, node, gpu, kind, reason, source, created, waiting = row
    return Taint(tid, node, gpu, TaintKind(kind), reason, source, created, waiting)


DEFAULT_STATE = Path("/var/lib/tpagent-orchestrator/state.db")
_SQLITE = b"SQLite format 3\x00"  # (the first 16 bytes of every SQLite database)


def _own_file(path: Path) -> None:
    """``path`` made (or found) a regular file, 0600, never through a symlink: the database's (a
    --state of /dev/null made the node's /dev/null root's alone).  A file that holds something
    else is left as it was (--state /etc/passwd shut it to root alone)."""
    if path.is_dir():
        raise UsageError(f"{path} is a directory; give the path of a file in it for the orchestrator's database.")
    if Path(os.path.abspath(path)).parent == Path("/"):
        raise UsageError(f"{path} is not in a directory of its own; give a path such as {DEFAULT_STATE}.")
    private_dir(path.parent)
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, 0o600)
    except OSError as e:
        raise UsageError(f"cannot use {path} as the orchestrator's database: {e.strerror}.") from e
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise UsageError(f"{path} is not a regular file; give a path for the orchestrator's database.")
        head = os.pread(fd, len(_SQLITE), 0)
        if head and (head != _SQLITE or not _orchestrators(path)):
            raise UsageError(f"{path} holds something else than an orchestrator's database; give a new path.")
        owner = os.fstat(fd).st_uid
        if not head and owner != os.geteuid():  # (empty, but someone else's file)
            raise UsageError(f"{path} is a file of UID {owner}'s; give a new path.")
        os.fchmod(fd, 0o600)
    finally:
        os.close(fd)


def _orchestrators(path: Path) -> bool:
    """Whether the SQLite database at ``path`` is an orchestrator's (another program's is left alone)."""
    try:
        with contextlib.closing(sqlite3.connect(f"file:{urllib.parse.quote(str(path))}?mode=ro", uri=True)) as db:
            if db.execute("SELECT count(*) FROM sqlite_master").fetchone()[0] == 0:
                return True  # (one an orchestrator stopped before it made its tables: it holds nothing)
            return db.execute("SELECT value FROM meta WHERE key = 'schema'").fetchone() is not None
    except sqlite3.Error:
        return False


class State:
    def __init__(self, path: Path) -> None:
        _own_file(path)
        self.path = path
        # One orchestrator to a database: a second one (another port, another host sharing it) is refused.
        self._held = os.open(path.parent / (path.name + ".lock"), os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        try:
            fcntl.flock(self._held, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(self._held)
            raise UsageError(f"another orchestrator uses {path}; stop it first.") from None
        self.lock = threading.Lock()
        self.changed = threading.Condition(self.lock)  # notified on every new event
        self.db = sqlite3.connect(path, check_same_thread=False, isolation_level=None, timeout=30)
        self.db.execute("PRAGMA journal_mode=WAL")
        self.db.execute("PRAGMA synchronous=FULL")
        with self.db:
            self.db.executescript(_TABLES)
            self.db.execute("INSERT OR IGNORE INTO meta VALUES ('schema', ?)", (str(SCHEMA),))
        marks = ", ".join("?" * len(ACTIVE))
        rows = self.db.execute(
            f"SELECT job FROM moves WHERE state IN ({marks}) UNION SELECT job FROM away", [s.value for s in ACTIVE]
        )
        #: Jobs of active moves and ranks away named as before jobs had keys (:meth:`adopt`).
        self.legacy = {job for (job,) in rows if not is_key(job)}

    def close(self) -> None:
        with self.lock:
            self.db.close()
            os.close(self._held)

    def _write(self, sql: str, args: Iterable[Any] = ()) -> sqlite3.Cursor:
        with self.lock, self.db:
            self.db.execute("BEGIN IMMEDIATE")
            return self.db.execute(sql, tuple(args))

    def _read(self, sql: str, args: Iterable[Any] = ()) -> list[Any]:
        with self.lock:
            return self.db.execute(sql, tuple(args)).fetchall()

    # ---- nodes ---------------------------------------------------------------------------

    def node_seen(self, name: str, agent: str, gpus: tuple[Gpu, ...]) -> None:
        doc = json.dumps([[g.uuid, g.name, g.memory_total] for g in gpus])
        self._write("INSERT OR REPLACE INTO nodes VALUES (?, ?, ?)", (name, agent, doc))

    def known(self) -> dict[str, tuple[str, ...]]:
        """Every node that ever reported, and its GPUs' UUIDs."""
        return {n: tuple(g[0] for g in json.loads(gpus)) for n, gpus in self._read("SELECT name, gpus FROM nodes")}

    # ---- taints --------------------------------------------------------------------------

    def taint(self, node: str, gpu: str, kind: TaintKind, reason: str, source: str) -> Taint | None:
        """The new taint; None if ``source`` already taints that node or GPU."""
        now = time.time()
        try:
            cur = self._write(
                "INSERT INTO taints (node, gpu, kind, reason, source, created) VALUES (?, ?, ?, ?, ?, ?)",
                (node, gpu, kind.value, reason, source, now),
            )
        except sqlite3.IntegrityError:
            return None
        return Taint(int(cur.lastrowid or 0), node, gpu, kind, reason, source, now)

    def untaint(self, node: str, gpu: str, source: str | None = None) -> list[Taint]:
        """Remove the taints of ``node`` (``gpu``: of that GPU), by ``source`` (None: any)."""
        gone = [t for t in self.taints() if t.node == node and t.gpu == gpu and source in (None, t.source)]
        for t in gone:
            self._write("UPDATE taints SET removed = ? WHERE id = ?", (time.time(), t.id))
        return gone

    def taints(self) -> list[Taint]:
        return [_taint(r) for r in self._read(f"SELECT {_TAINT} FROM taints WHERE removed IS NULL ORDER BY id")]

    def taint_by_id(self, tid: int) -> Taint | None:
        rows = self._read(f"SELECT {_TAINT} FROM taints WHERE id = ?", (tid,))
        return _taint(rows[0]) if rows else None

    def waiting(self, tid: int, why: str) -> bool:
        """Say why taint ``tid``'s ranks do not move; whether that is news."""
        cur = self._write("UPDATE taints SET waiting = ? WHERE id = ? AND waiting != ?", (why, tid, why))
        return cur.rowcount > 0

    # ---- moves ---------------------------------------------------------------------------

    def plan(
        self,
        job: str,
        ranks: tuple[int, ...],
        source: str,
        target: str,
        kind: MoveKind,
        taint: int | None,
        attempt: int,
    ) -> Move | None:
        """The move, reserving its spare; None if the job moves already or the spare is taken."""
        now = time.time()
        try:
            cur = self._write(
                "INSERT INTO moves (job, ranks, source, target, kind, state, taint, attempt, message, migration, "
                "created) VALUES (?, ?, ?, ?, ?, ?, ?, ?, '', '', ?)",
                (
                    job,
                    json.dumps(list(ranks)),
                    source,
                    target,
                    kind.value,
                    MoveState.PLANNED.value,
                    taint,
                    attempt,
                    now,
                ),
            )
        except sqlite3.IntegrityError:
            return None
        return self.move(int(cur.lastrowid or 0))

    def move(self, mid: int) -> Move:
        return _move(self._read(f"SELECT {_MOVE} FROM moves WHERE id = ?", (mid,))[0])

    def moves(self, active: bool = False, last: int = 200) -> list[Move]:
        if active:
            marks = ", ".join("?" * len(ACTIVE))
            rows = self._read(
                f"SELECT {_MOVE} FROM moves WHERE state IN ({marks}) ORDER BY id", [s.value for s in ACTIVE]
            )
        else:
            rows = self._read(f"SELECT {_MOVE} FROM moves ORDER BY id DESC LIMIT ?", (last,))[::-1]
        return [_move(r) for r in rows]

    def failed(self, job: str, source: str, taint: int | None) -> list[Move]:
        """The tries of (job, source, taint) that failed or were interrupted."""
        rows = self._read(
            f"SELECT {_MOVE} FROM moves WHERE job = ? AND source = ? AND taint IS ? AND state IN (?, ?) ORDER BY id",
            (job, source, taint, MoveState.FAILED.value, MoveState.INTERRUPTED.value),
        )
        return [_move(r) for r in rows]

    def start(self, mid: int) -> bool:
        """PLANNED -> RUNNING, written before the source agent is asked; False if it was not planned."""
        cur = self._write(
            "UPDATE moves SET state = ?, started = ? WHERE id = ? AND state = ?",
            (MoveState.RUNNING.value, time.time(), mid, MoveState.PLANNED.value),
        )
        return cur.rowcount == 1

    def migration(self, mid: int, migration: str) -> None:
        self._write("UPDATE moves SET migration = ? WHERE id = ?", (migration, mid))

    def end(self, mid: int, state: MoveState, message: str, timings: dict[str, float] | None = None) -> Move:
        """The move's outcome (and, done, where its ranks now are: :class:`Away` kept in step); a move
        that has one already keeps it."""
        m = self.move(mid)
        with self.lock, self.db:
            self.db.execute("BEGIN IMMEDIATE")
            cur = self.db.execute(
                "UPDATE moves SET state = ?, message = ?, ended = ?, timings = ? WHERE id = ? AND state IN (?, ?)",
                (state.value, message, time.time(), json.dumps(timings or {}), mid, *(s.value for s in ACTIVE)),
            )
            done = cur.rowcount == 1 and state is MoveState.DONE
            if done and m.kind is MoveKind.HOME:
                self.db.executemany("DELETE FROM away WHERE job = ? AND rank = ?", [(m.job, r) for r in m.ranks])
            elif done:
                for r in m.ranks:
                    self.db.execute(
                        "INSERT INTO away VALUES (?, ?, ?, ?, ?) ON CONFLICT (job, rank) DO UPDATE SET on_node = ?",
                        (m.job, r, m.source, m.target, m.taint or 0, m.target),
                    )
        return self.move(mid)

    def timings(self, mid: int) -> dict[str, float]:
        return dict(json.loads(self._read("SELECT timings FROM moves WHERE id = ?", (mid,))[0][0]))

    def follow(self, a: Away, on: str) -> None:
        """Rank ``a`` runs on ``on`` now (moved outside the orchestrator): at home, it is away no more."""
        if on == a.home:
            self._write("DELETE FROM away WHERE job = ? AND rank = ? AND on_node = ?", (a.job, a.rank, a.on))
        else:
            self._write(
                "UPDATE away SET on_node = ? WHERE job = ? AND rank = ? AND on_node = ?", (on, a.job, a.rank, a.on)
            )

    def away(self) -> list[Away]:
        return [Away(*r) for r in self._read("SELECT job, rank, home, on_node, taint FROM away ORDER BY job, rank")]

    def adopt(self, keys: Iterable[str]) -> list[tuple[str, str]]:
        """The rows of :attr:`legacy` jobs (a bare name: written before jobs had identities)
        given the key of the one job of that name of ``keys`` (those reported now); (name, key)
        of each adopted.  With two jobs of that name (which one was it?), none is, until one ends;
        a rank whose identity is not known yet (before its hello) names no job."""
        if not self.legacy:
            return []
        found: dict[str, set[str]] = {}
        for key in filter(job_identity, keys):
            found.setdefault(job_name(key), set()).add(key)
        out = []
        for name in sorted(self.legacy):
            if len(found.get(name, ())) != 1:
                continue
            (key,) = found[name]
            try:
                with self.lock, self.db:
                    self.db.execute("BEGIN IMMEDIATE")
                    self.db.execute("UPDATE moves SET job = ? WHERE job = ?", (key, name))
                    self.db.execute("UPDATE away SET job = ? WHERE job = ?", (key, name))
            except sqlite3.IntegrityError:  # (the key moves already, or has that rank away: left as it is)
                continue
            self.legacy.discard(name)
            out.append((name, key))
        return out

    # ---- events --------------------------------------------------------------------------

    def event(self, kind: str, text: str, job: str = "", node: str = "", move: int = 0) -> int:
        cur = self._write(
            "INSERT INTO events (ts, kind, text, job, node, move) VALUES (?, ?, ?, ?, ?, ?)",
            (time.time(), kind, text, job, node, move),
        )
        with self.changed:
            self.changed.notify_all()
        return int(cur.lastrowid or 0)

    def events(self, after: int, limit: int = 1000) -> list[tuple[int, float, str, str, str, str, int]]:
        return [
            tuple(r)
            for r in self._read(
                "SELECT seq, ts, kind, text, job, node, move FROM events WHERE seq > ? ORDER BY seq LIMIT ?",
                (after, limit),
            )
        ]

    def wait_event(self, after: int, timeout: float) -> None:
        """Return once an event after ``after`` is there, or after ``timeout``."""
        with self.changed:
            if (self.db.execute("SELECT max(seq) FROM events").fetchone()[0] or 0) > after:
                return
            self.changed.wait(timeout)
