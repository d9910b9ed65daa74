"""What CRIU cannot checkpoint, found in a process's descriptors before anything is frozen
(:func:`host.criu_limits.uncheckpointable`), read as anyone may: this test's own process."""

from __future__ import annotations

import ctypes
import os

import pytest

from host import criu_limits

_libc = ctypes.CDLL(None, use_errno=True)
_libc.mq_open.restype = ctypes.c_int


def _mine() -> list[str]:
    return [s for s in criu_limits.uncheckpointable([os.getpid()]) if "message queue" in s]


@pytest.mark.parametrize("unlinked", [False, True])
def test_a_posix_message_queue_is_named_as_one_linked_or_not(unlinked: bool) -> None:
    name = f"/tpagent-unit-{os.getpid()}".encode()
    fd = _libc.mq_open(name, os.O_CREAT | os.O_RDWR, 0o600, None)
    if fd < 0:
        pytest.skip(f"no POSIX message queues here: {os.strerror(ctypes.get_errno())}")
    try:
        if unlinked:
            _libc.mq_unlink(name)  # (its descriptor's link is then "/NAME (deleted)")
        assert _mine() == [f"PID {os.getpid()} uses a POSIX message queue (fd {fd}), which CRIU cannot checkpoint."]
    finally:
        os.close(fd)
        _libc.mq_unlink(name)
    assert _mine() == []


def test_a_memfd_whose_link_looks_like_a_queues_is_not_one() -> None:
    """A memfd's link is one name after one slash too ("/memfd:NAME (deleted)")."""
    memfd = os.memfd_create("tpagent-unit")
    try:
        assert os.readlink(f"/proc/self/fd/{memfd}").startswith("/memfd:")
        assert _mine() == []
    finally:
        os.close(memfd)
    assert criu_limits._filesystem("/") not in (None, criu_limits._MQUEUE_MAGIC)
    assert criu_limits._filesystem("/nonexistent/path") is None
