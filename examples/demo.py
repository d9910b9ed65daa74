"""The tpagent demo: checkpoint a training job mid-run, restore it, and prove nothing changed.

1. Run examples/train.py uninterrupted: the reference loss sequence.
2. Start the same job under `tpagent launch` (its own PID namespace), let it train a while,
   `tpagent dump` it (the process ends), then `tpagent restore` it from the snapshot.
3. Compare the restored job's loss sequence with the reference, step by step, bit for bit.

Run as root from the repository (the README's main command does the set-up first).
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
TPAGENT = [sys.executable, "-m", "cli.main"]


def losses(log: Path) -> list[str]:
    return [ln for ln in log.read_text().splitlines() if ln.startswith("step ")]


def wait_for(pred: object, what: str, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not pred():  # type: ignore[operator]
        if time.monotonic() > deadline:
            sys.exit(f"demo: timed out waiting for {what}")
        time.sleep(0.1)


def tpagent(*args: str) -> str:
    print(f"$ tpagent {' '.join(args)}", flush=True)
    proc = subprocess.run([*TPAGENT, *args], text=True, capture_output=True)
    sys.stderr.write(proc.stderr)
    if proc.returncode != 0:
        sys.exit(f"demo: tpagent {args[0]} failed (exit {proc.returncode})")
    print(proc.stdout.rstrip(), flush=True)
    return proc.stdout.strip()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=120)
    parser.add_argument("--dump-at", type=int, default=40, help="dump once this many steps are logged")
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="tpagent-demo-"))
    job = [sys.executable, str(HERE / "train.py"), "--steps", str(args.steps)]

    print(f"[1/3] reference run of {args.steps} steps, uninterrupted", flush=True)
    ref_log = work / "reference.log"
    subprocess.run([*job, "--log", str(ref_log), "--step-time", "0"], check=True)
    reference = losses(ref_log)

    print("[2/3] the same job under tpagent, checkpointed and restored mid-run", flush=True)
    log = work / "train.log"
    pid = tpagent("launch", "--stdout", str(work / "train.out"), "--", *job, "--log", str(log))
    wait_for(lambda: log.exists() and len(losses(log)) >= args.dump_at, "training to reach the dump step", 120)
    tpagent("dump", pid, "--out", str(work / "snapshot"))
    frozen_at = len(losses(log))
    print(f"      job checkpointed and ended after step {frozen_at - 1}", flush=True)
    time.sleep(1.0)
    if len(losses(log)) != frozen_at:
        sys.exit("demo: the job kept training after its dump")
    tpagent("inspect", str(work / "snapshot"))
    tpagent("restore", str(work / "snapshot"))
    wait_for(lambda: log.read_text().rstrip().endswith("done"), "the restored job to finish", 300)

    print("[3/3] comparing loss sequences", flush=True)
    restored = losses(log)
    same = restored == reference
    print(f"      reference steps: {len(reference)}  restored-run steps: {len(restored)}")
    for i in (0, frozen_at - 1, frozen_at, len(reference) - 1):
        print(f"      {reference[i]:<44} | {restored[i] if i < len(restored) else '-'}")
    if not same:
        first = next(
            (i for i, (a, b) in enumerate(zip(reference, restored, strict=False)) if a != b),
            min(len(reference), len(restored)),
        )
        sys.exit(f"demo: FAILED: the loss sequences differ from step {first}")
    print(f"demo: OK: all {len(reference)} losses bit-identical across the checkpoint/restore (files in {work})")


if __name__ == "__main__":
    main()
