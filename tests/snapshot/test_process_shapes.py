"""Process shapes real jobs have, through real CRIU: workers exiting as the tree is frozen,
event loops on timerfds, inotify watches, a reused PID."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

import psutil
import pytest

from conftest import needs_criu
from helpers import STATEFUL, kill_and_wait, tpagent, wait_until
from snapshot import engine
from snapshot.api import DumpMode, SnapshotConfig, SnapshotError, Stage

pytestmark = needs_criu

WORKLOADS = STATEFUL.parent


@dataclass
class Loop:
    """A workload of tests/workloads/ whose log lines are ``KEY N KEY2 M ...`` (each line's numbers)."""

    script: str
    log: Path
    args: tuple[str, ...] = ()
    popen: subprocess.Popen[bytes] | None = field(default=None, repr=False)
    pid: int = 0

    def start(self) -> Loop:
        with open(self.log.with_suffix(".out"), "ab") as out:
            self.popen = subprocess.Popen(
                [sys.executable, str(WORKLOADS / self.script), str(self.log), *self.args],
                stdin=subprocess.DEVNULL, stdout=out, stderr=out, start_new_session=True,
            )  # fmt: skip
        self.pid = self.popen.pid
        wait_until(lambda: len(self.numbers("tick")) >= 5, f"{self.script} to start ticking")
        return self

    def numbers(self, key: str) -> list[list[int]]:
        """The numbers of each line starting with ``key``."""
        lines = self.log.read_text().splitlines() if self.log.exists() else []
        return [[int(x) for x in re.findall(r"-?\d+", ln)] for ln in lines if ln.startswith(key + " ")]

    def reap(self) -> None:
        if self.popen is not None:
            self.popen.wait(timeout=30)
            self.popen = None

    def stop(self) -> None:
        if self.pid:
            kill_and_wait(self.pid)
        self.reap()


@pytest.fixture
def loops():  # type: ignore[no-untyped-def]
    started: list[Loop] = []
    yield started
    for w in started:
        w.stop()


def _zombie_with_threads(parent: int) -> int | None:
    """A child of ``parent`` whose main thread has exited while another still runs."""
    for c in psutil.Process(parent).children():
        try:
            if c.status() == psutil.STATUS_ZOMBIE and len(list(Path(f"/proc/{c.pid}/task").iterdir())) > 1:
                return c.pid
        except (psutil.Error, OSError):
            continue
    return None


def test_a_worker_exiting_as_the_tree_is_frozen_is_retried(loops, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    """A DataLoader-style worker that is exiting (a zombie that still has a thread) makes CRIU
    refuse the dump: the tree is resumed, the dump tried again once the worker is gone, and the
    restored trainer goes on from where it stood (its tick and its count of reaped workers)."""
    hold = tmp_path / "hold"
    hold.touch()  # the worker's last thread lingers until the first refusal
    w = Loop("epoch_workers.py", tmp_path / "w.log", (str(hold),)).start()
    loops.append(w)
    zombie = wait_until(lambda: _zombie_with_threads(w.pid), "a worker to be a zombie with a thread")
    retries: list[str] = []

    def progress(stage: Stage, msg: str) -> None:
        if msg.startswith("refused for now"):
            retries.append(msg)
            hold.unlink(missing_ok=True)  # the worker ends now, as a real one does within milliseconds

    out = tmp_path / "snap"
    m = engine.checkpoint(w.pid, out, DumpMode.KILL, SnapshotConfig(), progress)
    assert retries and "Zombies with threads are not supported" in retries[0], retries
    assert zombie not in {p.pid for p in m.processes}  # (the worker was gone when the dump succeeded)
    w.reap()
    stopped = w.numbers("tick")[-1]  # [tick, reaped]
    assert stopped[1] >= 1  # the worker that was exiting had been reaped before the freeze
    assert len(w.numbers("tick")) == stopped[0] + 1

    restored = engine.restore(out)
    w.pid = restored.pid
    wait_until(lambda: w.numbers("tick")[-1][0] >= stopped[0] + 30, "the restored trainer to tick on")
    ticks = w.numbers("tick")
    assert [t[0] for t in ticks] == list(range(len(ticks)))  # it went on from where it stood
    assert ticks[stopped[0] + 1][1] == stopped[1]  # with the count it had
    assert ticks[-1][1] > stopped[1]  # and its workers come and go again


def test_a_refusal_that_persists_is_retried_a_bounded_number_of_times(loops, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    hold = tmp_path / "hold"
    hold.touch()  # the worker never finishes exiting
    w = Loop("epoch_workers.py", tmp_path / "w.log", (str(hold),)).start()
    loops.append(w)
    wait_until(lambda: _zombie_with_threads(w.pid), "a worker to be a zombie with a thread")
    seen: list[str] = []
    out = tmp_path / "snap"
    with pytest.raises(SnapshotError, match="Zombies with threads are not supported") as caught:
        engine.checkpoint(w.pid, out, DumpMode.KILL, SnapshotConfig(dump_retries=2), lambda s, msg: seen.append(msg))
    assert sum(msg.startswith("refused for now") for msg in seen) == 2
    assert caught.value.rolled_back and not out.exists()  # as it was: the same command can run again
    n = w.numbers("tick")[-1][0]
    wait_until(lambda: w.numbers("tick")[-1][0] > n + 5, "the trainer to run on")


def test_a_periodic_timerfd_fires_on_after_a_restore(loops, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    """An asyncio-style loop whose only clock is a 20 ms periodic timerfd: frozen for longer
    than a period, the timer has expired unread, which CRIU restores disarmed (its issue 3162);
    the restore arms it again, and the loop ticks on from where it stood."""
    w = Loop("epoll_loop.py", tmp_path / "w.log").start()
    loops.append(w)
    snap = tmp_path / "snap"
    proc = tpagent("dump", str(w.pid), "--out", str(snap))
    assert proc.returncode == 0, proc.stderr
    w.reap()
    stopped = w.numbers("tick")[-1]  # [tick, expirations]
    timers = json.loads((snap / "manifest.json").read_text())["timers"]
    assert timers == [{"pid": w.pid, "fd": timers[0]["fd"], "interval_ns": 20_000_000}]

    proc = tpagent("restore", str(snap), "--json")
    assert proc.returncode == 0, proc.stderr
    w.pid = json.loads(proc.stdout)["pid"]
    # Without the re-arm it ticks once (the expiration pending at the freeze) and never again.
    wait_until(lambda: w.numbers("tick")[-1][0] >= stopped[0] + 25, "the restored loop's timer to keep firing")
    ticks = w.numbers("tick")
    assert [t[0] for t in ticks] == list(range(len(ticks)))  # it went on from where it stood
    assert ticks[-1][1] >= stopped[1] + 25  # the timer itself fired those


def test_an_inotify_watch_is_warned_about_and_still_watches_after_a_restore(loops, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    """Events an inotify instance had queued at the freeze can be lost: the snapshot layer
    says so (the dump's output, `inspect`, :func:`snapshot.proc.restore_warnings` for a dry
    run), and the restored loop still gets the events of its watch."""
    from snapshot.proc import restore_warnings

    watched = tmp_path / "watched"
    watched.mkdir()
    w = Loop("epoll_loop.py", tmp_path / "w.log", ("--inotify", str(watched))).start()
    loops.append(w)
    (watched / "before").touch()
    wait_until(lambda: "created before" in w.log.read_text(), "the loop to see a file created")
    warned = restore_warnings([w.pid])
    assert len(warned) == 1 and f"PID {w.pid} watches files with inotify" in warned[0], warned

    snap = tmp_path / "snap"
    proc = tpagent("dump", str(w.pid), "--out", str(snap), "--json")
    assert proc.returncode == 0, proc.stderr
    assert f"warning: PID {w.pid} watches files with inotify" in proc.stderr
    assert json.loads(proc.stdout)["warnings"] == warned
    w.reap()
    shown = tpagent("inspect", str(snap))
    assert shown.returncode == 0 and f"  warning: {warned[0]}" in shown.stdout.splitlines(), shown.stdout
    assert json.loads(tpagent("inspect", str(snap), "--json").stdout)["warnings"] == warned

    proc = tpagent("restore", str(snap), "--json")
    assert proc.returncode == 0, proc.stderr
    w.pid = json.loads(proc.stdout)["pid"]
    (watched / "after").touch()
    wait_until(lambda: "created after" in w.log.read_text(), "the restored loop to see a file created")
    assert restore_warnings([w.pid]) == warned  # (the same process, the same watch)
