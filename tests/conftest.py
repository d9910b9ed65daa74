from __future__ import annotations

import functools
import os
import shutil
import signal
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from host import gpus
from snapshot.api import SnapshotError
from snapshot.criu import Criu
from support.helpers import Workload

# A suite started in the background by a non-interactive shell inherits SIGINT ignored, and so
# would every command it starts (an ignored signal stays ignored across exec): the tests that
# press Ctrl-C on a command need it to arrive.  A handler of our own is reset on exec instead.
signal.signal(signal.SIGINT, signal.default_int_handler)

pytest_plugins = ["support.cluster_fixtures", "support.rankjob"]

#: The tiers, each a mark of its own (pyproject.toml registers them), each run on its own by
#: scripts/test.sh, which prints its wall time.  A test's tier is its directory's, marked
#: here as it is collected (nobody has to remember), except that a test marked ``gpu`` is in the
#: gpu tier wherever it stands:
#:
#:   unit     as nobody: no process, server or job is started; each test well under a second
#:   rank     as nobody: the rank runtime and the rewire of ranks: torch jobs, processes, waits
#:   cluster  as root: CRIU, processes, servers, network namespaces as nodes; root's own branches
#:   gpu      as root: where there is an NVIDIA GPU (skipped elsewhere)
#:   image    as root: the container image built (scripts/image.sh) and run in a chroot of it
TIER_OF_DIRECTORY = {
    "unit": "unit",
    "rank": "rank",
    "host": "cluster",
    "snapshot": "cluster",
    "transfer": "cluster",
    "agent": "cluster",
    "cli": "cluster",
    "orchestrator": "cluster",
    "image": "image",
}
TIERS = ("unit", "rank", "cluster", "gpu", "image")
TESTS = Path(__file__).resolve().parent


def pytest_itemcollected(item: pytest.Item) -> None:
    """Mark each test with its tier, before -m selects by it."""
    where = item.path.resolve().relative_to(TESTS)
    marked = {m.name for m in item.iter_markers() if m.name in TIERS}
    tier = "gpu" if "gpu" in marked else TIER_OF_DIRECTORY.get(where.parts[0])
    if tier is None:
        raise pytest.UsageError(
            f"tests/{where} is in no tier: add its directory to TIER_OF_DIRECTORY in tests/conftest.py"
        )
    if marked - {tier}:
        raise pytest.UsageError(
            f"{item.nodeid} is marked {' and '.join(sorted(marked))}, but its tier is {tier}: "
            "a test's tier is its directory's (only gpu is marked by hand)"
        )
    if tier not in marked:
        item.add_marker(tier)


#: Marks a test (or, as ``pytestmark``, a module) that needs root and a working CRIU >= 4.2.
#: Such tests are skipped where CRIU cannot be used, unless TPAGENT_TESTS_NEED_CRIU is set
#: (scripts/test.sh, CI): there a missing CRIU fails the run instead.  CRIU is probed only
#: when a collected test carries the mark, so the tiers run as nobody (unit, rank) never probe it.
needs_criu = pytest.mark.criu

#: Marks a module (``pytestmark``) of the gpu tier: its tests need an NVIDIA GPU and are skipped,
#: never passed, where there is none.
HAS_GPU = Path("/dev/nvidiactl").exists() and bool(gpus.inventory())
needs_gpu = [pytest.mark.gpu, pytest.mark.skipif(not HAS_GPU, reason="no NVIDIA GPU on this machine")]


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


@pytest.fixture
def playground() -> Iterator[Path]:
    """A directory in /tmp that belongs to user nobody (as a user's own directory there would)."""
    d = Path("/tmp") / f"tp-attack-{uuid.uuid4().hex[:8]}"
    d.mkdir()
    os.chown(d, 65534, 65534)
    yield d
    shutil.rmtree(d, ignore_errors=True)


@pytest.fixture(scope="session")
def aware_reference(tmp_path_factory: pytest.TempPathFactory) -> list[str]:
    """Each rank's output of ``tests/workloads/aware_job.py``, uninterrupted, run once (the rank
    tier's model-aware move and recovery tests compare with it)."""
    pytest.importorskip("torch")
    from support.awarejob import uninterrupted

    return uninterrupted(tmp_path_factory.mktemp("aware-reference"))
