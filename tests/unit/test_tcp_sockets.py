"""host/sockets.py on this test's own sockets: what a process tree holds, what stays behind,
what only a target can judge (real sockets, read back from /proc)."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from collections.abc import Iterator

import pytest

from host import sockets

_SERVER = (
    "import socket,sys,time; s=socket.create_server(('127.0.0.1',0)); print(s.getsockname()[1], flush=True); "
    "c,_=s.accept(); time.sleep(60)"
)


@pytest.fixture
def outside() -> Iterator[int]:
    """The port of a loopback server in another process (outside "the tree": this process)."""
    with subprocess.Popen([sys.executable, "-c", _SERVER], stdout=subprocess.PIPE, text=True) as p:
        assert p.stdout is not None
        yield int(p.stdout.readline())
        p.kill()


def test_both_ends_in_the_tree_stay_together_and_a_loopback_peer_outside_is_named(outside: int) -> None:
    with socket.create_server(("127.0.0.1", 0)) as server, socket.create_connection(server.getsockname()) as client:
        accepted, _ = server.accept()
        lone = socket.create_connection(("127.0.0.1", outside))
        try:
            port, near, far = server.getsockname()[1], client.getsockname()[1], lone.getsockname()[1]
            # (only this test's sockets: earlier tests of the session may have left theirs open)
            held = [s for s in sockets.tree_tcp([os.getpid()]) if {s.local[1], s.remote[1]} & {port, near, far}]
            assert sorted(s.name for s in held) == sorted(
                [
                    f"127.0.0.1:{port} (listening)",
                    f"127.0.0.1:{near} -> 127.0.0.1:{port}",
                    f"127.0.0.1:{port} -> 127.0.0.1:{near}",
                    f"127.0.0.1:{far} -> 127.0.0.1:{outside}",
                ]
            )
            behind = sockets.left_behind(held)
            assert len(behind) == 1 and f"127.0.0.1:{far} -> 127.0.0.1:{outside}" in behind[0]
            # loopback connections need nothing of the target; the listener needs its port free there
            assert [s.name for s in sockets.must_check_on_target(held)] == [f"127.0.0.1:{port} (listening)"]
            taken = sockets.unusable_here("node-b", [(f"0.0.0.0:{port}", "")])  # (here: this machine)
            assert len(taken) == 1 and f"needs port {port}, which is taken on node-b" in taken[0]
        finally:
            accepted.close()
            lone.close()


def test_an_address_the_node_lacks_is_named_and_garbage_is_refused_in_words() -> None:
    problems = sockets.unusable_here(
        "node-b", [("192.0.2.7:5000", "198.51.100.1:80"), ("no-port", ""), ("[::1]:1", "")]
    )
    assert problems[0].startswith(
        "the TCP connection 192.0.2.7:5000 -> 198.51.100.1:80 is bound to 192.0.2.7, an address node-b does not have"
    )
    assert problems[1] == "the source sent a TCP endpoint this agent cannot read ('no-port', '')"
    assert len(problems) == 2  # [::1]:1: loopback, and nothing listens on port 1


def test_abstract_names_are_read_whatever_bytes_they_are() -> None:
    """Any process may bind a name that is not UTF-8: it is read (escaped) the same way on the
    source and the target, and never stops the check."""
    tag = os.urandom(4).hex().encode()
    with socket.socket(socket.AF_UNIX) as odd, socket.socket(socket.AF_UNIX) as plain:
        odd.bind(b"\0tpagent-\xff-" + tag)
        plain.bind(b"\0tpagent-plain-" + tag)
        mine = sockets.abstract_bound([os.getpid()])
        want = [f"@tpagent-\\xff-{tag.decode()}", f"@tpagent-plain-{tag.decode()}"]
        assert [n for n in mine if tag.decode() in n] == want
        assert sockets.abstract_taken([*want, "@tpagent-nobody-" + tag.decode()]) == want
