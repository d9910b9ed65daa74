"""`tpagent migrate` between agents on "nodes" (network namespaces): the workload moves and
goes on from where it stood; on every failure exactly one copy runs, with its state intact."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest

from cluster import Cluster, Ticker
from conftest import needs_criu
from helpers import kill_and_wait

pytestmark = needs_criu


@pytest.fixture
def cluster(tmp_path: Path) -> Iterator[Cluster]:
    c = Cluster(tmp_path, ["A", "B", "C"])
    try:
        for node in c.nodes.values():
            node.start_agent()
        yield c
    finally:
        c.close()


@pytest.fixture
def ticker(cluster: Cluster, tmp_path: Path) -> Iterator[Ticker]:
    t = Ticker.launch(cluster.nodes["A"], tmp_path)
    yield t
    kill_and_wait(t.pid)


def test_workload_moves_a_to_b_to_c_and_goes_on(cluster: Cluster, ticker: Ticker) -> None:
    for src, dst in (("A", "B"), ("B", "C")):
        proc = cluster.migrate(ticker.pid, src, dst, "--json")
        assert proc.returncode == 0, proc.stderr + cluster.nodes[src].agent_log()[-3000:]
        doc = json.loads(proc.stdout)
        assert doc["state"] == "done" and doc["new_pid"] > 0
        ticker.pid = doc["new_pid"]
        ticker.assert_one_copy_continuous()
    ns_c = Path(f"/run/netns/{cluster.nodes['C'].name}").stat().st_ino
    assert Path(f"/proc/{ticker.pid}/ns/net").stat().st_ino == ns_c  # it runs on node C now
