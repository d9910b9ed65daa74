"""Process shapes real jobs have, through real CRIU: workers exiting as the tree is frozen,
event loops on timerfds, inotify watches, a reused PID."""

from __future__ import annotations

import contextlib
import json
import os
import pwd
import re
import resource
import signal
import socket
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

import psutil
import pytest

from conftest import needs_criu
from host.proc import CAP_SYS_RESOURCE, has_capability
from snapshot import affinity, restore
from snapshot.api import DumpMode, SnapshotConfig, SnapshotError, Stage
from snapshot.dump import checkpoint
from support.helpers import (
    STATEFUL,
    alive,
    assert_continuous,
    assert_one_sentence_error,
    kill_and_wait,
    tpagent,
    wait_until,
)
from support.users import NOBODY, as_user, user_dir, user_python

pytestmark = needs_criu

WORKLOADS = STATEFUL.parent


@dataclass
class Loop:
    """A workload of tests/workloads/ whose log lines are ``KEY N KEY2 M ...`` (each line's numbers)."""

    script: str
    log: Path
    args: tuple[str, ...] = ()
    launched: bool = False  # under `tpagent launch` (pid: its namespace's init)
    pass_fds: tuple[int, ...] = ()  # (not launched) descriptors it inherits
    wrap: tuple[str, ...] = ()  # (not launched) a command it is started under (unshare -m)
    popen: subprocess.Popen[bytes] | None = field(default=None, repr=False)
    pid: int = 0

    def start(self) -> Loop:
        cmd = [sys.executable, str(WORKLOADS / self.script), str(self.log), *self.args]
        if self.launched:
            proc = tpagent("launch", "--stdout", str(self.log.with_suffix(".out")), "--", *cmd)
            assert proc.returncode == 0, proc.stderr
            self.pid = int(proc.stdout)
        else:
            with open(self.log.with_suffix(".out"), "ab") as out:
                self.popen = subprocess.Popen(
                    [*self.wrap, *cmd],
                    stdin=subprocess.DEVNULL,
                    stdout=out,
                    stderr=out,
                    start_new_session=True,
                    pass_fds=self.pass_fds,
                )
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
    m = checkpoint(w.pid, out, DumpMode.KILL, SnapshotConfig(), progress)
    assert retries and "Zombies with threads are not supported" in retries[0], retries
    assert all(p.pid != zombie or not p.tids for p in m.processes)  # (the worker had no thread left)
    w.reap()
    stopped = w.numbers("tick")[-1]  # [tick, reaped]
    assert len(w.numbers("tick")) == stopped[0] + 1

    restored = restore.restore(out)
    w.pid = restored.pid
    wait_until(lambda: w.numbers("tick")[-1][0] >= stopped[0] + 30, "the restored trainer to tick on")
    ticks = w.numbers("tick")
    assert [t[0] for t in ticks] == list(range(len(ticks)))  # it went on from where it stood
    # With the count it had (the worker that was ending as the tree froze may be reaped at the
    # first tick after: one more, never a count started again).
    assert stopped[1] <= ticks[stopped[0] + 1][1] <= stopped[1] + 1
    assert ticks[-1][1] > stopped[1]  # and its workers come and go again


