"""Which incoming connections a receiver keeps: strangers are bounded apart from members.

A connection is a *stranger* from ``accept`` until it has passed the TLS and HMAC handshakes,
and a *member* after.  A real sender's handshake takes milliseconds; a stranger that trickles
its bytes, or never finishes TLS, would take seconds per place.  So strangers are bounded
three ways, and cannot lock members out:

  * at most ``per_host`` at once from one host: a newcomer over it is refused.  A host with
    a member connection open is exempt (a sender's data streams arrive as one burst);
  * at most ``strangers`` at once in all: a newcomer over it evicts the oldest stranger (as
    sshd's MaxStartups does, but deterministically), so a real handshake always gets a
    place and keeps it for the milliseconds it needs;
  * each for at most the handshake timeout (:meth:`Gate.expired`).

Members are bounded on their own (``members``: the control stream, every data stream, and as
many reconnections again), so neither kind ever takes the other's places.
"""

from __future__ import annotations

import threading
import time
from collections import Counter
from dataclasses import dataclass, field

from host.api import is_whole
from transfer.api import Channel, Refusal


@dataclass(eq=False)
class Entry:
    """One admitted connection."""

    ch: Channel
    host: str | None  # None where the transport does not know it: no per-host bound then
    since: float = field(default_factory=time.monotonic)
    #: Why the connection was ended before it could carry a transfer, once it was.
    refused: Refusal | None = None


class Gate:
    def __init__(self, strangers: int, per_host: int, members: int) -> None:
        self.max_strangers = strangers
        self.per_host = per_host
        self.max_members = members
        self._lock = threading.Lock()
        self._strangers: dict[Entry, None] = {}  # in order of arrival: the first is the oldest
        self._strangers_from: Counter[str | None] = Counter()
        self._members: set[Entry] = set()
        self._members_from: Counter[str | None] = Counter()
        self._closed = False

    def admit(self, ch: Channel) -> tuple[Entry, Entry | None]:
        """A new connection's entry, and the stranger it evicted (to be interrupted): the
        oldest of its host's, if that host is at its bound (a newcomer is never refused, so
        strangers on a sender's own host cannot keep the sender out), else the oldest of all
        when all places are taken."""
        host = peer_host(getattr(ch, "peer", "?"))
        entry = Entry(ch, host)
        with self._lock:
            evicted = None
            if host is not None and self._strangers_from[host] >= self.per_host and not self._members_from[host]:
                evicted = next(e for e in self._strangers if e.host == host)
                self._drop(evicted, Refusal.PER_PEER_LIMIT)
            elif len(self._strangers) >= self.max_strangers:
                evicted = next(iter(self._strangers))
                self._drop(evicted, Refusal.EVICTED)
            self._strangers[entry] = None
            self._strangers_from[host] += 1
            return entry, evicted

    def expired(self, timeout: float) -> list[Entry]:
        """Strangers admitted more than ``timeout`` seconds ago, now dropped (to be interrupted)."""
        out = []
        with self._lock:
            now = time.monotonic()
            for entry in list(self._strangers):  # oldest first: stop at the first young one
                if now - entry.since <= timeout:
                    break
                self._drop(entry, Refusal.HANDSHAKE_TIMEOUT)
                out.append(entry)
        return out

    def promote(self, entry: Entry) -> bool:
        """The stranger passed its handshakes: make it a member.  False (and ``refused`` set)
        if it was dropped meanwhile, or all members' places are taken."""
        with self._lock:
            if entry.refused is not None:
                return False
            self._drop(entry, None)
            if len(self._members) >= self.max_members:
                entry.refused = Refusal.TOO_MANY_STREAMS
                return False
            self._members.add(entry)
            self._members_from[entry.host] += 1
            return True

    def refuse(self, entry: Entry, reason: Refusal) -> bool:
        """Record why a stranger's handshake failed, and drop it: False if the gate had already
        dropped it (and said why).  Whichever comes first, this or the gate's own deadline or
        eviction, is the one refusal of the connection: dropped now, it is no longer a stranger
        that :meth:`expired` or :meth:`admit` could refuse again before it is released."""
        with self._lock:
            if entry.refused is not None or self._closed:
                return False
            if entry in self._strangers:
                self._drop(entry, reason)
            entry.refused = reason
            return True

    def release(self, entry: Entry) -> None:
        """The connection has ended."""
        with self._lock:
            if entry in self._members:
                self._members.remove(entry)
                self._members_from[entry.host] -= 1
                if not self._members_from[entry.host]:
                    del self._members_from[entry.host]
            elif entry in self._strangers:
                self._drop(entry, entry.refused)

    def close(self) -> list[Entry]:
        """Every connection still open, strangers and members, to be interrupted: the receiver
        stops (their failures that follow are not refusals)."""
        with self._lock:
            self._closed = True
            return [*self._strangers, *self._members]

    def _drop(self, entry: Entry, reason: Refusal | None) -> None:
        del self._strangers[entry]
        self._strangers_from[entry.host] -= 1
        if not self._strangers_from[entry.host]:
            del self._strangers_from[entry.host]
        if reason is not None and entry.refused is None:
            entry.refused = reason


def peer_host(peer: str) -> str | None:
    """The host of ``HOST:PORT``; None for a peer without one (UCX's)."""
    host, sep, port = peer.rpartition(":")
    return host if sep and is_whole(port) else None
