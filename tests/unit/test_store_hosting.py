"""The job's store served by rank 0's stand-in rather than by rank 0 (srun, ``env://``: a rank
that served it could not move): which ranks it applies to, and the Python it is served with.
(A real server joined by a real rank through the runtime: tests/rank/test_store_hosting_job.py.)"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

from tpagent.jobs import standin


def test_the_python_that_runs_a_command(tmp_path: Path) -> None:
    env = {"PATH": os.path.dirname(sys.executable) + os.pathsep + "/usr/bin:/bin"}
    assert standin.python_of([sys.executable, "train.py"], env) == sys.executable
    assert standin.python_of([Path(sys.executable).name, "train.py"], env) == sys.executable
    script = tmp_path / "train"
    script.write_text(f"#!{sys.executable}\nprint()\n")
    assert standin.python_of([str(script)], env) == sys.executable  # (a console script)
    script.write_text("#!/usr/bin/env python3 -u\nprint()\n")
    assert Path(standin.python_of([str(script)], {"PATH": "/usr/bin:/bin"}) or "").name == "python3"
    script.write_text("#!/bin/sh\nexec python3 train.py\n")
    assert standin.python_of([str(script)], env) is None
    assert standin.python_of(["env", "python3", "train.py"], env) is None  # (what env runs is not looked into)
    assert standin.python_of(["no-such-program"], env) is None
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)  # (nobody writes: opened to read, it would block for good)
    assert standin.python_of([str(fifo)], env) is None
    assert standin.python_of(["/dev/null"], env) is None  # (a device is not opened at all)


def test_srun_ranks_get_what_env_rendezvous_reads() -> None:
    env = standin.launcher_env({"SLURM_PROCID": "5", "SLURM_NTASKS": "8", "SLURM_LOCALID": "1"})
    assert (env["RANK"], env["WORLD_SIZE"], env["LOCAL_RANK"]) == ("5", "8", "1")
    mine = standin.launcher_env({"SLURM_PROCID": "5", "RANK": "2"})
    assert mine["RANK"] == "2"  # (what the launcher set stays)


def test_a_rank_runs_without_nccls_ras_unless_its_user_asked_for_it(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    # (RAS listens on the node's address for the life of the process: the rank could not move)
    monkeypatch.setattr(standin, "runtime_dir", lambda: tmp_path)  # (root's /run/tpagent otherwise)
    assert standin.rank_env({}, "s", "j")["NCCL_RAS_ENABLE"] == "0"
    assert standin.rank_env({"NCCL_RAS_ENABLE": "1"}, "s", "j")["NCCL_RAS_ENABLE"] == "1"


def test_only_rank_0_of_a_job_no_launcher_serves_a_store_for_gets_one() -> None:
    cmd = [sys.executable, "train.py"]
    base = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500", "PATH": os.environ.get("PATH", "")}
    assert standin.host_store(cmd, {**base, "RANK": "1"}) == (None, "")
    assert standin.host_store(cmd, {**base, "RANK": "0", "TORCHELASTIC_USE_AGENT_STORE": "True"}) == (None, "")
    assert standin.host_store(cmd, {"RANK": "0"}) == (None, "")  # (no env:// rendezvous)
    server, why = standin.host_store(cmd, {**base, "RANK": "0", "MASTER_ADDR": "192.0.2.7"})
    assert server is None and "not an address of this node" in why
    server, why = standin.host_store(["env", *cmd], {**base, "RANK": "0"})
    assert server is None and "is not a Python interpreter" in why
