"""What a failed restore says where CRIU found a file the process held changed since the dump
(:func:`snapshot.criu._file_changed`), on CRIU's own lines (files-reg.c); the size and mode
cases are met for real in tests/snapshot/test_reopened.py, the build-ID ones only here (they
take another build of a library the process mapped)."""

from __future__ import annotations

from pathlib import Path

import pytest

from snapshot import criu

pytestmark = pytest.mark.unit

PREFIX = "(00.061234) 4242: Error (criu/files-reg.c:2146): "


@pytest.mark.parametrize(
    "line, said",
    [
        ("File usr/lib/libx.so has bad build-ID length 20 (expect 24)", "/usr/lib/libx.so, which the process held"),
        ("File usr/lib/libx.so has bad build-ID", "its ELF build-ID (another build of it)"),
        ("File data/a b.bin has bad size 7 (expect 1048576)", "its size (7 bytes here, 1,048,576 when dumped)"),
        ("File x has bad mode 0100600 (expect 0100644)", "/x, which the process held, has changed since the dump: its"),
    ],
)
def test_a_changed_file_is_named_in_one_sentence(tmp_path: Path, line: str, said: str) -> None:
    log = tmp_path / "restore.log"
    log.write_text(
        f"(00.06) 4242: Unrelated line\n{PREFIX}{line}\n(00.07) Error (criu/cr-restore.c:2331): Restoring FAILED.\n"
    )
    sentence = criu._file_changed(log)
    assert sentence is not None and said in sentence
    assert sentence.startswith("criu restore failed: ") and "nothing was restored" in sentence
    assert "\n" not in sentence


def test_a_name_with_control_characters_is_shown_escaped(tmp_path: Path) -> None:
    log = tmp_path / "restore.log"
    log.write_text(f"{PREFIX}File tmp/\x1b[2Jx has bad size 1 (expect 2)\n")
    sentence = criu._file_changed(log)
    assert sentence is not None and "\x1b" not in sentence and "/tmp/" in sentence


def test_other_failures_are_not_taken_for_it(tmp_path: Path) -> None:
    log = tmp_path / "restore.log"
    log.write_text("(00.06) 1: Error (criu/files.c:1221): Unable to open fd=3 id=0x17\n")
    assert criu._file_changed(log) is None
    assert criu._file_changed(tmp_path / "missing.log") is None
