"""The ties of a tree to processes outside it (:mod:`host.ends`), read as anyone may: the
kernel's table of connected unix sockets, and the pipes and sockets a process holds."""

from __future__ import annotations

import os
import socket

from host import ends, unix_diag


def _inode(s: socket.socket) -> int:
    return os.fstat(s.fileno()).st_ino


def test_the_kernels_table_pairs_each_connected_unix_stream_with_its_peer(tmp_path: os.PathLike[str]) -> None:
    a, b = socket.socketpair()
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    dgram_a, dgram_b = socket.socketpair(socket.AF_UNIX, socket.SOCK_DGRAM)
    with a, b, listener, dgram_a, dgram_b:
        listener.bind(os.path.join(tmp_path, "l"))
        listener.listen()
        client = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        client.connect(os.path.join(tmp_path, "l"))
        served, _ = listener.accept()
        with client, served:
            peers, names = unix_diag.peers()
            assert names[_inode(served)] == os.path.join(tmp_path, "l").encode()  # (its listener's name)
            assert peers[_inode(a)] == _inode(b) and peers[_inode(b)] == _inode(a)
            assert peers[_inode(client)] == _inode(served)
            assert _inode(listener) not in peers  # (listening: connected to nobody)
            assert _inode(dgram_a) not in peers  # (a datagram pair: CRIU takes it, and it is not refused)


def test_what_the_process_holds_both_ends_of_ties_it_to_nothing_nor_a_connection_whose_other_end_closed() -> None:
    a, b = socket.socketpair()
    half, gone = socket.socketpair()
    gone.close()  # (CRIU dumps what is left of it: one end, closed at the other)
    r, w = os.pipe()
    try:
        assert unix_diag.peers()[0].get(_inode(half)) in (None, 0)
        ours = [a.fileno(), b.fileno(), half.fileno(), r, w]
        said = ends.refusals([os.getpid()])  # (what pytest holds of its runner's, a pipe or a terminal, aside)
        assert [s for s in said if any(f"(fd {fd})" in s for fd in ours)] == [], said
    finally:
        for s in (a, b, half):
            s.close()
        os.close(r)
        os.close(w)


def test_a_truncated_answer_is_read_no_further_than_it_goes() -> None:
    def message(length: int, body: bytes) -> bytes:
        return length.to_bytes(4, "little") + (20).to_bytes(2, "little") + bytes(10) + body

    whole = message(20, b"abcd")
    assert list(unix_diag._messages(whole)) == [(20, b"abcd")]
    assert list(unix_diag._messages(whole + message(40, b"efgh"))) == [(20, b"abcd")]  # (says 40 bytes: 20 are there)
    assert list(unix_diag._attributes((2).to_bytes(2, "little") + bytes(6))) == []  # (a length under 4: stop)
    assert list(unix_diag._attributes((9).to_bytes(2, "little") + bytes(4))) == []  # (longer than what is there)
