"""Which ended or moved ranks a node forgets once it keeps too many (tpagent.jobs.ranks): those
whose name no user holds any more first, then the churning user's own, never the name another
user's stand-in still asks about (found by an unprivileged attack: forty short ranks of one
user's made the node forget another's that had just ended, and its name was the first's to take)."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from host import paths
from tpagent.common.threads import Threads
from tpagent.jobs import rankentry
from tpagent.jobs.rankentry import RankEntry
from tpagent.jobs.ranks import Ranks

VICTIM, CHURNER = 1000, 2000


def _ended(ranks: Ranks, job: str, owner: int, ago: float = 0.0, moved_to: str = "") -> None:
    e = RankEntry(job, 0, init=1 << 22, init_start=1, world=2, exit_code=None if moved_to else 0, owner=owner)
    e.ended_at = time.monotonic() - ago
    e.moved_to = moved_to
    ranks.entries[(job, 0)] = e


def test_a_user_who_churns_ranks_forgets_their_own_never_anothers(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(rankentry, "KEEP_ENDED", 4)
    monkeypatch.setattr(
        paths, "RANK_GO", tmp_path / "rank-go", raising=False
    )  # (not this node's: an agent's may be there)
    ranks = Ranks("tpagent-test-ended", "10.0.0.1:7400", Threads(), saved=tmp_path / "ranks.json")
    _ended(ranks, "long-ago", VICTIM, ago=3600)  # (its name is no one's now: the first to go)
    _ended(ranks, "victim", VICTIM)  # (ended just now: its stand-in may yet ask how)
    _ended(ranks, "moved", VICTIM, moved_to="10.0.0.2:7400")  # (its stand-in follows it through here)
    for i in range(40):
        _ended(ranks, f"churn{i}", CHURNER)
        with ranks.lock:
            ranks._save()
    kept = set(ranks.entries)
    assert {("victim", 0), ("moved", 0)} <= kept and ("long-ago", 0) not in kept
    assert kept - {("victim", 0), ("moved", 0)} == {("churn38", 0), ("churn39", 0)}  # (the churner's newest)
    assert ranks.owner_of("victim", 0) is not None and ranks.owner_of("victim", 0).claimed  # type: ignore[union-attr]
