"""``tests/workloads/aware_job.py`` as the rank tier runs it: four DDP ranks (gloo, a FileStore
in the test's directory) printing a line per step, and what their output says."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

from support.helpers import ROOT
from support.runtime import runtime_env

JOB = ROOT / "tests" / "workloads" / "aware_job.py"
WORLD = 4
STEPS = 60


def start(tmp: Path, rank: int, env: dict[str, str]) -> subprocess.Popen[str]:
    """Rank ``rank`` of the job whose store is ``tmp``/store, in ``tmp``."""
    argv = [sys.executable, "-X", "faulthandler", str(JOB), str(tmp / "store"), str(rank), str(WORLD)]
    argv += ["steps", str(STEPS), str(tmp)]
    return subprocess.Popen(argv, env=env, cwd=tmp, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def outputs(procs: list[subprocess.Popen[str]]) -> list[tuple[int, str, str]]:
    """Each one's status, standard output and error, once it ended."""
    ended = [p.communicate(timeout=300) for p in procs]
    return [(p.returncode, out, err) for p, (out, err) in zip(procs, ended, strict=True)]


def steps(out: str) -> list[str]:
    return [ln for ln in out.splitlines() if ln.startswith("step ")]


def final(out: str) -> dict[str, Any]:
    last = [ln for ln in out.splitlines() if ln.startswith("{")]
    assert last, out
    return dict(json.loads(last[-1]))


def uninterrupted(tmp: Path) -> list[str]:
    """Each rank's output, uninterrupted, with no agent (the runtime off)."""
    procs = [start(tmp, r, runtime_env(tmp)) for r in range(WORLD)]
    outs = outputs(procs)
    assert all(code == 0 for code, _out, _err in outs), outs
    return [out for _code, out, _err in outs]
