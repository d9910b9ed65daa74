from __future__ import annotations

import functools
import os
import signal
from collections.abc import Iterator
from pathlib import Path

import pytest

from helpers import Workload
from snapshot.api import SnapshotError
from snapshot.criu import Criu

# A suite started in the background by a non-interactive shell inherits SIGINT ignored, and so
# would every command it starts (an ignored signal stays ignored across exec): the tests that
# press Ctrl-C on a command need it to arrive.  A handler of our own is reset on exec instead.
signal.signal(signal.SIGINT, signal.default_int_handler)

pytest_plugins = ["cluster_fixtures", "rankjob"]

#: Marks a test (or, as ``pytestmark``, a module) that needs root and a working CRIU >= 4.2.
#: Such tests are skipped where CRIU cannot be used, unless TPAGENT_TESTS_NEED_CRIU is set
#: (scripts/test.sh, CI): there a missing CRIU fails the run instead.  CRIU is probed only
#: when a collected test carries the mark, so the unit tier (tests/unit) runs unprivileged.
needs_criu = pytest.mark.criu


@functools.cache
def criu_problem() -> str | None:
    """Why CRIU cannot be used here, or None (probed once, on first need)."""
    if os.geteuid() != 0:
        return "needs root (CRIU)"
    try:
        Criu().check()
    except SnapshotError as e:
        return f"no working CRIU >= 4.2: {e}"
    return None


@pytest.hookimpl(trylast=True)  # after -m and -k have deselected what will not run
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    needing = [item for item in items if item.get_closest_marker("criu") is not None]
    problem = criu_problem() if needing else None
    if problem is None:
        return
    if os.environ.get("TPAGENT_TESTS_NEED_CRIU"):
        raise pytest.UsageError(f"TPAGENT_TESTS_NEED_CRIU is set but CRIU cannot be used: {problem}")
    for item in needing:
        item.add_marker(pytest.mark.skip(reason=problem))


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
