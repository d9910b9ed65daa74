"""The rank runtime as `tpagent rank` gives it to a training process, for the rank tier's jobs:
its directory on the process's PYTHONPATH (before what the caller has there: as nobody, that is
how torch is found), and no TPAGENT_* of the caller's."""

from __future__ import annotations

import os
from pathlib import Path

from tpagent_rank.layout import write_runtime_dir


def runtime_env(tmp: Path, *before: Path, **extra: str) -> dict[str, str]:
    """This process's environment with the runtime (written once, at ``tmp``/runtime) first on
    PYTHONPATH, then ``before``, then the caller's; ``extra`` set (TPAGENT_RANK_SOCKET turns the
    runtime on)."""
    runtime = tmp / "runtime"
    if not runtime.exists():
        runtime.mkdir()
        write_runtime_dir(runtime)
    base = {k: v for k, v in os.environ.items() if not k.startswith("TPAGENT_")}
    path = [str(runtime), *map(str, before), base.get("PYTHONPATH", "")]
    return {**base, "PYTHONPATH": os.pathsep.join(filter(None, path)), **extra}
