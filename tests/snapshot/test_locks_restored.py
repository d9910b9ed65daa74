"""A process that holds a lock (flock, fcntl): CRIU takes it again as it restores it, and waits
for ever, saying nothing, behind another process that holds it on the node (the original left
running, a second instance that took it once the original was ended).  The dump notes the locks
the tree holds (``reopened`` in the manifest); the restore refuses in one sentence, naming the
file and, for an fcntl lock, its holder.  Once that process lets it go, the copy is restored and
holds the lock again."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import psutil
import pytest

from conftest import needs_criu
from host import proc, signals
from support.helpers import alive, assert_continuous, assert_one_sentence_error, tpagent, wait_until

pytestmark = needs_criu

TAKE = """
import fcntl, sys, time
f = open(sys.argv[1], "a")
if sys.argv[2] == "flock":
    fcntl.flock(f, fcntl.LOCK_EX)
else:
    fcntl.lockf(f, fcntl.LOCK_EX, 10, 50)  # (bytes 50-59: within the 100 the workload held)
print("held", flush=True)
time.sleep(600)
"""


@pytest.mark.parametrize("how", ["flock", "posix"])
def test_a_lock_another_process_holds_here_stops_the_restore_in_one_sentence(  # type: ignore[no-untyped-def]
    start, tmp_path: Path, how: str
) -> None:
    lock = tmp_path / "checkpoint.lock"
    w = start(mib=16, extra=("--lock" if how == "flock" else "--lockf", str(lock)))
    wait_until(lambda: len(w.ticks()) >= 5, "the workload to tick")
    snap = tmp_path / "snap"
    done = tpagent("dump", str(w.pid), "--out", str(snap))
    assert done.returncode == 0, done.stderr
    assert w.popen is not None and w.popen.wait(30) is not None  # (ended by the dump; reaped)
    held = "FLOCK WRITE 0 EOF" if how == "flock" else "POSIX WRITE 0 99"
    noted = {r["path"]: r["lock"] for r in json.loads((snap / "manifest.json").read_text())["reopened"]}
    assert noted[str(lock)] == held and noted[str(tmp_path)] == ""
    with subprocess.Popen([sys.executable, "-c", TAKE, str(lock), how], stdout=subprocess.PIPE, text=True) as other:
        try:
            assert other.stdout is not None and other.stdout.readline() == "held\n"
            refused = tpagent("restore", str(snap), timeout=120)  # (before: CRIU waited, for ever)
            holder = "another process" if how == "flock" else f"PID {other.pid}"
            assert_one_sentence_error(refused, f"{lock} is locked by {holder} on this node", "nothing was restored")
        finally:
            other.kill()
    restored = tpagent("restore", str(snap), "--json")
    assert restored.returncode == 0, restored.stderr
    w.pid = json.loads(restored.stdout)["pid"]
    n = w.ticks()[-1][0]
    wait_until(lambda: w.ticks()[-1][0] >= n + 5, "the restored copy to tick on")
    assert_continuous(w.ticks())
    assert any(path == str(lock) for _, _, path in proc.file_locks([w.pid]))  # (held again)


def test_a_lock_is_noted_whichever_process_of_the_tree_comes_first(tmp_path: Path) -> None:
    """One process holds the file open without a lock, another holds a lock on it: the lock is
    noted, whichever of the two is read first (before: the first one's lock-free entry stood)."""
    from host import reopened

    lock = tmp_path / "shared.lock"
    lock.touch()
    with (
        open(lock),  # (held lock-free by this process)
        subprocess.Popen([sys.executable, "-c", TAKE, str(lock), "flock"], stdout=subprocess.PIPE, text=True) as other,
    ):
        try:
            assert other.stdout is not None and other.stdout.readline() == "held\n"
            for pids in ([os.getpid(), other.pid], [other.pid, os.getpid()]):
                noted = {r.path: r.lock for r in reopened.note(pids)}
                assert noted[str(lock)] == "FLOCK WRITE 0 EOF", (pids, noted[str(lock)])
        finally:
            other.kill()


READERS = """
import fcntl, os, sys, time
path, log, n = sys.argv[1], sys.argv[2], int(sys.argv[3])
for i in range(n):  # (each reader of an LMDB opens its lock file and locks a byte of it: its PID's)
    if os.fork() == 0:
        f = open(path, "a")
        fcntl.lockf(f, fcntl.LOCK_EX, 1, i)
        time.sleep(3600)
        os._exit(0)
with open(log, "a", buffering=1) as out:
    tick = 0
    while True:
        out.write(f"{tick}\\n")
        tick += 1
        time.sleep(0.02)
"""


def test_a_tree_holding_more_locks_on_a_file_than_are_noted_is_dumped_and_restored(tmp_path: Path) -> None:
    """Seventy processes each lock a byte of one file (an LMDB's readers): the dump notes the
    first 64 of them (a bound of the manifest's), where it once noted them all, wrote a manifest
    no restore could read, and ended the tree (every later migration of such a job rolled back).
    The copy comes back holding all seventy."""
    lock, log = tmp_path / "lock.mdb", tmp_path / "ticks.log"
    run = [sys.executable, "-c", READERS, str(lock), str(log), "70"]
    with subprocess.Popen(run, start_new_session=True, stdin=subprocess.DEVNULL) as tree:
        try:
            wait_until(lambda: log.exists() and len(log.read_text().split()) > 5, "the tree to tick")
            wait_until(lambda: len(proc.tree_pids(tree.pid)) == 71, "the readers to start")
            wait_until(lambda: _locks_held(tree.pid, lock) == 70, "the readers to lock")
            done = tpagent("dump", str(tree.pid), "--out", str(tmp_path / "snap"))
            assert done.returncode == 0, done.stderr
        finally:
            signals.kill_tree(tree.pid)  # (ended by the dump; as an agent ends an original, should it not have)
            _end_group(tree.pid)
    noted = {r["path"]: r["lock"] for r in json.loads((tmp_path / "snap" / "manifest.json").read_text())["reopened"]}
    assert noted[str(lock)].count("POSIX WRITE") == 64, noted[str(lock)]
    restored = tpagent("restore", str(tmp_path / "snap"), "--json")
    assert restored.returncode == 0, restored.stderr
    root = json.loads(restored.stdout)["pid"]
    try:
        n = int(log.read_text().split()[-1])
        wait_until(lambda: int(log.read_text().split()[-1]) >= n + 5, "the restored tree to tick on")
        assert _locks_held(root, lock) == 70
        # As an agent drops a copy: all of it ends (its readers were left running once, reparented:
        # the tree's children were looked up through psutil, which remembered the original's)
        assert signals.kill_tree(root)
        assert not _locks_held(1, lock), "a reader outlived its tree"
        wait_until(lambda: not _in_group(root), "the ended readers to be reaped", 10)
    finally:
        _end_group(root)


def _in_group(leader: int) -> list[int]:
    """The processes of ``leader``'s process group."""
    return [p.pid for p in psutil.process_iter() if _pgid(p.pid) == leader]


def _pgid(pid: int) -> int:
    try:
        return os.getpgid(pid)
    except ProcessLookupError:
        return -1


def _end_group(leader: int) -> None:
    """End the tree's process group (the readers are in it, wherever they were reparented)."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(leader, signal.SIGKILL)


def _locks_held(root: int, lock: Path) -> int:
    """How many locks the tree of ``root`` holds on ``lock`` (/proc/locks: a restored tree's
    descriptors do not all show the locks taken through them)."""
    pids = {str(pid) for pid in proc.tree_pids(root)}
    ino = f":{lock.stat().st_ino} "
    return sum(1 for ln in Path("/proc/locks").read_text().splitlines() if ln.split()[4] in pids and ino in ln)


def test_a_lock_on_a_carried_file_found_there_the_same_stops_the_restore(start, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    """A carried file the restore finds on the node with the same bytes is kept, not made anew:
    a lock another process holds on it was not checked (carried files were left out, as new),
    and CRIU waited behind it.  It is checked once the files are put back."""
    scratch = tmp_path / "scratch.bin"
    w = start(mib=16, extra=("--scratch", str(scratch), "1", "--lock", str(scratch)))
    wait_until(lambda: len(w.ticks()) >= 5, "the workload to tick")
    done = tpagent("dump", str(w.pid), "--out", str(tmp_path / "snap"), "--carry", str(scratch))
    assert done.returncode == 0, done.stderr
    assert w.popen is not None and w.popen.wait(30) is not None
    with subprocess.Popen(
        [sys.executable, "-c", TAKE, str(scratch), "flock"], stdout=subprocess.PIPE, text=True
    ) as other:
        try:
            assert other.stdout is not None and other.stdout.readline() == "held\n"
            refused = tpagent("restore", str(tmp_path / "snap"), timeout=120)
            assert_one_sentence_error(refused, f"{scratch} is locked by another process on this node")
        finally:
            other.kill()
    assert not alive(w.pid) and scratch.exists()  # (nothing started; the file, not made by it, stays)
