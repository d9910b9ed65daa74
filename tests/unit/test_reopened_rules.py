"""Which copy of a reopened path a restore trusts (host.reopened): the same, or one no one else
could have put there than could where it was dumped."""

from __future__ import annotations

import fcntl
import os
import stat
from pathlib import Path

import pytest

from host import proc
from host.reopened import _HELD, Reopened, _conflicts, _differs, _end, untrusted

DIR = stat.S_IFDIR
WAS = Reopened("/scratch/job", 1000, 100, DIR | 0o755)


def _here(mode: int, uid: int = 1000, gid: int = 100) -> os.stat_result:
    return os.stat_result((mode, 0, 0, 1, uid, gid, 0, 0, 0, 0))


@pytest.mark.parametrize(
    "here",
    [
        _here(DIR | 0o755),  # the same
        _here(DIR | 0o700),  # fewer may write, or read
        _here(DIR | 0o755, uid=0),  # root's: root could have done anything anyway
    ],
)
def test_the_same_or_a_safer_copy_is_trusted(here: os.stat_result) -> None:
    assert _differs(WAS, here) == ("", "")


@pytest.mark.parametrize(
    "was, here, said",
    [
        (WAS, _here(stat.S_IFLNK | 0o777), ("is a symbolic link", "a directory")),
        (WAS, _here(stat.S_IFREG | 0o644), ("is a file", "a directory")),
        (WAS, _here(DIR | 0o755, uid=65534), ("belongs to UID 65534", "to UID 1000")),
        (WAS, _here(DIR | 0o775), ("may be written to by its group", "not")),
        (WAS, _here(DIR | 0o757), ("may be written to by anyone", "not")),
        (
            Reopened("/scratch/job", 1000, 100, DIR | 0o775),
            _here(DIR | 0o775, gid=200),
            ("may be written to by group 200", "by group 100"),
        ),
        (
            Reopened("/scratch", 0, 0, DIR | 0o1777),
            _here(DIR | 0o777, uid=0, gid=0),
            ("is not sticky", "as it was"),
        ),
    ],
)
def test_a_copy_someone_else_could_have_put_there_is_not(
    was: Reopened, here: os.stat_result, said: tuple[str, str]
) -> None:
    assert _differs(was, here) == said


@pytest.mark.parametrize(
    ("ours", "theirs", "waits"),
    [
        ("FLOCK WRITE 0 EOF", "1: FLOCK  ADVISORY  READ 7 fe:00:12 0 EOF", True),
        ("FLOCK READ 0 EOF", "1: FLOCK  ADVISORY  READ 7 fe:00:12 0 EOF", False),  # (two readers)
        ("FLOCK WRITE 0 EOF", "1: POSIX  ADVISORY  WRITE 7 fe:00:12 0 EOF", False),  # (flock and fcntl: apart)
        ("POSIX WRITE 0 99", "1: OFDLCK ADVISORY  READ -1 fe:00:12 50 59", True),  # (fcntl and OFD: one family)
        ("POSIX WRITE 0 99", "1: POSIX  ADVISORY  WRITE 7 fe:00:12 100 EOF", False),  # (bytes apart)
        ("POSIX READ 200 EOF", "1: POSIX  ADVISORY  WRITE 7 fe:00:12 100 300", True),
        ("OFDLCK READ 0 0", "1: POSIX  ADVISORY  READ 7 fe:00:12 0 EOF", False),
    ],
)
def test_which_lock_held_here_a_restored_one_would_wait_for(ours: str, theirs: str, waits: bool) -> None:
    kind, mode, start, end = ours.split()
    held = _HELD.match(theirs)
    assert held is not None
    assert _conflicts(kind, mode, int(start), _end(end), held) is waits


def test_a_lease_or_a_waiter_is_no_lock_the_tree_holds(tmp_path: Path) -> None:
    """A lease is noted as no lock (the manifest's notes hold flock, fcntl and OFD locks only:
    one noted as "LEASE" once made a manifest no restore could read); nor is a waiter's line."""
    path = tmp_path / "leased"
    path.write_text("x")
    with open(path) as f:
        fcntl.fcntl(f, fcntl.F_SETLEASE, fcntl.F_RDLCK)
        assert "LEASE" in Path(f"/proc/self/fdinfo/{f.fileno()}").read_text()
        assert proc.fd_locks(os.getpid(), str(f.fileno())) == []
        fcntl.flock(f, fcntl.LOCK_SH)
        assert proc.fd_locks(os.getpid(), str(f.fileno())) == ["FLOCK READ 0 EOF"]
    assert _HELD.match("1: -> FLOCK  ADVISORY  WRITE 7 fe:00:12 0 EOF") is None


def test_a_directory_only_on_the_way_to_a_removed_file_may_be_missing(tmp_path: Path) -> None:
    """CRIU makes it where it is missing (to put the removed file back there, then remove it):
    missing, it is no stranger's; there, it is checked as any other (and a row of it that says
    anything else is no manifest's)."""
    gone = str(tmp_path / "gone")
    there = Reopened(str(tmp_path), os.getuid(), os.getgid(), DIR | 0o700, removed=1)
    os.chmod(tmp_path, 0o700)
    assert untrusted([Reopened(gone, 0, 0, DIR | 0o755, removed=1), there], (), (), "here") == []
    assert untrusted([Reopened(gone, 0, 0, DIR | 0o755)], (), (), "here") == [f"{gone} is not on here"]
    os.chmod(tmp_path, 0o777)
    assert untrusted([there], (), (), "here") == [
        f"{tmp_path} may be written to by anyone on here, not where it was dumped"
    ]
    assert not Reopened(gone, 0, 0, DIR | 0o755, removed=2).valid() and there.valid()
