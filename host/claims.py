"""Root's claims on the processes a dump freezes, so that two dumps never freeze one process at
once (a `tpagent dump` typed beside a migration of the same job, two CLIs): the second is refused
in one sentence before it touches the tree, instead of fighting the first for it (one CRIU's
rollback resuming what the other holds frozen, one's CUDA lock undoing the other's)::

    DUMPING/<PID>-<START TICKS>    flock'd (exclusive) by the dump that freezes that process

A claim lasts while its dump runs, a migration's hold included (:mod:`snapshot.held`): the lock
goes with its descriptor, whatever ends the dump.  A claim's file stays (unlinking a locked file
would let two dumps each lock a file of the same name); those of processes that ended are
removed as later claims are taken (no dump can want them again: a PID's start ticks are its
own in a boot, and /run is emptied at the next).
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import re
import threading
from pathlib import Path

from host import paths, proc
from host.api import UsageError
from host.safefs import private_dir

DUMPING = paths.DUMPING
_NAME = re.compile(r"(\d+)-(\d+)")


class Claims:
    """The processes one dump has claimed (:meth:`take`), let go together by :meth:`close`; used
    by one thread (what :func:`held` says to that thread leaves its own claims out)."""

    def __init__(self) -> None:
        self._held: dict[int, int] = {}  # PID -> the descriptor of its locked file
        #: Ancestors looked at already (a tree's members share theirs; one another dump claims
        #: later would have to claim this dump's processes too, which it cannot).
        self._looked: set[int] = set()

    def take(self, pids: list[int]) -> None:
        """Claim each of ``pids`` not claimed yet here; UsageError if another dump holds one, or
        holds an ancestor of one (a child forked once that dump had looked at its tree is in it
        as CRIU freezes it).  Claims taken so far stay held, let go by :meth:`close`.  A
        process that ended is left out (the dump finds it gone as it would have)."""
        new = [pid for pid in pids if pid not in self._held]
        if not new:
            return
        at = private_dir(DUMPING)
        _prune(at)
        for pid in new:
            try:
                name = f"{pid}-{proc.start_ticks(pid)}"
            except (OSError, IndexError, ValueError):
                continue
            fd = os.open(at / name, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                os.close(fd)
                raise UsageError(f"{busy(pid)} Nothing was done.") from None
            self._held[pid] = fd
            _mine().add(pid)
            above = [a for a in _ancestors(pid) if a not in self._looked]
            self._looked.update(above)
            if any(held(a) for a in above):  # (after its own claim: of two dumps, either sees the other's)
                raise UsageError(f"{busy(pid)} Nothing was done.")

    def close(self) -> None:
        for pid, fd in self._held.items():
            os.close(fd)
            _mine().discard(pid)
        self._held.clear()

    def __enter__(self) -> Claims:
        return self

    def __exit__(self, *_: object) -> None:
        self.close()


_local = threading.local()


def _mine() -> set[int]:
    """The processes this thread's dump has claimed."""
    if not hasattr(_local, "pids"):
        _local.pids = set()
    pids: set[int] = _local.pids
    return pids


def _ancestors(pid: int) -> list[int]:
    out: list[int] = []
    with contextlib.suppress(OSError, IndexError, ValueError):
        while (pid := proc.parent_pid(pid)) > 1 and len(out) < 4096:
            out.append(pid)
    return out


def busy(pid: int) -> str:
    """What is said of a process another dump has claimed."""
    return (
        f"PID {pid} is being checkpointed already (by another `tpagent dump`, or a migration); "
        "try again once that has ended."
    )


def held(pid: int) -> bool:
    """Whether another dump (not this thread's) holds its claim on ``pid`` now: read from
    /proc/locks, so no lock is taken and no dump is refused for being looked at."""
    if pid in _mine():
        return False
    try:
        st = os.stat(DUMPING / f"{pid}-{proc.start_ticks(pid)}", follow_symlinks=False)
        with open("/proc/locks") as f:
            locks = f.read()
    except (OSError, IndexError, ValueError):
        return False
    key = (os.major(st.st_dev), os.minor(st.st_dev), st.st_ino)
    return any(_locked_file(line) == key for line in locks.splitlines())


def _locked_file(line: str) -> tuple[int, int, int] | None:
    """The file an flock of /proc/locks's ``line`` is on (MAJOR:MINOR:INODE, hex, hex, decimal);
    None for another kind of lock, or a waiter's line."""
    parts = line.split()
    if len(parts) < 6 or parts[1] != "FLOCK" or "->" in parts:
        return None
    with contextlib.suppress(ValueError):
        major, minor, inode = parts[5].split(":")
        return int(major, 16), int(minor, 16), int(inode)
    return None


def _prune(at: Path) -> None:
    """Remove the claims' files of processes that ended (or whose PID another took)."""
    for entry in os.scandir(at):
        m = _NAME.fullmatch(entry.name)
        if m is None:
            continue
        pid = int(m.group(1))
        try:
            live = proc.start_ticks(pid) == int(m.group(2))
        except (OSError, IndexError, ValueError):
            live = False
        if not live:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(at / entry.name)
