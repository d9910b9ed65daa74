"""The sender's side of the transfer handshake tells a refusal from a broken connection: only a
receiver that says it refused (an ERROR frame) is an authentication failure, which is never
tried again; a connection that closed in the middle (a receiver cutting strangers while a
partition heals, a reset) is a broken stream, which the sender tries again."""

from __future__ import annotations

import os
import socket
import threading

import pytest

from transfer import wire
from transfer.api import AuthError, TransferError
from transfer.stream import client_handshake
from transfer.tcp import TcpChannel
from transfer.wire import HELLO, Kind, Role


def _receiver(sock: socket.socket, says_no: bool) -> None:
    """Reads the hello, sends its nonce, reads the proof; then refuses, or just closes."""
    with sock:
        ch = TcpChannel(sock, 5.0)
        ch.recv_exact(HELLO.size)
        ch.send(os.urandom(wire.NONCE_LEN))
        ch.recv_exact(wire.MAC_LEN)
        if says_no:
            wire.send_frame(ch, Kind.ERROR, b"authentication failed")


@pytest.mark.parametrize("says_no", [True, False], ids=["refused", "closed"])
def test_only_a_said_refusal_is_an_authentication_failure(says_no: bool) -> None:
    with socket.create_server(("127.0.0.1", 0)) as server:
        ours = socket.create_connection(server.getsockname())
        theirs, _ = server.accept()
    t = threading.Thread(target=_receiver, args=(theirs, says_no))
    t.start()
    with ours, pytest.raises(TransferError) as caught:
        client_handshake(TcpChannel(ours, 5.0), b"s" * 32, Role.CONTROL, 0, os.urandom(16))
    t.join(10)
    assert isinstance(caught.value, AuthError) == says_no, caught.value
    if not says_no:
        assert "cluster secret" not in str(caught.value)
