"""Paths a root process uses on a user's behalf, checked against planted directories and symlinks.

tpagent runs as root on nodes that other users share.  Every directory it writes into is one
it created itself with mode 0700, or an existing one of its own (owned by the user running
tpagent, writable by no one else, or else empty; made 0700 before use) reached through
directories no other user can change and no symlink but root's: a directory planted by
someone else (their own ``log/`` swapped in, say) is refused in one sentence.  Secrets and
private keys are read only from files private to the same user.

Carried files (what a checkpointed process had open, taken along in its snapshot) are read
by the dump and written back by the restore, both as root, along a path that a user may
control: it is walked from "/" one directory fd at a time with O_NOFOLLOW, so no symlink on
it is ever followed, and the file's directory must belong to root or to the file's owner.
A file put back is created anew (O_EXCL) and handed to its owner before it gets its mode,
which never includes setuid/setgid bits.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import shutil
import stat
from collections.abc import Callable
from pathlib import Path
from typing import IO

from host.api import UsageError

log = logging.getLogger(__name__)

PRIVATE = 0o700
DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC


def _changeable_by_others(st: os.stat_result) -> bool:
    """A directory whose entries someone else could replace: not root's or ours, or writable
    by group or others without the sticky bit (in /tmp, /dev/shm others add names, but
    cannot move ours)."""
    writable = st.st_mode & (stat.S_IWGRP | stat.S_IWOTH)
    return st.st_uid not in (0, os.geteuid()) or bool(writable and not st.st_mode & stat.S_ISVTX)


def _unsafe(at: Path, st: os.stat_result, path: Path) -> UsageError:
    return UsageError(
        f"{at} can be changed by other users (owner UID {st.st_uid}, mode {stat.S_IMODE(st.st_mode):o}), so {path} "
        "under it is not safe for tpagent to use; give a path in a directory only root can change."
    )


def safe_ancestors(path: Path) -> None:
    """Nobody but root (or us) can replace any existing directory on the way to ``path``
    (symlinks: root's only, see :func:`trusted_realpath`)."""
    real = trusted_realpath(path.parent)
    for ancestor in [real, *real.parents]:
        try:
            st = os.stat(ancestor)
        except FileNotFoundError:
            continue
        if _changeable_by_others(st):
            raise _unsafe(ancestor, st, path)


def _open_private_dir(at: Path, path: Path, empty: bool, created: bool, dir_fd: int) -> int:
    """An fd of ``at`` (in ``dir_fd``): a real directory of ours nobody else could have written to
    (``created``: made here), and empty if ``empty``; made 0700 if looser only if empty or made here
    (one holding others' files, /dev or /var/lib given as a parent, keeps its mode)."""
    try:
        fd = os.open(at.name, DIR_FLAGS, dir_fd=dir_fd)
    except OSError as e:
        if e.errno in (errno.ENOTDIR, errno.ELOOP):
            raise UsageError(f"{at} exists and is not a directory; give a new directory.") from e
        raise
    st = os.fstat(fd)
    if st.st_uid != os.geteuid() or (st.st_mode & 0o022 and not created):
        os.close(fd)
        raise UsageError(
            f"{at} already exists with owner UID {st.st_uid} and mode {stat.S_IMODE(st.st_mode):o}; tpagent only uses "
            "a directory of its own that no one else could write to (they could plant files in it): "
            "remove it or give a new one."
        )
    if empty and os.listdir(fd):  # (first: a directory refused is left as it was, /etc's mode too)
        os.close(fd)
        raise UsageError(f"output directory {path} is not empty; give an empty or new directory.")
    if stat.S_IMODE(st.st_mode) != PRIVATE and (empty or created):
        try:
            os.fchmod(fd, PRIVATE)  # ours (no one else may write in it): shut (the umask may have taken bits too)
        except OSError as e:
            os.close(fd)
            raise UsageError(f"{at} cannot be made private ({e.strerror}); give a new directory.") from e
    return fd


def private_dir(path: Path, empty: bool = False, create: bool = True) -> Path:
    """Create ``path`` (and any missing parents) with mode 0700, or accept an existing one
    only if it is a real directory of ours that nobody else could have written to (an empty
    one made 0700 if looser) and empty where ``empty`` says, every directory on the way being one no other
    user can change.  The path is walked from "/" one directory fd at a time, each component
    checked (or created) under the fd of its checked parent: nobody can slip a directory of
    theirs in between.  ``create`` False: only check what exists (a refusal before anything
    is done).  Returns the path, made absolute, root's symlinks resolved."""
    real = trusted_realpath(Path(os.path.abspath(path)))
    if real == Path("/"):  # (no component to check: the root is nobody's private directory)
        raise UsageError("/ cannot be a private directory; give a new directory.")
    fd = os.open("/", DIR_FLAGS)
    try:
        at = Path("/")
        for i, name in enumerate(real.parts[1:], start=1):
            at = at / name
            last = i == len(real.parts) - 1
            made = False
            try:
                os.stat(name, dir_fd=fd, follow_symlinks=False)
            except FileNotFoundError:
                if not create:
                    return real  # (made, as ours, when it is needed)
                try:
                    os.mkdir(name, PRIVATE, dir_fd=fd)
                    made = True
                except FileExistsError:
                    pass  # someone was quicker: checked like any existing directory
                except OSError as e:
                    raise UsageError(f"cannot create {at}: {e.strerror}.") from e
            if last or made:
                child = _open_private_dir(at, real, empty and last, made, fd)
            else:
                try:
                    child = os.open(name, DIR_FLAGS, dir_fd=fd)
                except OSError as e:
                    raise UsageError(
                        f"{at} is not a directory (or is a symlink); give a path through real directories."
                    ) from e
                st = os.fstat(child)
                if _changeable_by_others(st):
                    os.close(child)
                    raise _unsafe(at, st, real)
            os.close(fd)
            fd = child
    finally:
        os.close(fd)
    return real


def trusted_realpath(path: Path, hops: int = 40) -> Path:
    """``path`` with its symlinks resolved, each of which must belong to root (as a Kubernetes
    Secret volume's ``tls.key -> ..data/tls.key`` chain does); a user's symlink is refused.
    What does not exist yet is kept as it is."""
    todo = list(Path(os.path.abspath(path)).parts[1:])
    at = Path("/")
    while todo:
        name = todo.pop(0)
        nxt = at.parent if name == ".." else at / name
        try:
            st = os.lstat(nxt)
        except FileNotFoundError:
            return nxt.joinpath(*todo)  # (the rest does not exist yet: no symlink there)
        except NotADirectoryError as e:
            raise UsageError(f"{at} is not a directory, so {path} cannot be under it; give another path.") from e
        if not stat.S_ISLNK(st.st_mode):
            at = nxt
            continue
        hops -= 1
        if st.st_uid != 0 or hops < 0:
            raise UsageError(
                f"{nxt} is a symlink owned by UID {st.st_uid} (or one of too many); give the file's real path."
            )
        target = Path(os.readlink(nxt))
        todo = [*target.parts[1 if target.is_absolute() else 0 :], *todo]
        at = Path("/") if target.is_absolute() else at
    return at


def private_opener(path: str, flags: int) -> int:
    """``open(path, mode, opener=private_opener)``: a new file is 0600 whatever the umask,
    and the last component is never a symlink."""
    return os.open(path, flags | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)


# Carried files: what a process had open, read (dump) and written back (restore) by root.
# Every path is walked from "/" one component at a time with O_NOFOLLOW, so no symlink is
# ever followed, and each step acts on the directory fd it reached, not on a name again.

#: A directory the restore creates on the way to a carried file (as root's ``mkdir -p``).
CREATED_DIR = 0o755
_CHUNK = 1 << 20


def _symlink_refused(at: Path, path: Path) -> UsageError:
    where = "" if at == path else f" on the way to {path}"
    return UsageError(
        f"{at} is a symlink{where}, and tpagent (as root) follows no symlink to a file it carries: "
        "use the file's real path, or remove the link."
    )


def step_failed(e: OSError, dir_fd: int, name: str, at: Path, path: Path, exists: OSError | None) -> Exception:
    """The error for a component ``name`` that O_NOFOLLOW|O_DIRECTORY would not open."""
    if e.errno in (errno.ENOTDIR, errno.ELOOP):
        try:
            is_link = stat.S_ISLNK(os.stat(name, dir_fd=dir_fd, follow_symlinks=False).st_mode)
        except OSError:
            is_link = False
        if is_link:
            return _symlink_refused(at, path)
        if exists is not None:  # a file where a directory must be created: what mkdir said
            return OSError(exists.errno, exists.strerror, str(at))
    return OSError(e.errno, e.strerror, str(at))


def open_dir(path: Path, created: list[Path] | None = None, to: Path | None = None) -> int:
    """An fd of the directory ``path`` (absolute, normalised), reached from "/" without
    following any symlink (one on the way raises UsageError, naming the file ``to`` if given).
    Without ``created`` a missing component raises FileNotFoundError; with it, each missing
    one is made as root's ``mkdir -p`` would (owned by us, mode 755, never by a user) and
    appended to it."""
    fd = os.open("/", DIR_FLAGS)
    at = Path("/")
    try:
        for name in path.parts[1:]:
            at = at / name
            if name in (".", ".."):
                raise UsageError(f"{path} is not a normalised absolute path.")
            exists = None
            made = False
            if created is not None:
                try:
                    os.mkdir(name, CREATED_DIR, dir_fd=fd)
                except FileExistsError as e:
                    exists = e
                except OSError as e:
                    raise OSError(e.errno, e.strerror, str(at)) from e
                else:
                    made = True
                    created.append(at)
            try:
                child = os.open(name, DIR_FLAGS, dir_fd=fd)
            except OSError as e:
                raise step_failed(e, fd, name, at, to or path, exists) from e
            os.close(fd)
            fd = child
            if made:
                os.fchmod(fd, CREATED_DIR)  # exactly 755: the umask may take bits, a setgid parent add one
    except BaseException:
        os.close(fd)
        raise
    return fd


def changeable_dir(path: Path) -> str:
    """How a user could change what the directory ``path`` (absolute) holds under a root that
    writes a name into it ("" if none can): a symlink on the way, a directory on the way that is
    another user's, or one writable by others without the sticky bit; or it is gone."""
    at = Path("/")
    for name in ("", *path.parts[1:]):
        at = at / name
        try:
            st = os.lstat(at)
        except OSError as e:
            return f"cannot be looked at ({at}: {e.strerror})"
        if not stat.S_ISDIR(st.st_mode):
            return f"is reached through {at}, a {'symlink' if stat.S_ISLNK(st.st_mode) else 'file'}"
        if st.st_uid != 0 or _changeable_by_others(st):
            mode = stat.S_IMODE(st.st_mode)
            return f"is reached through {at} (owner UID {st.st_uid}, mode {mode:o}), which others can change"
    return ""


def link_back(path: Path, to: Path, created: list[Path]) -> None:
    """Give the regular file ``to`` the name ``path`` too, in the same directory (a hard link,
    reached through no symlink, appended to ``created``); a name already there must be that
    very file (as on the node the snapshot was taken on), or UsageError."""
    fd = open_dir(path.parent, to=path)
    try:
        st = os.stat(to.name, dir_fd=fd, follow_symlinks=False)
        if not stat.S_ISREG(st.st_mode):
            raise UsageError(f"{to} is no regular file, so it cannot be given the name {path} too.")
        try:
            os.link(to.name, path.name, src_dir_fd=fd, dst_dir_fd=fd, follow_symlinks=False)
        except FileExistsError:
            there = os.stat(path.name, dir_fd=fd, follow_symlinks=False)
            if (there.st_dev, there.st_ino) != (st.st_dev, st.st_ino):
                raise UsageError(f"{path} is there as another file than {to}, which it is to name.") from None
            return
        created.append(path)
    finally:
        os.close(fd)


def open_regular(dir_fd: int, name: str, path: Path) -> int | None:
    """A read-only fd of the regular file ``name`` in the directory ``dir_fd`` (``path`` names
    it in errors), or None if there is none: no such name, or something else there (a FIFO
    or a device is never opened).  A symlink there raises UsageError: it is never followed."""
    try:
        st = os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
    except FileNotFoundError:
        return None
    if stat.S_ISLNK(st.st_mode):
        raise _symlink_refused(path, path)
    if not stat.S_ISREG(st.st_mode):
        return None
    try:  # (O_NONBLOCK|O_NOCTTY: should it have become a FIFO or a tty meanwhile, opening it does nothing)
        fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC, dir_fd=dir_fd)
    except FileNotFoundError:
        return None
    except OSError as e:
        if e.errno == errno.ELOOP:
            raise _symlink_refused(path, path) from e
        raise OSError(e.errno, e.strerror, str(path)) from e
    if not stat.S_ISREG(os.fstat(fd).st_mode):  # what counts is what was opened
        os.close(fd)
        return None
    return fd


