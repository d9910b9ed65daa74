"""Carried files left behind: the node-local copies a committed migration took away.

When a migration commits, its original is gone and its node-local files (a log, a scratch
file, a shared-memory segment) now live on at the target; the copies here are stale.  They
are not deleted (a file the process only read may be anyone's input, and the user may want
the old log), but they must not stop the workload from coming back: a restore that finds a
carried file here with other content replaces it if, and only if, it is the very file this
node let go, untouched since.

Untouched is decided without reading the file: the dump records each carried file's identity
(device, inode, size, change time in ns) as it archives it, frozen (``log/carried.json`` of
the snapshot); at commit, a file that still has that identity is noted here as left behind;
at a restore, an existing file with the identity of its note is replaced.  Any change to the
file (a write, a truncation, a chmod, a rename over it) changes its inode or its ctime, which
no user can set back.

    NOTE      ::= LEFT/<sha256 of PATH>.json = {"path", "dev", "ino", "size", "ctime_ns"}
    CARRIED   ::= SNAPSHOT/log/carried.json = {PATH: [dev, ino, size, ctime_ns]}
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
from pathlib import Path

from host import paths, safefs, userdirs
from host.safefs import private_dir, private_opener
from snapshot import manifest
from snapshot.api import SnapshotError
from snapshot.hook import CARRIED_IDS, identity

log = logging.getLogger(__name__)

#: Root's notes of the carried files this node let go (persistent: a return may come later).
LEFT = paths.LEFT_BEHIND


def _note_path(path: str, left: Path) -> Path:
    return left / f"{hashlib.sha256(path.encode()).hexdigest()}.json"


def _current(path: str) -> list[int] | None:
    """The identity of the regular file ``path`` now (reached through no symlink), or None."""
    try:
        fd = safefs.open_to_read(Path(path))
    except (OSError, SnapshotError):
        return None
    if fd is None:
        return None
    try:
        return identity(os.fstat(fd))
    finally:
        os.close(fd)


def note_left_behind(snapshot: Path, left: Path = LEFT) -> list[str]:
    """After the original of ``snapshot`` was ended (its copy runs elsewhere): note each carried
    file that is still exactly as it was archived; returns their paths."""
    try:
        carried = json.loads((snapshot / "log" / CARRIED_IDS).read_text())
    except (OSError, ValueError):
        return []
    noted = []
    for path, ident in carried.items() if isinstance(carried, dict) else ():
        if _current(path) != ident:
            continue  # changed since the freeze (someone else writes it): never replaced later
        try:
            private_dir(left)
            tmp = left / f".{os.getpid()}.tmp"
            with open(tmp, "w", opener=private_opener) as f:
                json.dump({"path": path, "dev": ident[0], "ino": ident[1], "size": ident[2], "ctime_ns": ident[3]}, f)
            tmp.rename(_note_path(path, left))
            noted.append(path)
        except (OSError, SnapshotError) as e:  # only a later return is affected: it then says so
            log.warning("could not note %s as left behind: %s", path, e)
    return noted


def clear_sockets(snapshot: Path) -> list[str]:
    """After the original of ``snapshot`` was ended: remove the socket files it had bound (those
    very files, reached through no symlink), then the directories of theirs the dump recorded
    on the way, once empty: what the process would have removed as it exited (its own
    ``pymp-XXXX``), and what would keep its copy from coming back (a restore makes them).
    The paths removed."""
    try:
        m = manifest.load(snapshot)
    except SnapshotError:
        return []
    # (that very file only: on a path all nodes share, the copy's socket is there now)
    removed = [b.path for b in m.sockets if userdirs.remove_socket(Path(b.path), b.uid, (b.dev, b.ino, b.ctime_ns))]
    for d in sorted(m.dirs, key=lambda d: -d.path.count("/")):
        with contextlib.suppress(OSError, SnapshotError):  # (not empty, or gone: left as it is)
            if userdirs.remove_dir(Path(d.path), d.uid):
                removed.append(d.path)
    return removed


def left_behind(path: Path, st: os.stat_result, left: Path = LEFT) -> bool:
    """Whether the file at ``path``, whose fstat is ``st``, is one this node let go, untouched since."""
    try:
        note = json.loads(_note_path(str(path), left).read_text())
    except (OSError, ValueError):
        return False
    return (
        isinstance(note, dict)
        and note.get("path") == str(path)
        and [
            note.get("dev"),
            note.get("ino"),
            note.get("size"),
            note.get("ctime_ns"),
        ]
        == identity(st)
    )


def forget(path: Path, left: Path = LEFT) -> None:
    """The file at ``path`` was put back: its old note no longer applies."""
    _note_path(str(path), left).unlink(missing_ok=True)
