"""The migration protocol as a state machine, and its journal.

Source side (the node the process leaves)::

    CHECKING ──> FREEZING ──> HELD ──> RESTORING ──> COMMITTING ──> DONE
       │            │           │          │
       └> FAILED    └───────────┴──────────┴──> ROLLING_BACK ──> ROLLED_BACK

  CHECKING     both agents check versions, memory, CRIU, shared files; nothing is touched
               (a dry run ends here: DONE or FAILED, with what would fail).
  FREEZING     CUDA lock + checkpoint, CRIU dump; the images stream to the target as CRIU
               writes them.  CRIU's post-dump hook then *holds* the sealed, frozen tree.
  HELD         the target has the snapshot, verified; the original is frozen, resumable.
  RESTORING    the target restores its copy, held (READY), and says so.
  COMMITTING   decided (journaled first): the target makes its copy final and lets it run
               (``Finish`` answers ``done``; an abort can no longer touch it), then the hook
               lets CRIU end the original (frozen all along: never two running).
  ROLLING_BACK any failure before COMMITTING: the target drops its copy (kills it if it
               had started), then the hook makes CRIU roll back: the original runs on
               where it stood.  Both copies never run at once: the original runs again only
               after the target said its copy is gone, and the copy runs only while the
               original is frozen and is ended before the original is let go.  If the
               target made its copy final meanwhile (a takeover, below), ROLLING_BACK turns
               into COMMITTING: the original is ended, never resumed.

Target side: RECEIVING -> RECEIVED -> RESTORING -> READY -> DONE, or DISCARDED.  READY: the
copy is restored but held (stopped; a CUDA process: its GPU still locked); it starts only at
DONE, when the source commits — so a copy that is then dropped has never run.  A READY copy
whose source agent cannot be reached for ``takeover_after`` seconds goes to DONE on its own
(its node is presumed lost with the frozen original): a source that asked for the restore
never resumes its original unless the target says the copy is gone, so it can only commit.

Each transition is written to ``WORK/migrations/ID.json`` before it takes effect, so an
agent that restarts finds its migrations and finishes or rolls back each (``recover``).
"""

from __future__ import annotations

import enum
import json
import logging
import os
import re
import threading
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from snapshot.safefs import private_dir, private_opener

log = logging.getLogger(__name__)


class State(str, enum.Enum):
    CHECKING = "checking"
    FREEZING = "freezing"
    HELD = "held"
    RESTORING = "restoring"
    COMMITTING = "committing"
    DONE = "done"
    ROLLING_BACK = "rolling_back"
    ROLLED_BACK = "rolled_back"
    FAILED = "failed"
    # the target's side
    RECEIVING = "receiving"
    RECEIVED = "received"
    READY = "ready"
    DISCARDED = "discarded"


S = State
TRANSITIONS: dict[State, set[State]] = {
    S.CHECKING: {S.FREEZING, S.DONE, S.FAILED},
    S.FREEZING: {S.HELD, S.ROLLING_BACK},
    S.HELD: {S.RESTORING, S.ROLLING_BACK},
    S.RESTORING: {S.COMMITTING, S.ROLLING_BACK},
    S.COMMITTING: {S.DONE, S.ROLLING_BACK},  # back only if the target says its copy is gone
    S.ROLLING_BACK: {S.ROLLED_BACK, S.COMMITTING},  # forward only if the target made its copy final
    S.RECEIVING: {S.RECEIVED, S.DISCARDED},
    S.RECEIVED: {S.RESTORING, S.DISCARDED},
    S.READY: {S.DONE, S.DISCARDED},
}
#: The target's RESTORING moves on to READY or DISCARDED (the same name as the source's).
TARGET_RESTORING = {S.READY, S.DISCARDED}
FINAL = {S.DONE, S.FAILED, S.ROLLED_BACK, S.DISCARDED}
_ID = re.compile(r"[0-9a-f]{32}")


class BadTransition(RuntimeError):
    pass


class JournalError(RuntimeError):
    pass


def valid_id(text: str) -> bool:
    return bool(_ID.fullmatch(text))


@dataclass
class Record:
    """What the journal keeps of one migration."""

    migration_id: str
    role: str  # "source" or "target"
    state: State
    pid: int = 0  # source: the original's root; target: the restored copy's
    peer: str = ""  # the other agent's address
    snapshot: str = ""
    message: str = ""
    cuda_pids: list[int] = field(default_factory=list)
    #: Source: Restore was asked of the target, so a copy may run there: the original may run
    #: again only once the target has said its copy is gone.
    restore_sent: bool = False
    #: The start time of ``pid`` (source: the original's root; target: the copy's), to tell
    #: it from a process that reused its PID.
    create_time: float = 0.0
    #: Target: the source agent's gRPC address, asked while a restored copy waits for its word.
    peer_agent: str = ""

    def to_json(self) -> dict[str, Any]:
        return {**asdict(self), "state": self.state.value}

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Record:
        return cls(**{**data, "state": State(data["state"])})


class Journal:
    def __init__(self, directory: Path) -> None:
        self.directory = directory
        private_dir(directory)  # root's alone: a record is trusted to name processes

    def path(self, migration_id: str) -> Path:
        if not valid_id(migration_id):
            raise ValueError(f"{migration_id!r} is not a migration id")
        return self.directory / f"{migration_id}.json"

    def write(self, record: Record) -> None:
        tmp = self.path(record.migration_id).with_suffix(f".{os.getpid()}.{threading.get_ident()}.tmp")
        with open(tmp, "w", opener=private_opener) as f:
            json.dump(record.to_json(), f)
            f.flush()
            os.fsync(f.fileno())
        tmp.rename(self.path(record.migration_id))
        fd = os.open(self.directory, os.O_RDONLY | os.O_DIRECTORY)
        try:
            os.fsync(fd)  # the rename itself survives a power loss too
        finally:
            os.close(fd)

    def move(self, record: Record, to: State, message: str = "") -> None:
        """Journal ``to`` (if the protocol allows it from where ``record`` stands), then apply it."""
        allowed = TARGET_RESTORING if (record.role == "target" and record.state is S.RESTORING) else TRANSITIONS.get(record.state, set())
        if to not in allowed:
            raise BadTransition(f"migration {record.migration_id}: {record.state.value} -> {to.value} is not allowed")
        record.state = to
        record.message = message or record.message
        self.write(record)

    def read(self, migration_id: str) -> Record | None:
        """The record, or None if there is none.  A record that exists but cannot be read raises
        JournalError: "unknown here" must never be said of a migration that may hold a copy."""
        try:
            text = self.path(migration_id).read_text()
        except FileNotFoundError:
            return None
        except OSError as e:
            raise JournalError(f"the journal of migration {migration_id} cannot be read: {e.strerror}") from e
        try:
            return Record.from_json(json.loads(text))
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
            if r is not None and r.state not in FINAL:
                out.append(r)
        return out
