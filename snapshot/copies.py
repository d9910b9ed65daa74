"""Root's notes of the copies restored on this node, one file per snapshot (by its id), so
that a snapshot restored twice does not run twice (:func:`snapshot.restore.restore` refuses,
unless asked for a clone)::

    RESTORED/<snapshot id>.json ::= JSON list of { "pid": int, "started": STARTED, "host": str }
    STARTED ::= TICKS "@" BOOT_ID           (host.proc.started; older notes: "create_time": float)

A note counts only while that very process (its PID and start, on this host, in this boot) still
runs.  While a snapshot is restored, ``RESTORED/<snapshot id>.lock`` is locked (``flock``) from
the check that no copy of it runs to the note of the new one: a second restore of it meanwhile
is refused.
"""

from __future__ import annotations

import fcntl
import json
import logging
import os
import platform
import re
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from pathlib import Path
from typing import Any

import psutil

from host import paths, proc
from host.api import UsageError
from host.safefs import private_dir, private_opener
from snapshot.api import SnapshotError, SnapshotInvalid
from snapshot.manifest import Manifest

log = logging.getLogger(__name__)

#: Root's notes of the copies restored on this node, one per snapshot (by its id): a snapshot
#: restored twice would run twice.
RESTORED = paths.RESTORED


def _note_path(m: Manifest) -> Path:
    if not re.fullmatch(r"[0-9a-f]{1,64}", m.snapshot_id):
        raise SnapshotInvalid(f"the snapshot's id {m.snapshot_id[:80]!r} is not hexadecimal.")
    return RESTORED / f"{m.snapshot_id}.json"


def _live_copies(m: Manifest) -> list[dict[str, Any]]:
    """The notes of copies of ``m`` restored here before whose very process still runs."""
    return _live(_note_path(m))


def _live(path: Path) -> list[dict[str, Any]]:
    try:
        notes = json.loads(path.read_text())
    except (OSError, ValueError):
        return []
    live = []
    for note in notes if isinstance(notes, list) else []:
        try:
            p = psutil.Process(int(note["pid"]))
            if (
                proc.is_started(p.pid, note.get("started", note.get("create_time")))
                and note["host"] == platform.node()
                and p.status() != psutil.STATUS_ZOMBIE
            ):
                live.append(note)
        except (ValueError, KeyError, TypeError, psutil.Error):
            continue
    return live


@contextmanager
def restoring(m: Manifest) -> Iterator[None]:
    """Held while ``m`` is restored here, from the check that no copy of it runs to the note of
    the new one: a second restore of it at the same time (both would start a copy) is refused."""
    private_dir(RESTORED)
    lock = _note_path(m).with_suffix(".lock")
    fd = private_opener(str(lock), os.O_RDWR | os.O_CREAT)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise UsageError(
                "another restore of this snapshot is under way on this node (two would start two copies); "
                "let it end, then restore again if no copy runs."
            ) from None
        try:
            yield
        finally:  # (a restore that opened the file before this goes finds it locked; one after, the note)
            with suppress(OSError):
                lock.unlink()
    finally:
        os.close(fd)


def still_running(m: Manifest) -> int | None:
    """The PID of a copy of ``m`` restored here before, if that very process still runs."""
    live = _live_copies(m)
    return int(live[0]["pid"]) if live else None


def note_copy(m: Manifest, root: int) -> None:
    """Add the copy just restored (as PID ``root``) to the notes of ``m``'s live copies."""
    try:
        private_dir(RESTORED)
        note = {"pid": root, "started": proc.started(root), "host": platform.node()}
        tmp = _note_path(m).with_suffix(f".{os.getpid()}.tmp")
        with open(tmp, "w", opener=private_opener) as f:
            json.dump([*(n for n in _live_copies(m) if n["pid"] != root), note], f)  # (noted once)
        tmp.rename(_note_path(m))
    except (OSError, psutil.Error, SnapshotError) as e:  # the copy runs; only the note of it is missing
        log.warning("could not note the copy of %s restored as PID %d: %s", m.snapshot_id, root, e)
    for other in RESTORED.glob("*.json"):  # (the notes of copies that left or ended go)
        if not _live(other):
            other.unlink(missing_ok=True)
