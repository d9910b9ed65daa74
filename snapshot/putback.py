"""What a restore makes on the node's disk before CRIU runs, and taking it back.

:func:`put_back` makes the directories the unix sockets are bound in and writes the carried
files back where they were (their archive: :data:`~snapshot.manifest.CARRIED_NAME`, in
``images/``), as root and through no symlink (:mod:`host.safefs`); :func:`take_back` removes
what it made should the restore fail.  :func:`note_created` writes down what the restore made
(and the sockets CRIU bound), so that :func:`take_back_created` can remove it should the copy
be dropped later::

    NOTE ::= JSON { "boot": str, "made": [ { "path": str, "dev": int, "ino": int, "uid": int } ] }
"""

from __future__ import annotations

import json
import logging
import os
import stat
import tarfile
from pathlib import Path

from host import proc, safefs, trusted, userdirs
from host.safefs import private_opener
from snapshot import leftovers, manifest
from snapshot.api import SnapshotError, SnapshotInvalid, ToolError
from snapshot.manifest import IMAGES_DIR, Manifest

log = logging.getLogger(__name__)


def put_back(directory: Path, m: Manifest, created: list[Path]) -> None:
    """Make the directories the unix sockets are bound in, where missing, and write the
    carried files back where they were, adding what it creates to ``created``.
    A file already there must hold the same bytes (the same file, or a copy): else the restore
    stops.  As root, on paths users may control: no symlink is followed, the directory must
    belong to root or to the file's owner, setuid/setgid are never restored (:mod:`host.safefs`)."""
    try:
        for b in m.sockets:
            userdirs.check_socket_path(Path(b.path), b.uid)
        for d in m.dirs:  # (for CRIU to bind the unix sockets in: root's until it has)
            safefs.make_dir(Path(d.path), created)
        _write_carried(directory, m, created)
        for path, other in sorted(m.links.items()):  # (CRIU's names of relinked files: it opens them)
            safefs.link_back(Path(path), Path(other), created)
        for d in m.dirs:  # (CRIU checks a restored working directory's whole mode: root's, others may not write)
            if Path(d.path) in created:
                safefs.hand_over(Path(d.path), 0, 0, d.mode & ~0o002)
    except (OSError, tarfile.TarError) as e:
        what = getattr(e, "filename", None) or directory / IMAGES_DIR / manifest.CARRIED_NAME
        raise ToolError(
            f"putting back the files the process had open failed at {what}",
            detail=getattr(e, "strerror", None) or str(e),
        ) from e


def _write_carried(directory: Path, m: Manifest, created: list[Path]) -> None:
    """Write the carried files back, once the archive is checked whole: the files the manifest
    names, each (a directory made on the way to one must be its owner's or root's)."""
    if not m.carried:
        return
    wanted = {p.lstrip("/"): Path(p) for p in m.carried}
    with tarfile.open(directory / IMAGES_DIR / manifest.CARRIED_NAME) as tar:
        members = tar.getmembers()
        for member in members:
            path = wanted.get(member.name)
            if path is None or not member.isfile():
                raise SnapshotInvalid(
                    f"{directory}'s carried files hold {member.name!r}, which the manifest does not name."
                )
            if any(str(path).startswith(d.path + "/") and d.uid not in (0, member.uid) for d in m.dirs):
                raise SnapshotInvalid(f"{directory}'s manifest gives a directory on the way to {path} to another user.")
        if lacking := sorted(str(wanted[n]) for n in set(wanted) - {mb.name for mb in members}):
            raise SnapshotInvalid(f"{directory}'s carried files lack {', '.join(lacking)}.")  # (no owner vouched)
        for member in members:
            path = wanted[member.name]
            source = tar.extractfile(member)
            assert source is not None  # (a regular file: checked above)
            if safefs.write_file(
                path, source, member.uid, member.gid, member.mode, member.mtime, created, leftovers.left_behind
            ):
                log.info("%s replaced the stale copy a migration from this node had left behind", path)
            leftovers.forget(path)  # (what is there now is the process's own file again)


def identities(created: list[Path]) -> dict[Path, tuple[int, int, int]]:
    """What :func:`put_back` made, each as it is now (device, inode, owner): read once it is done
    (root's, or its file's owner's, in a directory of root's or of that owner's)."""
    out = {}
    for path in created:
        try:
            st = os.lstat(path)
        except OSError:
            continue
        out[path] = (st.st_dev, st.st_ino, st.st_uid)
    return out


def take_back(created: list[Path], made: dict[Path, tuple[int, int, int]]) -> None:
    """Remove what :func:`put_back` created (files, then the directories it made), each only if it
    is still that very one (``made``: :func:`identities`): its owner may have put another in its
    place since, or replaced it and left the name to someone else, in a shared directory."""
    for path in reversed(created):
        try:
            if path in made and not userdirs.remove_same(path, made[path]):
                log.warning("left %s, which the restore had put back: another is there now, or it is not empty", path)
        except (OSError, SnapshotError) as e:  # (a directory someone has since put files in)
            log.warning("could not remove %s, which the restore had put back: %s", path, e)


def note_created(note: Path, made: list[Path], sockets: list[manifest.BoundSocket]) -> None:
    """Write down ``made`` (the directories and files a restore made, in that order) and the
    ``sockets`` CRIU bound, each as it is now (device, inode, owner; a socket only if it is
    its owner's), with this boot's id: after a reboot, inode numbers on a tmpfs start again."""
    entries = []
    for path, uid in [*((p, None) for p in made), *((Path(b.path), b.uid) for b in sockets)]:
        try:
            st = os.lstat(path)
        except OSError:
            continue
        if uid is None or (stat.S_ISSOCK(st.st_mode) and st.st_uid == uid):
            entries.append({"path": str(path), "dev": st.st_dev, "ino": st.st_ino, "uid": st.st_uid})
    tmp = note.with_name(f".{note.name}.{os.getpid()}")
    with open(tmp, "w", opener=private_opener) as f:
        json.dump({"boot": proc.boot_id(), "made": entries}, f)
    tmp.rename(note)


def take_back_created(note: Path) -> list[str]:
    """Remove what the restore noted in ``note`` made (its copy was dropped: the files, sockets
    and directories it would have found), each only if it is still that very one (a directory
    only once empty), the last made first; the paths removed."""
    if not os.path.lexists(note):
        return []  # (the restore never got so far: it took back what it made itself)
    try:
        entries = json.loads(trusted.read_private_file(note, "the note of what a restore made"))
    except (OSError, ValueError, SnapshotError) as e:
        log.warning("could not read %s: what the dropped copy's restore made is left: %s", note, e)
        return []
    if not isinstance(entries, dict) or entries.get("boot") != proc.boot_id():
        return []  # (made before a reboot: gone with a tmpfs, or another file by now)
    made = entries.get("made")
    removed = []
    for entry in reversed(made if isinstance(made, list) else []):
        try:
            path = Path(str(entry["path"]))
            if userdirs.remove_same(path, (int(entry["dev"]), int(entry["ino"]), int(entry["uid"]))):
                removed.append(str(path))
        except (KeyError, TypeError, ValueError, OSError, SnapshotError) as e:
            log.warning("could not remove %r, which a dropped copy's restore had made: %s", entry, e)
    return removed
