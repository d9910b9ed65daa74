"""The rank socket's door: every connection to it is met here, in one thread, until it is a
rank's connection (:class:`tpagent.jobs.connection.Connection`, one reader thread each, and one
per registered rank at most) or closed.

Anyone on the node may connect, so nothing here grows with strangers: connections not yet
welcomed are at most :data:`PENDING_MAX` (:data:`PER_USER_MAX` of one user), each has
:data:`HELLO_WITHIN` seconds to say hello and :data:`PENDING_FOR` more to be registered, and
no thread is started for any of them.  Who connected is the kernel's word, as a pidfd
(:mod:`host.peers`): a connection whose process has exited is refused, whoever holds it now.
"""

from __future__ import annotations

import contextlib
import logging
import selectors
import socket
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from host import peers
from host.hushed import Hushed
from tpagent.common.threads import Threads
from tpagent_rank import codec, lines
from tpagent_rank import protocol as P

log = logging.getLogger(__name__)
#: Refused connections (any local user may open them): logged at most once a second.
REFUSED = Hushed(log)
UNREGISTERED = Hushed(log)  # (its own: a flood of the others hides none of these)

#: Connections not yet welcomed, at most (more are refused at once); of one user, at most.
PENDING_MAX = 128
PER_USER_MAX = 32
#: Seconds a connection has to say hello; then to be registered (a stand-in's registration and
#: its rank's hello race).
HELLO_WITHIN = 5.0
PENDING_FOR = 30.0
#: How often the waiting hellos look for their registration.
TICK = 0.1


class Refuse(Exception):
    """Said to the caller (one line), then its connection is closed."""


@dataclass
class Caller:
    sock: socket.socket
    peer: peers.Peer
    deadline: float
    #: Its socket's descriptor as accepted, its key here: the admitter may have closed the socket
    #: (a welcome that could not be sent) by the time the door forgets it.
    fd: int = -1
    #: The user it counts against (:func:`host.peers.account`: a subordinate UID is its owner's).
    user: int = -1
    data: bytearray = field(default_factory=bytearray)
    hello: lines.Hello | None = None
    #: What the admitter found out about the caller once (it is asked again at every tick).
    known: dict[str, Any] = field(default_factory=dict)


#: Given a caller that said hello: True once it is a rank's connection (its socket and pidfd are
#: that connection's), False while its registration is not there; raises :class:`Refuse`.
Admit = Callable[[Caller], bool]
#: Given an init's exit report; raises :class:`Refuse`.
Exited = Callable[[peers.Peer, lines.Exit], None]


