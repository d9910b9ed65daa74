"""The fixtures of the tests that run agents on "nodes" (tests/support/cluster.py), for every test
module (a plugin named in tests/conftest.py): ``cluster`` (nodes A, B, C, each with its agent
serving) and ``ticker`` (tests/workloads/stateful.py launched on A)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from support.cluster import Cluster, Ticker
from support.helpers import kill_and_wait


@pytest.fixture
def cluster(tmp_path: Path) -> Iterator[Cluster]:
    with Cluster.with_agents(tmp_path, ["A", "B", "C"]) as c:
        yield c


@pytest.fixture
def ticker(cluster: Cluster, tmp_path: Path) -> Iterator[Ticker]:
    t = Ticker.launch(cluster.nodes["A"], tmp_path)
    yield t
    kill_and_wait(t.pid)
