"""The regular files a process tree uses: what a migration must find on the target (shared
paths) or take along (the node's own files), and which of those cannot be taken."""

from __future__ import annotations

import os
import re
import stat
from collections.abc import Iterable, Sequence
from contextlib import suppress
from dataclasses import dataclass
from pathlib import Path

import psutil

from host import proc, safefs
from host.api import UsageError, shown

#: What the kernel makes, not files anyone puts in place (devices are root's; /dev/shm is not).
_KERNELS = ("/proc/", "/sys/", "/dev/")
_ANYONES = ("/dev/shm/",)
#: The name CRIU gives a relinked file beside where it was (``--link-remap``; criu/files-reg.c).
LINK_REMAP = re.compile(r"link_remap\.[0-9]+")


#: What /proc adds to the name of a file removed while in use.
DELETED = " (deleted)"


def removed(pid: int, via: str, name: str) -> bool:
    """Whether ``name``, what /proc shows for a file ``pid`` holds (reached through ``via``: its
    ``/proc/PID/fd/N`` or ``map_files`` entry), names a file since removed: it ends in the kernel's
    " (deleted)", and the name itself, as ``pid`` sees it, does not lead to that file (a live file
    may be named so; CRIU tells the two apart the same way)."""
    if not name.endswith(DELETED):
        return False
    try:
        held = os.stat(via)
        if not held.st_nlink:
            return True  # (no name leads to it: not looked up by one, which anyone could plant)
        named = os.stat(f"/proc/{pid}/root{name}")
    except OSError:
        return True
    return (named.st_dev, named.st_ino) != (held.st_dev, held.st_ino)


def open_in(tree: list[psutil.Process]) -> dict[str, bool]:
    """The regular files the tree has open or mapped shared, and whether it writes to each.

    A file mapped shared (``shm_open`` + ``mmap`` + ``close``, as C libraries do) has no fd
    left, only a line in /proc/PID/maps; CRIU needs it on the target as it needs an open one.
    Private mappings (libraries, the interpreter) are the node's own files, never carried; nor
    are the kernel's (/proc/PID/stat a sampler reads: CRIU opens it again by name)."""
    out: dict[str, bool] = {}
    for p in tree:
        try:
            for f in p.open_files():
                if not kernels(f.path):
                    out[f.path] = out.get(f.path, False) or f.mode != "r"
        except psutil.Error:
            continue
        for fields in mappings(p.pid):
            if (
                fields[1][3] != "s"
                or not fields[5].startswith("/")
                or removed(p.pid, f"/proc/{p.pid}/map_files/{fields[0]}", fields[5])
                or kernels(fields[5])
            ):
                continue  # (private, anonymous, or deleted: CRIU keeps its bytes, or names it again: Relinked)
            try:
                if not stat.S_ISREG(os.stat(fields[5]).st_mode):
                    continue  # (a device: /dev/nvidia*, /dev/zero)
            except OSError:
                continue
            out[fields[5]] = out.get(fields[5], False) or fields[1][1] == "w"
    return out


def kernels(path: str) -> bool:
    """Whether ``path`` is the kernel's (/proc, /sys, a device), no file of a node's to carry."""
    return path.startswith(_KERNELS) and not path.startswith(_ANYONES)


def under(path: str, tops: Iterable[str]) -> bool:
    """Whether ``path`` is one of ``tops`` or in one of them."""
    return any(path == t or path.startswith(t.rstrip("/") + "/") for t in tops)


def mappings(pid: int) -> list[list[str]]:
    """The fields of each of ``pid``'s mappings of a file (``/proc/PID/maps``: range, mode,
    offset, device, inode, path); none if it is gone."""
    try:
        maps = Path(f"/proc/{pid}/maps").read_text(errors="surrogateescape")
    except OSError:
        return []
    out = [fields for line in maps.splitlines() if len(fields := line.split(maxsplit=5)) == 6]
    for fields in out:
        if "\\012" in fields[5]:  # (a newline in a name, which maps escapes: its link says it whole)
            with suppress(OSError):
                fields[5] = os.readlink(f"/proc/{pid}/map_files/{fields[0]}")
    return out


def held(pid: int) -> list[tuple[str, str]]:
    """What ``pid`` holds open or mapped: a path that reaches each (``/proc/PID/fd/N``,
    ``/proc/PID/map_files/RANGE``) and the name /proc shows for it."""
    named = [(f"/proc/{pid}/fd/{fd}", link) for fd, link in proc.fd_links(pid)]
    return named + [(f"/proc/{pid}/map_files/{fields[0]}", fields[5]) for fields in mappings(pid)]


