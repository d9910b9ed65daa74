"""host.safefs on tmp_path: private directories and files, and carried files' paths.

These run as whoever runs them (the unit tier: user nobody).  A symlink "of a user" is one not
owned by root: as root the test hands it to nobody first.  Root's own branches (a symlink of
root's is followed, a user's is not; a directory of another user's): tests/host/test_safefs_as_root.py."""

from __future__ import annotations

import errno
import io
import os
import stat
from pathlib import Path

import pytest

from host import safefs, trusted
from host.api import UsageError
from transfer.api import MIN_SECRET, read_secret

NOBODY = 65534


def _mode(path: Path) -> int:
    return stat.S_IMODE(path.lstat().st_mode)


def _users_symlink(link: Path, target: Path) -> Path:
    link.symlink_to(target)
    if os.geteuid() == 0:
        os.lchown(link, NOBODY, NOBODY)
    return link


def test_private_dir_creates_missing_parents_0700(tmp_path: Path) -> None:
    out = safefs.private_dir(tmp_path / "a" / "b" / "out")
    assert out == tmp_path / "a" / "b" / "out"
    for p in (tmp_path / "a", tmp_path / "a" / "b", out):
        assert p.is_dir() and _mode(p) == 0o700 and p.stat().st_uid == os.geteuid()


def test_private_dir_takes_an_own_looser_dir_and_shuts_it(tmp_path: Path) -> None:
    mine = tmp_path / "mine"
    mine.mkdir(0o755)
    mine.chmod(0o755)
    assert safefs.private_dir(mine, empty=True) == mine
    assert _mode(mine) == 0o700


def test_a_path_under_a_file_is_refused_in_one_sentence(tmp_path: Path) -> None:
    (tmp_path / "afile").touch()
    with pytest.raises(UsageError, match=r"afile is not a directory, so .*afile/x/y cannot be under it"):
        safefs.private_dir(tmp_path / "afile" / "x" / "y", empty=True)


def test_a_non_empty_dir_refused_keeps_its_mode(tmp_path: Path) -> None:
    """A dump's --out (or a restore's snapshot) refused as not empty is left as it was: a dump
    told --out /etc made /etc 0700 before it refused it."""
    d = tmp_path / "etc"
    d.mkdir()
    (d / "passwd").touch()
    d.chmod(0o755)
    with pytest.raises(UsageError, match="is not empty"):
        safefs.private_dir(d, empty=True)
    assert stat.S_IMODE(d.stat().st_mode) == 0o755


def test_a_directory_holding_others_files_keeps_its_mode(tmp_path: Path) -> None:
    """A directory given as a parent, or as a place to read from, that holds files already (an
    orchestrator's --state /dev/x.db, an agent's work_dir /var/lib) was shut to 0700: /dev so
    shut, no user could open /dev/null.  Only a directory to fill (empty, or made here) is."""
    system = tmp_path / "dev"
    system.mkdir()
    (system / "null").touch()
    system.chmod(0o755)
    assert safefs.private_dir(system) == system
    assert safefs.private_dir(system / "db-dir") == system / "db-dir"
    assert _mode(system) == 0o755 and _mode(system / "db-dir") == 0o700


@pytest.mark.parametrize("mode", [0o770, 0o707, 0o1777], ids=["group-writable", "other-writable", "sticky-shared"])
def test_private_dir_refuses_an_existing_dir_others_could_write(tmp_path: Path, mode: int) -> None:
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(mode)
    (shared / "planted").touch()
    with pytest.raises(UsageError, match=f"already exists with owner UID {os.geteuid()} and mode {mode:o}"):
        safefs.private_dir(shared)
    assert _mode(shared) == mode  # refused before anything was changed


def test_private_dir_refuses_a_path_through_a_dir_others_could_change(tmp_path: Path) -> None:
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o775)
    with pytest.raises(UsageError, match=f"{shared} can be changed by other users"):
        safefs.private_dir(shared / "run" / "out")
    assert not (shared / "run").exists()


def test_private_dir_goes_through_a_sticky_shared_dir(tmp_path: Path) -> None:
    sticky = tmp_path / "tmp"
    sticky.mkdir()
    sticky.chmod(0o1777)
    assert safefs.private_dir(sticky / "out").is_dir()
    assert _mode(sticky / "out") == 0o700


def test_private_dir_refuses_a_non_empty_dir_when_asked_for_an_empty_one(tmp_path: Path) -> None:
    out = tmp_path / "out"
    out.mkdir(0o700)
    (out / "left.img").touch()
    with pytest.raises(UsageError, match="is not empty"):
        safefs.private_dir(out, empty=True)
    assert safefs.private_dir(out) == out


def test_private_dir_refuses_a_file_and_a_users_symlink(tmp_path: Path) -> None:
    (tmp_path / "file").touch()
    with pytest.raises(UsageError, match="exists and is not a directory"):
        safefs.private_dir(tmp_path / "file")
    real = safefs.private_dir(tmp_path / "real")
    link = _users_symlink(tmp_path / "link", real)
    with pytest.raises(
        UsageError, match=f"{link} is a symlink owned by UID {NOBODY if os.geteuid() == 0 else os.geteuid()}"
    ):
        safefs.private_dir(link / "out")
    assert not (real / "out").exists()


