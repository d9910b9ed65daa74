"""A moved rank takes its job's store back (tpagent_rank.store.reattach); a store that has ended
(torchrun killed on its node in the middle of a move) is said at once, in one sentence, rather
than waited for as a TCPStore client would, for its whole timeout, once per rebuild."""

from __future__ import annotations

import socket

import pytest

from tpagent_rank import store


def test_a_store_that_refuses_every_connection_is_said_at_once() -> None:
    with socket.socket() as gone:  # (a port nothing listens on any more)
        gone.bind(("127.0.0.1", 0))
        port = gone.getsockname()[1]
    with socket.socket() as placeholder, pytest.raises(RuntimeError) as caught:
        store.reattach([(placeholder.fileno(), "127.0.0.1", port)], timeout=20)
    assert f"the job's store at 127.0.0.1:{port} refuses connections" in str(caught.value), caught.value
