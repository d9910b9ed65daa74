"""The host floor's contract: its error family, which the snapshot layer above takes for its own.

A check of this floor that refuses (a path through a symlink, a directory someone else could
change, a PID that is not a process of ours) raises :class:`UsageError`: the request cannot be
carried out as asked.  :mod:`snapshot.api` names the base :class:`HostError` ``SnapshotError``,
so that such a refusal reaches the snapshot layer's callers as one of its own errors.
"""

from __future__ import annotations

#: The most seconds any wait of the project takes (its settings and options are bounded by it):
#: some are taken in milliseconds by a C int (``poll``, 24.8 days) or 32 bits (CUDA's lock); no
#: wait of a migration is near 23 days.
MOST_SECONDS = 2e6


def is_whole(text: str) -> bool:
    """Whether ``text`` is a whole number of ASCII digits, as every number the project reads
    from outside is (``str.isdigit`` takes "²", which ``int`` refuses, and "٣", which it reads)."""
    return text.isascii() and text.isdigit()


def shown(path: str) -> str:
    """A name another user chose (a path, a memfd's name) in one line of text: its control and
    undecodable characters escaped, as Python writes them (a newline could forge a line of the
    output, an escape sequence drive the terminal)."""
    return path if path.isprintable() else ascii(path)[1:-1]


def unbracketed(host: str) -> str:
    """``host`` without the brackets around an IPv6 address ("[V6]", as settings and addresses
    write it); any other as it is."""
    return host[1:-1] if host.startswith("[") and host.endswith("]") else host


def port_number(text: str) -> int | None:
    """The port ``text`` names (0 to 65535, in ASCII digits), or None."""
    return int(text) if is_whole(text) and len(text) <= 5 and int(text) <= 65535 else None


class HostError(Exception):
    """Base of the host floor's errors and the snapshot layer's.  ``str(e)`` is one sentence fit
    for a user."""

    #: True when the process was frozen and has been resumed where it stood.
    rolled_back: bool = False
    #: True when the same request may well work a moment later (CRIU refused for a passing reason).
    transient: bool = False


class UsageError(HostError):
    """The request cannot be carried out as asked (bad PID, not root, occupied directory...)."""
