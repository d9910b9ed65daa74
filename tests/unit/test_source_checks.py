"""A process that ends as the source agent checks it (before anything is frozen) is said to have
ended, as a failure of the move: it was an "internal error" with the agent's traceback (a
reviewer's fault injection hit /proc/PID/ns/pid gone between two reads)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from tpagent.migration import source


def _ended_pid() -> int:
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()
    return p.pid


def test_a_process_gone_as_it_is_checked_is_a_failure_in_one_sentence(monkeypatch: pytest.MonkeyPatch) -> None:
    m = source.SourceMigration.__new__(source.SourceMigration)
    m.pid = _ended_pid()

    def gone(_target: object) -> None:
        raise FileNotFoundError(2, "No such file or directory", f"/proc/{m.pid}/ns/pid")

    monkeypatch.setattr(m, "_checks", gone)
    with pytest.raises(source._Failure, match=rf"^PID {m.pid} ended as it was checked$"):
        m._check(None)  # type: ignore[arg-type]
    m.pid = 1  # (one that runs: the error is no process's end, and stays what it was)
    with pytest.raises(FileNotFoundError):
        m._check(None)  # type: ignore[arg-type]
