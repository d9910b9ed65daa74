"""A restart waits for what its process writes to files (:func:`tpagent_rank.recover.quiet`):
its ``exec`` would cut a checkpoint's write short."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import BinaryIO

import pytest

from tpagent_rank import recover


@pytest.fixture(autouse=True)
def _still(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(recover, "STILL", 0.5, raising=False)  # (2 s in a rank: these tests' writers pause less)


@contextmanager
def writing(f: BinaryIO, pieces: int | None = None, pause: float = 0.01) -> Iterator[Callable[[], None]]:
    """``f`` written 4 KiB each ``pause`` seconds, by another thread (``pieces`` of them, else
    until the end)."""
    stop = threading.Event()

    def write() -> None:
        n = 0
        while not stop.is_set() and (pieces is None or n < pieces):
            f.write(b"x" * 4096)
            f.flush()
            n += 1
            time.sleep(pause)

    t = threading.Thread(target=write)
    t.start()
    try:
        yield t.join
    finally:
        stop.set()
        t.join()


def test_a_file_being_written_is_named_once_it_has_been_waited_for(tmp_path: Path) -> None:
    path = tmp_path / "checkpoint.pt"
    with open(path, "wb") as f:
        with writing(f):
            said = recover.quiet(0.3)
        assert said.startswith(f"{path} was still being written") and "cut short" in said, said
        assert recover.quiet(5.0) == ""  # (open, but nothing written to it now)


def test_a_write_that_ends_is_waited_for(tmp_path: Path) -> None:
    path = tmp_path / "checkpoint.pt"
    with open(path, "wb") as f, writing(f, pieces=40) as joined:
        assert recover.quiet(30.0) == ""
        assert path.stat().st_size == 40 * 4096  # (waited for until the last piece)
        joined()


def test_logs_appended_to_and_files_read_are_not_waited_for(tmp_path: Path) -> None:
    (tmp_path / "data").write_bytes(b"d" * 4096)
    with open(tmp_path / "train.log", "ab") as log, open(tmp_path / "data", "rb") as data, writing(log):
        data.read(100)
        assert recover.quiet(5.0) == ""


def test_a_writer_that_pauses_between_its_writes_is_waited_for(tmp_path: Path) -> None:
    """Its pauses (pickling the next tensor, its thread waiting for the interpreter) are longer
    than a look at its offset, shorter than STILL."""
    path = tmp_path / "checkpoint.pt"
    with open(path, "wb") as f, writing(f, pieces=3, pause=0.25) as joined:
        assert recover.quiet(30.0) == ""
        assert path.stat().st_size == 3 * 4096
        joined()
