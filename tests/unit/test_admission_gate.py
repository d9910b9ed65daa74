"""transfer.admission.Gate: strangers bounded per host and in all (the oldest evicted), members apart.

The channels are real accepted loopback TCP connections, each from its own source address in
127.0.0.0/8, so that their hosts differ as a receiver sees them."""

from __future__ import annotations

import socket
from collections.abc import Callable, Iterator

import pytest

from transfer.admission import Gate, peer_host
from transfer.api import Refusal
from transfer.tcp import TcpChannel

Connect = Callable[[str], TcpChannel]


@pytest.fixture
def connect() -> Iterator[Connect]:
    """``connect(host)``: the receiver's end of a new connection from ``host`` (127.x.y.z)."""
    opened: list[socket.socket | TcpChannel] = []
    server = socket.create_server(("127.0.0.1", 0))
    opened.append(server)

    def _connect(host: str) -> TcpChannel:
        client = socket.socket()
        opened.append(client)
        client.bind((host, 0))
        client.connect(server.getsockname())
        accepted, _ = server.accept()
        ch = TcpChannel(accepted, timeout=5)
        opened.append(ch)
        return ch

    yield _connect
    for x in reversed(opened):
        x.close()


def test_a_hosts_newcomer_over_its_bound_evicts_that_hosts_oldest(connect: Connect) -> None:
    gate = Gate(strangers=10, per_host=2, members=4)
    a1, _ = gate.admit(connect("127.0.0.2"))
    b1, _ = gate.admit(connect("127.0.0.3"))
    a2, _ = gate.admit(connect("127.0.0.2"))
    a3, evicted = gate.admit(connect("127.0.0.2"))
    assert evicted is a1 and a1.refused is Refusal.PER_PEER_LIMIT
    assert (a2.refused, a3.refused, b1.refused) == (None, None, None)
    assert gate.promote(a1) is False  # an evicted stranger never becomes a member
    assert gate.promote(a3) is True


def test_a_newcomer_over_the_total_bound_evicts_the_oldest_stranger(connect: Connect) -> None:
    gate = Gate(strangers=3, per_host=2, members=4)
    first, _ = gate.admit(connect("127.0.0.2"))
    second, _ = gate.admit(connect("127.0.0.3"))
    gate.admit(connect("127.0.0.4"))
    _, evicted = gate.admit(connect("127.0.0.5"))
    assert evicted is first and first.refused is Refusal.EVICTED
    _, evicted = gate.admit(connect("127.0.0.6"))
    assert evicted is second and second.refused is Refusal.EVICTED


def test_a_host_with_a_member_is_not_bound_per_host(connect: Connect) -> None:
    gate = Gate(strangers=4, per_host=1, members=4)
    control, _ = gate.admit(connect("127.0.0.2"))
    assert gate.promote(control)
    admitted = [gate.admit(connect("127.0.0.2")) for _ in range(4)]
    assert [evicted for _, evicted in admitted] == [None, None, None, None]
    _, evicted = gate.admit(connect("127.0.0.2"))
    assert evicted is admitted[0][0] and evicted.refused is Refusal.EVICTED  # (the total bound still holds)


def test_strangers_without_a_host_are_bound_only_in_all(connect: Connect) -> None:
    gate = Gate(strangers=3, per_host=1, members=1)
    channels = [connect("127.0.0.2") for _ in range(4)]
    for ch in channels:
        ch.peer = "?"  # as UCX's channels: no HOST:PORT
    entries = [gate.admit(ch) for ch in channels]
    assert [e.host for e, _ in entries] == [None] * 4
    assert [evicted for _, evicted in entries] == [None, None, None, entries[0][0]]


