"""Who is at the other end of a local (unix) socket, as the kernel says: the user, and the
process as a pidfd, an identity that cannot be recycled.  A PID read from ``SO_PEERCRED`` names
the process that connected even after it exited, and once its number is reused, some other
process: a caller may connect, hand its socket to a child, exit, and wait for its PID to become
someone else's.  A pidfd names one process for good, and says when it has exited."""

from __future__ import annotations

import contextlib
import errno
import os
import pwd
import select
import socket
import struct
from dataclasses import dataclass
from pathlib import Path

from host.api import is_whole

#: ``SO_PEERPIDFD`` (Linux 6.5; Python names it from 3.13).
SO_PEERPIDFD = getattr(socket, "SO_PEERPIDFD", 77)


class PeerGone(Exception):
    """The process that connected has exited (its socket may live on in another)."""


@dataclass
class Peer:
    """The process that connected (``pid`` while ``alive()``) and its user."""

    pid: int
    uid: int
    pidfd: int

    def alive(self) -> bool:
        """The process that connected still runs: what was read of ``pid`` until now was its."""
        if self.pidfd < 0:
            return False
        poller = select.poll()
        poller.register(self.pidfd, select.POLLIN)
        return not poller.poll(0)

    def close(self) -> None:
        if self.pidfd >= 0:
            with contextlib.suppress(OSError):
                os.close(self.pidfd)
            self.pidfd = -1


def credentials(sock: socket.socket) -> tuple[int, int, int]:
    """PID, UID and GID of the process that connected (or listened, seen from a client)."""
    pid, uid, gid = struct.unpack("3i", sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, 12))
    return int(pid), int(uid), int(gid)


#: Where each user's subordinate UIDs are given (shadow-utils: ``NAME:FIRST:COUNT`` a line).
SUBUID = Path("/etc/subuid")


def account(uid: int) -> int:
    """The user a UID acts for: the owner of the subordinate range it falls in (a process in a
    user namespace of theirs, ``newuidmap``, is seen as one of those UIDs), else the UID itself.
    One user with 65 536 subordinate UIDs is one user to whoever counts what users hold."""
    try:
        lines = SUBUID.read_text(errors="replace").splitlines()
    except OSError:
        return uid
    for line in lines:
        name, _, rest = line.partition(":")
        first, _, count = rest.partition(":")
        if is_whole(first) and is_whole(count) and int(first) <= uid < int(first) + int(count):
            try:
                return int(name) if is_whole(name) else pwd.getpwnam(name).pw_uid
            except KeyError:
                return uid
    return uid


def peer(sock: socket.socket) -> Peer:
    """The peer of a connected unix socket.  Raises :class:`PeerGone` if the process that
    connected has already exited.  Kernels before 6.5 have no ``SO_PEERPIDFD``: there the PID
    is pinned with ``pidfd_open`` at once, which leaves a recycling between the connect and this
    call unseen."""
    pid, uid, _gid = credentials(sock)
    try:
        fd = sock.getsockopt(socket.SOL_SOCKET, SO_PEERPIDFD)
    except OSError as e:
        if e.errno == errno.ESRCH:
            raise PeerGone(f"PID {pid}, which connected, has exited") from e
        if e.errno not in (errno.ENOPROTOOPT, errno.EINVAL):
            raise
        try:
            fd = os.pidfd_open(pid)
        except ProcessLookupError as e:
            raise PeerGone(f"PID {pid}, which connected, has exited") from e
    found = Peer(pid, uid, fd)
    if pidfd_pid(fd) != pid or not found.alive():
        found.close()
        raise PeerGone(f"PID {pid}, which connected, has exited")
    return found


def pidfd_pid(fd: int) -> int:
    """The PID (in our namespace) of the process a pidfd names; -1 once it has exited."""
    with open(f"/proc/self/fdinfo/{fd}") as f:
        for line in f:
            if line.startswith("Pid:"):
                return int(line.split()[1])
    return -1
