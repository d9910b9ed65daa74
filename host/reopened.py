"""The paths CRIU opens again by name when it restores a tree, and whether this node's copy of
each can be trusted as the one the tree had.

A restore runs as root and reopens by path what each process held: its working directory, root
and executable, the files it maps (its libraries, private or shared) and the files and
directories it has open.  On another node, or on the same one later, such a path may be
missing, and anyone who may write to a directory above it may then put their own file (a
library, a symlink to root's files, a directory of theirs as the copy's working directory)
there.  So the dump notes, for every such path and every directory on the way to it, its owner,
group and mode; the restore refuses a path whose copy here is missing, or that someone could
have put there who could not have put it where it was dumped.
"""

from __future__ import annotations

import os
import stat
from collections.abc import Collection, Iterator, Sequence
from dataclasses import dataclass
from pathlib import PurePosixPath

from host import files, proc

#: What the kernel makes, not files anyone puts in place (devices are root's; /dev/shm is not).
_KERNELS = ("/proc/", "/sys/", "/dev/")
_ANYONES = ("/dev/shm/",)
#: The paths noted at most (each directory on the way counts): a bound on a manifest's size.
MOST = 100_000
_WRITERS = 0o022


@dataclass(frozen=True)
class Reopened:
    """A path a restore opens again by name (or a directory on the way to one), as it was where
    the tree was dumped."""

    path: str
    uid: int
    gid: int
    mode: int  # (st_mode: its type and permissions)


def note(pids: Sequence[int]) -> list[Reopened]:
    """What the tree of ``pids`` (frozen: what it holds does not change) will have reopened:
    each path and each directory on the way to it, as the process sees it (through its root)."""
    seen: dict[str, Reopened] = {}
    for pid in pids:
        for path in filter(_by_name, _held(pid)):
            for at in (path, *(str(p) for p in PurePosixPath(path).parents[:-1])):
                if at in seen or len(seen) >= MOST:
                    continue
                try:
                    st = os.lstat(f"/proc/{pid}/root{at}")
                except OSError:
                    continue
                seen[at] = Reopened(at, st.st_uid, st.st_gid, st.st_mode)
    return sorted(seen.values(), key=lambda r: r.path)


def _held(pid: int) -> Iterator[str]:
    """What ``pid`` holds, as /proc names it: cwd, root, exe, mapped files, open descriptors."""
    for link in ("cwd", "root", "exe"):
        try:
            name = os.readlink(f"/proc/{pid}/{link}")
        except OSError:
            continue
        yield name
    yield from (fields[5] for fields in files.mappings(pid))
    yield from (link for _, link in proc.fd_links(pid))


def _by_name(path: str) -> bool:
    """Whether ``path`` names a file a restore finds by that name (not a deleted one, whose bytes
    CRIU keeps; not one of the kernel's; not a socket or pipe, which /proc names otherwise)."""
    if not path.startswith("/") or path.endswith(" (deleted)") or path == "/":
        return False
    return not path.startswith(_KERNELS) or path.startswith(_ANYONES)


def untrusted(noted: Sequence[Reopened], made: Collection[str], missing: Collection[str], node: str) -> list[str]:
    """One phrase for each noted path whose copy on this node is missing, or could have been put
    there by someone who could not have put it where it was dumped: a symlink where there was
    none, of another kind, owned by another than root or its owner there, writable by others,
    or by another group, than it was there (or a sticky directory that is not sticky here).
    Parents first.  ``made``: the paths the restore puts in place itself, with checks of its
    own (carried files, sockets); ``missing``: those it makes where missing (directories)."""
    out = []
    for was in noted:
        if was.path in made:
            continue
        try:
            st = os.lstat(was.path)
        except OSError:
            if was.path not in missing:
                out.append(f"{was.path} is not on {node}")
            continue
        here, there = _differs(was, st)
        if here:
            out.append(f"{was.path} {here} on {node}, {there} where it was dumped")
    return out


def _differs(was: Reopened, st: os.stat_result) -> tuple[str, str]:
    """What this node's copy is that the dumped one was not (nothing: the same, or safer)."""
    if stat.S_IFMT(st.st_mode) != stat.S_IFMT(was.mode):
        return f"is {_kind(st.st_mode)}", _kind(was.mode)
    if st.st_uid not in (0, was.uid):
        return f"belongs to UID {st.st_uid}", f"to UID {was.uid}"
    more = st.st_mode & _WRITERS & ~was.mode
    if more:
        return f"may be written to by {'anyone' if more & stat.S_IWOTH else 'its group'}", "not"
    if st.st_mode & stat.S_IWGRP and st.st_gid != was.gid:
        return f"may be written to by group {st.st_gid}", f"by group {was.gid}"
    if st.st_mode & _WRITERS and was.mode & stat.S_ISVTX and not st.st_mode & stat.S_ISVTX:
        return "is not sticky", "as it was"
    return "", ""


def _kind(mode: int) -> str:
    for test, name in (
        (stat.S_ISLNK, "a symbolic link"),
        (stat.S_ISDIR, "a directory"),
        (stat.S_ISREG, "a file"),
        (stat.S_ISFIFO, "a FIFO"),
        (stat.S_ISSOCK, "a socket"),
    ):
        if test(mode):
            return name
    return "a device"
