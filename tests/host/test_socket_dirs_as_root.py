"""Root's own branches of the directories a restore makes for a process's unix sockets, and of
the socket files it removes (tests/unit/test_socket_dirs.py runs as nobody, the unit tier's
user): only root can give a directory or a socket to another user, and only root has
directories of root's to make."""

from __future__ import annotations

import os
import socket
import stat
from pathlib import Path

import pytest

from host import userdirs
from host.api import UsageError
from snapshot import hook
from snapshot.manifest import MadeDir

NOBODY = 65534
pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="root's own branches: run as root")


def _socket_file(path: Path) -> None:
    with socket.socket(socket.AF_UNIX) as s:
        s.bind(str(path))  # (the file stays once the socket is closed, as a killed process's does)


def test_only_the_directories_of_the_socket_s_owner_are_listed(tmp_path: Path) -> None:
    """Root's directories on the way (/tmp, say) are every node's: a restore makes none of them
    on a user's behalf."""
    users = tmp_path / "shared" / "pymp-f"
    users.mkdir(parents=True)
    os.chmod(users, 0o755)  # (whatever the umask)
    os.chown(users, NOBODY, NOBODY)
    found = hook._dirs_to([(str(users / "listener"), NOBODY)])
    assert found == [MadeDir(str(users), NOBODY, NOBODY, 0o755)]


@pytest.fixture
def roots(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A directory of root's, 0755, under /tmp (sticky; fs.protected_symlinks taken as on)."""
    if os.geteuid() != 0:
        pytest.skip("only root has directories of root's to make")
    monkeypatch.setattr(userdirs, "_protected_symlinks", lambda: True)
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
    userdirs.check_socket_path(roots / "pymp-y" / "listener", NOBODY)  # (missing: made root's)
    userdirs.check_socket_path(roots / "app.sock", NOBODY)  # (nothing there)
    theirs = roots / "theirs.sock"
    _socket_file(theirs)
    with pytest.raises(UsageError, match=r"is a socket of UID 0 on this node, where the process \(UID 65534\)"):
        userdirs.check_socket_path(theirs, NOBODY)
    assert theirs.exists()
    userdirs.check_socket_path(theirs, 0)


def test_a_world_writable_way_needs_the_sticky_bit_and_protected_symlinks(
    roots: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    open_ = roots / "open"
    open_.mkdir()
    os.chmod(open_, 0o777)
    with pytest.raises(UsageError, match="may be written by other users"):
        userdirs.check_socket_path(open_ / "app.sock", NOBODY)
    os.chmod(open_, 0o1777)
    userdirs.check_socket_path(open_ / "app.sock", NOBODY)
    monkeypatch.setattr(userdirs, "_protected_symlinks", lambda: False)
    with pytest.raises(UsageError, match="fs.protected_symlinks is off"):
        userdirs.check_socket_path(open_ / "app.sock", NOBODY)


def test_a_directory_of_another_user_on_the_way_is_refused_to_root(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """As root (the agent): a directory of nobody's on the way to nobody's socket is refused, as
    it is when nobody asks (tests/unit/test_socket_dirs.py), and root's own socket is root's affair."""
    monkeypatch.setattr(userdirs, "_protected_symlinks", lambda: True)
    users = tmp_path / "users"
    users.mkdir()
    os.chown(users, NOBODY, NOBODY)
    with pytest.raises(UsageError, match=rf"belongs to UID {NOBODY}, who could change the way"):
        userdirs.check_socket_path(users / "pymp-x" / "listener", NOBODY)
    userdirs.check_socket_path(users / "pymp-x" / "listener", 0)


def test_root_removes_a_socket_only_for_its_owner(tmp_path: Path) -> None:
    """Root may remove any file: it removes a socket only on its owner's behalf."""
    roots = tmp_path / "roots.sock"
    theirs = tmp_path / "theirs.sock"
    _socket_file(roots)
    _socket_file(theirs)
    os.lchown(theirs, NOBODY, NOBODY)
    assert not userdirs.remove_socket(roots, NOBODY) and roots.exists()
    assert not userdirs.remove_socket(theirs, 0) and theirs.exists()
    assert userdirs.remove_socket(theirs, NOBODY) and not theirs.exists()
    assert userdirs.remove_socket(roots, 0) and not roots.exists()
