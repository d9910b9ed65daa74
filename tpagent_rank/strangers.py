"""Connections from anyone on the network, held until they prove themselves, bounded so that
nobody can lock out the rightful peer (the hand-over port, the metrics port, the webhook).

A stranger is a connection from ``accept`` until it has shown who it is (a secret's MAC, a
token) or been served.  A rightful peer does that in milliseconds; one that says nothing, or
trickles a byte at a time, would hold a place for as long as it is let.  So:

  * each stranger has :attr:`Strangers.within` seconds in all (not per read) before it is cut
    (:meth:`Strangers.expire`, called from the server's loop);
  * a newcomer is never turned away: when all places are taken, the oldest stranger of the
    address holding most places is cut.  A crowd from one address displaces only its own, and
    a rightful peer that needs its place for milliseconds keeps it.  Every loopback address
    counts as one address (a local user has all of 127.0.0.0/8).

The transfer receiver keeps the same rule with members apart (:mod:`transfer.admission`).
Standard library only: loaded into a training process for the hand-over.
"""

from __future__ import annotations

import contextlib
import ipaddress
import socket
import threading
import time
from collections import Counter


def address_of(host: str) -> str:
    """The address a peer's places are counted under: its IP, IPv4 for an IPv4-mapped one, and
    ``loopback`` for any loopback address."""
    try:
        ip = ipaddress.ip_address(host.strip("[]").partition("%")[0])
    except ValueError:
        return host
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        ip = ip.ipv4_mapped
    return "loopback" if ip.is_loopback else str(ip)


class Strangers:
    def __init__(self, places: int, within: float) -> None:
        self.places = places
        self.within = within
        self._lock = threading.Lock()
        #: In order of arrival (the first is the oldest): its address and when it came.
        self._held: dict[socket.socket, tuple[str, float]] = {}
        self._of: Counter[str] = Counter()

    def admit(self, conn: socket.socket, host: str) -> bool:
        """Hold ``conn``, from ``host``; True if another stranger was cut to make room."""
        address = address_of(host)
        with self._lock:
            cut = False
            if len(self._held) >= self.places:
                most = max(self._of.values())
                self._cut(next(c for c, (a, _) in self._held.items() if self._of[a] == most))
                cut = True
            self._held[conn] = (address, time.monotonic())
            self._of[address] += 1
            return cut

    def expire(self) -> int:
        """Cut the strangers held longer than :attr:`within`; how many."""
        with self._lock:
            old = [c for c, (_, since) in self._held.items() if time.monotonic() - since > self.within]
            for conn in old:
                self._cut(conn)
            return len(old)

    def leave(self, conn: socket.socket) -> bool:
        """``conn`` proved itself, or ended: it is no longer held.  False if it had been cut
        (its peer is to be told nothing more).  Called before the connection is closed."""
        with self._lock:
            if conn not in self._held:
                return False
            self._forget(conn)
            return True

    def __len__(self) -> int:
        return len(self._held)

    def _cut(self, conn: socket.socket) -> None:
        """Forget ``conn`` and wake whoever waits on it (its reads end as if its peer closed)."""
        self._forget(conn)
        with contextlib.suppress(OSError):  # (its thread closes it, after it left: never here)
            conn.shutdown(socket.SHUT_RDWR)

    def _forget(self, conn: socket.socket) -> None:
        address, _ = self._held.pop(conn)
        self._of[address] -= 1
        if not self._of[address]:
            del self._of[address]
