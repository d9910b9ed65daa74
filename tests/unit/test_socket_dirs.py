"""Where a process's unix sockets are bound, and the directories a restore makes for them on
another node (:func:`host.sockets.unix_bound`, the hook's ``_dirs_to``,
:func:`host.safefs.make_dir`).  As whoever runs them (the unit tier: nobody; the suite: root)."""

from __future__ import annotations

import os
import socket
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from host import safefs, sockets
from host.api import UsageError
from snapshot import hook
from snapshot.manifest import BoundSocket, MadeDir

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
    with subprocess.Popen(
        [sys.executable, "-c", code, str(path)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    ) as p:
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


@pytest.mark.skipif(os.geteuid() != 0, reason="only root can give a directory to another user")
def test_only_the_directories_of_the_socket_s_owner_are_listed(tmp_path: Path) -> None:
    """Root's directories on the way (/tmp, say) are every node's: a restore makes none of them
    on a user's behalf."""
    users = tmp_path / "shared" / "pymp-f"
    users.mkdir(parents=True)
    os.chmod(users, 0o755)  # (whatever the umask)
    os.chown(users, NOBODY, NOBODY)
    found = hook._dirs_to([(str(users / "listener"), NOBODY)])
    assert found == [MadeDir(str(users), NOBODY, NOBODY, 0o755)]


def test_a_missing_directory_is_made_private_then_handed_over_and_one_there_is_left_as_it_is(tmp_path: Path) -> None:
    created: list[Path] = []
    made = tmp_path / "pymp-b"
    safefs.make_dir(made, created)
    assert created == [made] and stat.S_IMODE(made.lstat().st_mode) == 0o700  # (root's, while CRIU binds)
    safefs.hand_over(made, os.geteuid(), os.getegid(), 0o6750)
    st = made.lstat()
    assert (st.st_uid, st.st_gid, stat.S_IMODE(st.st_mode)) == (os.geteuid(), os.getegid(), 0o750)  # no set-id
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
        safefs.check_socket_path(tmp_path / "planted" / "app.sock", NOBODY)
    assert created == [] and list(elsewhere.iterdir()) == []


def _socket_file(path: Path) -> None:
    with socket.socket(socket.AF_UNIX) as s:
        s.bind(str(path))  # (the file stays once the socket is closed, as a killed process's does)


def test_a_directory_of_a_user_on_the_way_is_refused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """CRIU binds by name, as root: had a user a directory on the way, they could swap it for a
    symlink meanwhile (and have root remove and replace a socket anywhere, or chown a file)."""
    monkeypatch.setattr(safefs, "_protected_symlinks", lambda: True)  # (/tmp passes: the user's own is refused)
    users = tmp_path / "users"
    users.mkdir()
    uid = NOBODY if os.geteuid() == 0 else os.geteuid()
    if os.geteuid() == 0:
        os.chown(users, NOBODY, NOBODY)
    with pytest.raises(UsageError, match=rf"belongs to UID {uid}, who could change the way"):
        safefs.check_socket_path(users / "pymp-x" / "listener", uid)
    safefs.check_socket_path(users / "pymp-x" / "listener", 0)  # (root's own socket: root's affair)


@pytest.fixture
def roots(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A directory of root's, 0755, under /tmp (sticky; fs.protected_symlinks taken as on)."""
    if os.geteuid() != 0:
        pytest.skip("only root has directories of root's to make")
    monkeypatch.setattr(safefs, "_protected_symlinks", lambda: True)
    d = tmp_path / "roots"
    d.mkdir(mode=0o755)
    for at in [d, *d.parents]:
        if at.stat().st_uid == 0 and at.stat().st_mode & 0o022 and not at.stat().st_mode & stat.S_ISVTX:
            pytest.skip(f"{at} may be written by others")
    return d


def test_a_way_of_root_s_directories_is_taken_and_a_socket_of_another_user_there_never_replaced(roots: Path) -> None:
    """... and CRIU, as root, removes a socket file it finds where it binds one: a restore is
    refused first when that file is someone else's (a user's process bound /tmp/.X11-unix/X0 on
    its node; on this one, that is the display's)."""
    safefs.check_socket_path(roots / "pymp-y" / "listener", NOBODY)  # (missing: made root's)
    safefs.check_socket_path(roots / "app.sock", NOBODY)  # (nothing there)
    theirs = roots / "theirs.sock"
    _socket_file(theirs)
    with pytest.raises(UsageError, match=r"is a socket of UID 0 on this node, where the process \(UID 65534\)"):
        safefs.check_socket_path(theirs, NOBODY)
    assert theirs.exists()
    safefs.check_socket_path(theirs, 0)


def test_a_world_writable_way_needs_the_sticky_bit_and_protected_symlinks(
    roots: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    open_ = roots / "open"
    open_.mkdir()
    os.chmod(open_, 0o777)
    with pytest.raises(UsageError, match="may be written by other users"):
        safefs.check_socket_path(open_ / "app.sock", NOBODY)
    os.chmod(open_, 0o1777)
    safefs.check_socket_path(open_ / "app.sock", NOBODY)
    monkeypatch.setattr(safefs, "_protected_symlinks", lambda: False)
    with pytest.raises(UsageError, match="fs.protected_symlinks is off"):
        safefs.check_socket_path(open_ / "app.sock", NOBODY)


def test_only_a_socket_of_its_owner_is_removed(tmp_path: Path) -> None:
    mine = tmp_path / "mine.sock"
    _socket_file(mine)
    (tmp_path / "file").write_text("x")
    other = NOBODY if os.geteuid() == 0 else 0
    assert not safefs.remove_socket(mine, other) and mine.exists()
    assert not safefs.remove_socket(tmp_path / "file", os.geteuid()) and (tmp_path / "file").exists()
    st = mine.lstat()
    ident = (st.st_dev, st.st_ino, st.st_ctime_ns)
    assert not safefs.remove_socket(mine, os.geteuid(), (*ident[:2], ident[2] + 1)) and mine.exists()  # (another)
    assert safefs.remove_socket(mine, os.geteuid(), ident) and not mine.exists()
    _socket_file(mine)
    assert safefs.remove_socket(mine, os.geteuid()) and not mine.exists()
    assert not safefs.remove_socket(tmp_path / "gone" / "x.sock", os.geteuid())


def test_once_committed_the_original_s_sockets_and_their_empty_directories_go_but_not_a_copy_s(
    tmp_path: Path,
) -> None:
    """On a path every node shares, the copy has bound its own socket where the original's was:
    that one stays (once it was removed, and the copy's DataLoader could no longer reach its workers)."""
    from host.proc import ProcInfo
    from snapshot import leftovers, manifest

    me = os.geteuid()
    gone, shared = tmp_path / "pymp-g", tmp_path / "pymp-s"
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
