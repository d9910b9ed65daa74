"""What a failed checkpoint (:mod:`snapshot.dump`) says: one sentence, from its error and what
CRIU and its hook wrote, the disk the snapshot was on, and the tree that was to be dumped."""

from __future__ import annotations

import errno
import logging
import os
import shutil
from contextlib import suppress
from pathlib import Path

from host import proc
from host.api import UsageError
from snapshot import hook
from snapshot.api import CriuError, Interrupted, SnapshotError, ToolError

log = logging.getLogger(__name__)


def why(
    e: BaseException, pid: int, out: Path, pids: list[int], said: str, cancelled: bool, full: bool
) -> SnapshotError:
    """The error that says why the checkpoint failed: ``e``, or what CRIU or its hook ``said``
    (``full``: CRIU failed, and the disk holding the snapshot had no byte left, not even root's: its
    own line about it may have been cut where the disk ended)."""
    if cancelled:
        return Interrupted(f"the checkpoint of PID {pid} was interrupted")
    if isinstance(e, CriuError) and not proc.alive(pid):  # (CRIU's own words: it could not detach from it)
        return UsageError(f"PID {pid} exited as it was being checkpointed; nothing was kept.")
    said_full = "No space left on device" in said or (isinstance(e, OSError) and e.errno == errno.ENOSPC)
    if not said_full and hook.NOT_THE_PROCESS in said:
        return UsageError(
            f"PID {pid} is no longer the process that was checked (that one exited and its PID was reused); "
            "nothing was done."
        )
    if said_full or full:
        return CriuError(
            f"the disk holding {out} ran out of space: the snapshot of PID {pid} needs about "
            f"{size(proc.dump_size_estimate(pids))}, and {size(free_bytes(out))} are free there; "
            "free some space or give --out on a larger disk",
            code=errno.ENOSPC,
        )
    if isinstance(e, SnapshotError):
        return e
    if isinstance(e, OSError):
        return CriuError(f"writing the snapshot to {out} failed", detail=str(e), code=e.errno)
    # a bug, or a library raising what it should not: the rollback above still ran
    log.exception("checkpoint of %d failed unexpectedly", pid)
    return ToolError(f"the checkpoint of PID {pid} failed unexpectedly ({type(e).__name__}: {e})")


def read(path: Path) -> str:
    try:
        return path.read_text(errors="replace")
    except OSError:
        return ""


def free_bytes(out: Path, as_root: bool = False) -> int:
    """Free bytes on the file system ``out`` is (or would be) on: for users, or (``as_root``) with
    the blocks reserved for root, which CRIU, run as root, may still fill."""
    for at in (out, *out.parents):
        with suppress(OSError):
            if as_root:
                st = os.statvfs(at)
                return st.f_bfree * st.f_frsize
            return shutil.disk_usage(at).free
    return 0


def size(n: int) -> str:
    return f"{n / 2**20:.1f} MiB ({n:,} bytes)"
