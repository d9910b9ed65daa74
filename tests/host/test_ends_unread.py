"""A tree whose ties outside it could not all be looked for in time is refused, not taken as tied
to nobody (host.ends: the node's processes are read for the other ends of the tree's pipes,
sockets, terminals and shared memory, for HOLDERS_WITHIN seconds at most).  A pipe whose reader
is outside the tree is the tie: found when there is time, and the reason for one sentence of
refusal when there is none (a copy of it would write to a pipe with nobody at the other end)."""

from __future__ import annotations

import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from host import ends


@pytest.fixture
def writer() -> Iterator[subprocess.Popen[bytes]]:
    """A process writing to a pipe whose only reader is this test's process, outside its tree."""
    p = subprocess.Popen(["sleep", "600"], stdout=subprocess.PIPE, stdin=subprocess.DEVNULL)
    try:
        yield p
    finally:
        p.kill()
        p.wait()
        assert p.stdout is not None
        p.stdout.close()


def test_a_pipe_read_outside_the_tree_is_found_when_there_is_time(writer: subprocess.Popen[bytes]) -> None:
    said = ends.refusals([writer.pid])
    assert len(said) == 1 and f"PID {writer.pid} writes to a pipe (fd 1)" in said[0], said


def test_a_tree_whose_ties_could_not_all_be_looked_for_is_refused(
    writer: subprocess.Popen[bytes], monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setattr(ends, "HOLDERS_WITHIN", -1.0)  # (no time at all: not one process is read)
    said = ends.refusals([writer.pid])
    assert said == [
        f"PID {writer.pid}'s tree could not be checked for the holders of the pipes and sockets outside it: not "
        "all of this node's processes were read within -1 s (the node is too busy, or runs too many), and a tie "
        "to one left unseen would break its copy; try again."
    ]
    assert ends.shared_maps([writer.pid], [tmp_path / "nothing-mapped"]) == []  # (nothing to look for: no refusal)
