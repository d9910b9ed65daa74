"""The job's store that rank 0's stand-in serves (srun, ``env://``) runs with no privilege: the
stand-in is root's (it launches the rank into namespaces), the store needs none, and it runs the
rank's own Python, which is the user's choice.  As root here, as a stand-in runs."""

from __future__ import annotations

import os
import subprocess
import sys
import sysconfig
from datetime import timedelta
from pathlib import Path

import psutil
import pytest
from torch import distributed as torch_distributed

from support.agents import free_port
from tpagent.jobs import standin, storeserver
from tpagent_rank import protocol as P

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="a stand-in runs as root")
NOBODY = 65534


def _anyones_python() -> tuple[str, dict[str, str]]:
    """A Python with torch that any user can run: this one, or the system's with this one's packages."""
    try:
        subprocess.run([sys.executable, "-c", "import torch"], user=NOBODY, group=NOBODY, extra_groups=[], check=True)
        return sys.executable, {}
    except (OSError, subprocess.CalledProcessError):  # (a Python under root's home, as pyenv's)
        pass
    return "/usr/bin/python3", {"PYTHONPATH": sysconfig.get_path("purelib")}


def _serves(python: str, env: dict[str, str]) -> tuple[psutil.Process, str, object]:
    port = free_port()
    mine = {k: v for k, v in os.environ.items() if not k.startswith("SUDO_")}  # (under sudo: only what a case sets)
    env = {**mine, **env, "RANK": "0", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "HF_TOKEN": "hf_x"}
    server, said = standin.host_store([python, "train.py"], env)
    assert server is not None, said
    client = torch_distributed.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=10))
    client.set("k", "v")
    assert client.get("k") == b"v"  # (it serves the job as before)
    return psutil.Process(server.pid), said, server


def _groups(pid: int) -> list[int]:
    with open(f"/proc/{pid}/status") as f:
        line = next(ln for ln in f if ln.startswith("Groups:"))
    return [int(g) for g in line.split()[1:]]


@pytest.mark.parametrize(("sudo", "uid"), [({}, 65534), ({"SUDO_UID": "1", "SUDO_GID": "1"}, 1)])
def test_the_store_a_stand_in_serves_runs_as_nobody_or_the_user_who_started_it(sudo: dict[str, str], uid: int) -> None:
    python, env = _anyones_python()
    p, said, server = _serves(python, {**env, **sudo})
    try:
        assert said == ""
        assert set(p.uids()) == {uid} and set(p.gids()) == {uid} and set(_groups(p.pid)) <= {uid}
        assert "HF_TOKEN" not in p.environ()  # (the rank's keys stay with the rank)
    finally:
        standin.stop_store(server)  # type: ignore[arg-type]


def test_a_python_only_root_may_run_serves_it_as_root_and_says_so(tmp_path: Path) -> None:
    hidden = tmp_path / "root-only"
    hidden.mkdir(mode=0o700)
    (hidden / "python3").symlink_to(sys.executable)
    p, said, server = _serves(str(hidden / "python3"), {"PYTHONPATH": sysconfig.get_path("purelib")})
    try:
        assert p.uids().effective == 0
        assert said.startswith("the job's store is served as root: as UID 65534 it did not start"), said
    finally:
        standin.stop_store(server)  # type: ignore[arg-type]


def test_a_users_rank_is_never_served_as_root_anew(tmp_path: Path) -> None:
    """The store of a job lost with its node, served anew by the agent (root) with the Python of
    a rank of a user's (nobody's here): as that user, and where the user cannot run it (a Python
    only root may run, or one the user's own code makes fail as any user but root), not at all,
    never as root, which would run the user's code (its Python, its PYTHONPATH) as root."""
    hidden = tmp_path / "root-only"
    hidden.mkdir(mode=0o700)
    (hidden / "python3").symlink_to(sys.executable)
    env = (f"PYTHONPATH={sysconfig.get_path('purelib')}",)
    spec = P.Join((str(hidden / "python3"), "train.py"), env, "/", 0o022, NOBODY, NOBODY, (), "/dev/null", "/dev/null")
    before = _store_servers()
    with pytest.raises(RuntimeError, match=r"^serving it on port 0 failed: .*python3: Permission denied"):
        storeserver.serve_anew("job1", spec, "127.0.0.1", "", lambda: True)
    assert _store_servers() <= before  # (no server of it runs, as root or anyone)


def _store_servers() -> set[int]:
    found = set()
    for p in psutil.process_iter():
        try:
            if storeserver.STORE_SERVER in p.cmdline():
                found.add(p.pid)
        except psutil.Error:
            continue
    return found
