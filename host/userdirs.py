"""What root does, on a user's behalf, at paths in directories users can reach when it binds or
removes something there: the way to a unix socket CRIU binds by name as root
(:func:`check_socket_path`), and removing, through no symlink, only that very file, socket or
empty directory (:func:`remove_socket`, :func:`remove_same`, :func:`remove`).  The walks are
:mod:`host.safefs`'s."""

from __future__ import annotations

import errno
import os
import stat
from collections.abc import Callable
from pathlib import Path

from host.api import UsageError
from host.safefs import DIR_FLAGS, open_dir, step_failed


def _protected_symlinks() -> bool:
    try:
        return Path("/proc/sys/fs/protected_symlinks").read_text().strip() == "1"
    except OSError:
        return False


def _way_refused(st: os.stat_result, at: Path, path: Path) -> UsageError | None:
    if st.st_uid != 0:
        return UsageError(
            f"{at}, on the way to the socket {path}, belongs to UID {st.st_uid}, who could change the way while CRIU "
            "binds the socket there as root; if it is a stale one (a copy of the process ran here), remove it."
        )
    if st.st_mode & 0o022 and not (st.st_mode & stat.S_ISVTX and _protected_symlinks()):
        return UsageError(
            f"{at}, on the way to the socket {path}, may be written by other users (not sticky, or "
            "fs.protected_symlinks is off), who could change the way while CRIU binds the socket there as root."
        )
    return None


def check_socket_path(path: Path, uid: int) -> None:
    """Refuse a restore in which CRIU, as root and by name, would bind a socket of ``uid`` at
    ``path`` (removing a socket file it finds there, then giving the new one its owner and
    mode) where anyone but root could change the way meanwhile: each directory on the way that
    exists must be root's, and one that others may write in sticky with fs.protected_symlinks
    on (/tmp); those missing are made root's until CRIU is done (:func:`make_dir`).  Nor may a
    socket of another user be at ``path``.  A socket of root's is root's affair: not checked."""
    if uid == 0:
        return
    fd = os.open("/", DIR_FLAGS)
    at = Path("/")
    try:
        for name in path.parts[1:-1]:
            refused = _way_refused(os.fstat(fd), at, path)
            if refused is not None:
                raise refused
            at = at / name
            try:
                child = os.open(name, DIR_FLAGS, dir_fd=fd)
            except FileNotFoundError:
                return  # (the rest is made, root's while CRIU binds)
            except OSError as e:
                raise step_failed(e, fd, name, at, path, None) from e
            os.close(fd)
            fd = child
        refused = _way_refused(os.fstat(fd), at, path)
        if refused is not None:
            raise refused
        try:
            st = os.stat(path.name, dir_fd=fd, follow_symlinks=False)
        except FileNotFoundError:
            return
    finally:
        os.close(fd)
    if stat.S_ISSOCK(st.st_mode) and st.st_uid != uid:
        raise UsageError(
            f"{path} is a socket of UID {st.st_uid} on this node, where the process (UID {uid}) had a socket of its "
            "own; restoring it would replace that one, so it is not restored here."
        )


def remove_socket(path: Path, uid: int, ident: tuple[int, int, int] | None = None) -> bool:
    """Remove the socket file ``path`` (reached through no symlink) if it is one of ``uid``'s
    (and, given ``ident``, that very file: its device, inode and change time, as an inode
    number is soon reused)."""
    return _remove_if(
        path,
        lambda st: (
            stat.S_ISSOCK(st.st_mode) and st.st_uid == uid and ident in (None, (st.st_dev, st.st_ino, st.st_ctime_ns))
        ),
    )


def remove_same(path: Path, ident: tuple[int, int, int]) -> bool:
    """Remove ``path`` (a file, a socket, an empty directory; reached through no symlink) if it
    is that very one: its device, inode and owner."""
    return path.is_absolute() and _remove_if(path, lambda st: (st.st_dev, st.st_ino, st.st_uid) == ident)


def _remove_if(path: Path, wanted: Callable[[os.stat_result], bool]) -> bool:
    """Remove ``path`` (reached through no symlink) if its lstat is ``wanted``; whether it did
    (not: gone, another file, a directory not empty)."""
    try:
        parent = open_dir(path.parent, to=path)
    except (FileNotFoundError, UsageError):
        return False
    try:
        st = os.stat(path.name, dir_fd=parent, follow_symlinks=False)
        if not wanted(st):
            return False
        if stat.S_ISDIR(st.st_mode):
            os.rmdir(path.name, dir_fd=parent)
        else:
            os.unlink(path.name, dir_fd=parent)
        return True
    except FileNotFoundError:
        return False
    except OSError as e:
        if e.errno in (errno.ENOTEMPTY, errno.EEXIST):
            return False
        raise
    finally:
        os.close(parent)


def remove_dir(path: Path, uid: int) -> bool:
    """Remove the directory ``path`` if it is one (not a symlink to one, nor a file), of ``uid``'s,
    and empty, reached without following any symlink; whether it was."""
    parent = open_dir(path.parent)
    try:
        st = os.stat(path.name, dir_fd=parent, follow_symlinks=False)
        if not stat.S_ISDIR(st.st_mode) or st.st_uid != uid:
            return False  # (another's now, or a file: never removed)
        os.rmdir(path.name, dir_fd=parent)
        return True
    finally:
        os.close(parent)