def test_the_cli_dump_retries_and_says_so(loops, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    """`tpagent dump` goes through the same retry, and says on stderr why it waits."""
    from support.helpers import ROOT

    hold = tmp_path / "hold"
    hold.touch()
    w = Loop("epoch_workers.py", tmp_path / "w.log", (str(hold),)).start()
    loops.append(w)
    wait_until(lambda: _zombie_with_threads(w.pid), "a worker to be a zombie with a thread")
    snap = tmp_path / "snap"
    cli = subprocess.Popen(
        [sys.executable, "-m", "cli.main", "dump", str(w.pid), "--out", str(snap), "--leave-running"],
        cwd=ROOT,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    assert cli.stderr is not None
    said = [cli.stderr.readline()]
    while said[-1] and "refused for now" not in said[-1]:
        said.append(cli.stderr.readline())
    hold.unlink()  # the worker ends once the first refusal was seen
    out, err = cli.communicate(timeout=120)
    assert cli.returncode == 0, "".join(said) + err
    assert "criu_dump        refused for now (Zombies with threads are not supported); retry 1 in 0.5 s" in said[-1]
    assert "Error (" not in "".join(said) + err and "snapshot of PID" in out
    n = w.numbers("tick")[-1][0]  # left running: it goes on
    wait_until(lambda: w.numbers("tick")[-1][0] > n + 5, "the trainer to run on")
    assert json.loads((snap / "manifest.json").read_text())["origin"]["mode"] == "leave-running"


def test_a_refusal_that_persists_is_retried_a_bounded_number_of_times(loops, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    hold = tmp_path / "hold"
    hold.touch()  # the worker never finishes exiting
    w = Loop("epoch_workers.py", tmp_path / "w.log", (str(hold),)).start()
    loops.append(w)
    wait_until(lambda: _zombie_with_threads(w.pid), "a worker to be a zombie with a thread")
    seen: list[str] = []
    out = tmp_path / "snap"
    with pytest.raises(SnapshotError, match="Zombies with threads are not supported") as caught:
        checkpoint(w.pid, out, DumpMode.KILL, SnapshotConfig(dump_retries=2), lambda s, msg: seen.append(msg))
    assert sum(msg.startswith("refused for now") for msg in seen) == 2
    assert caught.value.rolled_back and not out.exists()  # as it was: the same command can run again
    n = w.numbers("tick")[-1][0]
    wait_until(lambda: w.numbers("tick")[-1][0] > n + 5, "the trainer to run on")


@pytest.mark.parametrize("launched", [False, True], ids=["plain", "launched"])
def test_a_periodic_timerfd_fires_on_after_a_restore(loops, tmp_path: Path, launched: bool) -> None:  # type: ignore[no-untyped-def]
    """An asyncio-style loop whose only clock is a 20 ms periodic timerfd: frozen for longer
    than a period, the timer has expired unread, which CRIU restores disarmed (its issue 3162);
    the restore arms it again, and the loop ticks on from where it stood."""
    w = Loop("epoll_loop.py", tmp_path / "w.log", launched=launched).start()
    loops.append(w)
    loop_pid = psutil.Process(w.pid).children()[0].pid if launched else w.pid
    snap = tmp_path / "snap"
    proc = tpagent("dump", str(w.pid), "--out", str(snap))
    assert proc.returncode == 0, proc.stderr
    w.reap()
    stopped = w.numbers("tick")[-1]  # [tick, expirations]
    timers = json.loads((snap / "manifest.json").read_text())["timers"]
    assert timers == [{"pid": loop_pid, "fd": timers[0]["fd"], "interval_ns": 20_000_000}]

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
    says so (the dump's output, `inspect`, :func:`host.criu_limits.restore_warnings` for a dry
    run), and the restored loop still gets the events of its watch."""
    from host.criu_limits import restore_warnings

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


@pytest.mark.parametrize("killed", ["criu", "hook"])
def test_a_pinned_dump_whose_criu_or_hook_is_killed_leaves_its_tree_stopped(start, tmp_path: Path, killed: str) -> None:  # type: ignore[no-untyped-def]
    """A migration's dump is held, pinned (its copy may start elsewhere); then CRIU, or its
    post-dump hook, is killed.  Either lets the tree go (CRIU as it dies; a failed hook makes
    CRIU roll back): before, the original ran at once beside its copy (a reviewer's fault
    injection: two copies ticked).  It stays stopped, the hook ends, and once its pinner sends
    SIGCONT (knowing the copy does not run) it runs on where it stood."""
    from snapshot.held import HeldDump

    w = start(mib=16)
    out = tmp_path / "snap"
    dump = HeldDump.start(w.pid, out, SnapshotConfig(), hold=600)
    wait_until(dump.sealed, "the snapshot to be sealed and its tree held")
    assert dump.pin()
    criu = psutil.Process(int((out / "log" / "criu.pid").read_text().split()[0]))
    hooks = [p for p in criu.children(recursive=True) if "hook" in " ".join(p.cmdline())]
    assert hooks, [p.cmdline() for p in criu.children(recursive=True)]
    for p in [criu] if killed == "criu" else hooks:
        p.kill()
    wait_until(lambda: not any(alive(p.pid) for p in hooks), "the hook to end")
    wait_until(lambda: not dump.running(), "the dump's thread to report")
    assert dump.error is not None, "the dump said it succeeded"
    tree = [w.pid, w.worker_pid]
    wait_until(lambda: all(psutil.Process(p).status() == psutil.STATUS_STOPPED for p in tree), "the tree to stop")
    n = len(w.ticks())
    assert all(psutil.Process(p).status() == psutil.STATUS_STOPPED for p in tree) and len(w.ticks()) == n
    for p in tree:
        os.kill(p, signal.SIGCONT)
    wait_until(lambda: len(w.ticks()) > n + 10, "the workload to run on")
    assert_continuous(w.ticks())
    w.verify_state()


def test_a_pinned_dump_let_go_leaves_a_child_stopped_before_it_stopped_and_the_rest_running(  # type: ignore[no-untyped-def]
    loops, tmp_path: Path
) -> None:
    """A child the user had stopped before the dump: the hook queues its stop to the whole tree
    once pinned, and takes it back at the abort; CRIU's rollback then stops again what it
    found stopped.  The parent runs on where it stood, the child stays stopped, each as it was."""
    from snapshot.held import HeldDump

    w = Loop("stopped_child.py", tmp_path / "w.log", ()).start()
    loops.append(w)
    (child,) = psutil.Process(w.pid).children()
    try:
        os.kill(child.pid, signal.SIGSTOP)
        wait_until(lambda: child.status() == psutil.STATUS_STOPPED, "the child to stop")
        dump = HeldDump.start(w.pid, tmp_path / "snap", SnapshotConfig(), hold=600)
        wait_until(dump.sealed, "the snapshot to be sealed and its tree held")
        assert dump.pin() and dump.stopped() == [child.pid]
        dump.let_go(timeout=60)
        assert dump.error is not None and dump.error.rolled_back, dump.error
        n = w.numbers("tick")[-1][0]
        wait_until(lambda: w.numbers("tick")[-1][0] > n + 10, "the parent to run on")
        assert child.status() == psutil.STATUS_STOPPED and psutil.Process(w.pid).status() != psutil.STATUS_STOPPED
        ticks = [t[0] for t in w.numbers("tick")]
        assert ticks == list(range(len(ticks)))
    finally:  # (the loop's end ends its parent; the stopped child, left to init, would stay for ever)
        with contextlib.suppress(psutil.Error):
            child.kill()


def test_a_held_dump_is_let_go_on_a_disk_that_filled_since(start, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    """The snapshot's disk fills while its tree is held (the copy restored elsewhere meanwhile):
    the abort, a file written then, failed for want of room, and the original stayed frozen for
    ever (a reviewer's fault injection).  Its word, made as the hold began, is renamed into place:
    CRIU rolls back and the workload runs on where it stood."""
    from snapshot.held import HeldDump

    w = start(mib=16)
    disk = tmp_path / "disk"
    disk.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=48m", "tpagent-test", str(disk)], check=True)
    try:
        dump = HeldDump.start(w.pid, disk / "snap", SnapshotConfig(), hold=600)
        wait_until(dump.sealed, "the snapshot to be sealed and its tree held")
        assert dump.pin()
        full = subprocess.run(["dd", "if=/dev/zero", f"of={disk / 'fill'}", "bs=1M"], capture_output=True, text=True)
        assert "No space left on device" in full.stderr, full.stderr
        dump.let_go(timeout=60)
        assert dump.error is not None and dump.error.rolled_back, dump.error
        n = w.ticks()[-1][0]
        wait_until(lambda: w.ticks()[-1][0] > n + 10, "the workload to run on")
        assert_continuous(w.ticks())
        w.verify_state()
    finally:
        subprocess.run(["umount", "-l", str(disk)], check=False)


_REUSE = """#!/bin/sh
# Before CRIU freezes PID $3, end that process and start another under its very PID.
if [ "$1" = dump ]; then
  kill -9 "$3"
  while [ -e "/proc/$3" ]; do sleep 0.01; done
  for _ in 1 2 3 4 5 6 7 8 9 10 11 12 13 14 15 16 17 18 19 20; do
    echo $(($3 - 1)) > /proc/sys/kernel/ns_last_pid
    setsid sleep 600 </dev/null >/dev/null 2>&1 &
    [ "$!" = "$3" ] && break
    kill -9 "$!"
  done
  echo "$!" > "{newpid}"
fi
exec {criu} "$@"
"""


def test_a_pid_reused_before_the_freeze_is_not_dumped(tmp_path: Path) -> None:
    """The process checked under a PID exits and another one gets that PID just before CRIU
    freezes it (a CRIU wrapper does exactly that): the post-dump hook, which sees the frozen
    root's start time, makes CRIU roll back.  Nothing is dumped, the newcomer runs on."""
    from host.api import UsageError
    from snapshot.criu import Criu

    newpid = tmp_path / "newpid"
    wrapper = tmp_path / "criu-reusing-the-pid"
    wrapper.write_text(_REUSE.replace("{newpid}", str(newpid)).replace("{criu}", str(Criu().path)))
    wrapper.chmod(0o755)
    # Not our child (its PID is free once it is killed): its parent exits at once.
    started = subprocess.run(
        ["sh", "-c", "setsid sleep 600 </dev/null >/dev/null 2>&1 & echo $!"], capture_output=True, text=True
    )
    pid = int(started.stdout)
    out = tmp_path / "snap"
    try:
        with pytest.raises(UsageError, match=f"PID {pid} is no longer the process that was checked"):
            checkpoint(pid, out, DumpMode.KILL, SnapshotConfig(criu=wrapper))
        assert int(newpid.read_text()) == pid  # (the PID was indeed taken over)
        assert psutil.Process(pid).status() == psutil.STATUS_SLEEPING  # the newcomer runs on, not frozen
        assert not out.exists()
    finally:
        kill_and_wait(pid)


def test_sysv_shared_memory_comes_back_under_launch_and_is_refused_in_one_sentence_without(
    loops, tmp_path: Path
) -> None:  # type: ignore[no-untyped-def]
    """Two processes counting in one SysV segment: launched (an IPC namespace of its own), the
    segment is saved and restored with its count, and both go on; started plainly, in the
    node's IPC namespace, the dump says so in one sentence before anything is frozen."""
    w = Loop("sysv_shm.py", tmp_path / "w.log", launched=True).start()
    loops.append(w)
    snap = tmp_path / "snap"
    proc = tpagent("dump", str(w.pid), "--out", str(snap))
    assert proc.returncode == 0, proc.stderr
    w.reap()
    stopped = w.numbers("tick")[-1]  # [tick, shared]
    proc = tpagent("restore", str(snap), "--json")
    assert proc.returncode == 0, proc.stderr
    w.pid = json.loads(proc.stdout)["pid"]
    wait_until(lambda: w.numbers("tick")[-1][0] >= stopped[0] + 10, "the restored pair to tick on")
    ticks = w.numbers("tick")
    assert [t[0] for t in ticks] == list(range(len(ticks)))  # the parent went on from where it stood
    shared = [t[1] for t in ticks]
    assert shared == sorted(shared), "the segment's count fell back: it was not restored as it was"
    assert shared[-1] > stopped[1], "the child no longer counts in the segment the parent reads"

    plain = Loop("sysv_shm.py", tmp_path / "plain.log").start()
    loops.append(plain)
    try:
        proc = tpagent("dump", str(plain.pid), "--out", str(tmp_path / "plain-snap"))
        assert proc.returncode != 0 and proc.stderr.count("\n") == 1, proc.stderr
        assert "SysV shared memory" in proc.stderr and "tpagent launch" in proc.stderr, proc.stderr
        n = plain.numbers("tick")[-1][0]
        wait_until(lambda: plain.numbers("tick")[-1][0] > n + 5, "the plain pair to run on, never frozen")
    finally:
        plain.stop()
        ((segment,),) = plain.numbers("shm")  # (the node's: it outlives the pair)
        subprocess.run(["ipcrm", "-m", str(segment)], check=True)


def test_sysv_semaphores_and_message_queues_come_back_under_launch_and_are_refused_without(
    loops, tmp_path: Path
) -> None:  # type: ignore[no-untyped-def]
    """A count kept in a SysV message queue and a semaphore alone: launched, both come back with
    it and it counts on.  Started plainly, in the node's IPC namespace, the dump refused it in one
    sentence before anything is frozen (before: it was dumped without them, and restored on
    another node its queue's ID named nothing there, or another user's queue)."""
    w = Loop("sysv_sem_msg.py", tmp_path / "w.log", launched=True).start()
    loops.append(w)
    snap = tmp_path / "snap"
    proc = tpagent("dump", str(w.pid), "--out", str(snap))
    assert proc.returncode == 0, proc.stderr
    stopped = w.numbers("tick")[-1][0]
    proc = tpagent("restore", str(snap), "--json")
    assert proc.returncode == 0, proc.stderr
    w.pid = json.loads(proc.stdout)["pid"]
    wait_until(lambda: w.numbers("tick")[-1][0] >= stopped + 10, "the restored count to go on")
    ticks = w.numbers("tick")
    assert [n for n, _ in ticks] == list(range(len(ticks))), (
        "the count kept in the queue did not go on from where it stood"
    )
    assert all(v == n + 1 for n, v in ticks), "the semaphore did not come back with its value"

    plain = Loop("sysv_sem_msg.py", tmp_path / "plain.log").start()
    loops.append(plain)
    try:
        proc = tpagent("dump", str(plain.pid), "--out", str(tmp_path / "plain-snap"))
        assert_one_sentence_error(proc)
        assert "SysV semaphores and SysV message queues in the node's IPC namespace" in proc.stderr, proc.stderr
        assert "tpagent launch" in proc.stderr and not (tmp_path / "plain-snap").exists()
        n = plain.numbers("tick")[-1][0]
        wait_until(lambda: plain.numbers("tick")[-1][0] > n + 5, "the plain count to go on, never frozen")
    finally:
        plain.stop()
        ((sem, queue),) = plain.numbers("ids")
        subprocess.run(["ipcrm", "-s", str(sem), "-q", str(queue)], check=True)


def test_a_process_that_exits_as_criu_seizes_it_is_said_to_have_exited(tmp_path: Path) -> None:
    """(CRIU's own lines were the sentence: "Unable to detach from PID: No such process".)"""
    from snapshot.criu import Criu

    wrapper = tmp_path / "criu-it-exits-before"
    wrapper.write_text(f'#!/bin/sh\nif [ "$1" = dump ]; then kill -9 "$3"; fi\nexec "{Criu().path}" "$@"\n')
    wrapper.chmod(0o755)
    started = subprocess.run(
        ["sh", "-c", "setsid sleep 600 </dev/null >/dev/null 2>&1 & echo $!"], capture_output=True, text=True
    )
    pid = int(started.stdout)
    try:
        proc = tpagent("dump", str(pid), "--out", str(tmp_path / "snap"), "--criu", str(wrapper))
        assert_one_sentence_error(proc, f"PID {pid} exited as it was being checkpointed; nothing was kept.")
        assert not (tmp_path / "snap").exists()
    finally:
        kill_and_wait(pid)


@pytest.mark.parametrize("who", ["user", "group"])
def test_another_users_process_is_refused_before_the_freeze_where_criu_could_not_read_its_limits(
    tmp_path: Path, who: str
) -> None:
    """CRIU reads each process's resource limits, which takes CAP_SYS_RESOURCE for a process
    of another user, or group (the kernel lets one read them without only where all their UIDs
    and GIDs are the same): a container's root without SYS_RESOURCE, this CI's root.  Without
    it, a dump of nobody's process, or of root's under group nobody (``setpriv --regid``: a
    reviewer's find), is refused in one sentence before anything is frozen (before: frozen,
    then CRIU's own lines, ``Can't get rlimit 0``); with it, the process is dumped and restored."""
    python, env = user_python()
    run_as = as_user(NOBODY) if who == "user" else ["setpriv", f"--regid={NOBODY[1]}", "--clear-groups", "--"]
    with user_dir(NOBODY) as home:
        log = home / "w.log"
        p = subprocess.Popen(
            [*run_as, python, str(STATEFUL), str(log), "16"],
            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
            start_new_session=True, cwd=home, env={"PATH": os.defpath, **env},
        )  # fmt: skip
        try:
            wait_until(lambda: log.exists() and log.read_text().count("\n") >= 3, "the workload to run")
            proc = tpagent("dump", str(p.pid), "--out", str(tmp_path / "snap"))
            if has_capability(CAP_SYS_RESOURCE):
                assert proc.returncode == 0, proc.stderr
                proc = tpagent("restore", str(tmp_path / "snap"))
                assert proc.returncode == 0, proc.stderr
                assert psutil.Process(p.pid).gids().real == NOBODY[1]
            else:
                runs = f"UID {NOBODY[0]}" if who == "user" else f"group {NOBODY[1]}"
                assert_one_sentence_error(proc, f"PID {p.pid} runs as {runs}", "lacks CAP_SYS_RESOURCE")
                assert "Nothing was done" in proc.stderr and not (tmp_path / "snap").exists()
                n = log.read_text().count("\n")
                wait_until(lambda: log.read_text().count("\n") > n + 2, "the workload to run on, never frozen")
        finally:
            kill_and_wait(p.pid)
            p.wait(10)


@pytest.mark.parametrize("held", ["many", "high"])
def test_a_job_holding_many_descriptors_is_restored_and_one_too_near_the_limit_refused(  # type: ignore[no-untyped-def]
    loops, tmp_path: Path, held: str
) -> None:
    """A job that raised its own limit on open files and holds 1500 (``many``), dumped and
    restored by a tpagent run from a shell whose soft limit is 1024: CRIU puts its descriptors
    above the tree's highest, under its soft limit, which it could not raise without
    CAP_SYS_RESOURCE: the dump ended the job and its restore failed ("Can't chose
    service_fd_base").  Now tpagent runs CRIU at its hard limit, and the copy counts on with all
    its descriptors.  One numbered 10 under the hard limit (``high``) leaves CRIU no room at all
    without that capability: refused before the freeze, in one sentence; with it, restored."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    top = hard - 10
    resource.setrlimit(resource.RLIMIT_NOFILE, (min(1024, hard), hard))  # (tpagent's, and the job's to start with)
    try:
        loop = Loop("many_fds.py", tmp_path / "w.log", ("1500" if held == "many" else f"@{top}",)).start()
        loops.append(loop)
        fds = loop.numbers("tick")[-1][1]
        proc = tpagent("dump", str(loop.pid), "--out", str(tmp_path / "snap"))
        if held == "high" and not has_capability(CAP_SYS_RESOURCE):
            assert_one_sentence_error(proc, f"PID {loop.pid} holds descriptor {top}, too near", "CAP_SYS_RESOURCE")
            assert "Nothing was done" in proc.stderr and not (tmp_path / "snap").exists()
            n = len(loop.numbers("tick"))
            wait_until(lambda: len(loop.numbers("tick")) > n + 2, "the job to run on, never frozen")
            return
        assert proc.returncode == 0, proc.stderr
        loop.reap()
        n = len(loop.numbers("tick"))
        proc = tpagent("restore", str(tmp_path / "snap"), "--json")
        assert proc.returncode == 0, proc.stderr
        loop.pid = json.loads(proc.stdout)["pid"]
        wait_until(lambda: len(loop.numbers("tick")) > n + 5, "the copy to tick on")
        ticks = loop.numbers("tick")
        assert [t[0] for t in ticks] == list(range(len(ticks))), "the copy did not count on from where it stood"
        assert {t[1] for t in ticks} == {fds}, "the copy does not hold the descriptors it had"
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


#: Binds a UDP socket, has a datagram sent to it, never reads it.
UNREAD_DATAGRAM = """
import socket, sys, time
a = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
a.bind(("127.0.0.1", 0))
socket.socket(socket.AF_INET, socket.SOCK_DGRAM).sendto(b"queued", a.getsockname())
with open(sys.argv[1] + ".tmp", "w") as f:
    f.write(str(a.fileno()))
import os; os.rename(sys.argv[1] + ".tmp", sys.argv[1])
time.sleep(600)
"""


def test_a_datagram_queued_unread_is_warned_about(tmp_path: Path) -> None:
    """CRIU saves no inet socket's receive queue: a datagram that arrived but was not read is
    lost at a restore.  The dump says so (and ``inspect``, and a dry run), naming the socket."""
    from host.criu_limits import restore_warnings

    said_fd = tmp_path / "fd"
    p = subprocess.Popen(
        [sys.executable, "-c", UNREAD_DATAGRAM, str(said_fd)],
        stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True,
    )  # fmt: skip
    try:
        wait_until(said_fd.exists, "the socket to be bound and sent to")
        fd = said_fd.read_text()
        said = f"PID {p.pid} has datagrams queued unread on a UDP socket (fd {fd})"
        warned = restore_warnings([p.pid])
        assert len(warned) == 1 and warned[0].startswith(said), warned
        proc = tpagent("dump", str(p.pid), "--out", str(tmp_path / "snap"), "--leave-running")
        assert proc.returncode == 0 and f"warning: {said}" in proc.stderr, proc.stderr
        shown = tpagent("inspect", str(tmp_path / "snap"))
        assert f"  warning: {warned[0]}" in shown.stdout.splitlines(), shown.stdout
    finally:
        kill_and_wait(p.pid)
        p.wait(10)


#: A server that has not accepted a connection its own child made (``tcp``: and sent on; ``unix``:
#: a unix one, with data written): CRIU dumps no such connection in flight.  Counts in the file
#: argv[1] names (its line: a number each 20 ms).
NOT_ACCEPTED = """
import os, socket, sys, time
kind = sys.argv[2]
family = socket.AF_UNIX if kind == "unix" else socket.AF_INET
server = socket.socket(family)
server.bind(sys.argv[1] + ".sock" if kind == "unix" else ("127.0.0.1", 0))
server.listen()
if os.fork() == 0:
    client = socket.socket(family)
    client.connect(server.getsockname())
    client.sendall(b"waiting")
    time.sleep(3600)
n = 0
while True:
    with open(sys.argv[1], "w") as f:
        f.write(str(n))
    n += 1
    time.sleep(0.02)
"""


@pytest.mark.parametrize("kind", ["tcp", "unix"])
def test_a_connection_not_yet_accepted_is_said_in_one_sentence_and_the_tree_runs_on(tmp_path: Path, kind: str) -> None:
    """A listening socket with a connection queued that its server has not accepted (in flight,
    data sent on it): CRIU refuses the dump once the tree is frozen, in its own lines (one naming
    an option of its own that tpagent does not give).  Now one sentence says why and when to try
    again; the tree was resumed and counts on."""
    count = tmp_path / "n"
    p = subprocess.Popen(
        [sys.executable, "-c", NOT_ACCEPTED, str(count), kind],
        stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True,
    )  # fmt: skip
    try:
        wait_until(lambda: count.exists() and count.read_text() not in ("", "0"), "the server to run")
        proc = tpagent("dump", str(p.pid), "--out", str(tmp_path / "snap"))
        assert_one_sentence_error(
            proc, f"PID {p.pid}'s tree has a listening socket with connections queued that it has not accepted"
        )
        assert "try again" in proc.stderr and "nothing was lost: the process was resumed" in proc.stderr
        n = int(count.read_text() or 0)
        wait_until(lambda: int(count.read_text() or 0) > n + 3, "the server to count on, resumed")
    finally:
        for child in psutil.Process(p.pid).children():
            kill_and_wait(child.pid)
        kill_and_wait(p.pid)
        p.wait(10)


def test_personality_flags_are_warned_about_and_what_a_restore_makes_of_them_is_seen(tmp_path: Path) -> None:
    """A process started with ``setarch -R`` (ADDR_NO_RANDOMIZE, 0x40000): CRIU reads its
    personality as a decimal number and never puts it back (a reviewer's find), so its copy
    runs without it.  The dump says so; the restored process shows what it warned of."""
    log = tmp_path / "w.log"
    p = subprocess.Popen(
        ["setarch", "-R", sys.executable, str(STATEFUL), str(log), "8"],
        stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True,
    )  # fmt: skip
    try:
        wait_until(lambda: log.exists() and "tick " in log.read_text(), "the workload to run")
        said = f"PID {p.pid} runs with personality flags 0x40000"
        proc = tpagent("dump", str(p.pid), "--out", str(tmp_path / "snap"))
        assert proc.returncode == 0 and f"warning: {said}" in proc.stderr, proc.stderr
        p.wait(10)
        proc = tpagent("restore", str(tmp_path / "snap"), "--json")
        assert proc.returncode == 0, proc.stderr
        assert Path(f"/proc/{p.pid}/personality").read_text().strip() == "00000000"  # (as warned: lost)
    finally:
        kill_and_wait(p.pid)


#: A tracer as gdb, strace or py-spy is one: it seizes the process it is given, and holds it.
TRACER = """
import ctypes, sys, time
libc = ctypes.CDLL(None, use_errno=True)
assert libc.ptrace(0x4206, int(sys.argv[1]), 0, 0) == 0, ctypes.get_errno()  # (PTRACE_SEIZE)
print("seized", flush=True)
time.sleep(600)
"""


@pytest.mark.parametrize(
    "kind, said",
    [
        ("io_uring", "uses io_uring (fd "),
        ("perf_event", "uses a perf event (fd "),
        ("mqueue", "uses a POSIX message queue (fd "),
        ("traced", "is traced by PID "),
        ("traced-root", "is traced by PID "),  # (the dump's own claim on it is not another dump's)
        ("pipe", "writes to a pipe (fd "),
        ("unix", "holds a unix socket (fd "),
        ("terminal", "'s terminal (/dev/pts/"),
        ("pdeathsig", "asks to be killed when its parent dies (SIGTERM, PR_SET_PDEATHSIG) and its parent, PID "),
        ("foreign-mount", ") from a mount outside its mount namespace (opened before it entered the namespace"),
        ("sealed-memfd", " (memfd_create) shared and sealed against writes, which CRIU checkpoints but cannot restore"),
        ("pidfd", ", a process outside its tree, which CRIU cannot checkpoint"),
        ("pidfd-thread", "holds a pidfd of a thread (fd "),
        ("fifo", "writes to the named pipe "),
        ("packet-pipe", "uses a pipe in packet mode (pipe2 with O_DIRECT) (fd "),
        ("stale-epoll", "uses an epoll instance watching a descriptor it has closed (another process still holding"),
    ],
)
def test_what_criu_cannot_dump_is_refused_in_one_sentence_before_anything_is_frozen(  # type: ignore[no-untyped-def]
    loops, tmp_path: Path, kind: str, said: str
) -> None:
    """CRIU cannot checkpoint an io_uring instance or a perf event (no dumper for those
    anonymous inodes) or a POSIX message queue (none for its filesystem), nor seize a process
    a debugger or tracer holds, nor take one end of a unix connection whose other end is
    outside the tree, or the slave of a terminal whose master is (a shell's in tmux), nor find
    the mount of a file opened before its process entered a mount namespace, nor hold a pidfd
    of a process outside the tree.  Given one end of such a pipe (``python train.py | tee log``),
    or of a named pipe, it dumps it, and the copy's pipe has nobody at the other end; a memfd
    sealed against writes and mapped shared it dumps, and no restore of it ever works; given a
    root that asked to be killed when its parent (outside the tree) dies, it restores that too,
    as its own child, and leaves: the copy is killed as it starts.  It finds the first ones out
    only once the tree is frozen (a page of its errors), the last ones not at all; the dump
    says so first, in one sentence, and the process never stops; `doctor --pid` names it."""
    disabled = Path("/proc/sys/kernel/io_uring_disabled")
    if kind == "io_uring" and disabled.exists() and disabled.read_text().strip() != "0":
        pytest.skip("this kernel gives no io_uring (kernel.io_uring_disabled)")
    with contextlib.ExitStack() as held:
        theirs = _outside_end(kind, held)
        own = ("io_uring", "perf_event", "mqueue", "pdeathsig", "sealed-memfd", "pidfd", "pidfd-thread", "packet-pipe")
        own += ("stale-epoll",)
        args = (kind if kind in own else _fifo(tmp_path, held) if kind == "fifo" else "none",)
        plain = bool(theirs) or kind in ("pdeathsig", "foreign-mount", "pidfd", "fifo")  # (a parent or end: this test)
        # (foreign-mount: its descriptors, this test's files among them, opened before it entered its namespace)
        wrap = ("unshare", "--mount", "--propagation", "private") if kind == "foreign-mount" else ()
        w = Loop("anon_inode_loop.py", tmp_path / "w.log", args, launched=not plain, pass_fds=theirs, wrap=wrap)
        loops.append(w.start())
        for fd in theirs:
            os.close(fd)  # (the test holds only the other end)
        if kind.startswith("traced"):
            (loop,) = psutil.Process(w.pid).children()
            traced = w.pid if kind == "traced-root" else loop.pid
            tracer = held.enter_context(
                subprocess.Popen([sys.executable, "-c", TRACER, str(traced)], stdout=subprocess.PIPE, text=True)
            )
            held.callback(tracer.kill)
            assert tracer.stdout is not None and tracer.stdout.readline() == "seized\n"
        proc = tpagent("dump", str(w.pid), "--out", str(tmp_path / "snap"))
        doctor = json.loads(tpagent("doctor", "--json", "--pid", str(w.pid)).stdout)["checks"]
    assert proc.returncode != 0 and proc.stderr.count("\n") == 1, proc.stderr
    assert [c["verdict"] for c in doctor if said in c["message"]] == ["FAIL"], doctor  # (doctor --pid says it too)
    assert said in proc.stderr and "Nothing was done" in proc.stderr, proc.stderr
    assert not (tmp_path / "snap").exists()
    ticks = w.numbers("tick")
    assert [t[0] for t in ticks] == list(range(len(ticks)))
    n = ticks[-1][0]
    wait_until(lambda: w.numbers("tick")[-1][0] > n + 5, "the loop to run on, never frozen")


def _outside_end(kind: str, held: contextlib.ExitStack) -> tuple[int, ...]:
    """For "pipe", "unix" and "terminal": the end of a pipe (its writing end), of a unix
    connection or of a pseudo-terminal (its slave) to give the loop, the test keeping the other
    (until ``held`` closes); none for the other kinds."""
    if kind == "pipe":
        ours, theirs = os.pipe()
        held.callback(os.close, ours)
        return (theirs,)
    if kind == "unix":
        a, b = socket.socketpair()
        held.callback(a.close)
        return (b.detach(),)
    if kind == "terminal":  # (as a terminal window, tmux or sshd holds the master of a shell's terminal)
        master, slave = os.openpty()
        held.callback(os.close, master)
        return (slave,)
    return ()


@pytest.mark.parametrize("streamed", [False, True])
def test_descriptors_queued_on_a_unix_socket_are_refused_with_the_tree_frozen_and_it_runs_on(  # type: ignore[no-untyped-def]
    loops, tmp_path: Path, streamed: bool
) -> None:
    """A worker sent its parent descriptors it has not read yet (SCM_RIGHTS, as
    torch.multiprocessing passes tensors): CRIU dumped them, and ended the tree, but its restore
    lost them (memfds: the parent never got them) or failed (regular files), a reviewer found.
    The hook reads CRIU's queues (from the images, or as they stream by) and refuses: CRIU rolls
    back and the tree runs on, its queue intact; once read, the same dump works."""
    w = Loop("queued_fds.py", tmp_path / "w.log", (), launched=True).start()
    loops.append(w)
    config = SnapshotConfig(stream=lambda name, offset, chunk: None) if streamed else SnapshotConfig()
    said = r"3 message\(s\) queued on a unix socket of the tree carry descriptors \(SCM_RIGHTS"
    with pytest.raises(SnapshotError, match=said) as refused:
        checkpoint(w.pid, tmp_path / "refused", config=config)
    assert refused.value.rolled_back
    n = w.numbers("tick")[-1][0]
    wait_until(lambda: w.numbers("tick")[-1][0] > n + 5, "the workload to run on")
    (parent,) = psutil.Process(w.pid).children()
    os.kill(parent.pid, signal.SIGUSR1)
    wait_until(lambda: w.numbers("got"), "the parent to read what was queued")
    assert w.numbers("got") == [[0, 0, 1, 1, 2, 2]]  # (each number, and its memfd's: all there, in order)
    checkpoint(w.pid, tmp_path / "snap")
    w.reap()
    stopped = w.numbers("tick")[-1][0]
    w.pid = restore.restore(tmp_path / "snap").pid
    wait_until(lambda: w.numbers("tick")[-1][0] > stopped + 5, "the restored workload to tick on")
    assert [t[0] for t in w.numbers("tick")] == list(range(len(w.numbers("tick"))))


def _fifo(tmp_path: Path, held: contextlib.ExitStack) -> str:
    """The loop's argument for a named pipe the test reads (as a log collector would)."""
    path = tmp_path / "fifo"
    os.mkfifo(path)
    held.callback(os.close, os.open(path, os.O_RDONLY | os.O_NONBLOCK))
    return f"fifo:{path}"


def _named_again() -> list[str]:
    """The names CRIU gave relinked files in /dev/shm (``link_remap.N``) that are still there."""
    return sorted(n for n in os.listdir("/dev/shm") if n.startswith("link_remap."))


@pytest.mark.parametrize("where", ["here", "elsewhere"])
@pytest.mark.parametrize("method", ["spawn", "forkserver"])
def test_spawn_and_forkserver_multiprocessing_comes_back_its_semaphores_shared(  # type: ignore[no-untyped-def]
    loops, tmp_path: Path, method: str, where: str
) -> None:
    """Every lock and queue of Python's spawn and forkserver multiprocessing (torch's DataLoader
    with such workers, Python 3.14's default) is a POSIX semaphore the parent maps under a name
    glibc removed, the file keeping its own name, which the worker maps: CRIU refused such a tree
    ("Can't create link remap").  It is dumped, leaves no name behind, and comes back with parent
    and worker still on one semaphore: here, and "elsewhere", where the semaphores' files are
    not (they come from the snapshot, linked as they were)."""
    before = _named_again()
    w = Loop("mp_sync.py", tmp_path / "w.log", (method,), launched=True).start()
    loops.append(w)
    snap = tmp_path / "snap"
    proc = tpagent("dump", str(w.pid), "--out", str(snap), "--json")
    assert proc.returncode == 0, proc.stderr
    w.reap()
    assert _named_again() == before, "CRIU's names of the semaphores stayed on the node"
    m = json.loads((snap / "manifest.json").read_text())
    assert m["links"] and set(m["links"].values()) <= set(m["carried"]), m
    if where == "elsewhere":
        for path in m["carried"]:
            os.unlink(path)
    stopped = w.numbers("tick")[-1][0]
    proc = tpagent("restore", str(snap), "--json")
    assert proc.returncode == 0, proc.stderr
    w.pid = json.loads(proc.stdout)["pid"]
    wait_until(lambda: w.numbers("tick")[-1][0] >= stopped + 30, "the restored pair to pass numbers on")
    ticks = [t[0] for t in w.numbers("tick")]
    assert ticks == list(range(len(ticks))), "a number was lost or read twice"
    assert _named_again() == before, "the restore left CRIU's names of the semaphores"
    assert all(os.path.exists(p) for p in m["carried"]), "a semaphore's own name is gone (a worker opens it so)"


@pytest.mark.parametrize("other", ["beside", "elsewhere"])
def test_a_file_open_under_a_removed_name_stays_one_file_with_its_other_name(  # type: ignore[no-untyped-def]
    loops, tmp_path: Path, other: str
) -> None:
    """A file the process has open under a name since removed, the file linked again in that
    directory (or in another, so that the snapshot carries CRIU's name of it as a file of its
    own): after a restore here, what the process writes through its descriptor is still what
    the other name shows (one file, not a copy), and no name of CRIU's is left once restored."""
    d = tmp_path / "relink"
    kept = tmp_path / "kept-in" if other == "elsewhere" else d
    kept.mkdir(parents=True, exist_ok=True)
    d.mkdir(exist_ok=True)
    args = ("fork", "--relink", str(d), "--kept-in", str(kept))
    w = Loop("mp_sync.py", tmp_path / "w.log", args, launched=True).start()
    loops.append(w)
    snap = tmp_path / "snap"
    proc = tpagent("dump", str(w.pid), "--out", str(snap))
    assert proc.returncode == 0, proc.stderr
    w.reap()
    names = json.loads((snap / "manifest.json").read_text())
    assert bool(names["links"]) == (other == "beside"), names
    stopped = w.numbers("tick")[-1][0]
    proc = tpagent("restore", str(snap), "--json")
    assert proc.returncode == 0, proc.stderr
    w.pid = json.loads(proc.stdout)["pid"]
    wait_until(lambda: int((kept / "kept").read_text()) >= stopped + 20, "the other name to show the restored writes")
    assert sorted(os.listdir(d)) == ([] if other == "elsewhere" else ["kept"]), "a name of CRIU's was left"


def test_a_removed_name_in_a_directory_users_can_change_is_refused_in_one_sentence(  # type: ignore[no-untyped-def]
    loops, tmp_path: Path
) -> None:
    """CRIU names such a file again, as root, in its directory: in one a user can change (swap
    for a symlink meanwhile) that is refused before anything is frozen, and the process runs on."""
    d = tmp_path / "users"
    d.mkdir()
    nobody = pwd.getpwnam("nobody")
    os.chown(d, nobody.pw_uid, nobody.pw_gid)
    w = Loop("mp_sync.py", tmp_path / "w.log", ("fork", "--relink", str(d)), launched=True).start()
    loops.append(w)
    proc = tpagent("dump", str(w.pid), "--out", str(tmp_path / "snap"))
    assert proc.returncode != 0 and proc.stderr.count("\n") == 1, proc.stderr
    assert f"has {d}/opened open under a name removed" in proc.stderr and "Nothing was done" in proc.stderr
    assert f"{d} (owner UID {nobody.pw_uid}" in proc.stderr, proc.stderr
    assert not (tmp_path / "snap").exists() and sorted(os.listdir(d)) == ["kept"]
    n = w.numbers("tick")[-1][0]
    wait_until(lambda: w.numbers("tick")[-1][0] > n + 10, "the process to run on, never frozen")


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs two CPUs to bind threads to")
@pytest.mark.parametrize("launched", [False, True], ids=["plain", "launched"])
def test_threads_bound_to_cpus_come_back_bound(loops, tmp_path: Path, launched: bool) -> None:  # type: ignore[no-untyped-def]
    """CRIU keeps no thread's CPU affinity: a copy's threads came back on every CPU, each
    binding lost (Slurm's --cpu-bind, taskset, NUMA binding).  Each bound thread is bound again
    to the same CPUs; one that was free stays free."""
    cpus = sorted(os.sched_getaffinity(0))
    everything = sum(1 << c for c in cpus)
    one = cpus[-1]
    loop = Loop("bound_threads.py", tmp_path / "loop.log", (str(one),), launched=launched).start()
    loops.append(loop)
    before = loop.numbers("tick")[-1]
    assert before[1:] == [1 << one, everything & ~(1 << one), everything], before
    m = checkpoint(loop.pid, tmp_path / "snap")
    loop.reap()
    assert sorted(sorted(affinity.parse(b.cpus)) for b in m.bindings) == sorted([[one], cpus[:-1]]), m.bindings
    shown = tpagent("inspect", str(tmp_path / "snap")).stdout
    assert f"bound to CPUs {m.bindings[0].cpus}, bound again on restore" in shown, shown
    n = len(loop.numbers("tick"))
    loop.pid = restore.restore(tmp_path / "snap").pid
    wait_until(lambda: len(loop.numbers("tick")) > n + 5, "the copy to tick")
    after = loop.numbers("tick")[-1]
    assert after[1:] == before[1:], f"the copy's threads' CPUs: {after[1:]}, before the dump: {before[1:]}"


@pytest.mark.parametrize("who", ["client", "server"])
def test_a_restore_whose_listening_port_is_taken_says_so_and_restores_once_it_is_free(  # type: ignore[no-untyped-def]
    loops, tmp_path: Path, who: str
) -> None:
    """A server restored on the node it was dumped on finds its port taken if another socket
    listens there meanwhile, or if it closed connections first (``who``: they wait out
    TIME_WAIT for a minute) with no SO_REUSEADDR set, as ``socket.socket()`` leaves it: CRIU
    cannot bind it again.  The restore says which port, and why, in one sentence (CRIU's words
    after it); nothing is restored, and the snapshot is restored once the port is free."""
    w = Loop("tcp_server.py", tmp_path / "w.log", (who,), launched=True).start()
    loops.append(w)
    snap = tmp_path / "snap"
    assert tpagent("dump", str(w.pid), "--out", str(snap)).returncode == 0
    n, port, _ = w.numbers("tick")[-1]
    with contextlib.ExitStack() as held:
        if who == "client":  # (nothing of it is left on its port: another process listens there)
            squatter = held.enter_context(socket.socket())
            squatter.bind(("127.0.0.1", port))
            squatter.listen()
        proc = tpagent("restore", str(snap))
    why = f"a socket listens on 127.0.0.1:{port} here" if who == "client" else "wait out TIME_WAIT"
    taken = f"TCP port 127.0.0.1:{port}, which the process had bound, is taken on this node ("
    assert_one_sentence_error(proc, taken, why, "nothing was restored")
    assert w.numbers("tick")[-1][0] == n  # (nothing of it runs)
    if who == "client":
        proc = tpagent("restore", str(snap), "--json")
        assert proc.returncode == 0, proc.stderr
        w.pid = json.loads(proc.stdout)["pid"]
        wait_until(lambda: w.numbers("tick")[-1][0] >= n + 10, "the restored server to take connections again")
        ticks = w.numbers("tick")
        assert ticks == [[i, port, i] for i in range(len(ticks))]  # the same listener, from where it stood


@pytest.mark.parametrize("launched", [False, True], ids=["plain", "launched"])
def test_names_of_no_encoding_are_dumped_and_come_back(loops, tmp_path: Path, launched: bool) -> None:  # type: ignore[no-untyped-def]
    """A process's own name, a thread's, a mapped file's and an open file's may be any bytes
    (prctl, pthread_setname_np, open): a dump read them as UTF-8 and ended in a traceback
    (UnicodeDecodeError), the process frozen no more but never dumped.  Now it is dumped, and its
    copy counts on from where it stood."""
    loop = Loop("odd_names.py", tmp_path / "loop.log", launched=launched).start()
    loops.append(loop)
    checkpoint(loop.pid, tmp_path / "snap")
    loop.reap()
    n = len(loop.numbers("tick"))
    loop.pid = restore.restore(tmp_path / "snap").pid
    wait_until(lambda: len(loop.numbers("tick")) > n + 5, "the copy to tick")
    ticks = loop.numbers("tick")
    assert [t[0] for t in ticks] == list(range(len(ticks))), "the copy did not count on from where it stood"
    assert all(t[0] == t[1] for t in ticks), "the mapped file's count is not the copy's"
