"""The directories a restore makes for a process's unix sockets on another node (the hook's
``_dirs_to``, :func:`host.safefs.make_dir`), and the socket files it removes.  As whoever runs
them (the unit tier: nobody).  Root's own branches: tests/host/test_socket_dirs_as_root.py; the
sockets a real process has bound: tests/host/test_process_sockets.py."""

from __future__ import annotations

import os
import socket
import stat
from pathlib import Path

import pytest

from host import safefs, userdirs
from host.api import UsageError
from snapshot import hook
from snapshot.manifest import BoundSocket, MadeDir

NOBODY = 65534


def test_the_directories_on_the_way_are_listed_parents_first_as_they_are(tmp_path: Path) -> None:
    deep = tmp_path / "pymp-a" / "inner"
    deep.mkdir(parents=True)
    os.chmod(deep.parent, 0o700)
    me = os.geteuid()
    found = hook._dirs_to([(str(deep / "listener-1"), me), (str(deep.parent / "listener-2"), me)])
    paths = [d.path for d in found]
    assert paths[-2:] == [str(deep.parent), str(deep)] and "/" not in paths
    assert paths == sorted(set(paths), key=lambda p: (p.count("/"), p))  # once each, parents first
    mine = {d.path: d for d in found}[str(deep.parent)]
    assert (mine.uid, mine.mode) == (me, 0o700)


def test_a_path_through_a_symlink_gets_no_directories(tmp_path: Path) -> None:
    (tmp_path / "real").mkdir()
    (tmp_path / "link").symlink_to(tmp_path / "real")
    assert hook._dirs_to([(str(tmp_path / "link" / "app.sock"), os.geteuid())]) == []


def test_a_missing_directory_is_made_private_then_handed_over_and_one_there_is_left_as_it_is(tmp_path: Path) -> None:
    created: list[Path] = []
    made = tmp_path / "pymp-b"
    safefs.make_dir(made, created)
    assert created == [made] and stat.S_IMODE(made.lstat().st_mode) == 0o700  # (root's, while CRIU binds)
    safefs.hand_over(made, os.geteuid(), os.getegid(), 0o6750)
    st = made.lstat()
    # never setuid; setgid, a directory's, gives what is made in it its group (a project's 2775)
    assert (st.st_uid, st.st_gid, stat.S_IMODE(st.st_mode)) == (os.geteuid(), os.getegid(), 0o2750)
    there = tmp_path / "there"
    there.mkdir()
    os.chmod(there, 0o755)  # (whatever the umask)
    safefs.make_dir(there, created)
    assert created == [made] and stat.S_IMODE(there.lstat().st_mode) == 0o755


def test_a_planted_symlink_on_the_way_is_refused_and_nothing_is_made_where_it_points(tmp_path: Path) -> None:
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (tmp_path / "planted").symlink_to(elsewhere)
    created: list[Path] = []
    with pytest.raises(UsageError, match="is a symlink"):
        safefs.make_dir(tmp_path / "planted" / "pymp-c", created)
    with pytest.raises(UsageError, match="is a symlink"):
        safefs.hand_over(tmp_path / "planted", NOBODY, NOBODY, 0o700)
    with pytest.raises(UsageError):  # (a user's directory on the way, or the symlink itself)
        userdirs.check_socket_path(tmp_path / "planted" / "app.sock", NOBODY)
    assert created == [] and list(elsewhere.iterdir()) == []


def _socket_file(path: Path) -> None:
    with socket.socket(socket.AF_UNIX) as s:
        s.bind(str(path))  # (the file stays once the socket is closed, as a killed process's does)


def test_a_directory_of_a_user_on_the_way_is_refused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """CRIU binds by name, as root: had a user a directory on the way, they could swap it for a
    symlink meanwhile (and have root remove and replace a socket anywhere, or chown a file)."""
    monkeypatch.setattr(userdirs, "_protected_symlinks", lambda: True)  # (/tmp passes: the user's own is refused)
    users = tmp_path / "users"
    users.mkdir()
    uid = NOBODY if os.geteuid() == 0 else os.geteuid()
    if os.geteuid() == 0:
        os.chown(users, NOBODY, NOBODY)
    with pytest.raises(UsageError, match=rf"belongs to UID {uid}, who could change the way"):
        userdirs.check_socket_path(users / "pymp-x" / "listener", uid)
    userdirs.check_socket_path(users / "pymp-x" / "listener", 0)  # (root's own socket: root's affair)


