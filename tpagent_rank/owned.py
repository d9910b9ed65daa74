"""The sockets of a rank's communicators and store connections, and a forked child's copies.

A child the rank forks once its groups exist (a DataLoader worker) gets a copy of every
descriptor, those sockets included.  It never uses them, but it keeps them open: when a rewire
tears the communicators down, their connections stay open in the child, and CRIU, freezing the
rank with its children, finds connections bound to the old node's address (the move is
refused; the job goes on where it was).  So the runtime notes the sockets opened while a group
is made or rebuilt, by an inner backend's first collective (NCCL connects then) and by a store
connection taken back after a move, and those of the job's store (which a script may make
itself, before the default group); a forked child puts /dev/null in their place at once
(``dup2``: each descriptor number stays taken, so whatever the child's copies of those objects
might still close is never another file of its own).

Noted sockets are also made close-on-exec (a program the rank starts runs no fork hook).  A
socket another thread of the rank opens in one of those moments is noted too: a forked child
then cannot use it.  Connections an inner backend opens after its first collective (gloo with
TORCH_GLOO_LAZY_INIT; NCCL's later ones: point-to-point, algorithms connected at first use) are
not noted, nor NCCL's non-socket descriptors (InfiniBand's): untested, no GPU where this was written.
"""

from __future__ import annotations

import contextlib
import os
import socket
import stat
import threading
from collections.abc import Iterator

#: Descriptor -> socket inode, as noted (a descriptor closed and reused since no longer matches).
_OWNED: dict[int, int] = {}
_lock = threading.Lock()


def sockets() -> dict[int, int]:
    """Descriptor -> inode of this process's sockets."""
    out = {}
    for fd in os.listdir("/proc/self/fd"):
        try:
            link = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if link.startswith("socket:["):
            out[int(fd)] = int(link[8:-1])
    return out


def note_since(before: dict[int, int]) -> None:
    """Note the sockets opened since ``before`` (a :func:`sockets`) as the communicators'."""
    now = sockets()
    with _lock:
        for fd in [fd for fd, ino in _OWNED.items() if now.get(fd) != ino]:
            del _OWNED[fd]  # (closed since)
    _own(now, [fd for fd, ino in now.items() if before.get(fd) != ino])


def note(fds: list[int]) -> None:
    """Note the sockets at ``fds`` (the store's, which the user's script may have made itself)."""
    _own(sockets(), fds)


def _own(now: dict[int, int], fds: list[int]) -> None:
    with _lock:
        _OWNED.update((fd, now[fd]) for fd in fds if fd in now)
    for fd in fds:  # (nor does a program the rank runs get them: a child started by exec runs no fork hook)
        with contextlib.suppress(OSError):
            os.set_inheritable(fd, False)


@contextlib.contextmanager
def noting() -> Iterator[None]:
    """Note the sockets opened in the ``with`` block."""
    before = sockets()
    try:
        yield
    finally:
        note_since(before)


def shut_connections(keep: int = -1) -> None:
    """Shut (both ways) each noted socket still open as noted that is connected, not listening,
    but the descriptor ``keep``: whatever waits on one of them (a collective, a store call) fails
    at once."""
    with _lock:
        noted = dict(_OWNED)
    now = sockets()
    for fd, ino in noted.items():
        if now.get(fd) != ino or fd == keep:
            continue
        try:
            s = socket.socket(fileno=fd)  # (closed meanwhile: OSError)
        except OSError:
            continue
        try:
            if os.fstat(fd).st_ino == ino and not s.getsockopt(socket.SOL_SOCKET, socket.SO_ACCEPTCONN):
                s.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        finally:
            s.detach()  # (the descriptor stays its owner's)


def release_in_child() -> None:
    """In a forked child: /dev/null in place of each noted socket it inherited."""
    owned = dict(_OWNED)  # (no lock: a forked child has only this thread, and the lock may be held)
    _OWNED.clear()
    if not owned:
        return
    null = os.open(os.devnull, os.O_RDWR | os.O_CLOEXEC)
    try:
        for fd, ino in owned.items():
            try:
                st = os.fstat(fd)
            except OSError:
                continue
            if stat.S_ISSOCK(st.st_mode) and st.st_ino == ino:
                os.dup2(null, fd, inheritable=False)
    finally:
        os.close(null)


os.register_at_fork(after_in_child=release_in_child)
