"""The journal: one record per migration, written before each transition takes effect.

::

    JOURNAL ::= WORK_DIR "/migrations/" { ID ".json" }      one file per migration
    ID      ::= 32 * HEX                                      (lower case)
    RECORD  ::= JSON object {
                  "format": 2,                                absent: format 0 (tpagent 0.1); 0 and 1
                                                              have no boot_id (read as unknown)
                  "migration_id": ID,
                  "role": "source" | "target",
                  "state": STATE,                             of the role (tpagent/migration/api.py)
                  "pid": INT, "create_time": FLOAT,           source: the original's root; target: the copy's;
                  "start_ticks": INT,                         its start in clock ticks since boot (format 2;
                                                              not moved by clock steps, unlike create_time);
                                                              a record without either names no process
                  "peer": HOST ":" PORT,                      source: the target agent; target: the source node
                  "peer_agent": HOST ":" PORT | "",           target: the source's agent, asked while it holds
                  "snapshot": PATH,                           inside WORK_DIR (anything else is left alone)
                  "message": STR,
                  "cuda_pids": [INT, ...],                    source: to give the GPU back after a restart
                  "stopped": [INT, ...],                      source: its processes stopped before the freeze,
                                                              left stopped after a restart (format 4)
                  "restore_sent": BOOL,                       source: a copy may exist on the target
                  "boot_id": STR,                             the node's boot when the record was made
                                                              (/proc/sys/kernel/random/boot_id)
                  "operator": "" | "commit" | "discard" }     source: an operator's decision (tpagent
                                                              resolve), taken when the target gave none

A record is written to ``ID.PID.TID.tmp`` (0600), fsynced, renamed over ``ID.json``, and the
directory fsynced: after a crash or power loss either the old or the new record is there,
whole.  The directory is root's, 0700: a record is trusted to name processes.  It must be on
storage that outlives a reboot (what each state means after one: :mod:`tpagent.migration.api`);
:func:`on_tmpfs` tells the agent when it is not.
"""

from __future__ import annotations

import json
import logging
import os
import re
import threading
import time
from collections.abc import Callable, Iterable
from contextlib import suppress
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import psutil

from host import proc
from host.api import UsageError
from host.proc import boot_id
from host.safefs import private_dir, private_opener
from tpagent.migration.api import BadTransition, JournalError, Role, SourceState, State, TargetState, allowed, is_final

log = logging.getLogger(__name__)

#: Records of migrations and rewires that are over are kept this many seconds, and at most this many.
KEEP_FOR = 30 * 86400.0
KEEP_FINAL = 1000
FORMAT = 5  # 1: start_ticks, 2: boot_id, 3: hold, 4: stopped, 5: tree (an older agent must refuse what it cannot read)
_ID = re.compile(r"[0-9a-f]{32}")


def valid_id(text: str) -> bool:
    return bool(_ID.fullmatch(text))


@dataclass
class Record:
    """What the journal keeps of one migration (see the grammar above)."""

    migration_id: str
    role: Role
    state: State
    pid: int = 0
    peer: str = ""
    snapshot: str = ""
    message: str = ""
    cuda_pids: list[int] = field(default_factory=list)
    restore_sent: bool = False
    create_time: float = 0.0
    start_ticks: int = 0
    peer_agent: str = ""
    boot_id: str = field(default_factory=lambda: boot_id())
    operator: str = ""
    hold: float = 0.0  # a target's copy the source confirms itself, within this many seconds (Offer.hold)
    stopped: list[int] = field(default_factory=list)  # source: its processes stopped before the freeze
    tree: list[list[int]] = field(default_factory=list)  # target: the copy's other processes, [PID, start ticks]

    def rebooted(self) -> bool:
        """Whether this node was rebooted since the record was made (unknown: no)."""
        return bool(self.boot_id) and self.boot_id != boot_id()

    def started(self) -> str | None:
        """The start of the record's process (:func:`host.proc.started`; an older record's wall
        clock start time), for a check that it is still that process; None: no process."""
        if self.start_ticks:
            return f"{self.start_ticks}@{self.boot_id}"
        return repr(self.create_time) if self.create_time else None

    def to_json(self) -> dict[str, Any]:
        # (the oldest format that holds it: an agent of the version before reads every other record)
        body = asdict(self)
        for newer in ("hold", "stopped", "tree"):
            if not body[newer]:
                del body[newer]
        version = 5 if self.tree else 4 if self.stopped else 3 if self.hold else 2
        return {"format": version, **body, "role": self.role.value, "state": self.state.value}

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Record:
        data = dict(data)
        version = data.pop("format", 0)
        if version not in range(FORMAT + 1):
            raise ValueError(f"format {version!r} is not one this tpagent reads (it reads 0 to {FORMAT})")
        role = Role(data.pop("role"))
        state: State = (SourceState if role is Role.SOURCE else TargetState)(data.pop("state"))
        data.setdefault("boot_id", "")  # (formats 0 and 1: not known, never the boot reading it)
        return cls(role=role, state=state, **data)


