"""A job's store served anew by the agent that rebuilt the job (unplanned recovery) outlives that
agent: it is written down, and the agent's next run keeps it (:func:`tpagent.jobs.storeserver.adopt`)
until no rank of its job is left on the node, then ends it; a record whose process is not that
server (it ended, its PID was taken again) is forgotten, and that process left alone.  The
servers here are stand-ins of the store's: processes whose command line holds the server's
program.  (A real one, the agent restarted: ``tests/orchestrator/test_recover_lost.py``, (c).)"""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest
from psutil import _pslinux

from host import proc
from support.helpers import wait_until
from tpagent.jobs import storeserver


@pytest.fixture
def server() -> Iterator[subprocess.Popen[bytes]]:
    p = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)", storeserver.STORE_SERVER])
    yield p
    p.kill()
    p.wait()


def _write(kept: Path, *rows: dict[str, object]) -> None:
    kept.write_text(json.dumps({"format": 1, "stores": list(rows)}))


def _rows(kept: Path) -> list[dict[str, object]]:
    return list(json.loads(kept.read_text())["stores"])


def test_a_kept_store_lives_while_its_job_has_ranks_here_then_ends(
    tmp_path: Path, server: subprocess.Popen[bytes], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(storeserver, "KEEP_CHECK", 0.05)
    kept = tmp_path / "stores.json"
    _write(kept, {"job": "job1", "address": "10.0.0.2:4000", "pid": server.pid, "started": proc.started(server.pid)})
    then = _pslinux.boot_time()  # (the kernel's boot time, in whole seconds, read a second later: a
    monkeypatch.setattr(_pslinux, "boot_time", lambda: then + 1.0)  # slewed clock; CI once forgot it so)
    here = {"job1": True}
    storeserver.adopt(kept, lambda job: here.get(job, False))
    with pytest.raises(subprocess.TimeoutExpired):
        server.wait(0.5)  # (its job still has ranks here)
    assert [r["job"] for r in _rows(kept)] == ["job1"]
    here["job1"] = False
    wait_until(lambda: server.poll() is not None, "it to be ended (killed, and reaped)", 10, 0.05)
    wait_until(lambda: _rows(kept) == [], "its record to be forgotten", 10, 0.05)


def test_a_record_whose_process_is_not_the_server_is_forgotten_and_the_process_left_alone(
    tmp_path: Path, server: subprocess.Popen[bytes]
) -> None:
    kept = tmp_path / "stores.json"
    other = psutil.Process(server.pid)
    _write(
        kept,
        {"job": "job1", "address": "10.0.0.2:4000", "pid": server.pid, "started": other.create_time() - 5},
        {"job": "job2", "address": "10.0.0.2:4001", "pid": 2**22 + 1, "started": 0.0},
    )
    storeserver.adopt(kept, lambda job: False)
    assert _rows(kept) == []
    assert server.poll() is None  # (its PID taken again: not the server written down)


@pytest.mark.parametrize("text", ["{", '{"stores": 5}', "[]", '{"stores": [7, "x"]}'])
def test_a_record_that_cannot_be_read_keeps_nothing(tmp_path: Path, text: str) -> None:
    kept = tmp_path / "stores.json"
    kept.write_text(text)
    storeserver.adopt(kept, lambda job: True)  # (no traceback: the agent starts)
