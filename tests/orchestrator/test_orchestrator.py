"""The orchestrator moves ranks without a person (issue 24): five network-namespace nodes, the
3-rank torchrun job of the rewire tests on A, B and C, D a dedicated spare and E floating
capacity, every agent reporting to `tpagent orchestrator`.  Each job must end bit-identical (every
rank's losses, step by step, and its final parameters) to the same job under plain torchrun."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import sqlite3
import subprocess
import urllib.request
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest

from conftest import needs_criu
from support.agents import free_port
from support.cluster import Cluster
from support.helpers import wait_until
from support.orchestrator import Orchestrator
from support.rankjob import IFNAME, RUN, Job, steps

pytestmark = needs_criu


@pytest.fixture
def five(tmp_path: Path) -> Iterator[tuple[Cluster, Orchestrator]]:
    c = Cluster(tmp_path, list("ABCDE"), ifname=IFNAME)
    o = Orchestrator(c, tmp_path, dedicated_spares=[c.nodes["D"].name])
    try:
        o.start()
        c.start_agents(rewire_timeout="60", orchestrator=o.address, report_period="0.5")
        yield c, o
    finally:
        o.close()
        c.close()


def _ns(c: Cluster, name: str) -> str:
    return c.nodes[name].name


def _started(c: Cluster, o: Orchestrator, tmp_path: Path) -> Job:
    job = Job(c, tmp_path, step_time=0.5)
    job.at_step(2, 5)
    wait_until(lambda: all(o.rank_on(RUN, r) for r in range(3)), "the orchestrator to see every rank", 60, 0.5)
    return job


def _taint(o: Orchestrator, node: str, reason: str = "maintenance") -> None:
    assert "tainted" in o.ok("taint", node, "--reason", reason)


@pytest.mark.timeout(900)
def test_taints_move_ranks_to_spares_and_back_and_the_job_is_bit_identical(
    five: tuple[Cluster, Orchestrator], tmp_path: Path, reference: Path
) -> None:
    c, o = five
    job = _started(c, o, tmp_path)
    try:
        # Planned maintenance: B's rank goes to the dedicated spare and comes back once B is untainted.
        _taint(o, _ns(c, "B"))
        o.wait_rank_on(RUN, 1, _ns(c, "D"))
        assert job.copies(1) == ["D"]
        o.ok("untaint", _ns(c, "B"))
        o.wait_rank_on(RUN, 1, _ns(c, "B"))
        assert job.copies(1) == ["B"]
        wait_until(o.idle, "the moves to end", 60, 0.5)
        assert o.cluster()["spares_free"] == 2  # (D and E)

        # Two nodes tainted: the dedicated spare first, then the floating one.
        _taint(o, _ns(c, "B"))
        _taint(o, _ns(c, "C"))
        o.wait_rank_on(RUN, 1, _ns(c, "D"))
        o.wait_rank_on(RUN, 2, _ns(c, "E"))
        assert job.copies(1) == ["D"] and job.copies(2) == ["E"]

        # No spare left: the taint is recorded, the job runs on, and the cluster says why nothing moved.
        _taint(o, _ns(c, "A"))
        wait_until(lambda: _waiting(o, _ns(c, "A")), "the taint of A to say why nothing moves", 30, 0.5)
        assert "no spare fits" in _waiting(o, _ns(c, "A")), _waiting(o, _ns(c, "A"))
        at = steps(job.logs, 0)
        job.at_step(0, at + 3)
        assert job.copies(0) == ["A"]
        shown = o.ok("cluster")
        assert "nothing moved: job job1 rank(s) 0: no spare fits" in shown, shown

        for name in "ABC":
            o.ok("untaint", _ns(c, name))
        o.wait_rank_on(RUN, 1, _ns(c, "B"))
        o.wait_rank_on(RUN, 2, _ns(c, "C"))
        wait_until(o.idle, "the moves to end", 60, 0.5)
        done = [m for m in o.cluster()["moves"] if m["state"] == "done"]
        moved = [(m["kind"], m["ranks"]) for m in done]
        assert moved[:4] == [("away", [1]), ("home", [1]), ("away", [1]), ("away", [2])], done
        assert sorted(moved[4:]) == [("home", [1]), ("home", [2])], done
        assert job.copies(0) == ["A"] and job.copies(1) == ["B"] and job.copies(2) == ["C"]
        job.finishes_as(reference)
        events = o.ok("events", "--json")
        assert all(json.loads(line)["kind"] for line in events.splitlines())
    finally:
        job.close()


@pytest.mark.timeout(900)
def test_a_rank_moved_away_by_hand_is_followed_and_comes_home(
    five: tuple[Cluster, Orchestrator], tmp_path: Path, reference: Path
) -> None:
    """An operator moves a rank the orchestrator had moved off a taint on again (`tpagent migrate`,
    D to E): the orchestrator's record stayed on D, so D stayed held (and so did the scheduler's
    hold), and once its home was untainted the move home asked D for a rank it had no longer: the
    rank never came home.  Now the record follows the rank where its agents report it."""
    c, o = five
    job = _started(c, o, tmp_path)
    try:
        _taint(o, _ns(c, "B"))
        o.wait_rank_on(RUN, 1, _ns(c, "D"))
        wait_until(o.idle, "the move to end", 60, 0.5)
        job.moves(1, "E")
        o.wait_rank_on(RUN, 1, _ns(c, "E"))
        wait_until(
            lambda: (
                [(r["node"], r["home"]) for r in o.cluster()["ranks"] if r["rank"] == 1] == [(_ns(c, "E"), _ns(c, "B"))]
            ),
            "the orchestrator to follow rank 1 to E, its home still B",
            60,
            0.5,
        )
        assert f"rank 1 runs on {_ns(c, 'E')}, not {_ns(c, 'D')}: moved outside the orchestrator" in o.ok("events")
        o.ok("untaint", _ns(c, "B"))
        o.wait_rank_on(RUN, 1, _ns(c, "B"))
        assert job.copies(1) == ["B"]
        wait_until(o.idle, "the move home to end", 60, 0.5)
        assert [(m["kind"], m["source"], m["state"]) for m in o.cluster()["moves"]] == [
            ("away", _ns(c, "B"), "done"),
            ("home", _ns(c, "E"), "done"),
        ]
        job.finishes_as(reference)
    finally:
        job.close()


@pytest.mark.timeout(900)
def test_after_a_restart_no_move_is_planned_before_every_known_node_has_reported(
    five: tuple[Cluster, Orchestrator], tmp_path: Path, reference: Path
) -> None:
    """A restarted orchestrator planned a taint's move as soon as the first spare reported: the
    floating one (E) won over the dedicated one (D), whose report came a moment later.  Now no
    move is planned until every node it knows has reported (or could have): D, first, is chosen."""
    c, o = five
    job = _started(c, o, tmp_path)
    d = c.nodes["D"].agent
    assert d is not None
    try:
        o.kill()
        os.kill(d.pid, signal.SIGSTOP)  # (D reports again only once the others have)
        try:
            o.start()
            _taint(o, _ns(c, "B"))
            others = {_ns(c, n) for n in "ABCE"}
            wait_until(
                lambda: {n["name"] for n in o.cluster()["nodes"] if n["reachable"]} >= others,
                "A, B, C and E to report to the restarted orchestrator",
                30,
                0.2,
            )
            planned = [m for m in o.cluster()["moves"] if m["state"] in ("planned", "running")]
        finally:
            os.kill(d.pid, signal.SIGCONT)
        assert planned == [], planned
        o.wait_rank_on(RUN, 1, _ns(c, "D"))
        assert job.copies(1) == ["D"]
        job.finishes_as(reference)
    finally:
        job.close()


def _waiting(o: Orchestrator, node: str) -> str:
    return next((t["waiting"] for t in o.cluster()["taints"] if t["node"] == node), "")


class Alertmanager:
    """Debian's prometheus-alertmanager, routing every alert to the orchestrator's webhook at once."""

    def __init__(self, tmp: Path, webhook: str, token: Path, ca: Path) -> None:
        self.port = free_port()
        self.work = tmp / "alertmanager"
        self.work.mkdir()
        config = self.work / "alertmanager.yml"
        config.write_text(
            json.dumps(
                {
                    "route": {
                        "receiver": "tpagent",
                        "group_by": ["alertname", "node"],
                        "group_wait": "1s",
                        "group_interval": "1s",
                        "repeat_interval": "1h",
                    },
                    "receivers": [
                        {
                            "name": "tpagent",
                            "webhook_configs": [
                                {
                                    "url": f"https://{webhook}/alertmanager",
                                    "send_resolved": True,
                                    "http_config": {
                                        "authorization": {"type": "Bearer", "credentials_file": str(token)},
                                        "tls_config": {"ca_file": str(ca)},
                                    },
                                }
                            ],
                        }
                    ],
                }
            )
        )
        self.log = open(self.work / "alertmanager.log", "wb")  # noqa: SIM115 (closed in stop)
        self.proc = subprocess.Popen(
            [
                "prometheus-alertmanager",
                f"--config.file={config}",
                f"--storage.path={self.work}",
                f"--web.listen-address=127.0.0.1:{self.port}",
                "--cluster.listen-address=",
            ],
            stdout=self.log,
            stderr=subprocess.STDOUT,
        )
        wait_until(self._ready, "alertmanager to be ready", 60, 0.2)

    def _ready(self) -> bool:
        assert self.proc.poll() is None, (self.work / "alertmanager.log").read_text()
        with contextlib.suppress(OSError):
            return urllib.request.urlopen(f"http://127.0.0.1:{self.port}/-/ready", timeout=2).status == 200
        return False

    def alert(self, node: str, firing: bool) -> None:
        now = datetime.now(UTC)
        doc = {
            "labels": {"alertname": "GpuXidErrors", "node": node, "severity": "critical"},
            "annotations": {"summary": "XID 79 on a GPU"},
            "startsAt": (now - timedelta(minutes=1)).isoformat(),
        }
        if not firing:
            doc["endsAt"] = (now - timedelta(seconds=1)).isoformat()
        request = urllib.request.Request(
            f"http://127.0.0.1:{self.port}/api/v2/alerts",
            data=json.dumps([doc]).encode(),
            headers={"Content-Type": "application/json"},
            method="POST",
        )
        assert urllib.request.urlopen(request, timeout=10).status == 200

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(30)
        self.log.close()


def _moves(o: Orchestrator) -> list[tuple[int, str, str, str]]:
    """(id, kind, state, migration) of every move, from the database (read while it runs)."""
    db = sqlite3.connect(f"file:{o.settings['state']}?mode=ro", uri=True, timeout=10)
    try:
        return list(db.execute("SELECT id, kind, state, migration FROM moves ORDER BY id"))
    finally:
        db.close()


@pytest.mark.timeout(900)
def test_alerts_taint_and_a_killed_orchestrator_settles_its_moves(
    five: tuple[Cluster, Orchestrator], tmp_path: Path, reference: Path
) -> None:
    """A real Alertmanager routes an alert naming C to the webhook: C's rank moves to the spare;
    the orchestrator is SIGKILLed while it asks for that move (and again in the middle of the move
    back, once the source agent runs it), and restarted: each move is settled from the agents'
    reports and done once, one copy of every rank, and the job ends bit-identical."""
    c, o = five
    token = tmp_path / "webhook-token"
    token.write_text(os.urandom(16).hex())
    token.chmod(0o600)
    o.kill(signal.SIGTERM)
    o.settings.update(webhook_listen=f"{c.bridge_addr}:{free_port()}", webhook_token_file=str(token))
    o.start()
    am = Alertmanager(tmp_path, str(o.settings["webhook_listen"]), token, o.tls / "ca.crt")
    job = _started(c, o, tmp_path)
    try:
        am.alert(_ns(c, "C"), firing=True)
        wait_until(lambda: any(m[2] == "running" for m in _moves(o)), "the alert's move to run", 60, 0.05)
        o.kill()
        o.start()
        o.wait_rank_on(RUN, 2, _ns(c, "D"))
        assert job.copies(2) == ["D"]
        taints = o.cluster()["taints"]
        assert [(t["node"], t["kind"]) for t in taints] == [(_ns(c, "C"), "preemptive")], taints
        assert taints[0]["source"].startswith("alert:") and "GpuXidErrors" in taints[0]["reason"], taints

        am.alert(_ns(c, "C"), firing=False)
        wait_until(lambda: any(m[1] == "home" and m[3] for m in _moves(o)), "the move back to begin", 60, 0.05)
        o.kill()
        o.start()
        o.wait_rank_on(RUN, 2, _ns(c, "C"))
        wait_until(o.idle, "the moves to end", 60, 0.5)
        assert job.copies(2) == ["C"] and job.copies(1) == ["B"] and job.copies(0) == ["A"]
        assert o.cluster()["taints"] == []
        moves = _moves(o)
        assert [m[2] for m in moves].count("done") == 2 and not any(m[2] in ("planned", "running") for m in moves)
        job.finishes_as(reference)
    finally:
        job.close()
        am.stop()
