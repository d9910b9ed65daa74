"""Running things as ordinary users (a job's user under Slurm, an attacker): ``setpriv`` to the
user with no supplementary group, an interpreter that user can run with the tree's packages, and
a directory of their own (under /tmp: a test's own directory is root's alone)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import sysconfig
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from support.helpers import ROOT

#: (UID, GID) of two users every Debian has: a job's user and another one.
NOBODY = (65534, 65534)
DAEMON = (1, 1)


def as_user(user: tuple[int, int]) -> list[str]:
    return ["setpriv", f"--reuid={user[0]}", f"--regid={user[1]}", "--clear-groups", "--"]


def user_python() -> tuple[str, dict[str, str]]:
    """An interpreter any user can run, with this tree and the .venv's packages on its path
    (.venv's own may live where only root reaches, as pyenv's under /root)."""
    site = sysconfig.get_path("purelib")
    env = {"PYTHONPATH": os.pathsep.join((str(ROOT), site))}
    probe = [*as_user(NOBODY), "sh", "-c", 'exec "$0" -c ""', sys.executable]  # (setpriv's own exec sees more)
    if subprocess.run(probe, capture_output=True).returncode == 0:
        return sys.executable, env
    version = f"{sys.version_info[0]}.{sys.version_info[1]}"
    system = "/usr/bin/python3"
    out = subprocess.run([*as_user(NOBODY), system, "-c", "import sys; print(*sys.version_info[:2], sep='.')"],
                         capture_output=True, text=True)  # fmt: skip
    assert out.stdout.strip() == version, f"no Python {version} that any user can run (.venv's is root's alone)"
    return system, env


@contextmanager
def user_dir(user: tuple[int, int], prefix: str = "tpagent-user-") -> Iterator[Path]:
    d = Path(tempfile.mkdtemp(prefix=prefix, dir="/tmp"))
    try:
        os.chown(d, *user)
        d.chmod(0o700)
        yield d
    finally:
        shutil.rmtree(d, ignore_errors=True)
