"""The regular files a process tree uses: what a migration must find on the target (shared
paths) or take along (the node's own files), and which of those cannot be taken."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import psutil

from host import safefs
from host.api import UsageError


def open_in(tree: list[psutil.Process]) -> dict[str, bool]:
    """The regular files the tree has open or mapped shared, and whether it writes to each.

    A file mapped shared (``shm_open`` + ``mmap`` + ``close``, as C libraries do) has no fd
    left, only a line in /proc/PID/maps; CRIU needs it on the target as it needs an open one.
    Private mappings (libraries, the interpreter) are the node's own files, never carried."""
    out: dict[str, bool] = {}
    for p in tree:
        try:
            for f in p.open_files():
                out[f.path] = out.get(f.path, False) or f.mode != "r"
            maps = Path(f"/proc/{p.pid}/maps").read_text()
        except (psutil.Error, OSError):
            continue
        for line in maps.splitlines():
            fields = line.split(maxsplit=5)
            if (
                len(fields) < 6
                or fields[1][3] != "s"
                or not fields[5].startswith("/")
                or fields[5].endswith(" (deleted)")
            ):
                continue  # (private, anonymous, or deleted: CRIU keeps a deleted file's bytes itself)
            try:
                if not stat.S_ISREG(os.stat(fields[5]).st_mode):
                    continue  # (a device: /dev/nvidia*, /dev/zero)
            except OSError:
                continue
            out[fields[5]] = out.get(fields[5], False) or fields[1][1] == "w"
    return out


def uncarriable(paths: list[Path]) -> list[str]:
    """Why node-local files could not be taken along: the checks the post-dump hook makes as
    root when it archives them (no symlink on the path, the directory's owner), made now."""
    out = []
    for path in paths:
        try:
            fd = safefs.open_to_read(path)
        except UsageError as e:
            out.append(str(e).rstrip("."))
            continue
        except OSError as e:
            out.append(f"{path}, which the process has open, cannot be read to take it along ({e.strerror})")
            continue
        if fd is not None:
            os.close(fd)
    return out


def size(path: str) -> int:
    """Its size now (0: gone, or not readable)."""
    try:
        return Path(path).stat().st_size
    except OSError:
        return 0