def test_private_dir_without_create_only_checks(tmp_path: Path) -> None:
    assert safefs.private_dir(tmp_path / "later" / "out", create=False) == tmp_path / "later" / "out"
    assert not (tmp_path / "later").exists()


def test_a_private_file_is_read_only_if_ours_and_0600(tmp_path: Path) -> None:
    secret = tmp_path / "secret"
    secret.write_bytes(b"k" * 40 + b"\n")
    secret.chmod(0o600)
    assert trusted.read_private_file(secret, "the cluster secret") == b"k" * 40 + b"\n"
    assert read_secret(secret) == b"k" * 40
    secret.chmod(0o640)
    with pytest.raises(
        UsageError, match="the cluster secret in .* must be a file owned by .* with mode 600 or stricter"
    ):
        trusted.read_private_file(secret, "the cluster secret")
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo, 0o600)  # (its open waited for a writer, for ever)
    with pytest.raises(UsageError, match=r"the cluster secret in .*fifo must be a regular file, and .* is not one"):
        trusted.read_private_file(fifo, "the cluster secret")


def test_a_private_file_is_refused_behind_a_users_symlink_or_a_shared_dir(tmp_path: Path) -> None:
    shared = tmp_path / "shared"
    shared.mkdir()
    (shared / "key").write_bytes(b"x")
    (shared / "key").chmod(0o600)
    link = _users_symlink(tmp_path / "key", shared / "key")
    with pytest.raises(UsageError, match="is a symlink owned by UID"):
        trusted.read_private_file(link, "the TLS private key")
    shared.chmod(0o777)
    with pytest.raises(UsageError, match="can be changed by other users"):
        trusted.read_private_file(shared / "key", "the TLS private key")
    with pytest.raises(UsageError, match="cannot read the TLS private key from .*missing"):
        trusted.read_private_file(tmp_path / "missing", "the TLS private key")


def test_read_secret_refuses_none_and_a_short_secret(tmp_path: Path) -> None:
    with pytest.raises(UsageError, match="no cluster secret: pass --secret-file or set TPAGENT_SECRET_FILE"):
        read_secret(None)
    short = tmp_path / "short"
    short.write_bytes(b"k" * (MIN_SECRET - 1) + b"\n")
    short.chmod(0o600)
    with pytest.raises(UsageError, match=f"shorter than {MIN_SECRET} bytes"):
        read_secret(short)


def test_private_opener_makes_0600_and_follows_no_symlink(tmp_path: Path) -> None:
    with open(tmp_path / "new", "w", opener=safefs.private_opener) as f:
        f.write("x")
    assert _mode(tmp_path / "new") == 0o600
    (tmp_path / "link").symlink_to(tmp_path / "new")
    with pytest.raises(OSError) as e:
        safefs.private_opener(str(tmp_path / "link"), os.O_WRONLY | os.O_TRUNC)
    assert e.value.errno == errno.ELOOP
    assert (tmp_path / "new").read_text() == "x"


def test_a_carried_file_is_read_through_no_symlink(tmp_path: Path) -> None:
    data = tmp_path / "data"
    data.mkdir()
    (data / "cache.bin").write_bytes(b"cached")
    fd = safefs.open_to_read(data / "cache.bin")
    assert fd is not None
    with os.fdopen(fd, "rb") as f:
        assert f.read() == b"cached"
    assert safefs.open_to_read(data / "gone.bin") is None
    os.mkfifo(data / "fifo")
    assert safefs.open_to_read(data / "fifo") is None  # (never opened: it would block)
    (tmp_path / "via").symlink_to(data)
    with pytest.raises(
        UsageError, match=f"{tmp_path / 'via'} is a symlink on the way to {tmp_path / 'via' / 'cache.bin'}"
    ):
        safefs.open_to_read(tmp_path / "via" / "cache.bin")
    (data / "alias.bin").symlink_to(data / "cache.bin")
    with pytest.raises(UsageError, match="is a symlink, and tpagent .* follows no symlink"):
        safefs.open_to_read(data / "alias.bin")


def test_check_owner_wants_the_dir_of_root_or_of_the_files_owner(tmp_path: Path) -> None:
    safefs.check_owner(0, 1000, tmp_path)
    safefs.check_owner(1000, 1000, tmp_path)
    with pytest.raises(UsageError, match="belongs to UID 1000 but its directory to UID 1001"):
        safefs.check_owner(1001, 1000, tmp_path)


def test_write_file_puts_a_file_back_without_setuid(tmp_path: Path) -> None:
    target = tmp_path / "new" / "deeper" / "state.bin"
    created: list[Path] = []
    uid = os.geteuid()
    gid = os.getegid()
    safefs.write_file(target, io.BytesIO(b"state"), uid, gid, 0o4750, 1_000_000.0, created)
    assert created == [tmp_path / "new", tmp_path / "new" / "deeper", target]
    assert target.read_bytes() == b"state" and _mode(target) == 0o750 and target.stat().st_mtime == 1_000_000.0
    assert _mode(tmp_path / "new") == safefs.CREATED_DIR
    again: list[Path] = []
    safefs.write_file(target, io.BytesIO(b"state"), uid, gid, 0o750, 0.0, again)  # the same file: left as it is
    assert again == []
    with pytest.raises(UsageError, match="exists on this node with other content, owner or mode"):
        safefs.write_file(target, io.BytesIO(b"other"), uid, gid, 0o750, 0.0, again)
    assert target.read_bytes() == b"state"
    target.unlink()
