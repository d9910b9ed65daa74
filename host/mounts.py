"""The mounts of a workload's mount namespace.  A `tpagent launch` workload's namespace is a copy
of its node's mounts as they were when it started: CRIU declares them external as it dumps and
binds each back at its path on the node it restores on, failing the restore where that path is
missing there (a container's overlay, a pod's volume, a session's /run/user/UID, on the source
only).  A migration leaves out of its dump those the target lacks that the tree holds nothing
in (CRIU's ``--skip-mnt``): the copy finds nothing at their paths, as anything on the target."""

from __future__ import annotations

import os
import re
from collections.abc import Iterable, Sequence

from host import files, proc
from host.api import shown

#: The most mount points a migration offer names (a node running many containers has
#: thousands), and the longest path taken of one.
MOST = 20_000
LONGEST = 4096


def _unescaped(field: bytes) -> str:
    """A mountinfo path field as a path: the kernel writes space, tab, newline and backslash as
    octal escapes (``\\040``)."""
    return os.fsdecode(re.sub(rb"\\([0-7]{3})", lambda m: bytes([int(m.group(1), 8) & 0xFF]), field))


def points(pid: int) -> list[str]:
    """The mount points of ``pid``'s mount namespace but its root, in mount order (none if the
    process is gone)."""
    try:
        with open(f"/proc/{pid}/mountinfo", "rb") as f:
            return points_of(f.read())
    except OSError:
        return []


def points_of(mountinfo: bytes) -> list[str]:
    """The mount points a /proc/PID/mountinfo text names but the root, each once, in order."""
    out: dict[str, None] = {}
    for line in mountinfo.splitlines():
        fields = line.split(b" ", 5)
        if len(fields) > 4 and (path := _unescaped(fields[4])) != "/":
            out[path] = None
    return list(out)


def absent(paths: Iterable[str]) -> list[str]:
    """Those of ``paths`` (absolute, at most :data:`MOST`, each at most :data:`LONGEST` long)
    that name nothing on this node, where CRIU could not bind a mount back."""
    return [p for p in list(paths)[:MOST] if p.startswith("/") and len(p) <= LONGEST and not os.path.lexists(p)]


def used(pids: Sequence[int]) -> set[str]:
    """The paths the tree holds: each process's root, working directory and executable, the
    files it has open and those it maps (as /proc names them, in its mount namespace)."""
    out: set[str] = set()
    for pid in pids:
        for link in ("root", "cwd", "exe"):
            try:
                out.add(os.readlink(f"/proc/{pid}/{link}"))
            except OSError:
                continue
        out.update(name for _, name in proc.fd_links(pid) if name.startswith("/"))
        out.update(fields[5] for fields in files.mappings(pid) if fields[5].startswith("/"))
    return {p.removesuffix(" (deleted)") for p in out}


def left_out(mounted: Sequence[str], missing: Iterable[str], held: Iterable[str]) -> list[str]:
    """The mounts of ``mounted`` a dump leaves out so that it restores on a node that lacks
    ``missing``: each missing one the tree holds nothing in (``held``: :func:`used`), and every
    mount beneath it (CRIU refuses to dump a mount whose parent it was told to skip)."""
    held = list(held)
    tops = [m for m in set(missing) & set(mounted) if not any(files.under(p, [m]) for p in held)]
    return [m for m in mounted if files.under(m, tops)]


def for_node(
    mounted: Sequence[str], missing: Iterable[str], held: Iterable[str], carried: Iterable[str], node: str
) -> tuple[list[str], list[str], str]:
    """What a dump of a tree whose namespace has ``mounted`` does for ``node``, which lacks
    ``missing``: the mounts it leaves out (:func:`left_out`); one sentence for each missing mount
    the tree holds a path in that will not be there (anything but a file it carries, whose
    directories are made as it is put back); and what is said of those left out ("": none)."""
    held = set(held)
    skip = left_out(mounted, missing, held)
    tops = [m for m in mounted if m in set(missing)]
    stuck = []
    for m in (m for m in tops if m not in skip):
        lost = sorted(p for p in held if files.under(p, [m]) and p not in set(carried))
        if lost:
            stuck.append(
                f"the process holds {shown(lost[0])} in the mount at {shown(m)}, which {node} lacks: its copy "
                "could not find it there"
            )
    gone = [m for m in tops if m in skip]
    said = ""
    if gone:
        more = f" and {len(gone) - 3} more" if len(gone) > 3 else ""
        said = (
            f"the copy goes without {len(gone)} mount(s) of the process's namespace that {node} lacks and the process "
            f"holds nothing in ({', '.join(map(shown, gone[:3]))}{more}): it finds nothing at their paths there"
        )
    return skip, stuck, said
