"""Whose file a rank's output is read from for its stand-in (tpagent.jobs.rankentry.readable_by):
only one its user may read by the file's mode, as the kernel would judge it."""

from __future__ import annotations

import os
import stat

import pytest

from tpagent.jobs.rankentry import readable_by

USER, GROUP, TEAM = 1000, 1000, 2000


def _file(mode: int, uid: int, gid: int) -> os.stat_result:
    return os.stat_result((stat.S_IFREG | mode, 1, 1, 1, uid, gid, 0, 0, 0, 0))


@pytest.mark.parametrize(
    ("mode", "uid", "gid", "readable"),
    [
        (0o622, 0, 0, False),  # root's, anyone may write, only root read: the attack
        (0o600, 0, 0, False),
        (0o644, 0, 0, True),
        (0o200, USER, GROUP, True),  # its own (it may make it readable anyway)
        (0o640, 0, TEAM, True),  # its team's, the team may read
        (0o620, 0, TEAM, False),  # its team's, the team may only write
        (0o624, 0, TEAM, False),  # a group it is in is judged by the group's bits, as the kernel does
        (0o604, 0, 3000, True),  # a group it is not in: others' bits
    ],
)
def test_a_rank_output_file_is_read_only_where_its_user_may_read_it(
    mode: int, uid: int, gid: int, readable: bool
) -> None:
    assert readable_by(_file(mode, uid, gid), USER, (GROUP, TEAM)) is readable


def test_roots_rank_may_read_any_file() -> None:
    assert readable_by(_file(0o000, USER, GROUP), 0, ())
