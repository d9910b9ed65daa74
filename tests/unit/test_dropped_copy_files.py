"""What a restore made on a node, taken back when its copy is dropped
(:func:`snapshot.putback.take_back_created`, :func:`host.userdirs.remove_same`): only those very
files, sockets and directories, through no symlink, a directory only once empty.  As whoever
runs them (the unit tier: nobody; the suite: root)."""

from __future__ import annotations

import json
import os
import socket
from pathlib import Path

from host import proc
from snapshot import putback
from snapshot.manifest import BoundSocket


def _made(tmp_path: Path) -> tuple[Path, list[Path]]:
    """A directory with a file, a socket and a file in a subdirectory, as a restore makes them
    (a carried file, a DataLoader worker's socket); the note of them; what it lists."""
    d = tmp_path / "local" / "pymp-x"
    (d / "sub").mkdir(parents=True)
    (d / "scratch").write_bytes(b"carried")
    (d / "sub" / "shm").write_bytes(b"mapped")
    with socket.socket(socket.AF_UNIX) as s:
        s.bind(str(d / "listener"))
    made = [d, d / "sub", d / "scratch", d / "sub" / "shm", d / "listener"]
    note = tmp_path / "note"
    bound = [
        BoundSocket(str(d / "listener"), os.geteuid(), 0, 0, 0),
        BoundSocket(str(d / "scratch"), os.geteuid(), 0, 0, 0),
    ]
    putback.note_created(note, made[:4], bound)  # (no socket at the second: not noted twice)
    return note, made


def test_what_the_restore_made_goes_the_last_made_first(tmp_path: Path) -> None:
    note, made = _made(tmp_path)
    assert putback.take_back_created(note) == [str(p) for p in reversed(made)]
    assert os.listdir(tmp_path / "local") == []


def test_a_file_replaced_since_and_one_put_there_since_stay_with_their_directory(tmp_path: Path) -> None:
    note, made = _made(tmp_path)
    d = made[0]
    (d / "scratch.new").write_bytes(b"someone's")
    os.replace(d / "scratch.new", d / "scratch")  # (another file at the path now)
    (d / "sub" / "theirs").write_bytes(b"put there since")
    assert putback.take_back_created(note) == [str(d / "listener"), str(d / "sub" / "shm")]
    assert (d / "scratch").read_bytes() == b"someone's" and (d / "sub" / "theirs").exists()
    (d / "sub" / "theirs").unlink()
    (d / "scratch").unlink()
    assert putback.take_back_created(note) == [str(d / "sub"), str(d)]  # (empty now: they go)


def test_nothing_is_removed_through_a_directory_swapped_for_a_symlink(tmp_path: Path) -> None:
    note, made = _made(tmp_path)
    d = made[0]
    elsewhere = tmp_path / "elsewhere"
    d.rename(elsewhere)  # (the very files, their inodes unchanged, now reached through a symlink)
    d.symlink_to(elsewhere)
    assert putback.take_back_created(note) == []
    assert sorted(os.listdir(elsewhere)) == ["listener", "scratch", "sub"]
    assert (elsewhere / "sub" / "shm").read_bytes() == b"mapped"


def test_a_missing_or_damaged_note_or_one_of_another_boot_removes_nothing(tmp_path: Path) -> None:
    note, made = _made(tmp_path)
    kept = note.read_text()
    assert putback.take_back_created(tmp_path / "no note") == []
    boot = proc.boot_id()
    note.write_text(kept.replace(boot, "another boot"))  # (inode numbers start again after a reboot)
    assert putback.take_back_created(note) == []
    bad = [{"path": "relative/x", "dev": 1, "ino": 2, "uid": 0}, {"path": 3}, "x"]
    note.write_text(json.dumps({"boot": boot, "made": bad}))
    assert putback.take_back_created(note) == []
    note.write_text("not json")
    assert putback.take_back_created(note) == []
    assert all(os.path.lexists(p) for p in made)


def test_a_failed_restore_takes_back_only_what_it_made_as_it_made_it(tmp_path: Path) -> None:
    """:func:`putback.take_back` (a restore that failed after putting files back): a file its
    owner replaced since, and a directory someone put a file in, stay; the rest goes."""
    _, made = _made(tmp_path)
    d = made[0]
    ids = putback.identities(made)
    (d / "scratch.new").write_bytes(b"someone's")
    os.replace(d / "scratch.new", d / "scratch")
    putback.take_back(made, ids)
    assert os.listdir(tmp_path / "local") == ["pymp-x"]
    assert os.listdir(d) == ["scratch"] and (d / "scratch").read_bytes() == b"someone's"
    (d / "scratch").unlink()
    putback.take_back(made, ids)
    assert os.listdir(tmp_path / "local") == []
