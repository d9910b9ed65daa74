"""Ranks moved together onto GPUs named on the target (`tpagent migrate --job J --rank 0 --rank 1
--to-gpu X`): each rank's own move would fit on X, so the source agent counts the GPUs all the
moving ranks use against the names, and refuses before any rank stops at a boundary.  The
agent and the ranks' processes are real; the node's GPUs are not (no GPU here: the two the
ranks use are written out, a stand-in for NVML)."""

from __future__ import annotations

import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from host import gpus, proc
from host.gpus import GpuInfo
from support.agents import agent_config, node_of
from support.helpers import kill_and_wait
from tpagent.jobs.rankentry import RankEntry
from tpagent.migration.api import Refused, Why


@pytest.fixture
def ranks() -> Iterator[list[int]]:
    """Two ranks' processes (their namespaces' inits, as far as the agent is told)."""
    ps = [subprocess.Popen(["sleep", "600"], start_new_session=True) for _ in range(2)]
    yield [p.pid for p in ps]
    for p in ps:
        kill_and_wait(p.pid)
        p.wait()


def test_ranks_moved_together_onto_fewer_gpus_than_they_use_are_refused_before_they_stop(
    tmp_path: Path, ranks: list[int], monkeypatch: pytest.MonkeyPatch
) -> None:
    sleep = shutil.which("sleep")
    assert sleep is not None
    agent = node_of(agent_config(tmp_path, "n", allow_executables=(str(Path(sleep).resolve()),)))
    for r, pid in enumerate(ranks):
        agent.ranks.entries[("job", r)] = RankEntry("job", r, pid, proc.start_ticks(pid), world=2)
    used = [GpuInfo(i, f"GPU-n{i}", "H100", 80 << 30, 1 << 30, 40, 0, (pid,)) for i, pid in enumerate(ranks)]
    monkeypatch.setattr(gpus, "gpus_of", lambda pids: [g for g in used if set(g.pids) & pids])
    for dry_run in (True, False):
        with pytest.raises(Refused) as e:
            agent.start_migration(0, "127.0.0.1:1", dry_run, "job", (0, 1), "transparent", "", ("GPU-t3",))
        assert e.value.why is Why.INVALID
        assert str(e.value) == "the moving ranks use 2 GPUs; name as many of the target's (--to-gpu), or none."
    assert not agent.rewires.running  # (nothing began: no rank was asked to stop)
