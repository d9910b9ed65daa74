"""Root's own branches of host.safefs (tests/unit/test_safefs_private.py runs as nobody, the unit
tier's user): root follows a symlink of root's and no other user's, and takes no directory of
another user's for its own."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from host import safefs, trusted
from host.api import UsageError

NOBODY = 65534
pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="root's own branches: run as root")


def test_private_dir_follows_roots_symlink_and_refuses_a_users_dir(tmp_path: Path) -> None:
    real = safefs.private_dir(tmp_path / "real")
    (tmp_path / "roots").symlink_to(real)
    assert safefs.private_dir(tmp_path / "roots" / "out") == real / "out"
    theirs = tmp_path / "theirs"
    theirs.mkdir(0o700)
    os.chown(theirs, NOBODY, NOBODY)
    with pytest.raises(UsageError, match=f"already exists with owner UID {NOBODY}"):
        safefs.private_dir(theirs)


def test_root_refuses_a_symlink_of_another_user_on_the_way(tmp_path: Path) -> None:
    """A symlink that nobody owns, on the way to a private directory or a private file: root
    goes through neither (nobody could point it anywhere)."""
    real = safefs.private_dir(tmp_path / "real")
    (real / "key").write_bytes(b"x")
    (real / "key").chmod(0o600)
    link = tmp_path / "link"
    link.symlink_to(real)
    os.lchown(link, NOBODY, NOBODY)
    with pytest.raises(UsageError, match=f"{link} is a symlink owned by UID {NOBODY}"):
        safefs.private_dir(link / "out")
    assert not (real / "out").exists()
    with pytest.raises(UsageError, match=f"is a symlink owned by UID {NOBODY}"):
        trusted.read_private_file(link / "key", "the TLS private key")


def test_a_secret_of_another_users_is_not_to_be_made_roots(tmp_path: Path) -> None:
    """Refused, root was told to `chown 0` it: a secret another user wrote, and knows, adopted.
    Root is told to make a new one; its own, too open, to chmod it."""
    secret = tmp_path / "secret"
    secret.write_bytes(b"k" * 40)
    secret.chmod(0o600)
    os.chown(secret, NOBODY, NOBODY)
    with pytest.raises(UsageError, match="owner UID 65534, mode 600\\); make a new one: its owner knows") as e:
        trusted.read_private_file(secret, "the cluster secret")
    assert "chown" not in str(e.value)
    os.chown(secret, 0, 0)
    secret.chmod(0o644)
    with pytest.raises(UsageError, match=f"mode 644\\); run: chmod 600 {secret}\\.$"):
        trusted.read_private_file(secret, "the cluster secret")