def on_tmpfs(directory: Path) -> bool:
    """Whether ``directory`` lies on memory (tmpfs, ramfs): gone after a reboot."""
    path = str(directory.resolve())
    best = None
    for part in psutil.disk_partitions(all=True):
        mp = part.mountpoint
        if (path == mp or path.startswith(mp.rstrip("/") + "/")) and (best is None or len(mp) > len(best.mountpoint)):
            best = part
    return best is not None and best.fstype in ("tmpfs", "ramfs")


def same_process_alive(r: Record) -> bool:
    """Whether the record's process (source: the original; target: the copy) still exists,
    and is the same one, not a process that reused its PID.  A record without a start time
    names no process: it is never trusted to (the agent signals what this says is there).
    Compared by start ticks since boot (a stepped wall clock moves create_time), within the
    boot the record was made in; an earlier tpagent's record, with no ticks, by its wall-clock
    start within 1.5 s (host.proc.is_started)."""
    if not r.pid or r.rebooted():
        return False
    try:
        if r.start_ticks:
            return proc.start_ticks(r.pid) == r.start_ticks
        return bool(r.create_time) and proc.is_started(r.pid, r.create_time)
    except (OSError, ValueError, IndexError, psutil.Error):
        return False


def note_process(r: Record, pid: int) -> bool:
    """Name ``pid`` in the record by its start (both ways); False if it is already gone."""
    try:
        r.pid = pid
        r.create_time = psutil.Process(pid).create_time()
        r.start_ticks = proc.start_ticks(pid)
        return True
    except (OSError, ValueError, IndexError, psutil.Error):
        r.pid = pid
        r.create_time = 0.0
        r.start_ticks = 0
        return False


def note_tree(r: Record, pids: Iterable[int]) -> None:
    """Name a copy's processes other than its root (``r.pid``) by their starts: should its root
    end first, in a tree in the node's own PID namespace the others run on (reparented), and a
    drop must still find them."""
    r.tree = []
    for pid in pids:
        with suppress(OSError, ValueError, IndexError):
            if pid != r.pid:
                r.tree.append([pid, proc.start_ticks(pid)])


def source_record(migration_id: str, **kw: Any) -> Record:
    return Record(migration_id, Role.SOURCE, SourceState.CHECKING, **kw)


def target_record(migration_id: str, **kw: Any) -> Record:
    return Record(migration_id, Role.TARGET, TargetState.RECEIVING, **kw)


def write_durably(path: Path, data: Any) -> None:
    """``data`` as JSON at ``path`` (0600, in a private directory), whole after a crash or a
    power loss: written aside, fsynced, renamed over ``path``, and the directory fsynced."""
    tmp = path.with_suffix(f".{os.getpid()}.{threading.get_ident()}.tmp")
    with open(tmp, "w", opener=private_opener) as f:
        json.dump(data, f)
        f.flush()
        os.fsync(f.fileno())
    tmp.rename(path)
    fd = os.open(path.parent, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)  # the rename itself survives a power loss too
    finally:
        os.close(fd)


class RecordFiles:
    """A directory of versioned JSON records, one file per id (:func:`valid_id`), each written
    durably (:func:`write_durably`): the migrations' journal here, the rewires' in
    :mod:`tpagent.jobs.journal`.  Root's alone, 0700: a record is trusted to name processes.
    ``what`` names a record in messages ("migration", "rewire")."""

    def __init__(self, directory: Path, what: str, create: bool = True) -> None:
        """``create`` False: the directory is made (or checked) only as the first record is written."""
        self.directory = directory
        self.what = what
        self.made = create
        if create:
            private_dir(directory)

    def path(self, record_id: str) -> Path:
        if not valid_id(record_id):
            raise ValueError(f"{record_id!r} is not a {self.what} id")
        return self.directory / f"{record_id}.json"

    def write(self, record_id: str, data: dict[str, Any]) -> None:
        try:
            if not self.made:
                private_dir(self.directory)
                self.made = True
            write_durably(self.path(record_id), data)
        except OSError as e:
            raise JournalError(f"the journal of {self.what} {record_id} cannot be written: {e.strerror}") from e
        except UsageError as e:  # (its directory is not one root may trust)
            raise JournalError(f"the journal of {self.what} {record_id} cannot be written: {e}") from e

    def read(self, record_id: str) -> dict[str, Any] | None:
        """The record's JSON object, or None if there is none (JournalError: it cannot be read)."""
        try:
            text = self.path(record_id).read_text()
        except FileNotFoundError:
            return None
        except OSError as e:
            raise JournalError(f"the journal of {self.what} {record_id} cannot be read: {e.strerror}") from e
        try:
            data = json.loads(text)
        except ValueError as e:
            raise JournalError(f"the journal of {self.what} {record_id} is damaged: {e}") from e
        if not isinstance(data, dict):
            raise JournalError(f"the journal of {self.what} {record_id} is damaged: not a JSON object")
        return data

    def ids(self) -> list[str]:
        return [p.stem for p in sorted(self.directory.glob("*.json")) if valid_id(p.stem)]

    def prune(
        self, final: Callable[[dict[str, Any]], bool], proof: Callable[[dict[str, Any]], bool] = lambda d: False
    ) -> None:
        """Forget the records that ``final`` says are over, once older than :data:`KEEP_FOR`
        seconds or past the newest :data:`KEEP_FINAL` of them (one that is ``proof`` only once
        that old); never one still going on, or one that cannot be read (left for an operator)."""
        ended: list[tuple[float, bool, Path]] = []
        for record_id in self.ids():
            try:
                data = self.read(record_id)
                when = self.path(record_id).stat().st_mtime
            except (JournalError, OSError):
                continue
            if data is not None and final(data):
                ended.append((when, proof(data), self.path(record_id)))
        ended.sort(key=lambda e: e[0], reverse=True)  # (newest first)
        now = time.time()
        for i, (when, kept, path) in enumerate(ended):
            if (i >= KEEP_FINAL and not kept) or now - when > KEEP_FOR:
                path.unlink(missing_ok=True)