def test_members_are_bounded_apart_and_a_release_frees_a_place(connect: Connect) -> None:
    gate = Gate(strangers=1, per_host=1, members=2)
    members = []
    for host in ("127.0.0.2", "127.0.0.3"):
        entry, _ = gate.admit(connect(host))
        assert gate.promote(entry)
        members.append(entry)
    extra, evicted = gate.admit(connect("127.0.0.4"))
    assert evicted is None  # members take no stranger's place
    assert gate.promote(extra) is False and extra.refused is Refusal.TOO_MANY_STREAMS
    gate.release(members[0])
    again, _ = gate.admit(connect("127.0.0.4"))
    assert gate.promote(again) is True


def test_a_released_stranger_frees_its_place(connect: Connect) -> None:
    gate = Gate(strangers=1, per_host=1, members=1)
    first, _ = gate.admit(connect("127.0.0.2"))
    gate.release(first)
    second, evicted = gate.admit(connect("127.0.0.2"))
    assert evicted is None and first.refused is None and second.refused is None


def test_expired_drops_only_strangers_older_than_the_timeout(connect: Connect) -> None:
    gate = Gate(strangers=10, per_host=10, members=1)
    old, _ = gate.admit(connect("127.0.0.2"))
    young, _ = gate.admit(connect("127.0.0.3"))
    member, _ = gate.admit(connect("127.0.0.4"))
    old.since -= 60
    member.since -= 60
    assert gate.promote(member)
    assert gate.expired(timeout=30) == [old]
    assert old.refused is Refusal.HANDSHAKE_TIMEOUT and young.refused is None and member.refused is None
    assert gate.expired(timeout=30) == []


def test_refuse_records_the_first_reason_only(connect: Connect) -> None:
    gate = Gate(strangers=1, per_host=1, members=1)
    first, _ = gate.admit(connect("127.0.0.2"))
    second, evicted = gate.admit(connect("127.0.0.3"))
    assert evicted is first
    assert gate.refuse(first, Refusal.AUTH_FAILED) is False and first.refused is Refusal.EVICTED
    assert gate.refuse(second, Refusal.TLS_FAILED) is True and second.refused is Refusal.TLS_FAILED


def test_a_stranger_refused_for_its_handshake_is_refused_once(connect: Connect) -> None:
    """Its handshake failed (a read timed out at its deadline, say), and the receiver has not
    let it go yet: neither the gate's deadline passing meanwhile nor a newcomer that needs its
    place refuses it a second time.  One connection, one refusal, one reason."""
    gate = Gate(strangers=1, per_host=1, members=1)
    late, _ = gate.admit(connect("127.0.0.2"))
    late.since -= 60  # (past the deadline too)
    assert gate.refuse(late, Refusal.HANDSHAKE_TIMEOUT) is True
    assert gate.expired(timeout=30) == []
    newcomer, evicted = gate.admit(connect("127.0.0.2"))
    assert evicted is None and newcomer.refused is None
    assert gate.refuse(late, Refusal.HANDSHAKE_FAILED) is False and late.refused is Refusal.HANDSHAKE_TIMEOUT
    gate.release(late)  # (the receiver lets it go: nothing more to say)
    assert gate.promote(newcomer) is True


def test_close_hands_back_every_open_connection_and_ends_refusals(connect: Connect) -> None:
    gate = Gate(strangers=5, per_host=5, members=5)
    stranger, _ = gate.admit(connect("127.0.0.2"))
    member, _ = gate.admit(connect("127.0.0.3"))
    assert gate.promote(member)
    assert gate.close() == [stranger, member]
    assert gate.refuse(stranger, Refusal.HANDSHAKE_FAILED) is False and stranger.refused is None


@pytest.mark.parametrize(
    ("peer", "host"),
    [
        ("10.0.0.1:7400", "10.0.0.1"),
        ("[fe80::1]:7400", "[fe80::1]"),
        ("node-b:1", "node-b"),
        ("?", None),
        ("ucx:worker", None),
        ("h:", None),
    ],
)
def test_peer_host(peer: str, host: str | None) -> None:
    assert peer_host(peer) == host
