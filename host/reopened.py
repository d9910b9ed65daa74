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

It notes too the locks the tree holds on each (flock, fcntl, OFD): CRIU takes them again as it
restores, and waits for ever, saying nothing, behind another process that holds one here (the
original left running, a second instance that took it once the original was ended).  The restore
refuses such a copy in one sentence instead (:func:`locked`).
"""

from __future__ import annotations

import os
import re
import stat
from collections.abc import Collection, Iterator, Mapping, Sequence
from contextlib import suppress
from dataclasses import dataclass
from pathlib import PurePosixPath

from host import files, proc
from host.api import shown

#: The paths noted at most (each directory on the way counts): a bound on a manifest's size.
MOST = 100_000
#: The locks noted at most on one path (many readers of an LMDB each lock a byte of its own):
#: one past them, if another process here holds it, CRIU waits for until its restore times out.
LOCKS_MOST = 64
_WRITERS = 0o022
_LOCK = r"(?:FLOCK|POSIX|OFDLCK) (?:READ|WRITE) \d{1,20} (?:\d{1,20}|EOF)"
_LOCKS = re.compile(rf"(?:{_LOCK}(?:, {_LOCK}){{0,{LOCKS_MOST - 1}}})?")


@dataclass(frozen=True)
class Reopened:
    """A path a restore opens again by name (or a directory on the way to one), as it was where
    the tree was dumped."""

    path: str
    uid: int
    gid: int
    mode: int  # (st_mode: its type and permissions)
    #: The locks the tree held on it: ``KIND MODE START END`` each (:func:`host.proc.fd_locks`),
    #: joined by ", " ("": none).
    lock: str = ""
    #: 1: only a directory on the way to a file the tree had removed, which CRIU makes where it is
    #: missing (to put the file back and remove it again; then it removes the directory too).
    removed: int = 0

    def valid(self) -> bool:
        """Whether its fields are in their bounds (it is read from a manifest)."""
        bounded = min(self.uid, self.gid) >= 0 and 0 <= self.mode < 1 << 32 and self.removed in (0, 1)
        return bounded and bool(_LOCKS.fullmatch(self.lock))


def note(pids: Sequence[int]) -> list[Reopened]:
    """What the tree of ``pids`` (frozen: what it holds does not change) will have reopened:
    each path and each directory on the way to it, as the process sees it (through its root)."""
    seen: dict[str, Reopened] = {}
    links = {pid: proc.fd_links(pid) for pid in pids}
    locks: dict[str, list[str]] = {}  # (of every process first: one that holds the path lock-free may come first)
    for pid, fds in links.items():
        for fd, path in fds:
            if _by_name(pid, f"/proc/{pid}/fd/{fd}", path) and (held := proc.fd_locks(pid, fd)):
                known = locks.setdefault(path, [])
                known += [h for h in held if h not in known][: LOCKS_MOST - len(known)]
    for pid in pids:
        for via, name in _held(pid, links[pid]):
            ways, removed = _on_the_way(pid, via, name)
            for at in ways:
                noted = seen.get(at)
                if (noted.removed <= removed) if noted else len(seen) >= MOST:
                    continue
                try:
                    st = os.lstat(f"/proc/{pid}/root{at}")
                except OSError:
                    continue
                seen[at] = Reopened(at, st.st_uid, st.st_gid, st.st_mode, ", ".join(locks.get(at, ())), removed)
    return sorted(seen.values(), key=lambda r: r.path)


def _held(pid: int, fds: list[tuple[str, str]]) -> Iterator[tuple[str, str]]:
    """What ``pid`` holds: a /proc path that reaches each (cwd, root, exe, mapped files, open
    descriptors: ``fds``, :func:`host.proc.fd_links`, read once) and the name /proc gives it."""
    for link in ("cwd", "root", "exe"):
        try:
            name = os.readlink(f"/proc/{pid}/{link}")
        except OSError:
            continue
        yield f"/proc/{pid}/{link}", name
    yield from ((f"/proc/{pid}/map_files/{fields[0]}", fields[5]) for fields in files.mappings(pid))
    yield from ((f"/proc/{pid}/fd/{fd}", link) for fd, link in fds)


def _on_the_way(pid: int, via: str, name: str) -> tuple[list[str], int]:
    """The paths a restore reaches by name for what ``pid`` holds as ``name``: the file and each
    directory on the way to it; for a removed file, whose bytes CRIU keeps and puts back in its
    directory under its old name (then removes it), each directory on the way to it (and 1)."""
    if _by_name(pid, via, name):
        return [name, *(str(p) for p in PurePosixPath(name).parents[:-1])], 0
    if _ghost(pid, via, name):
        return [str(p) for p in PurePosixPath(name.removesuffix(files.DELETED)).parents[:-1]], 1
    return [], 0


def _ghost(pid: int, via: str, name: str) -> bool:
    """Whether ``name`` is a removed file of a node's, not one of the kernel's (memory, a device)."""
    return name.startswith("/") and not files.kernels(name) and files.removed(pid, via, name)


def _by_name(pid: int, via: str, name: str) -> bool:
    """Whether ``name``, what /proc calls a file ``pid`` holds (reached through ``via``), is one a
    restore finds by that name (not a removed one, whose bytes CRIU keeps; not one of the
    kernel's; not a socket or pipe, which /proc names otherwise)."""
    if not name.startswith("/") or name == "/" or files.removed(pid, via, name):
        return False
    return not files.kernels(name)


def untrusted(
    noted: Sequence[Reopened],
    made: Collection[str],
    missing: Collection[str],
    node: str,
    seen: dict[str, tuple[int, int]] | None = None,
) -> list[str]:
    """One phrase for each noted path whose copy on this node is missing, or could have been put
    there by someone who could not have put it where it was dumped: a symlink where there was
    none, of another kind, owned by another than root or its owner there, writable by others,
    or by another group, than it was there (or a sticky directory that is not sticky here).
    Parents first.  ``made``: the paths the restore puts in place itself, with checks of its
    own (carried files, sockets); ``missing``: those it makes where missing (directories).
    ``seen``: filled with each one trusted, by its device and inode as checked (:func:`strangers`)."""
    out = []
    for was in noted:
        if was.path in made:
            continue
        try:
            st = os.lstat(was.path)
        except OSError:
            if was.path not in missing and not was.removed:
                out.append(f"{was.path} is not on {node}")
            continue
        here, there = _differs(was, st)
        if here:
            out.append(f"{was.path} {here} on {node}, {there} where it was dumped")
        elif seen is not None:
            seen[was.path] = (st.st_dev, st.st_ino)
    return out


def strangers(pids: Sequence[int], known: Mapping[str, tuple[int, int]], criu: Sequence[str] = ()) -> list[str]:
    """One phrase for each restored process (``pids``, still stopped) that holds a file or
    directory by a name ``known`` lacks (path -> device and inode, as checked before CRIU opened
    it by that name), or another than the one checked: CRIU opened it as root, by name, and the
    name led elsewhere (a directory its owner swapped for a symlink since the check, a name
    renamed as the tree was frozen); a removed file put back, and removed again, in another
    directory than the one checked.  The kernel's files and memory are not named, nor, in a
    tree CRIU still holds, what it holds there itself (``criu``: those paths and what is in them)."""
    out = []
    for pid in pids:
        for via, name in _restored(pid):
            if name.startswith("/memfd:") or any(name == c or name.startswith(c + "/") for c in criu):
                continue
            if _by_name(pid, via, name):
                at = name
            elif _ghost(pid, via, name) and (at := os.path.dirname(name)) != "/":
                pass  # (its directory, as checked: lstat)
            else:
                continue
            try:
                st = os.stat(via) if at == name else os.lstat(at)
            except OSError:
                continue
            if known.get(at) != (st.st_dev, st.st_ino):
                out.append(f"PID {pid} holds {shown(name)}")
                break
    return out


def _restored(pid: int) -> Iterator[tuple[str, str]]:
    """What ``pid`` holds: a /proc path that reaches each (its root, working directory and
    executable, descriptors and mapped files) and the name the kernel gives it, unescaped."""
    entries = [f"/proc/{pid}/{link}" for link in ("root", "cwd", "exe")]
    entries += [f"/proc/{pid}/fd/{fd}" for fd, _ in proc.fd_links(pid)]
    with suppress(OSError):
        entries += [f"/proc/{pid}/map_files/{r}" for r in os.listdir(f"/proc/{pid}/map_files")]
    for via in entries:
        try:
            yield via, os.readlink(via)
        except OSError:
            continue


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


#: A lock /proc/locks lists (not a waiter's, "N: -> ..."): KIND ADVISORY|MANDATORY MODE PID
#: MAJOR:MINOR:INODE (hex, hex, decimal) START END.
_HELD = re.compile(
    r"\d+: (FLOCK|POSIX|OFDLCK)\s+\S+\s+(READ|WRITE)\s+(-?\d+)\s+([0-9a-f]+):([0-9a-f]+):(\d+)\s+(\d+)\s+(\d+|EOF)"
)
#: Lock kinds that wait for each other: flock with flock; fcntl (POSIX) and OFD with either.
_FAMILY = {"FLOCK": "flock", "POSIX": "fcntl", "OFDLCK": "fcntl"}
_ALL = 1 << 64


def locked(noted: Sequence[Reopened], node: str, skip: Collection[str] = ()) -> list[str]:
    """One phrase for each noted file (but those in ``skip``: files the restore puts in place
    anew) that another process here holds a lock on that conflicts with one the tree held, CRIU
    would wait for it.  Read from /proc/locks: nothing is opened, and no lock is taken."""
    try:
        with open("/proc/locks") as f:
            held = [m for m in map(_HELD.match, f) if m]
    except OSError:
        return []
    out = []
    for was in noted:
        if not was.lock or was.path in skip:
            continue
        try:
            st = os.stat(was.path)
        except OSError:
            continue  # (a missing one is untrusted()'s to say)
        key = (os.major(st.st_dev), os.minor(st.st_dev), st.st_ino)
        theirs = [h for h in held if (int(h[4], 16), int(h[5], 16), int(h[6])) == key]
        for lock in was.lock.split(", "):
            kind, mode, start, end = lock.split()
            hit = next((h for h in theirs if _conflicts(kind, mode, int(start), _end(end), h)), None)
            if hit is not None:
                holder = f"PID {hit[3]}" if int(hit[3]) > 0 and hit[1] != "FLOCK" else "another process"
                out.append(f"{was.path} is locked by {holder} on {node} ({kind} {mode}, as the tree held it)")
                break
    return out


def _end(end: str) -> int:
    return _ALL if end == "EOF" else int(end)


def _conflicts(kind: str, mode: str, start: int, end: int, held: re.Match[str]) -> bool:
    """Whether a ``kind`` lock (``mode`` READ or WRITE) of bytes ``start``..``end`` would wait
    for the lock ``held`` (a line of /proc/locks)."""
    if _FAMILY[kind] != _FAMILY[held[1]] or "WRITE" not in (mode, held[2]):
        return False
    return kind == "FLOCK" or (start <= _end(held[8]) and int(held[7]) <= end)
