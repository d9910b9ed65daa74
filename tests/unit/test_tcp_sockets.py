"""host/sockets.py on this test's own sockets: what only a target can judge, abstract names
(real sockets, read back from /proc).  What a process tree holds beside a loopback peer in
another process: tests/host/test_process_sockets.py."""

from __future__ import annotations

import os
import socket

from host import sockets


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
