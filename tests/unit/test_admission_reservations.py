"""tpagent.migration.admission.Reservations: a migration is admitted only beside those in flight.

Real directories and files, and the machine's real memory: each case asks for more than could
fit, or for what fits, and checks what is reserved, counted and said.  The disk of the cases
that count its bytes is the test's alone (:func:`disk`): the machine's real free space moves
with whatever else writes or deletes meanwhile, by more than their margins on a busy machine."""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Any

import psutil
import pytest

from tpagent.migration import admission
from tpagent.migration.admission import Reservation, Reservations, on_tmpfs, sized, written


def test_offer_entries_are_parsed() -> None:
    assert sized(["/a/b:10", "/c:d:7", "/x:*", "junk"]) == [("/a/b", 10), ("/c:d", 7), ("/x", 0), ("", 0)]
    assert sized(["/a:²", "/b:٣"]) == [("/a", 0), ("/b", 0)]  # (a peer's; before: ValueError, and 3)


def test_tmpfs_is_known() -> None:
    assert on_tmpfs(Path("/dev/shm")) and not on_tmpfs(Path("/proc/self"))


def test_what_fits_is_reserved_and_said(tmp_path: Path) -> None:
    live = {"m1"}
    r = Reservations(tmp_path, 2, lambda mid: mid in live)
    problems, reservation, words = r.check("B", 1 << 20, [(str(tmp_path / "f"), 3 << 20)])
    assert problems == [], problems
    assert reservation.disk >= 4 << 20 and reservation.memory >= 1 << 20
    assert "B reserves 4 MiB in" in words and "1 carried file(s) of 3 MiB" in words and "0 other" in words
    r.reserve("m1", reservation)
    assert "1 other migration(s) in flight" in r.check("B", 1 << 20, [])[2]
    live.clear()  # its copy was restored (or dropped): its room is free again
    assert r.in_flight() == {}


@pytest.fixture
def disk(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> int:
    """A disk of a fixed size whose used bytes are those of the files under ``tmp_path``; its size."""
    size = 1 << 40
    usage = type(shutil.disk_usage(tmp_path))

    def disk_usage(path: object) -> Any:
        used = sum(f.stat().st_blocks * 512 for f in tmp_path.rglob("*") if f.is_file())
        return usage(size, used, size - used)

    monkeypatch.setattr(admission.shutil, "disk_usage", disk_usage)
    return size


def test_disk_memory_and_count_are_refused_beside_those_in_flight(tmp_path: Path, disk: int) -> None:
    free = disk
    r = Reservations(tmp_path, 1, lambda mid: True)
    # Another migration in flight has reserved nearly all the disk and written nothing yet.
    r.reserve("other", Reservation(free - (8 << 20), 0, tmp_path / "other"))
    problems, _, _ = r.check("B", 16 << 20, [])
    assert any("max_incoming" in p for p in problems), problems
    assert any("work directory" in p and "No space left on device" in p for p in problems), problems
    too_much = psutil.virtual_memory().total * 2
    assert any("GiB of memory free" in p for p in r.check("B", too_much, [])[0])


def test_what_the_others_wrote_is_not_counted_twice(tmp_path: Path, disk: int) -> None:
    free = disk
    r = Reservations(tmp_path, 0, lambda mid: True)
    r.reserve("other", Reservation(free - (48 << 20), 0, tmp_path / "other"))
    assert not r.check("B", 16 << 20, [])[0]
    (tmp_path / "other").mkdir()
    with open(tmp_path / "other" / "pages.img", "wb") as f:
        f.write(os.urandom(1 << 20) * 32)  # written: no longer free, no longer still to come
    assert written(tmp_path / "other") >= 32 << 20
    assert not r.check("B", 16 << 20, [])[0]
    r.reserve("third", Reservation(40 << 20, 0, tmp_path / "third"))  # (what is still to come counts)
    assert r.check("B", 16 << 20, [])[0]