def check_owner(dir_uid: int, uid: int, path: Path) -> None:
    """The ownership rule for a carried file: its directory belongs to root or to the file's
    owner ``uid``; anything else (root's file in a user's directory, one user's file in
    another's) is refused, since whoever owns the directory chooses what is in it."""
    if dir_uid not in (0, uid):
        raise UsageError(
            f"{path} belongs to UID {uid} but its directory to UID {dir_uid}, and tpagent carries a file only "
            "from a directory owned by root or by the file's owner: move the file, "
            "or give the directory to one of them."
        )


def owned_fd(parent: int, fd: int, path: Path) -> int:
    """``fd`` (of ``path``, in the directory ``parent``) once it passes :func:`check_owner`;
    else it is closed and UsageError raised."""
    try:
        check_owner(os.fstat(parent).st_uid, os.fstat(fd).st_uid, path)
    except BaseException:
        os.close(fd)
        raise
    return fd


def open_to_read(path: Path) -> int | None:
    """A read-only fd of the regular file ``path``, reached without following any symlink
    and checked against :func:`check_owner`; None if it is gone or is no regular file."""
    try:
        parent = open_dir(path.parent, to=path)
    except FileNotFoundError:
        return None
    try:
        fd = open_regular(parent, path.name, path)
        return None if fd is None else owned_fd(parent, fd, path)
    finally:
        os.close(parent)


