"""Files a process holds under a name since removed while the file keeps another
(:func:`host.files.relinked`), and the directories CRIU may name them again in."""

from __future__ import annotations

import os
from pathlib import Path

from host import files, reopened, safefs


def test_a_file_open_under_a_removed_name_with_another_is_found_once(tmp_path: Path) -> None:
    (tmp_path / "opened").write_bytes(b"x")
    fd = os.open(tmp_path / "opened", os.O_RDWR)
    again = os.open(tmp_path / "opened", os.O_RDONLY)
    gone = os.open(tmp_path / "gone", os.O_RDWR | os.O_CREAT)
    try:
        os.link(tmp_path / "opened", tmp_path / "kept")
        os.unlink(tmp_path / "opened")
        os.unlink(tmp_path / "gone")  # (no other name: CRIU keeps its bytes itself, a ghost file)
        found = [r for r in files.relinked([os.getpid()]) if r.path.startswith(str(tmp_path))]
        st = os.stat(tmp_path / "kept")
        assert found == [files.Relinked(os.getpid(), str(tmp_path / "opened"), st.st_dev, st.st_ino)]
    finally:
        for f in (fd, again, gone):
            os.close(f)


def test_only_directories_no_user_can_change_take_a_name_from_root(tmp_path: Path) -> None:
    assert safefs.changeable_dir(Path("/tmp")) == ""  # (root's, sticky)
    assert safefs.changeable_dir(Path("/dev/shm")) == ""
    mine = tmp_path / "d"
    mine.mkdir()
    if os.geteuid() != 0:  # (the unit tier runs as nobody, in a directory of its own: a user's)
        assert "which others can change" in safefs.changeable_dir(mine)
    assert safefs.changeable_dir(Path("/dev/fd")) == "is reached through /dev/fd, a symlink"
    assert "cannot be looked at (/tpagent-nothing:" in safefs.changeable_dir(Path("/tpagent-nothing/d"))


def test_a_live_file_named_as_the_kernel_names_removed_ones_is_no_removed_one(tmp_path: Path) -> None:
    """/proc shows a removed file's name with " (deleted)" after it, and a live file may be named
    so: it is no relinked file and a restore finds it by that name (it went unnoted, so its check
    of what CRIU reopened skipped it).  A removed file whose old name now leads to another file of
    that name is still a removed one.  In a directory a user can change, the live one is refused
    still: its name may be removed before CRIU looks, which would then name it again there."""
    live = tmp_path / "live (deleted)"
    live.write_bytes(b"x")
    (tmp_path / "opened").write_bytes(b"y")
    fds = [os.open(live, os.O_RDWR), os.open(tmp_path / "opened", os.O_RDWR)]
    try:
        os.link(tmp_path / "opened", tmp_path / "kept")
        os.unlink(tmp_path / "opened")
        (tmp_path / "opened (deleted)").write_bytes(b"another file of the name /proc shows")
        found = [r.path for r in files.relinked([os.getpid()]) if r.path.startswith(str(tmp_path))]
        assert found == [str(tmp_path / "opened")]
        noted = [r.path for r in reopened.note([os.getpid()])]
        assert str(live) in noted and str(tmp_path / "opened (deleted)") not in noted
        assert not files.removed(os.getpid(), f"/proc/self/fd/{fds[0]}", str(live))
        refused = [why for why in files.relink_refusals([os.getpid()]) if f"has {live} open" in why]
        assert len(refused) == (1 if safefs.changeable_dir(tmp_path) else 0), refused
    finally:
        for f in fds:
            os.close(f)


def test_a_removed_file_is_never_looked_up_by_a_name_someone_planted(tmp_path: Path) -> None:
    """A file with no name left is a removed one, whatever its old name with " (deleted)" after it
    leads to: a symlink planted there to the file itself (through /proc) is not followed."""
    fd = os.open(tmp_path / "gone", os.O_RDWR | os.O_CREAT)
    try:
        os.unlink(tmp_path / "gone")
        (tmp_path / "gone (deleted)").symlink_to(f"/proc/{os.getpid()}/fd/{fd}")
        assert files.removed(os.getpid(), f"/proc/self/fd/{fd}", str(tmp_path / "gone (deleted)"))
    finally:
        os.close(fd)
