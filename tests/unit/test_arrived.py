"""transfer.arrived: a session that cannot be started lets go of what it opened and made (a
receiver that kept them would leak a descriptor per file, and a partial snapshot on disk, for
every stream that failed so)."""

from __future__ import annotations

import os
import resource
from pathlib import Path

import pytest

from transfer import arrived
from transfer.wire import Layout


def _fds() -> set[str]:
    return set(os.listdir("/proc/self/fd"))


def test_a_session_that_fails_to_open_its_files_leaves_nothing(tmp_path: Path) -> None:
    partial = tmp_path / ".snap.partial-0123"
    layout = Layout((("manifest.json", 10), *((f"images/{i}.img", 4096) for i in range(20))), 1 << 20)
    before = _fds()
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (len(before) + 8, hard))  # (the agent out of descriptors)
    try:
        with pytest.raises(OSError, match="Too many open files"):
            arrived.start(partial, layout, 1 << 20, "0" * 64, {}, "blake3")
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
    assert _fds() == before, "descriptors of the files it had opened were left open"
    assert not partial.exists(), "the partial snapshot was left on disk"


def test_a_session_that_starts_holds_its_files_sized(tmp_path: Path) -> None:
    partial = tmp_path / ".snap.partial-4567"
    layout = Layout((("manifest.json", 10), ("images/a.img", 3 << 20)), 1 << 20)
    s = arrived.start(partial, layout, 1 << 20, "0" * 64, {}, "blake3")
    try:
        assert [os.fstat(fd).st_size for fd in s.fds] == [10, 3 << 20]
        assert len(s.where) == layout.count == 4 and (partial.stat().st_mode & 0o777) == 0o700
    finally:
        arrived.discard(s, 1.0)
    assert not partial.exists()