def uncarriable(paths: list[Path]) -> list[str]:
    """Why node-local files could not be taken along: the checks the post-dump hook makes as
    root when it archives them (no symlink on the path, the directory's owner), made now; and
    none is the kernel's (its "files" are no node's: /proc/1/status)."""
    out = []
    for path in paths:
        if kernels(str(path)):
            out.append(
                f"{shown(str(path))} is the kernel's (in /proc, /sys or /dev), no file of this node's to take along"
            )
            continue
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


def survey(tree: list[psutil.Process], on: Sequence[str]) -> tuple[tuple[str, ...], list[Path], list[str]]:
    """What a migration tells its target of the tree's open files (:func:`open_in`), and what it
    refuses: those on the shared paths ``on`` ("PATH:SIZE"; "PATH:*" for one the tree writes: it
    grows as it runs, the target checks only that it is there), the node-local ones it carries,
    and one sentence for each it could not (its name not UTF-8, no safe way to read it)."""
    found = open_in(tree)
    problems = unnamed(found)
    found = {f: w for f, w in found.items() if utf8(f)}
    shared = tuple(f"{f}:{'*' if w else size(f)}" for f, w in sorted(found.items()) if under(f, on))
    carry = sorted(Path(f) for f in found if not under(f, on))
    return shared, carry, [*problems, *uncarriable(carry)]


def unnamed(paths: Iterable[str]) -> list[str]:
    """One sentence for each file whose name is not UTF-8: a migration names the files it
    checks and carries to the target in UTF-8 (gRPC's strings), and could not name it."""
    return [
        f"the process has open {ascii(p)[1:-1]}, whose name is not UTF-8, which a migration cannot name to the "
        "target; rename it"
        for p in paths
        if not utf8(p)
    ]


def utf8(text: str) -> bool:
    """Whether ``text`` (a name read with surrogateescape) is UTF-8."""
    try:
        text.encode()
    except UnicodeEncodeError:
        return False
    return True


def size(path: str) -> int:
    """Its size now (0: gone, or not readable)."""
    try:
        return Path(path).stat().st_size
    except OSError:
        return 0


@dataclass(frozen=True)
class Relinked:
    """A file a process has open or mapped under a name that is gone while the file still has
    another (its link count is above 0): a POSIX semaphore as glibc makes one (created under a
    temporary name, linked to its own, the temporary one removed: every lock and queue of
    Python's spawn and forkserver multiprocessing), or a file linked elsewhere, then removed.
    CRIU dumps it by naming it again (``--link-remap``: ``link_remap.N`` beside where it was),
    as root; the restore opens that name, then removes it."""

    pid: int
    path: str  # the name it was opened under (DELETED taken off)
    dev: int
    ino: int


def relinked(pids: Sequence[int], named_so: bool = False) -> list[Relinked]:
    """The relinked files of the processes (:class:`Relinked`), each file and name once.  Its
    mappings are read through ``/proc/PID/map_files``, which only root may follow: others see
    only the descriptors.  ``named_so``: with the files whose live name ends as a removed one's
    does (its name may be removed before CRIU looks)."""
    out: dict[tuple[int, int, str], Relinked] = {}
    for pid in pids:
        for at, link in held(pid):
            gone = removed(pid, at, link)
            if not link.startswith("/") or not (gone or named_so and link.endswith(DELETED)):
                continue
            path = link.removesuffix(DELETED) if gone else link
            try:
                st = os.stat(at)
            except OSError:
                continue
            if stat.S_ISREG(st.st_mode) and st.st_nlink > 0:
                out.setdefault((st.st_dev, st.st_ino, path), Relinked(pid, path, st.st_dev, st.st_ino))
    return list(out.values())


def relink_refusals(pids: Sequence[int]) -> list[str]:
    """One sentence for each relinked file CRIU would name again, as root, in a directory a user
    could change meanwhile (redirect, with a symlink, where root writes): refused before anything
    is frozen.  /dev/shm and /tmp, root's and sticky, are safe."""
    out = []
    for r in relinked(pids, named_so=True):
        why = safefs.changeable_dir(Path(r.path).parent)
        if why:
            out.append(
                f"PID {r.pid} has {r.path} open under a name removed while the file still has another, and CRIU "
                f"would name it again in its directory, which {why}: root does not write there; keep such files "
                "in a directory only root can change (/dev/shm, /tmp)."
            )
    return out
