"""What CRIU cannot checkpoint, found in a process's descriptors before anything is frozen
(:func:`host.criu_limits.uncheckpointable`), read as anyone may: this test's own process."""

from __future__ import annotations

import ctypes
import os
from pathlib import Path

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


def test_a_deleted_file_is_a_ghost_over_the_limit_by_its_data_and_only_without_another_name(tmp_path: Path) -> None:
    """Deleted and open: 2 MiB of data is over a 1 MiB limit; a sparse file of 64 MiB with
    one page of data is not (CRIU copies holes as holes); nor is one with another name left
    (CRIU names it again instead), nor a memfd (dumped as memory)."""
    mib = 1 << 20
    dense, sparse, linked = (open(tmp_path / n, "w+b") for n in ("dense", "sparse", "linked"))  # noqa: SIM115
    memfd = os.memfd_create("tpagent-unit")
    try:
        dense.write(os.urandom(2 * mib))
        sparse.truncate(64 * mib)
        sparse.write(b"x")
        linked.write(os.urandom(2 * mib))
        os.write(memfd, os.urandom(2 * mib))
        for f in (dense, sparse, linked):
            f.flush()
            os.fsync(f.fileno())  # (its blocks counted now, on a filesystem that allocates late)
        os.link(tmp_path / "linked", tmp_path / "other-name")
        for n in ("dense", "sparse", "linked"):
            os.unlink(tmp_path / n)
        everything = criu_limits.large_ghosts([os.getpid()], mib)
        assert not [s for s in everything if "memfd:tpagent-unit" in s], everything
        said = [s for s in everything if str(tmp_path) in s]  # (not pytest's own)
        assert said == [
            f"PID {os.getpid()} holds {tmp_path / 'dense'}, deleted while in use, with 2 MiB of data: more than the "
            "ghost limit (1 MiB), which CRIU would have to copy into the snapshot; raise it with --ghost-limit-mib "
            "(TPAGENT_GHOST_LIMIT_MIB, the agent's ghost_limit_mib)."
        ]
        assert [s for s in criu_limits.large_ghosts([os.getpid()], 4 * mib) if str(tmp_path) in s] == []
    finally:
        for f in (dense, sparse, linked):
            f.close()
        os.close(memfd)
