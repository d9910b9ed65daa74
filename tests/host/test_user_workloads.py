"""A workload launched for a user (tpagent launch's ``run_as``, what the agent does for a user's
stand-in): it runs as that user with no other group, in the user's directory, joins the stand-in's
control groups (so a scheduler's limits and its end of a job reach it), and root's init takes none
of the user's environment; a control group it cannot join is refused."""

from __future__ import annotations

import os
import subprocess
import uuid
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest

from host import cgroups
from host.api import UsageError
from support.helpers import ROOT, wait_until
from support.users import NOBODY, user_dir, user_python
from tpagent.workload import launch

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="root's own branches: run as root")
WHO = ROOT / "tests" / "workloads" / "who.py"


@pytest.fixture
def group() -> Iterator[Path]:
    """A control group of its own, in the first hierarchy mounted here with the pids controller."""
    found = [Path("/sys/fs/cgroup/pids"), Path("/sys/fs/cgroup/unified"), Path("/sys/fs/cgroup")]
    base = next((d for d in found if (d / "cgroup.procs").exists()), None)
    if base is None:
        pytest.skip("no cgroup hierarchy is mounted at /sys/fs/cgroup")
    d = base / f"tpagent-test-{uuid.uuid4().hex[:8]}"
    d.mkdir()
    try:
        yield d
    finally:
        for pid in (d / "cgroup.procs").read_text().split():
            psutil.Process(int(pid)).kill()
        wait_until(lambda: not (d / "cgroup.procs").read_text().split(), "the group to empty", 30)
        d.rmdir()


def test_a_users_workload_runs_as_the_user_in_the_stand_ins_control_group(group: Path) -> None:
    python, env = user_python()
    stand_in = subprocess.Popen(["sleep", "60"])  # (what the agent reads a stand-in's groups from)
    try:
        (group / "cgroup.procs").write_text(str(stand_in.pid))
        files = cgroups.of_process(stand_in.pid)
        assert str(group / "cgroup.procs") in files
        with user_dir(NOBODY) as home:
            env = {**env, "PATH": os.defpath, "LD_PRELOAD": str(home / "absent.so")}
            who = launch.RunAs(NOBODY[0], NOBODY[1], (), str(home), env, files)
            init, holder = launch.start([python, str(WHO), "400"], home / "out", home / "out", run_as=who)
            try:
                rank = wait_until(lambda: (psutil.Process(init).children() or [None])[0], "the workload", 30)
                assert rank.uids().real == NOBODY[0] and rank.gids().real == NOBODY[1]
                assert str(init) in (group / "cgroup.procs").read_text().split()
                assert str(rank.pid) in (group / "cgroup.procs").read_text().split()
                assert "LD_PRELOAD" not in psutil.Process(init).environ()  # (root's init: none of it)
                assert psutil.Process(init).uids().real == 0
                wait_until(lambda: "tick 1 " in (home / "out").read_text(), "it to tick", 30)
                assert (
                    f"uid {NOBODY[0]} euid {NOBODY[0]} gid {NOBODY[1]} groups [] cwd {home}"
                    in (home / "out").read_text()
                )
            finally:
                holder.kill()
                psutil.Process(init).kill()
                holder.wait()

            # A group that is mounted here but cannot be joined (no such file in it): refused, nothing runs.
            bad = launch.RunAs(NOBODY[0], NOBODY[1], (), str(home), env, (str(group / "no-such-file"),))
            with pytest.raises(UsageError, match="cannot join the stand-in's control group"):
                launch.start([python, str(WHO), "4"], home / "o2", home / "o2", run_as=bad)
            assert not (home / "o2").exists() or "tick" not in (home / "o2").read_text()
    finally:
        stand_in.kill()
        stand_in.wait()


@pytest.mark.parametrize(
    "cmd, env, said",
    [
        (["x\ud800"], {}, "could not be launched: 'utf-8' codec can't encode"),
        (["x" * (1 << 17)], {}, "could not be launched: Argument list too long"),
        ([], {"A=B": "c"}, "could not be launched: cannot start"),
    ],
)
def test_a_command_the_kernel_or_python_refuses_is_said_and_leaves_no_descriptor(
    cmd: list[str], env: dict[str, str], said: str
) -> None:
    """(Each was a descriptor of root's agent leaked, asked of it by any user as often as they
    liked, or a false "did not start within 30 s".)"""
    python, user_env = user_python()
    fds = len(os.listdir("/proc/self/fd"))
    with user_dir(NOBODY) as home:
        who = launch.RunAs(NOBODY[0], NOBODY[1], (), str(home), {**user_env, **env})
        for _ in range(3):
            with pytest.raises(UsageError, match=said):
                launch.start([python, str(WHO), "4", *cmd], home / "out", home / "out", run_as=who)
    assert len(os.listdir("/proc/self/fd")) == fds