class Door:
    def __init__(self, server: socket.socket, name: str, threads: Threads, admit: Admit, exited: Exited) -> None:
        self.server = server
        self.name = name
        self.threads = threads
        self.admit = admit
        self.exited = exited
        self.callers: dict[int, Caller] = {}  # by socket descriptor
        self.per_user: Counter[int] = Counter()
        self.selector = selectors.DefaultSelector()

    def run(self) -> None:
        self.server.setblocking(False)
        self.selector.register(self.server, selectors.EVENT_READ)
        try:
            while not self.threads.stopping.is_set():
                for key, _ in self.selector.select(TICK):
                    if key.fileobj is self.server:
                        self._accept()
                    elif (c := self.callers.get(key.fd)) is not None and c.sock is key.fileobj:
                        self._guarded(self._read, c)
                for c in list(self.callers.values()):
                    self._guarded(self._look_again, c)
        except OSError as e:  # (the server socket closed under us: the agent stops)
            if not self.threads.stopping.is_set():
                log.error("the rank socket @%s stopped: %s", self.name, e)
        finally:
            for c in list(self.callers.values()):
                self._drop(c)
            self.selector.close()

    def _accept(self) -> None:
        try:
            sock, _ = self.server.accept()
        except (BlockingIOError, InterruptedError, ConnectionAbortedError):
            return
        try:
            peer = peers.peer(sock)
        except (OSError, peers.PeerGone) as e:
            REFUSED.warning("a connection on @%s was refused: %s", self.name, e)
            sock.close()
            return
        user = peers.account(peer.uid)
        if len(self.callers) >= PENDING_MAX or self.per_user[user] >= PER_USER_MAX:
            REFUSED.warning(
                "a connection from PID %d (UID %d) on @%s was refused: too many", peer.pid, peer.uid, self.name
            )
            _tell(sock, "too many connections wait for their registration here")
            sock.close()
            peer.close()
            return
        sock.setblocking(False)
        caller = Caller(sock, peer, time.monotonic() + HELLO_WITHIN, fd=sock.fileno(), user=user)
        self.callers[caller.fd] = caller
        self.per_user[user] += 1
        self.selector.register(sock, selectors.EVENT_READ)

    def _read(self, c: Caller) -> None:
        try:
            chunk = c.sock.recv(P.LINE_MAX + 1 - len(c.data))
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            chunk = b""
        if not chunk or c.hello is not None:  # (closed; or said more than hello before its welcome)
            self._drop(c)
            return
        c.data += chunk
        line, sep, rest = bytes(c.data).partition(b"\n")
        if not sep:
            if len(c.data) > P.LINE_MAX:
                self._refuse(c, "its first line is too long")
            return
        try:
            if rest:
                raise Refuse("it said more than its first line before it was answered")
            self._first(c, codec.parse_line(line + sep))
        except (Refuse, ValueError) as e:
            self._refuse(c, str(e))

    def _first(self, c: Caller, first: dict[str, Any]) -> None:
        if codec.is_said(first, lines.LineOp.EXIT):
            self.exited(c.peer, codec.decode(lines.Exit, first))
            self._drop(c)
            return
        hello = codec.decode(lines.Hello, first) if codec.is_said(first, lines.LineOp.HELLO) else None
        if hello is None or not P.valid_job(hello.job) or not 0 <= hello.rank < hello.world <= P.RANK_MAX:
            raise Refuse("its hello is not valid")
        c.hello = hello
        c.deadline = time.monotonic() + PENDING_FOR
        self._try(c)

    def _try(self, c: Caller) -> None:
        if self.admit(c):
            self._forget(c)

    def _guarded(self, step: Callable[[Caller], None], c: Caller) -> None:
        """One caller's step: whatever goes wrong with it ends that caller, never the door."""
        try:
            step(c)
        except Refuse as e:
            self._refuse(c, str(e))
        except Exception:
            log.exception("a connection from PID %d on @%s failed; it is closed", c.peer.pid, self.name)
            if self.callers.get(c.fd) is c:
                self._drop(c)

    def _look_again(self, c: Caller) -> None:
        """A caller that waits: its registration, if it came; its deadline, if it passed."""
        if self.callers.get(c.fd) is not c:
            return  # (gone since the round began)
        if c.hello is not None:
            self._try(c)
        if self.callers.get(c.fd) is c and time.monotonic() > c.deadline:
            if c.hello is None:
                raise Refuse(f"it said no hello within {HELLO_WITHIN:.0f} s")
            UNREGISTERED.warning(
                "rank %s of job %s (PID %d) is not registered here", c.hello.rank, c.hello.job, c.peer.pid
            )
            raise Refuse("this rank is not registered with the agent")

    def _refuse(self, c: Caller, why: str) -> None:
        if self.callers.get(c.fd) is not c:
            return  # (no longer the door's to refuse)
        REFUSED.warning(
            "a connection from PID %d (UID %d) on @%s was refused: %s", c.peer.pid, c.peer.uid, self.name, why
        )
        _tell(c.sock, why)
        self._drop(c)

    def _forget(self, c: Caller) -> None:
        """No longer the door's (the socket and the pidfd are the connection's now); once."""
        if self.callers.get(c.fd) is not c:
            return
        with contextlib.suppress(KeyError, ValueError):
            self.selector.unregister(c.sock)
        del self.callers[c.fd]
        self.per_user[c.user] -= 1
        if self.per_user[c.user] <= 0:
            del self.per_user[c.user]

    def _drop(self, c: Caller) -> None:
        self._forget(c)
        c.sock.close()
        c.peer.close()


def _tell(sock: socket.socket, why: str) -> None:
    """One refusal line, if it fits in the socket's buffer now (a caller that reads nothing
    holds nobody up)."""
    with contextlib.suppress(OSError):
        sock.setblocking(False)
        sock.send(codec.said(lines.Refusal(why)))