def _holds(dir_fd: int, path: Path, source: IO[bytes], owner: tuple[int, int, int]) -> bool:
    """Whether the regular file ``path`` (in ``dir_fd``) is the one to put back: ``owner``
    (uid, gid, mode), and exactly the bytes of ``source``.  (A look-alike that someone else
    planted, with the same bytes, is not: the restored process would write into it.)"""
    fd = open_regular(dir_fd, path.name, path)
    if fd is None:
        return False
    with os.fdopen(fd, "rb") as f:
        st = os.fstat(fd)
        if (st.st_uid, st.st_gid, stat.S_IMODE(st.st_mode)) != owner:
            return False
        while True:
            a = f.read(_CHUNK)
            b = source.read(_CHUNK)
            if a != b:
                return False
            if not a:
                return True


def write_file(
    path: Path,
    source: IO[bytes],
    uid: int,
    gid: int,
    mode: int,
    mtime: float,
    created: list[Path],
    replaceable: Callable[[Path, os.stat_result], bool] = lambda path, st: False,
) -> bool:
    """Put ``source`` back at ``path`` as a new file owned by ``uid``:``gid`` with ``mode``
    (without setuid/setgid: never restored) and ``mtime``, appending what it creates
    (missing directories, see :func:`open_dir`, then the file) to ``created``.  No symlink is
    followed; the directory must pass :func:`check_owner`; a file already there must hold
    the same bytes (it is then left as it is), or be ``replaceable`` (a stale copy this node
    let go: it is then replaced, in one rename), else UsageError.  Whether it replaced one."""
    parent = open_dir(path.parent, created, to=path)
    replacing = False
    try:
        check_owner(os.fstat(parent).st_uid, uid, path)
        name = path.name
        try:
            fd = os.open(
                name, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600, dir_fd=parent
            )
        except FileExistsError:  # (also where a symlink is: O_EXCL follows none)
            if _holds(parent, path, source, (uid, gid, mode & 0o777)):
                return False
            there = open_regular(parent, name, path)
            if there is not None:
                try:
                    replacing = replaceable(path, os.fstat(there))
                finally:
                    os.close(there)
            if not replacing:
                raise UsageError(
                    f"{path} exists on this node with other content, owner or mode; "
                    "the process had it open: move it away first."
                ) from None
            source.seek(0)  # (_holds read some of it)
            name = f".{path.name}.tpagent-{os.getpid()}"
            fd = os.open(
                name, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600, dir_fd=parent
            )
        if not replacing:
            created.append(path)
        if mode & (stat.S_ISUID | stat.S_ISGID):
            log.warning(
                "%s had mode %o; it is put back as %o: tpagent never restores setuid/setgid bits",
                path,
                mode,
                mode & 0o777,
            )
        try:
            with os.fdopen(fd, "wb") as f:
                shutil.copyfileobj(source, f, _CHUNK)  # (in bounded pieces, however large the file)
                f.flush()
                os.fchown(fd, uid, gid)  # first: never a moment with its final mode while root owns it
                os.fchmod(fd, mode & 0o777)
                os.utime(fd, (mtime, mtime))
            if replacing:
                os.rename(name, path.name, src_dir_fd=parent, dst_dir_fd=parent)
        except BaseException:
            if replacing:
                with contextlib.suppress(OSError):
                    os.unlink(name, dir_fd=parent)
            raise
    finally:
        os.close(parent)
    return replacing


def make_dir(path: Path, created: list[Path]) -> None:
    """Make the directory ``path``, if it is missing, as root's and 0700 (:func:`hand_over`
    gives it to its owner later), appending it to ``created``; one already there is left as it
    is.  Its parent is reached through no symlink (made as root's ``mkdir -p`` would, if
    missing: see :func:`open_dir`)."""
    parent = open_dir(path.parent, created, to=path)
    try:
        os.mkdir(path.name, 0o700, dir_fd=parent)
    except FileExistsError:
        return
    finally:
        os.close(parent)
    created.append(path)


def hand_over(path: Path, uid: int, gid: int, mode: int) -> None:
    """Give the directory ``path`` (reached through no symlink) to ``uid``:``gid`` with ``mode``,
    never setuid (setgid, on a directory, gives what is made in it its group: a project's 2775)."""
    fd = open_dir(path)
    try:
        os.fchown(fd, uid, gid)  # first: never a moment with its final mode while root owns it
        os.fchmod(fd, mode & 0o3777)
    finally:
        os.close(fd)
