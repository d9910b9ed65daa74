"""A real (CPU) torch training job: its loss sequence is bit-identical across dump/restore."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from conftest import needs_criu
from support.helpers import ROOT, tpagent, wait_until

pytestmark = needs_criu
TRAIN = ROOT / "examples" / "train.py"
#: The job's length.  It must outlast the dump by far: ``tpagent dump`` freezes it some steps
#: after step 20 (about 9 of its 0.05 s steps on an idle 2-core machine, 24 with that machine
#: busy; with 60 steps, a busy CI machine once let it finish first).
STEPS = 200


def _losses(log: Path) -> list[str]:
    return [ln for ln in log.read_text().splitlines() if ln.startswith("step ")] if log.exists() else []


def test_loss_sequence_identical_to_uninterrupted_run(tmp_path: Path) -> None:
    job = [sys.executable, str(TRAIN), "--steps", str(STEPS), "--width", "256"]
    subprocess.run([*job, "--log", str(tmp_path / "ref.log"), "--step-time", "0"], check=True, timeout=300)
    reference = _losses(tmp_path / "ref.log")
    assert len(reference) == STEPS

    log = tmp_path / "run.log"
    launched = tpagent("launch", "--stdout", str(tmp_path / "run.out"), "--", *job, "--log", str(log))
    assert launched.returncode == 0, launched.stderr
    wait_until(lambda: len(_losses(log)) >= 20, "training to reach step 20", 120)
    dump = tpagent("dump", launched.stdout.strip(), "--out", str(tmp_path / "snap"))
    assert dump.returncode == 0, dump.stderr
    frozen = len(_losses(log))
    assert frozen < STEPS, "the job finished before it could be dumped"

    restored = tpagent("restore", str(tmp_path / "snap"), "--json")
    assert restored.returncode == 0, restored.stderr
    assert json.loads(restored.stdout)["pid"] > 0
    wait_until(lambda: log.read_text().rstrip().endswith("done"), "the restored job to finish", 300)
    assert _losses(log) == reference
