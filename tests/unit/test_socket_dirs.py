"""Where a process's unix sockets are bound, and the directories a restore makes for them on
another node (:func:`snapshot.sockets.unix_bound`, the hook's ``_dirs_to``,
:func:`snapshot.safefs.make_dir`).  As whoever runs them (the unit tier: nobody; the suite: root)."""

from __future__ import annotations

import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from snapshot import hook, safefs, sockets
from snapshot.api import UsageError
from snapshot.manifest import SocketDir

NOBODY = 65534


def test_a_process_s_bound_sockets_are_found_and_its_abstract_or_unbound_ones_are_not(tmp_path: Path) -> None:
    path = tmp_path / "run dir" / "app.sock"  # (a space in a path, as /proc/net/unix shows it)
    path.parent.mkdir()
    code = (
        "import socket, sys\n"
        "a = socket.socket(socket.AF_UNIX); a.bind(sys.argv[1]); a.listen()\n"
        "b = socket.socket(socket.AF_UNIX); b.bind('\\0tpagent-test-abstract'); b.listen()\n"
        "c, d = socket.socketpair()\n"
        "print('ready', flush=True); sys.stdin.read()\n"
    )
    with subprocess.Popen([sys.executable, "-c", code, str(path)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                          text=True) as p:  # fmt: skip
        try:
            assert p.stdout is not None and p.stdout.readline() == "ready\n"
            assert sockets.unix_bound([p.pid]) == [str(path)]
            assert sockets.unix_bound([os.getpid()]) == []  # (another process's socket is not this one's)
        finally:
            p.kill()


def test_the_directories_on_the_way_are_listed_parents_first_as_they_are(tmp_path: Path) -> None:
    deep = tmp_path / "pymp-a" / "inner"
    deep.mkdir(parents=True)
    os.chmod(deep.parent, 0o700)
    for name in (deep / "listener-1", tmp_path / "pymp-a" / "listener-2"):
        name.touch()  # (as the socket file there would be: only its owner counts)
    found = hook._dirs_to([str(deep / "listener-1"), str(tmp_path / "pymp-a" / "listener-2")])
    paths = [d.path for d in found]
    assert paths[-2:] == [str(deep.parent), str(deep)] and "/" not in paths
    assert paths == sorted(set(paths), key=lambda p: (p.count("/"), p))  # once each, parents first
    mine = {d.path: d for d in found}[str(deep.parent)]
    assert (mine.uid, mine.mode) == (os.geteuid(), 0o700)


def test_a_path_through_a_symlink_gets_no_directories(tmp_path: Path) -> None:
    (tmp_path / "real").mkdir()
    (tmp_path / "real" / "app.sock").touch()
    (tmp_path / "link").symlink_to(tmp_path / "real")
    assert hook._dirs_to([str(tmp_path / "link" / "app.sock")]) == []


@pytest.mark.skipif(os.geteuid() != 0, reason="only root can give a directory to another user")
def test_only_the_directories_of_the_socket_s_owner_are_listed(tmp_path: Path) -> None:
    """Root's directories on the way (/tmp, say) are every node's: a restore makes none of them
    on a user's behalf."""
    users = tmp_path / "shared" / "pymp-f"
    users.mkdir(parents=True)
    (users / "listener").touch()
    os.chown(users, NOBODY, NOBODY)
    os.chown(users / "listener", NOBODY, NOBODY)
    assert hook._dirs_to([str(users / "listener")]) == [SocketDir(str(users), NOBODY, NOBODY, 0o755)]


def test_a_missing_directory_is_made_as_it_was_and_one_there_is_left_as_it_is(tmp_path: Path) -> None:
    created: list[Path] = []
    made = tmp_path / "pymp-b"
    safefs.make_dir(made, os.geteuid(), os.getegid(), 0o700, created)
    st = made.lstat()
    assert created == [made] and stat.S_ISDIR(st.st_mode) and stat.S_IMODE(st.st_mode) == 0o700
    assert (st.st_uid, st.st_gid) == (os.geteuid(), os.getegid())
    there = tmp_path / "there"
    there.mkdir(mode=0o755)
    safefs.make_dir(there, os.geteuid(), os.getegid(), 0o700, created)
    assert created == [made] and stat.S_IMODE(there.lstat().st_mode) == 0o755
    safefs.make_dir(tmp_path / "setid", os.geteuid(), os.getegid(), 0o6755, created)
    assert stat.S_IMODE((tmp_path / "setid").lstat().st_mode) == 0o755  # (never setuid/setgid)


def test_a_planted_symlink_on_the_way_is_refused_and_nothing_is_made_where_it_points(tmp_path: Path) -> None:
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (tmp_path / "planted").symlink_to(elsewhere)
    created: list[Path] = []
    with pytest.raises(UsageError, match="is a symlink"):
        safefs.make_dir(tmp_path / "planted" / "pymp-c", os.geteuid(), os.getegid(), 0o700, created)
    assert created == [] and list(elsewhere.iterdir()) == []


@pytest.mark.skipif(os.geteuid() != 0, reason="only root can give a directory to another user")
def test_root_makes_nothing_for_one_user_in_another_user_s_directory(tmp_path: Path) -> None:
    theirs = tmp_path / "nobodys"
    theirs.mkdir()
    os.chown(theirs, NOBODY, NOBODY)
    created: list[Path] = []
    with pytest.raises(UsageError, match="belongs to UID 0 but its directory to UID 65534"):
        safefs.make_dir(theirs / "pymp-d", 0, 0, 0o700, created)
    assert created == [] and list(theirs.iterdir()) == []
    safefs.make_dir(theirs / "pymp-e", NOBODY, NOBODY, 0o700, created)  # (the directory's owner's: made)
    assert created == [theirs / "pymp-e"] and (theirs / "pymp-e").lstat().st_uid == NOBODY
