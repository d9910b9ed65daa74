"""Which copy of a reopened path a restore trusts (host.reopened): the same, or one no one else
could have put there than could where it was dumped."""

from __future__ import annotations

import os
import stat

import pytest

from host.reopened import Reopened, _differs

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
