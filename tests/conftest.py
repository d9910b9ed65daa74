from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from helpers import Workload
from snapshot.api import SnapshotError
from snapshot.criu import Criu


def _criu_problem() -> str | None:
    if os.geteuid() != 0:
        return "needs root (CRIU)"
    try:
        Criu().check()
    except SnapshotError as e:
        return f"no working CRIU >= 4.2: {e}"
    return None


_PROBLEM = _criu_problem()
if _PROBLEM is not None and os.environ.get("TPAGENT_TESTS_NEED_CRIU"):
    # scripts/test.sh (CI) sets this: there a missing CRIU is a failure, not a suite of skips.
    raise pytest.UsageError(f"TPAGENT_TESTS_NEED_CRIU is set but CRIU cannot be used: {_PROBLEM}")
needs_criu = pytest.mark.skipif(_PROBLEM is not None, reason=_PROBLEM or "")


@pytest.fixture
def workloads(tmp_path: Path) -> Iterator[list[Workload]]:
    """Collects started workloads and kills whatever is left of them after the test."""
    started: list[Workload] = []
    yield started
    for w in started:
        w.stop()


@pytest.fixture
def start(tmp_path: Path, workloads: list[Workload]):  # type: ignore[no-untyped-def]
    def _start(mib: int = 256, **kw: object) -> Workload:
        w = Workload(tmp_path / f"w{len(workloads)}.log", mib, **kw)  # type: ignore[arg-type]
        workloads.append(w)
        return w.start()

    return _start
