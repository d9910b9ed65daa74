"""Files root reads to decide what it does, or runs: a configuration, the cluster CA and this
node's certificate, the CRIU binary.  Each must be one no other user can change: owned by root
(or by us), not writable by group or others, reached through directories no other user can
change and through root's symlinks only (:func:`host.safefs.trusted_realpath`).  Others may read
them (a configuration is 644); a secret or a key must be private as well
(:func:`open_private_file`)."""

from __future__ import annotations

import os
import stat
from pathlib import Path

from host.api import UsageError
from host.safefs import safe_ancestors, trusted_realpath


def _opened(path: Path, unreadable: str, irregular: str) -> tuple[int, os.stat_result]:
    """An fd of ``path``, a regular file reached through directories no other user can change
    (symlinks: root's only), and its stat; else ``unreadable`` (with why) or ``irregular``.
    O_NONBLOCK: the open of a FIFO never waits for a writer."""
    try:
        real = trusted_realpath(path)
        safe_ancestors(real)
        fd = os.open(real, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK)
    except OSError as e:
        raise UsageError(f"{unreadable}: {e.strerror}.") from e
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode) or _kernels(st):
        os.close(fd)
        raise UsageError(irregular)
    return fd, st


#: A file of each filesystem the kernel makes up as it is read (there only where it is mounted:
#: a container's /sys may be a bare directory of the root filesystem).
_KERNEL_FILES = ("/proc/self/stat", "/sys/kernel/uevent_seqnum")


def _kernels(st: os.stat_result) -> bool:
    """Whether the file is one the kernel makes up as it is read (/proc, /sys: /proc/kmsg read
    as a secret, /proc/self/environ): "regular" files whose text is no file's."""
    for known in _KERNEL_FILES:
        try:
            if os.stat(known).st_dev == st.st_dev:
                return True
        except OSError:
            continue
    return False


def open_trusted(path: Path, what: str) -> int:
    """An fd of ``path`` (``what`` it is, for the sentence), a regular file only root or we can
    change; read what was checked through it."""
    fd, st = _opened(path, f"cannot read {what} {path}", f"{what} {path} is not a regular file.")
    if st.st_uid not in (0, os.geteuid()) or st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        os.close(fd)
        raise UsageError(
            f"{what} {path} can be changed by other users (owner UID {st.st_uid}, mode {stat.S_IMODE(st.st_mode):o}); "
            "give a file only root can change."
        )
    return fd


def open_private_file(path: Path, what: str) -> int:
    """An fd of a secret or a private key, checked: the file must be ours and 0600 or stricter
    (as :func:`open_trusted` otherwise).  Read what was checked through this fd
    (``/proc/self/fd/N`` for a library that wants a path)."""
    irregular = f"{what} in {path} must be a regular file, and {path} is not one."
    fd, st = _opened(path, f"cannot read {what} from {path}", irregular)
    if st.st_uid != os.geteuid() or st.st_mode & 0o077:
        os.close(fd)
        owner = "root" if os.geteuid() == 0 else f"UID {os.geteuid()}"
        # (another user's: they know what it holds, so a new one is needed, not this one made ours)
        fix = f"run: chmod 600 {path}" if st.st_uid == os.geteuid() else "make a new one: its owner knows what it holds"
        raise UsageError(
            f"{what} in {path} must be a file owned by {owner} with mode 600 or stricter (it has owner UID "
            f"{st.st_uid}, mode {stat.S_IMODE(st.st_mode):o}); {fix}."
        )
    return fd


def read_private_file(path: Path, what: str) -> bytes:
    """The bytes of a secret or a private key (see :func:`open_private_file`)."""
    with os.fdopen(open_private_file(path, what), "rb") as f:
        return f.read(1 << 20)


def read_trusted(path: Path, what: str, limit: int) -> bytes:
    """What ``path`` holds (at most ``limit`` bytes: more is refused), checked as :func:`open_trusted`."""
    with os.fdopen(open_trusted(path, what), "rb") as f:
        data = f.read(limit + 1)
    if len(data) > limit:
        size = f"{limit >> 20} MiB" if limit >= 1 << 20 else f"{limit >> 10} KiB"
        raise UsageError(f"{what} {path} is larger than {size}, which no such file is.")
    return data


def trusted_program(path: Path, what: str) -> Path:
    """``path``, an executable file only root or we can change (root runs it)."""
    fd = open_trusted(path, what)
    try:
        executable = os.fstat(fd).st_mode & 0o111
    finally:
        os.close(fd)
    if not executable:
        raise UsageError(f"{what} {path} is not executable.")
    return path
