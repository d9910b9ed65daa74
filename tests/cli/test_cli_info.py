"""Informational commands: they work (and do not crash) on a node without NVIDIA hardware."""

from __future__ import annotations

import json
import os
import subprocess

import pytest

from host import gpus
from support.helpers import kernel_thread, tpagent


def test_gpus_lists_this_nodes_gpus() -> None:
    proc = tpagent("gpus", "--json")
    assert proc.returncode == 0, proc.stderr
    listed = json.loads(proc.stdout)["gpus"]
    assert [g["uuid"] for g in listed] == [g.uuid for g in gpus.inventory()]
    text = tpagent("gpus")
    assert text.returncode == 0 and "UUID" in text.stdout
    if not listed:
        assert "no NVIDIA GPUs found" in text.stdout


@pytest.mark.skipif(os.geteuid() != 0, reason="doctor's CRIU check needs root")
def test_doctor_reports_each_check() -> None:
    proc = tpagent("doctor", "--json")
    checks = {c["name"]: c for c in json.loads(proc.stdout)["checks"]}
    assert {"root", "clock", "criu", "criu check", "kernel", "nvidia driver"} <= set(checks)
    assert checks["root"]["verdict"] == "OK"
    assert checks["clock"]["verdict"] != "FAIL"  # (a clock out of sync is a warning: the agents check the skew)
    failed = [c for c in checks.values() if c["verdict"] == "FAIL"]
    assert proc.returncode == (1 if failed else 0)
    if not gpus.inventory():
        assert checks["nvidia driver"]["verdict"] == "WARN"


@pytest.mark.skipif(os.geteuid() != 0, reason="doctor's CRIU check needs root")
def test_doctor_checks_a_process_and_names_one_that_is_not_there() -> None:
    with subprocess.Popen(["sleep", "60"]) as sleeper:
        here = tpagent("doctor", "--json", "--pid", str(sleeper.pid))
        sleeper.kill()
    checks = {c["name"]: c for c in json.loads(here.stdout)["checks"]}
    assert checks["process"]["verdict"] == "OK" and f"PID {sleeper.pid}" in checks["process"]["message"]
    assert "cannot be seen from outside" in checks["not visible"]["message"]  # (what doctor cannot tell, said)
    if not gpus.inventory():
        assert "on 0 GPU(s)" in checks["process"]["message"]
    gone = tpagent("doctor", "--pid", "999999999")
    assert gone.returncode == 1 and "there is no process with PID 999999999" in gone.stdout
    # What a dump refuses before anything, doctor says too (it said OK of each; a traceback of the last).
    kthread = kernel_thread()  # (kthreadd, 2, on a host; none in a PID namespace of its own)
    for pid, said in (
        (1, "PID 1 is the system's init"),
        *(((kthread, f"PID {kthread} is a kernel thread"),) if kthread else ()),
        (os.getpid(), f"PID {os.getpid()} is tpagent itself or its parent"),
        (10**20, f"there is no process with PID {10**20}"),
    ):
        refused = tpagent("doctor", "--pid", str(pid))
        assert refused.returncode == 1 and said in refused.stdout and "Traceback" not in refused.stderr, refused
