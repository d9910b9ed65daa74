"""Run inside the image (a chroot of its root, as root, by tests/image/test_image.py) with the
image's own Python: what the test checks, printed as one JSON object on stdout.

    python in_image.py PORT PACKAGE...

- ``version``, ``doctor``: ``tpagent --version``; ``tpagent doctor --json``
- ``packages``: where each PACKAGE is imported from (the image's venv: the installed wheel)
- ``rank``: a stand-in (``tpagent rank``) started the way a launcher starts one, with the image's
  agent serving on 127.0.0.1:PORT (its secret and certificates in /etc/tpagent): what the rank's
  Python found of the rank runtime, what the agent knew of the rank, the stand-in's status
- ``counts``: a counting workload launched, dumped and restored with the image's tpagent and CRIU:
  the count it had reached when frozen, and the counts it wrote after its restore
"""

from __future__ import annotations

import contextlib
import importlib
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

WORK = Path("/var/lib/tpagent-check")
COUNTER = """\
import sys, time
n = 0
while True:
    n += 1
    with open(sys.argv[1], "a") as f:
        f.write(f"{n}\\n")
    time.sleep(0.05)
"""
RANK = """\
import os, sys
import tpagent_rank
print(tpagent_rank.__file__)
sys.exit(7)
"""


def run(*cmd: str, **kw: Any) -> subprocess.CompletedProcess[str]:
    return subprocess.run(cmd, capture_output=True, text=True, timeout=120, **kw)


def wait_for(what: str, ok: Any, seconds: float = 60.0) -> None:
    deadline = time.monotonic() + seconds
    while not ok():
        if time.monotonic() > deadline:
            raise SystemExit(f"in_image: timed out waiting for {what}")
        time.sleep(0.05)


def counts(path: Path) -> list[int]:
    return [int(x) for x in path.read_text().split()] if path.exists() else []


def rank(port: str) -> dict[str, Any]:
    address = f"127.0.0.1:{port}"
    agent = subprocess.Popen(
        ["tpagent", "serve", "--listen", address, "--advertise", "127.0.0.1", "--node", "image"]
        + ["--work-dir", str(WORK / "agent"), "--health-listen", "", "--metrics-listen", ""],
        stdout=subprocess.DEVNULL,
        stderr=open(WORK / "agent.log", "w"),  # noqa: SIM115 (the agent's, for its life)
    )
    try:
        wait_for("the agent to serve", lambda: run("tpagent", "node", "--agent", address).returncode == 0)
        env = {**os.environ, "RANK": "0", "WORLD_SIZE": "1", "TPAGENT_JOB": "image-check"}
        stand_in = run(
            "tpagent", "rank", "--agent", address, "--stdout", str(WORK / "rank.out"), "--", "python3", "-c", RANK,
            env=env, cwd=WORK,
        )  # fmt: skip
        return {
            "status": stand_in.returncode,
            "said": stand_in.stderr,
            "runtime": (WORK / "rank.out").read_text().strip() if (WORK / "rank.out").exists() else "",
        }
    finally:
        agent.terminate()
        agent.wait(60)


def dump_and_restore() -> dict[str, Any]:
    written = WORK / "counts"
    launched = run(
        "tpagent", "launch", "--stdout", str(WORK / "w.out"), "--stderr", str(WORK / "w.err"), "--",
        "python3", "-c", COUNTER, str(written),
    )  # fmt: skip
    if launched.returncode != 0:
        return {"launch": launched.stderr}
    pid = int(launched.stdout.split()[-1])
    try:
        wait_for("the workload to count", lambda: len(counts(written)) >= 5)
        dumped = run("tpagent", "dump", str(pid), "--out", str(WORK / "snap"), "--json")
        frozen = counts(written)
        restored = run("tpagent", "restore", str(WORK / "snap"), "--json")
        if restored.returncode != 0:
            return {"dump": dumped.stdout + dumped.stderr, "restore": restored.stdout + restored.stderr}
        pid = json.loads(restored.stdout)["pid"]
        wait_for("the restored workload to count on", lambda: len(counts(written)) >= len(frozen) + 5)
        return {"dump": dumped.stdout, "frozen": frozen, "after": counts(written)[len(frozen) :]}
    finally:
        with contextlib.suppress(OSError):
            os.kill(pid, 9)  # (the namespace's init: all of it)


def main(port: str, packages: list[str]) -> None:
    WORK.mkdir(mode=0o700, exist_ok=True)
    os.environ["TPAGENT_SECRET_FILE"] = "/etc/tpagent/secret"  # (the agent's and the CLI's; TLS: its default)
    doctor = run("tpagent", "doctor", "--json")
    out = {
        "version": run("tpagent", "--version").stdout.strip(),
        "doctor": json.loads(doctor.stdout) if doctor.stdout else doctor.stderr,
        "packages": {p: getattr(importlib.import_module(p), "__file__", "") for p in packages},
        "rank": rank(port),
        "counts": dump_and_restore(),
    }
    print(json.dumps(out))


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2:])