def _over(data: dict[str, Any]) -> bool:
    try:
        return is_final(Record.from_json(data).state)
    except (ValueError, KeyError, TypeError):
        return False


def _copy_runs(data: dict[str, Any]) -> bool:
    """A target's record of a copy made final: its source, asking after a long stop (CRIU holding
    its original frozen meanwhile), must hear DONE, never "unknown" (that would resume it)."""
    return data.get("role") == Role.TARGET.value and data.get("state") == TargetState.DONE.value


class Journal:
    """The migrations' journal (see the grammar above)."""

    def __init__(self, directory: Path) -> None:
        self.files = RecordFiles(directory, "migration")
        #: Records :meth:`settle` moved in memory only (a full disk): read as they are, and written
        #: as soon as the disk takes them (a peer asking after a copy dropped hears DISCARDED).
        self.unwritten: dict[str, Record] = {}
        self._writing = threading.Lock()  # (one record written at a time: an older state never lands last)

    @property
    def directory(self) -> Path:
        return self.files.directory

    def path(self, migration_id: str) -> Path:
        return self.files.path(migration_id)

    def write(self, record: Record) -> None:
        with self._writing:
            self.files.write(record.migration_id, record.to_json())

    def move(self, record: Record, to: State, message: str = "") -> None:
        """Journal ``to`` (if the protocol allows it from where ``record`` stands), then apply it."""
        if not allowed(record.state, to):
            raise BadTransition(f"migration {record.migration_id}: {record.state.value} -> {to.value} is not allowed")
        with self._writing:  # (a read writing this record meanwhile never writes the state tried here)
            before = (record.state, record.message)
            record.state = to
            record.message = message or record.message
            try:
                self.files.write(record.migration_id, record.to_json())
            except JournalError:  # (the record in memory says what the journal says: nothing moved)
                record.state, record.message = before
                raise
            self.unwritten.pop(record.migration_id, None)
        if is_final(to):
            self.files.prune(_over, _copy_runs)

    def settle(self, record: Record, to: State, message: str = "") -> None:
        """:meth:`move`, for a step taken whether or not it can be written down: the original let
        go once no copy can run, the original ended once its copy is final, a copy dropped.  A
        journal that cannot be written (a full disk) is logged and the record moved in memory
        only (:meth:`read` says it so, and writes it once it can): after a restart the journal's
        earlier state asks the peer again, which answers the same (its answer is final), so the
        same end is reached."""
        try:
            self.move(record, to, message)
        except Exception as e:  # (the step goes on: never a process left frozen for a record)
            log.error("migration %s: could not journal %s: %s", record.migration_id, to.value, e)
            with self._writing:
                record.state = to
                record.message = message or record.message
                self.unwritten[record.migration_id] = record

    def read(self, migration_id: str) -> Record | None:
        """The record, or None if there is none.  A record that exists but cannot be read raises
        JournalError: "unknown here" must never be said of a migration that may hold a copy.  One
        :meth:`settle` could not write is read as it stands in memory (and written, if it can be now)."""
        with self._writing:  # (written and let go at once: a settle meanwhile is not lost)
            if (ahead := self.unwritten.get(migration_id)) is not None:
                try:
                    self.files.write(migration_id, ahead.to_json())
                except JournalError:
                    return Record.from_json(ahead.to_json())
                del self.unwritten[migration_id]
        data = self.files.read(migration_id)
        if data is None:
            return None
        try:
            return Record.from_json(data)
        except (ValueError, KeyError, TypeError) as e:
            raise JournalError(f"the journal of migration {migration_id} is damaged: {e}") from e

    def unfinished(self) -> list[Record]:
        """Every record not yet final; unreadable ones are logged and left for an operator."""
        out = []
        for p in sorted(self.directory.glob("*.json")):
            try:
                r = self.read(p.stem)
            except (JournalError, ValueError) as e:
                log.error("%s", e)
                continue
            if r is not None and not is_final(r.state):
                out.append(r)
        return out
