"""Who is cut when all places for strangers are taken (tpagent_rank.strangers): the oldest of
the address holding most, every loopback address counted as one; each for its time in all."""

from __future__ import annotations

import socket
from collections.abc import Iterator

import pytest

from tpagent_rank.strangers import Strangers, address_of


@pytest.fixture
def pairs() -> Iterator[list[tuple[socket.socket, socket.socket]]]:
    made: list[tuple[socket.socket, socket.socket]] = []
    yield made
    for a, b in made:
        a.close()
        b.close()


def _conn(pairs: list[tuple[socket.socket, socket.socket]]) -> socket.socket:
    """A held end; its peer's end tells whether it was cut."""
    pairs.append(socket.socketpair())
    return pairs[-1][0]


def _was_cut(pairs: list[tuple[socket.socket, socket.socket]], conn: socket.socket) -> bool:
    peer = next(b for a, b in pairs if a is conn)
    peer.setblocking(False)
    try:
        return peer.recv(1) == b""
    except BlockingIOError:
        return False


def test_a_crowd_from_one_address_displaces_only_its_own(pairs: list[tuple[socket.socket, socket.socket]]) -> None:
    held = Strangers(4, 60.0)
    rightful = _conn(pairs)
    held.admit(rightful, "10.0.0.7")
    crowd = [_conn(pairs) for _ in range(10)]
    for c in crowd:
        held.admit(c, "10.0.0.66")
    assert not _was_cut(pairs, rightful) and len(held) == 4
    assert [_was_cut(pairs, c) for c in crowd] == [True] * 7 + [False] * 3  # (its oldest first)
    assert held.leave(rightful) and not held.leave(crowd[0])


def test_every_loopback_address_counts_as_one(pairs: list[tuple[socket.socket, socket.socket]]) -> None:
    held = Strangers(4, 60.0)
    rightful = _conn(pairs)
    held.admit(rightful, "10.0.0.7")
    for i in range(2, 12):
        held.admit(_conn(pairs), f"127.0.0.{i}")
    held.admit(_conn(pairs), "::1")
    held.admit(_conn(pairs), "::ffff:127.0.0.9")
    assert not _was_cut(pairs, rightful)
    assert {address_of(a) for a in ("127.1.2.3", "::1", "[::ffff:127.0.0.1]")} == {"loopback"}
    assert address_of("::ffff:10.0.0.7") == "10.0.0.7" and address_of("fe80::1%eth0") == "fe80::1"


def test_with_one_place_each_the_oldest_is_cut(pairs: list[tuple[socket.socket, socket.socket]]) -> None:
    held = Strangers(2, 60.0)
    first, second, third = _conn(pairs), _conn(pairs), _conn(pairs)
    held.admit(first, "10.0.0.1")
    held.admit(second, "10.0.0.2")
    assert held.admit(third, "10.0.0.3")
    assert [_was_cut(pairs, c) for c in (first, second, third)] == [True, False, False]


def test_a_stranger_past_its_time_is_cut_and_one_that_left_is_not(
    pairs: list[tuple[socket.socket, socket.socket]],
) -> None:
    held = Strangers(4, 0.0)
    gone, proven = _conn(pairs), _conn(pairs)
    held.admit(gone, "10.0.0.1")
    held.admit(proven, "10.0.0.2")
    assert held.leave(proven)
    assert held.expire() == 1
    assert _was_cut(pairs, gone) and not _was_cut(pairs, proven) and len(held) == 0