def test_only_a_socket_of_its_owner_is_removed(tmp_path: Path) -> None:
    mine = tmp_path / "mine.sock"
    _socket_file(mine)
    (tmp_path / "file").write_text("x")
    other = NOBODY if os.geteuid() == 0 else 0
    assert not userdirs.remove_socket(mine, other) and mine.exists()
    assert not userdirs.remove_socket(tmp_path / "file", os.geteuid()) and (tmp_path / "file").exists()
    st = mine.lstat()
    ident = (st.st_dev, st.st_ino, st.st_ctime_ns)
    assert not userdirs.remove_socket(mine, os.geteuid(), (*ident[:2], ident[2] + 1)) and mine.exists()  # (another)
    assert userdirs.remove_socket(mine, os.geteuid(), ident) and not mine.exists()
    _socket_file(mine)
    assert userdirs.remove_socket(mine, os.geteuid()) and not mine.exists()
    assert not userdirs.remove_socket(tmp_path / "gone" / "x.sock", os.geteuid())


def test_once_committed_the_original_s_sockets_and_their_empty_directories_go_but_not_a_copy_s(
    tmp_path: Path,
) -> None:
    """On a path every node shares, the copy has bound its own socket where the original's was:
    that one stays (once it was removed, and the copy's DataLoader could no longer reach its workers)."""
    from host.proc import ProcInfo
    from snapshot import leftovers, manifest

    me = os.geteuid()
    gone = tmp_path / "pymp-g"
    shared = tmp_path / "pymp-s"
    gone.mkdir()
    shared.mkdir()
    for d in (gone, shared):
        _socket_file(d / "listener")
    ids = {d: ((st := (d / "listener").lstat()).st_dev, st.st_ino, st.st_ctime_ns) for d in (gone, shared)}
    (shared / "listener").unlink()
    _socket_file(shared / "listener")  # (the copy's, bound anew: often under the same inode number)
    snap = tmp_path / "snap"
    (snap / manifest.IMAGES_DIR).mkdir(parents=True)
    m = manifest.Manifest(
        root_pid=1,
        namespace=False,
        processes=[ProcInfo(1, 0, ("x",), (1,), False, ())],
        gpus=[],
        criu={"version": "4.1", "shell_job": False, "tcp_established": False},
        cuda={"driver_version": 0, "pids": []},
        tpagent_version="0",
        sockets=[BoundSocket(str(d / "listener"), me, *ids[d]) for d in (gone, shared)],
        dirs=[MadeDir(str(d), me, os.getegid(), 0o700) for d in (gone, shared)],
    )
    m.write(snap)
    assert leftovers.clear_sockets(snap) == [str(gone / "listener"), str(gone)]
    assert not gone.exists() and (shared / "listener").exists()


def test_a_recorded_directory_is_removed_only_if_it_is_still_its_owner_s_and_a_directory(tmp_path: Path) -> None:
    """Once the original is ended its empty directories go; a name someone else took since (a
    file, another's directory, a symlink) is never removed (once root unlinked a file there)."""
    from host import userdirs

    me = os.geteuid()
    (tmp_path / "theirs").write_text("another's file, at a recorded directory's name")
    (tmp_path / "elsewhere").mkdir()
    (tmp_path / "link").symlink_to(tmp_path / "elsewhere")
    (tmp_path / "mine").mkdir()
    assert not userdirs.remove_dir(tmp_path / "theirs", me) and (tmp_path / "theirs").exists()
    assert not userdirs.remove_dir(tmp_path / "link", me) and (tmp_path / "elsewhere").is_dir()
    assert not userdirs.remove_dir(tmp_path / "mine", me + 1) and (tmp_path / "mine").is_dir()
    assert userdirs.remove_dir(tmp_path / "mine", me) and not (tmp_path / "mine").exists()
