"""Real CRIU, real processes: dump, kill, restore, and the workload's state carries on."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import uuid
from pathlib import Path

import psutil
import pytest

from conftest import needs_criu
from support.helpers import (
    ROOT,
    Workload,
    alive,
    assert_continuous,
    assert_one_sentence_error,
    kill_and_wait,
    slow_restore_criu,
    tpagent,
    wait_until,
)

pytestmark = needs_criu


def _dump_restore_cycle(w, snap: Path) -> None:  # type: ignore[no-untyped-def]
    w.verify_state()
    proc = tpagent("dump", str(w.pid), "--out", str(snap))
    assert proc.returncode == 0, proc.stderr
    w.reap()
    assert not alive(w.pid)
    stopped_at = w.ticks()[-1][0]
    assert len(w.ticks()) == stopped_at + 1  # nothing ran after the dump

    proc = tpagent("restore", str(snap), "--json")
    assert proc.returncode == 0, proc.stderr
    w.pid = json.loads(proc.stdout)["pid"]
    wait_until(lambda: w.ticks()[-1][0] >= stopped_at + 10, "the restored workload to tick on")
    ticks = w.ticks()
    assert_continuous(ticks)  # tick N+1 follows tick N: it went on from where it stood
    w.verify_state()  # its 256 MiB are byte-identical


def _dumped(start, tmp_path: Path) -> tuple[Workload, Path, int]:  # type: ignore[no-untyped-def]
    """A workload of 16 MiB dumped (killed) to ``tmp_path/snap``: it, the snapshot, its last tick."""
    w = start(mib=16)
    snap = tmp_path / "snap"
    assert tpagent("dump", str(w.pid), "--out", str(snap)).returncode == 0
    w.reap()
    return w, snap, w.ticks()[-1][0]


def _restores_and_ticks_on(w: Workload, snap: Path, stopped_at: int) -> None:
    """``snap`` restores, and the copy ticks on from tick ``stopped_at``, continuous."""
    proc = tpagent("restore", str(snap), "--json")
    assert proc.returncode == 0, proc.stderr
    w.pid = json.loads(proc.stdout)["pid"]
    wait_until(lambda: w.ticks()[-1][0] >= stopped_at + 5, "the restored workload to tick on")
    assert_continuous(w.ticks())


@pytest.mark.parametrize("session_leader", [True, False], ids=["session-leader", "shell-job"])
def test_plain_process_dump_kill_restore(start, tmp_path: Path, session_leader: bool) -> None:  # type: ignore[no-untyped-def]
    w = start(session_leader=session_leader)
    pid = w.pid
    _dump_restore_cycle(w, tmp_path / "snap")
    assert w.pid == pid  # a plain process comes back under its own PID


def _restoring_after_criu(snap: Path, tmp: Path) -> subprocess.Popen[str]:
    """`tpagent restore` of ``snap``, once CRIU has restored the tree (stopped), which waits 3 s
    before it returns: the copy is neither noted nor let run yet."""
    from snapshot.criu import Criu

    wrapper, restored = tmp / "criu-then-wait", tmp / "restored"
    wrapper.write_text(
        f'#!/bin/sh\n"{Criu().path}" "$@"; rc=$?\nif [ "$1" = restore ]; then touch {restored}; sleep 3; fi\nexit $rc\n'
    )
    wrapper.chmod(0o755)
    cmd = [sys.executable, "-m", "cli.main", "restore", str(snap), "--criu", str(wrapper)]
    cli = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    wait_until(restored.exists, "CRIU to have restored the tree")
    return cli


def test_a_restore_ended_by_sigterm_once_criu_restored_the_tree_leaves_no_copy(start, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    """`kill` (SIGTERM) of `tpagent restore` once CRIU has restored the tree, stopped, and before
    the copy was noted and let run: the command ended at once, its undo never run, and the copy
    stayed stopped, noted nowhere, so a second restore started another beside it.  Now SIGTERM is
    taken as a Ctrl-C: the copy is killed, the command says so, and the snapshot restores again."""
    w, snap, stopped_at = _dumped(start, tmp_path)
    cli = _restoring_after_criu(snap, tmp_path)
    assert psutil.Process(w.pid).status() == psutil.STATUS_STOPPED  # (the copy, held stopped)
    cli.send_signal(signal.SIGTERM)
    _, err = cli.communicate(timeout=60)
    assert cli.returncode == 130 and "was interrupted; nothing was left running" in err, err
    wait_until(lambda: not alive(w.pid), "the stopped copy to be killed")
    assert w.ticks()[-1][0] == stopped_at
    _restores_and_ticks_on(w, snap, stopped_at)


def test_a_restore_killed_once_criu_restored_the_tree_names_its_stopped_copy_as_the_one_to_keep(  # type: ignore[no-untyped-def]
    start, tmp_path: Path
) -> None:
    """SIGKILL of `tpagent restore` (no undo can run) once CRIU has restored the tree, stopped: the
    next restore said the copy's PID was "held by process N; stop that process", the only copy.  It
    says that process is stopped, and to keep it if it is that copy; let run, it ticks on."""
    w, snap, stopped_at = _dumped(start, tmp_path)
    cli = _restoring_after_criu(snap, tmp_path)
    cli.kill()
    cli.communicate(timeout=60)
    assert psutil.Process(w.pid).status() == psutil.STATUS_STOPPED  # (the only copy)
    again = tpagent("restore", str(snap))
    assert_one_sentence_error(
        again, f"is held by process {w.pid} (", "stopped: if it is a copy of this snapshot whose restore was cut short"
    )
    os.kill(w.pid, signal.SIGCONT)
    wait_until(lambda: w.ticks()[-1][0] >= stopped_at + 5, "the copy let run to tick on")
    assert_continuous(w.ticks())


def test_two_restores_of_one_snapshot_at_once_start_one_copy(start, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    """Each checked that no copy ran, then both restored (a launched workload's PIDs are its
    namespace's: none taken here): two copies ran.  The second is refused while the first restores."""
    w = start(mib=16, launched=True)
    snap = tmp_path / "snap"
    assert tpagent("dump", str(w.pid), "--out", str(snap)).returncode == 0
    stopped_at = w.ticks()[-1][0]
    slow, started = slow_restore_criu(tmp_path, 3)
    cmd = [sys.executable, "-m", "cli.main", "restore", str(snap), "--json", "--criu", str(slow)]
    first = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    wait_until(started.exists, "the first restore to run CRIU")
    second = tpagent("restore", str(snap))
    assert_one_sentence_error(second, "another restore of this snapshot is under way on this node")
    out, err = first.communicate(timeout=120)
    assert first.returncode == 0, err
    w.pid = json.loads(out)["pid"]
    wait_until(lambda: w.ticks()[-1][0] >= stopped_at + 5, "the one copy to tick on")
    assert_continuous(w.ticks())  # (two copies would write each tick twice)


def _dump_held_before_criu(pid: int, snap: Path, tmp: Path) -> tuple[subprocess.Popen[str], Path]:
    """`tpagent dump PID` started, and waited for until it has claimed the tree and is about to
    run CRIU, which waits (the tree not frozen yet) until the file returned is made."""
    from snapshot.criu import Criu

    waiting = tmp / "waiting"
    go = tmp / "go"
    wrapper = tmp / "criu-waits"
    wrapper.write_text(
        f'#!/bin/sh\nif [ "$1" = dump ]; then touch {waiting}; while [ ! -e {go} ]; do sleep 0.05; done; fi\n'
        f'exec "{Criu().path}" "$@"\n'
    )
    wrapper.chmod(0o755)
    cmd = [sys.executable, "-m", "cli.main", "dump", str(pid), "--out", str(snap), "--criu", str(wrapper)]
    first = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    wait_until(waiting.exists, "the first dump to have claimed the tree")
    return first, go


def test_a_dump_of_a_process_another_dump_holds_is_refused_and_the_first_goes_on(start, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    """Two dumps of one process at once (a `tpagent dump` typed beside a migration) fought over
    it: the second found it traced "by a debugger", or both failed, each saying the process was
    resumed although the other had ended it.  Now whichever comes second, for the tree's root or
    for a process in it, is refused in one sentence before it touches the tree; the first dumps
    it, and its snapshot restores where the workload stood."""
    from host import claims, ends
    from host.ptrace import seized

    w = start(mib=16, launched=True)
    snap = tmp_path / "snap"
    first, go = _dump_held_before_criu(w.pid, snap, tmp_path)
    try:
        for pid in (w.pid, w.worker_pid):
            out = tmp_path / f"second-{pid}"
            second = tpagent("dump", str(pid), "--out", str(out), "--leave-running")
            assert second.returncode == 2, second.stderr
            assert_one_sentence_error(second, f"PID {pid} is being checkpointed already")
            assert not out.exists()
        with seized(w.worker_pid):  # (traced, as CRIU holds it: a migration's check says why)
            assert ends.unmovable([w.worker_pid]) == [claims.busy(w.worker_pid)]
        ticked = w.ticks()[-1][0]
        wait_until(lambda: w.ticks()[-1][0] > ticked + 2, "the workload to tick on (no dump froze it yet)")
    finally:
        go.touch()
    _, err = first.communicate(timeout=120)
    assert first.returncode == 0, err
    w.reap()
    _restores_and_ticks_on(w, snap, w.ticks()[-1][0])


FORKER = """
import os, signal, sys, time
def fork(*_):
    if (pid := os.fork()) == 0:
        while True:
            time.sleep(0.05)
    with open(sys.argv[1], "a") as f:
        f.write(f"{pid}\\n")
signal.signal(signal.SIGUSR1, fork)
while True:
    time.sleep(0.05)
"""


def test_a_child_forked_once_a_dump_looked_at_its_tree_is_refused_to_another_dump(tmp_path: Path) -> None:
    """A dump claims the tree it found; a child forked after that (a DataLoader's next worker)
    is in the tree CRIU freezes, unclaimed: a second dump of it went ahead.  Now a dump of a
    process whose ancestor another dump holds is refused as one of that process would be, and
    the first dump takes the child along."""
    children = tmp_path / "children"
    children.touch()
    with open(tmp_path / "out.log", "w") as out:
        forker = subprocess.Popen(
            [sys.executable, "-c", FORKER, str(children)],
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    snap = tmp_path / "snap"
    first, go = _dump_held_before_criu(forker.pid, snap, tmp_path)
    try:
        forker.send_signal(signal.SIGUSR1)
        wait_until(lambda: children.read_text().strip() != "", "the child to be forked")
        child = int(children.read_text())
        second = tpagent("dump", str(child), "--out", str(tmp_path / "second"), "--leave-running")
        assert_one_sentence_error(second, f"PID {child} is being checkpointed already")
        assert not (tmp_path / "second").exists()
    finally:
        go.touch()
        _, err = first.communicate(timeout=120)
        forker.kill()  # (ended by the dump, unless it failed)
        forker.wait()
    assert first.returncode == 0, err
    inspect = json.loads(tpagent("inspect", str(snap), "--json").stdout)
    assert sorted(p["pid"] for p in inspect["processes"]) == sorted([forker.pid, child])


def test_launched_namespace_dump_restore_twice(start, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    w = start(launched=True)
    manifest_pid = w.pid
    _dump_restore_cycle(w, tmp_path / "snap1")
    # The restored namespace can be checkpointed again (what a second migration does).
    _dump_restore_cycle(w, tmp_path / "snap2")
    inspect = json.loads(tpagent("inspect", str(tmp_path / "snap1"), "--json").stdout)
    assert inspect["namespace"] is True and inspect["root_pid"] == manifest_pid
    assert [p["ns_pids"][-1] for p in inspect["processes"]] == [1, 2]


@pytest.fixture
def driver_mount(tmp_path: Path):  # type: ignore[no-untyped-def]
    """A read-only squashfs mount on the node, as the GPU node's driver files are (/usr/local/nvidia)."""
    import os
    import subprocess

    src = tmp_path / "driver-files"
    src.mkdir()
    (src / "libdriver.so.1").write_bytes(os.urandom(256 << 10))
    image = tmp_path / "driver.squashfs"
    subprocess.run(["mksquashfs", str(src), str(image), "-quiet", "-noappend"], check=True, capture_output=True)
    mnt = tmp_path / "nvidia"
    mnt.mkdir()
    subprocess.run(["mount", "-t", "squashfs", "-o", "loop,ro", str(image), str(mnt)], check=True)
    yield mnt
    subprocess.run(["umount", "-l", str(mnt)], check=False)


def test_launched_namespace_with_a_library_mapped_from_a_squashfs_mount(
    start, driver_mount: Path, tmp_path: Path
) -> None:  # type: ignore[no-untyped-def]
    """CRIU has no support of its own for squashfs: the node's mounts are external to the
    namespace, so a workload with a library mapped from one dumps and comes back mapped."""
    lib = driver_mount / "libdriver.so.1"
    w = start(mib=16, launched=True, extra=("--map", str(lib)))
    _dump_restore_cycle(w, tmp_path / "snap")
    maps = Path(f"/proc/{w.worker_pid}/maps").read_text()
    assert str(lib) in maps


def test_a_network_namespace_of_the_node_that_goes_away_does_not_stop_the_restore(start, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    """The node mounts each named network namespace under /run/netns (`ip netns`, CNI): the
    workload's namespace does not keep them, so one deleted between the dump and the restore
    (as pods come and go) is not an external mount the restore must find (it once failed:
    "Can't stat mountpoint /run/netns/...")."""
    ns = f"tpgone-{uuid.uuid4().hex[:6]}"
    subprocess.run(["ip", "netns", "add", ns], check=True)
    try:
        w = start(mib=16, launched=True)
        assert f"/run/netns/{ns}" not in Path(f"/proc/{w.pid}/mountinfo").read_text()
        proc = tpagent("dump", str(w.pid), "--out", str(tmp_path / "snap"))
        assert proc.returncode == 0, proc.stderr
        w.reap()
    finally:
        subprocess.run(["ip", "netns", "del", ns], check=True)
    stopped_at = w.ticks()[-1][0]
    proc = tpagent("restore", str(tmp_path / "snap"), "--json")
    assert proc.returncode == 0, proc.stderr
    w.pid = json.loads(proc.stdout)["pid"]
    wait_until(lambda: w.ticks()[-1][0] >= stopped_at + 10, "the restored workload to tick on")
    assert_continuous(w.ticks())
    w.verify_state()


@pytest.fixture
def pod_volume(tmp_path: Path):  # type: ignore[no-untyped-def]
    """A tmpfs mounted on the node with another beneath it, as a container's overlay and its /dev
    are, or a pod's volume: mounts that come and go with what they belong to."""
    mnt = tmp_path / "pod-volume"
    mnt.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "pod", str(mnt)], check=True)
    (mnt / "dev").mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "pod-dev", str(mnt / "dev")], check=True)
    yield mnt
    subprocess.run(["umount", "-R", "-l", str(mnt)], check=False)


def test_a_mount_gone_since_the_dump_is_named_and_one_left_out_of_it_is_not_needed(  # type: ignore[no-untyped-def]
    start, pod_volume: Path, tmp_path: Path
) -> None:
    """Two workloads launched while the node has a mount: one dumped with it, one without it
    (``skip_mounts``, as a migration's dump leaves out what its target lacks).  The mount then
    goes.  The first's restore fails in one sentence naming it, starting nothing, and succeeds
    once its directories are there again (the workload held nothing in it); the second's
    restores at once, without the mount."""
    from snapshot.api import SnapshotConfig
    from snapshot.dump import checkpoint

    kept = start(mib=16, launched=True)
    left = start(mib=16, launched=True)
    assert str(pod_volume / "dev") in Path(f"/proc/{left.pid}/mountinfo").read_text()
    assert tpagent("dump", str(kept.pid), "--out", str(tmp_path / "kept")).returncode == 0
    skip = (str(pod_volume), str(pod_volume / "dev"))
    checkpoint(left.pid, tmp_path / "left", config=SnapshotConfig(skip_mounts=skip))
    for w in (kept, left):
        w.reap()
    subprocess.run(["umount", "-R", str(pod_volume)], check=True)
    pod_volume.rmdir()
    stopped_at = kept.ticks()[-1][0]

    proc = tpagent("restore", str(tmp_path / "kept"), "--json")
    assert_one_sentence_error(
        proc, f"had a mount at {pod_volume}, which is missing on this node", "nothing was restored"
    )
    assert kept.ticks()[-1][0] == stopped_at
    pod_volume.mkdir()  # (empty directories do: it held nothing there; this one is a mount's)
    proc = tpagent("restore", str(tmp_path / "kept"), "--json")
    assert_one_sentence_error(proc, f"had a mount at {pod_volume}/dev, which is missing on this node")
    (pod_volume / "dev").mkdir()
    for w, snap in ((kept, "kept"), (left, "left")):
        if snap == "left":
            shutil.rmtree(pod_volume)
        stopped_at = w.ticks()[-1][0]
        proc = tpagent("restore", str(tmp_path / snap), "--json")
        assert proc.returncode == 0, proc.stderr
        w.pid = json.loads(proc.stdout)["pid"]
        wait_until(lambda w=w, at=stopped_at: w.ticks()[-1][0] >= at + 10, "the restored workload to tick on")
        assert_continuous(w.ticks())
        w.verify_state()
    assert str(pod_volume) not in Path(f"/proc/{left.pid}/mountinfo").read_text()


def test_launched_namespace_survives_restore_while_pids_busy(start, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    """Inside its own PID namespace, a workload restores even where its inner PIDs are taken."""
    a = start(launched=True)
    b = start(launched=True)  # holds the same inner PIDs 1 and 2
    proc = tpagent("dump", str(a.pid), "--out", str(tmp_path / "snap"))
    assert proc.returncode == 0, proc.stderr
    proc = tpagent("restore", str(tmp_path / "snap"), "--json")
    assert proc.returncode == 0, proc.stderr
    a.pid = json.loads(proc.stdout)["pid"]
    stopped_at = a.ticks()[-1][0]
    wait_until(lambda: a.ticks()[-1][0] >= stopped_at + 5, "the restored workload to tick on")
    assert_continuous(a.ticks())
    assert alive(b.pid)


def test_leave_running(start, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    w = start()
    proc = tpagent("dump", str(w.pid), "--out", str(tmp_path / "snap"), "--leave-running", "--carry", str(w.log))
    assert proc.returncode == 0, proc.stderr
    n = w.ticks()[-1][0]
    wait_until(lambda: w.ticks()[-1][0] >= n + 10, "the workload to keep running")
    assert_continuous(w.ticks())
    w.verify_state()
    # The snapshot is complete: inspect reads it and a restore verifies it, then refuses,
    # because the original still holds the PID (nothing is started twice).
    assert tpagent("inspect", str(tmp_path / "snap")).returncode == 0
    proc = tpagent("restore", str(tmp_path / "snap"))
    assert proc.returncode == 2 and f"PID {w.pid}" in proc.stderr and "two copies" in proc.stderr, proc.stderr
    assert alive(w.pid)
    # Once the original is gone the snapshot restores as it was at the freeze: its log (taken
    # along with --carry; CRIU refuses a file that grew since) is put back as it was then.
    w.stop()
    w.log.rename(w.log.with_suffix(".original"))
    proc = tpagent("restore", str(tmp_path / "snap"), "--json")
    assert proc.returncode == 0, proc.stderr
    w.pid = json.loads(proc.stdout)["pid"]
    wait_until(lambda: w.ticks()[-1][0] >= n + 10, "the restored copy to tick on")
    assert_continuous(w.ticks())
    w.verify_state()


def test_leave_running_namespace_is_not_restored_twice(start, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    """In its own PID namespace nothing would collide, so the original is checked explicitly."""
    w = start(launched=True)
    assert tpagent("dump", str(w.pid), "--out", str(tmp_path / "snap"), "--leave-running").returncode == 0
    proc = tpagent("restore", str(tmp_path / "snap"))
    assert proc.returncode == 2 and "two copies" in proc.stderr, proc.stderr
    n = w.ticks()[-1][0]
    wait_until(lambda: w.ticks()[-1][0] >= n + 10, "the original to run on")
    assert_continuous(w.ticks())  # a second copy would write every tick twice


def test_established_tcp_connection_survives(tmp_path: Path) -> None:
    """CRIU < 4.2 cannot dump TCP sockets on these kernels; with 4.2 the connection lives on."""
    from support.helpers import TcpEcho

    w = TcpEcho(tmp_path / "tcp.log").start()
    try:
        proc = tpagent("dump", str(w.pid), "--out", str(tmp_path / "snap"))
        assert proc.returncode == 0, proc.stderr
        assert w.popen is not None
        w.popen.wait(timeout=30)
        stopped = w.pairs()[-1][0]
        proc = tpagent("restore", str(tmp_path / "snap"))
        assert proc.returncode == 0, proc.stderr
        wait_until(lambda: w.pairs()[-1][0] > stopped + 10, "the restored workload to use its connection")
        seq = w.pairs()
        assert [n for n, _ in seq] == list(range(len(seq)))
        assert all(n == m for n, m in seq)  # every byte went through the restored connection
    finally:
        w.stop()


def test_a_dump_out_of_time_is_rolled_back_by_criu_and_the_tcp_connection_lives_on(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """CRIU killed as the dump's time ran out left the tree's TCP connection in repair mode and
    its network locked: the workload died on its next read, and nothing of it was kept.  CRIU is
    told to roll back instead, which it does whole, and the workload goes on."""
    from snapshot.api import CriuError, SnapshotConfig, Timeouts
    from snapshot.dump import checkpoint
    from support.helpers import TcpEcho

    monkeypatch.setenv("TPAGENT_HOOK_HOLD", "120")  # (the sealed tree waits for a word: the dump cannot end in time)
    w = TcpEcho(tmp_path / "tcp.log").start()
    try:
        with pytest.raises(CriuError, match="criu dump did not finish within 2 s: rolled back") as err:
            checkpoint(w.pid, tmp_path / "snap", config=SnapshotConfig(timeouts=Timeouts(dump=2.0)))
        assert err.value.rolled_back and not (tmp_path / "snap").exists()
        n = w.pairs()[-1][0]
        wait_until(lambda: w.pairs()[-1][0] > n + 10, "the workload to use its connection again")
        seq = w.pairs()
        assert [n for n, _ in seq] == list(range(len(seq))) and all(n == m for n, m in seq)
    finally:
        w.stop()


def test_a_restore_out_of_time_leaves_no_copy_and_the_snapshot_restores_again(start, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    """CRIU killed as a restore's time ran out left the tree it had made: it ran on, unchecked and
    noted nowhere, beside the original a migration then resumed.  CRIU goes with its whole tree."""
    from snapshot.api import CriuError, SnapshotConfig, Timeouts
    from snapshot.criu import Criu
    from snapshot.restore import restore

    w, snap, stopped_at = _dumped(start, tmp_path)
    slow, wrapper = tmp_path / "slow-action", tmp_path / "criu-slow-to-resume"
    slow.write_text('#!/bin/sh\n[ "$CRTOOLS_SCRIPT_ACTION" = post-restore ] && sleep 120\nexit 0\n')
    wrapper.write_text(f'#!/bin/sh\nexec "{Criu().path}" "$@" --action-script {slow}\n')  # (after the tree is made)
    slow.chmod(0o755)
    wrapper.chmod(0o755)
    with pytest.raises(CriuError, match="^criu restore did not finish within 3 s$"):
        restore(snap, config=SnapshotConfig(criu=wrapper, timeouts=Timeouts(restore=3.0)))
    assert not alive(w.pid)
    _restores_and_ticks_on(w, snap, stopped_at)


def test_a_snapshot_whose_images_lead_to_a_users_directory_is_not_restored(start, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    """Root checked the snapshot's own directory only: ``images``, a symlink to a directory another
    user owns, was verified and read by CRIU from there (its owner could swap the images between
    the two, and CRIU restores whatever credentials they name).  It is refused before anything runs."""
    w, snap, _ = _dumped(start, tmp_path)
    theirs = Path("/tmp") / f"tp-images-{uuid.uuid4().hex[:8]}"
    try:
        shutil.move(snap / "images", theirs)
        os.chown(theirs, 65534, 65534)
        (snap / "images").symlink_to(theirs)
        proc = tpagent("restore", str(snap))
        assert_one_sentence_error(proc, str(theirs))
        assert not alive(w.pid)
    finally:
        shutil.rmtree(theirs, ignore_errors=True)


def test_carried_file_is_put_back_where_the_process_had_it(start, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    """A node-local file the process has open (its log) travels in the snapshot: on a node
    without it (here: deleted), restore writes it back as it was at the freeze, and the
    process goes on writing into it."""
    w = start(mib=16, launched=True)
    proc = tpagent("dump", str(w.pid), "--out", str(tmp_path / "snap"), "--carry", str(w.log))
    assert proc.returncode == 0, proc.stderr
    frozen = w.log.read_bytes()
    w.log.unlink()
    _restores_and_writes_on(w, tmp_path / "snap", frozen, 10)


def test_carried_file_with_other_content_on_the_node_stops_the_restore(start, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    w = start(mib=16, launched=True)
    proc = tpagent("dump", str(w.pid), "--out", str(tmp_path / "snap"), "--carry", str(w.log))
    assert proc.returncode == 0, proc.stderr
    w.log.write_text("someone else's file\n")
    proc = tpagent("restore", str(tmp_path / "snap"))
    assert proc.returncode == 2 and "exists on this node with other content" in proc.stderr
    assert w.log.read_text() == "someone else's file\n"  # untouched


def test_leave_stopped(start, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    """CRIU's third way to finish: the tree stays stopped, whole, until someone resumes it."""
    import os
    import signal
    import time

    import psutil

    from snapshot.api import DumpMode
    from snapshot.dump import checkpoint

    w = start(mib=16)
    m = checkpoint(w.pid, tmp_path / "snap", DumpMode.LEAVE_STOPPED)
    assert m.origin["mode"] == "leave-stopped"
    assert psutil.Process(w.pid).status() == psutil.STATUS_STOPPED
    n = w.ticks()[-1][0]
    time.sleep(0.5)
    assert w.ticks()[-1][0] == n  # stopped means no step runs
    os.kill(w.pid, signal.SIGCONT)
    wait_until(lambda: w.ticks()[-1][0] >= n + 5, "the resumed workload to tick on")
    assert_continuous(w.ticks())
    w.verify_state()


def test_carried_file_that_cannot_be_put_back(workloads, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    """The node has a file where the carried file's directory must be: one sentence, nothing
    started, nothing half-written; once the path is free the same snapshot restores."""
    from support.helpers import Workload

    w = Workload(tmp_path / "logs" / "w.log", 16, launched=True)
    w.log.parent.mkdir()
    workloads.append(w.start())
    out = w.log.with_suffix(".out")  # its stdout, also open and also node-local
    proc = tpagent("dump", str(w.pid), "--out", str(tmp_path / "snap"), "--carry", str(w.log), "--carry", str(out))
    assert proc.returncode == 0, proc.stderr
    frozen = w.log.read_bytes()
    shutil.rmtree(w.log.parent)
    w.log.parent.write_text("a file where the directory was\n")
    proc = tpagent("restore", str(tmp_path / "snap"))
    assert_one_sentence_error(proc, f"{w.log.parent} is a file on this node, a directory where it was dumped")
    assert w.log.parent.read_text() == "a file where the directory was\n"
    w.log.parent.unlink()
    _restores_and_writes_on(w, tmp_path / "snap", frozen, 5)


def test_a_restore_failing_after_criu_takes_back_what_it_made(start, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    """The rollback of a restore that fails once CRIU has started the copy (a fault injected
    after the CRIU stage): the copy is stopped, the carried file put back for it is removed
    again, CRIU's work directory goes, and nothing the note of what it made names is left to
    take back; the same snapshot then restores."""
    from snapshot import putback
    from snapshot.api import SnapshotConfig, Stage
    from snapshot.dump import checkpoint
    from snapshot.restore import restore
    from snapshot.stages import InjectedFault

    w = start(mib=16)
    checkpoint(w.pid, tmp_path / "snap", carry=[w.log])
    w.reap()
    frozen = w.log.read_bytes()
    w.log.unlink()
    work = tmp_path / "work"
    note = tmp_path / "made.json"
    with pytest.raises(InjectedFault, match="fault injected after criu_restore"):
        restore(tmp_path / "snap", config=SnapshotConfig(fail_after=Stage.CRIU_RESTORE), work=work, created_note=note)
    wait_until(lambda: not alive(w.pid), "the copy CRIU started to be stopped")
    assert not w.log.exists() and not work.exists()
    assert str(w.log) in note.read_text() and putback.take_back_created(note) == []
    result = restore(tmp_path / "snap")
    w.pid = result.pid
    assert w.log.read_bytes()[: len(frozen)] == frozen
    stopped_at = int(frozen.decode().splitlines()[-1].split()[1])
    wait_until(lambda: w.ticks()[-1][0] >= stopped_at + 5, "the restored workload to write on into its log")
    assert_continuous(w.ticks())
    w.verify_state()


@pytest.mark.parametrize("how", ["failed later", "copy dropped"])
def test_a_socket_directory_handed_to_its_user_is_still_taken_back(tmp_path: Path, playground: Path, how: str) -> None:
    """A restore makes a directory of nobody's for a unix socket (a DataLoader worker's private
    one), root's until CRIU has bound it, then hands it to nobody: should a later step fail, or
    its copy be dropped, that directory is still taken back (before: it was noted as root's, and
    nobody's was left).  The steps themselves, without CRIU (nobody's process cannot be dumped
    here without CAP_SYS_RESOURCE)."""
    from types import SimpleNamespace

    from host import safefs
    from snapshot import putback, restore
    from snapshot.manifest import MadeDir

    made = playground / "pymp-x"
    created: list[Path] = []
    safefs.make_dir(made, created)
    note = tmp_path / "made.json"
    job = SimpleNamespace(
        manifest=SimpleNamespace(dirs=[MadeDir(str(made), 65534, 65534, 0o700)]),
        created=created,
        made=putback.identities(created),
        created_note=note,
        fresh=[],
    )
    restore._note_made(job)  # type: ignore[arg-type]
    restore._hand_over(job)  # type: ignore[arg-type]
    assert made.stat().st_uid == 65534
    if how == "failed later":
        restore._take_back(job)  # type: ignore[arg-type]
    else:
        assert putback.take_back_created(note) == [str(made)]
    assert not made.exists()


def test_a_migrations_dump_carries_the_node_local_files_the_tree_has_open_once_frozen(  # type: ignore[no-untyped-def]
    start, tmp_path: Path
) -> None:
    """A migration checks the tree's open files before it freezes it; a file opened since (a
    checkpoint's temporary file, a tensor's /dev/shm segment) was neither carried nor on the
    target, and every such migration rolled back.  Its dump carries, as the tree is frozen,
    every file it has open then but those on shared paths; a plain dump only those named."""
    from snapshot.api import SnapshotConfig
    from snapshot.dump import checkpoint

    shared = tmp_path / "shared"
    shared.mkdir()
    scratch = tmp_path / "local" / "ckpt.pt.tmp"
    scratch.parent.mkdir()
    w = start(mib=16, extra=("--scratch", str(scratch), "1", "--lock", str(shared / "job.lock")))
    wait_until(lambda: len(w.ticks()) >= 3, "the workload to tick")
    m = checkpoint(w.pid, tmp_path / "snap", config=SnapshotConfig(carry_opened=(str(shared),)))
    w.reap()
    assert str(scratch) in m.carried and str(shared / "job.lock") not in m.carried, m.carried
    assert str(w.log) in m.carried  # (its log too: open, node-local)
    v = start(mib=16, extra=("--scratch", str(tmp_path / "local" / "other.tmp"), "1"))
    wait_until(lambda: len(v.ticks()) >= 3, "the other workload to tick")
    assert checkpoint(v.pid, tmp_path / "plain").carried == []
    v.reap()


_MAPS_IT = (
    "import mmap, sys\n"
    "f = open(sys.argv[1], 'r+b')\n"
    "m = mmap.mmap(f.fileno(), 4096)\n"
    "print('mapped', flush=True)\n"
    "sys.stdin.read()\n"
)


def test_a_migrations_dump_refuses_a_file_it_carries_that_a_process_outside_maps_shared(  # type: ignore[no-untyped-def]
    start, tmp_path: Path
) -> None:
    """A node-local file the tree maps shared, with a process outside mapping it too: a
    migration's check refuses it (its copy would map a copy, their writes no longer meeting).
    One the tree mapped since the check was carried as it was frozen, unchecked; its dump now
    refuses it, and the tree runs on.  What the kernel makes (/proc/self/stat, open as a sampler
    keeps it) is never carried."""
    from snapshot.api import SnapshotConfig, SnapshotError
    from snapshot.dump import checkpoint

    seg = tmp_path / "local" / "segment"
    seg.parent.mkdir()
    w = start(mib=16, extra=("--shm", str(seg)))
    wait_until(lambda: len(w.ticks()) >= 3, "the workload to tick")
    run = [sys.executable, "-c", _MAPS_IT, str(seg)]
    with subprocess.Popen(run, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True) as other:
        try:
            assert other.stdout is not None and other.stdout.readline() == "mapped\n"
            with pytest.raises(SnapshotError, match=f"maps {seg} shared with PID {other.pid}"):
                checkpoint(w.pid, tmp_path / "snap", config=SnapshotConfig(carry_opened=()))
        finally:
            other.kill()
    n = w.ticks()[-1][0]
    wait_until(lambda: w.ticks()[-1][0] >= n + 5, "the workload to tick on")
    with open("/proc/self/stat"):
        import psutil

        from host import files

        assert not [f for f in files.open_in([psutil.Process()]) if f.startswith("/proc/")]


def test_carried_files_grown_past_the_room_made_for_them_are_refused_as_the_tree_is_frozen(  # type: ignore[no-untyped-def]
    start, tmp_path: Path
) -> None:
    """A migration's target makes room for the carried files as they were at its check: one made
    huge since (truncated to 2 GiB, sparse: written out whole) was archived as the tree was
    frozen, filling the source's work directory and then the target's disk.  Past the bound the
    dump is refused in one sentence, and the tree runs on."""
    from snapshot.api import SnapshotConfig, SnapshotError
    from snapshot.dump import checkpoint

    scratch = tmp_path / "local" / "run.log"
    scratch.parent.mkdir()
    w = start(mib=16, extra=("--scratch", str(scratch), "1"))
    wait_until(lambda: len(w.ticks()) >= 3, "the workload to tick")
    os.truncate(scratch, 2 << 30)
    config = SnapshotConfig(carry_opened=(), carry_most=64 << 20)
    with pytest.raises(SnapshotError, match=r"hold 2\d{3} MiB once it is frozen .* more than the 64 MiB the target"):
        checkpoint(w.pid, tmp_path / "snap", config=config)
    n = w.ticks()[-1][0]
    wait_until(lambda: w.ticks()[-1][0] >= n + 5, "the workload to tick on")


def test_a_deleted_but_open_file_over_crius_limit(start, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    """A workload holds an 8 MiB file it deleted (as DataLoader workers' shared memory is):
    over a 4 MiB ghost limit the dump is refused in one sentence before anything is frozen
    (once CRIU found it with the tree frozen), naming the file, and the workload runs on; under
    the default limit it is dumped and restored with the file's bytes intact."""
    w = start(mib=16, extra=("--ghost", str(tmp_path / "shm-batch"), "8"))
    ghosts = lambda: [ln.split()[1] for ln in w.lines() if ln.startswith("ghost ")]  # noqa: E731
    wait_until(lambda: ghosts(), "the workload to hash its deleted file")
    proc = tpagent("dump", str(w.pid), "--out", str(tmp_path / "refused"), "--ghost-limit-mib", "4")
    deleted = f"holds {tmp_path / 'shm-batch'}, deleted while in use, with 8 MiB of data"
    assert_one_sentence_error(proc, deleted, "more than the ghost limit (4 MiB)", "--ghost-limit-mib")
    assert proc.returncode == 2 and "Nothing was done" in proc.stderr
    by_env = subprocess.run(
        [sys.executable, "-m", "cli.main", "dump", str(w.pid), "--out", str(tmp_path / "env")],
        cwd=ROOT,
        env={**os.environ, "TPAGENT_GHOST_LIMIT_MIB": "6"},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert_one_sentence_error(by_env, "more than the ghost limit (6 MiB)", "TPAGENT_GHOST_LIMIT_MIB")
    n = len(w.ticks())
    wait_until(lambda: len(w.ticks()) > n + 3, "the workload to run on")
    assert_continuous(w.ticks())  # (it ran on from where it stood)
    _dump_restore_cycle(w, tmp_path / "snap")
    before = len(ghosts())
    os.kill(w.worker_pid, signal.SIGUSR1)
    wait_until(lambda: len(ghosts()) > before, "the restored workload to hash its deleted file")
    assert ghosts()[-1] == ghosts()[0]  # the deleted file came back byte-identical


def test_one_snapshot_is_not_restored_twice(start, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    """A second restore of a snapshot whose first copy still runs here is refused in one
    sentence (two copies would write one log), also from a copy of the snapshot; --clone
    starts a second on purpose; once the first copy is gone, a restore works again."""
    w = start(mib=16, launched=True)  # (its own PID namespace: a second copy would not clash on PIDs)
    snap = tmp_path / "snap"
    assert tpagent("dump", str(w.pid), "--out", str(snap)).returncode == 0
    first = tpagent("restore", str(snap), "--json")
    assert first.returncode == 0, first.stderr
    w.pid = json.loads(first.stdout)["pid"]
    shutil.copytree(snap, tmp_path / "copy")
    for again in (snap, tmp_path / "copy"):
        proc = tpagent("restore", str(again))
        assert_one_sentence_error(proc, f"still runs here as PID {w.pid}", "--clone")
        assert proc.returncode == 2
    n = len(w.ticks())
    wait_until(lambda: len(w.ticks()) > n + 10, "the first copy to tick on")
    assert_continuous(w.ticks())  # one copy only
    clone = tpagent("restore", str(snap), "--clone", "--json")
    assert clone.returncode == 0, clone.stderr
    second = json.loads(clone.stdout)["pid"]
    try:
        wait_until(
            lambda: len(w.ticks()) != len({t[0] for t in w.ticks()}), "the clone to tick too"
        )  # two copies: ticks repeat
    finally:
        kill_and_wait(second)
    assert_one_sentence_error(
        tpagent("restore", str(snap)), f"still runs here as PID {w.pid}"
    )  # the first is still noted
    kill_and_wait(w.pid)
    again = tpagent("restore", str(snap), "--json")
    assert again.returncode == 0, again.stderr
    w.pid = json.loads(again.stdout)["pid"]


def _restores_and_writes_on(w: Workload, snap: Path, frozen: bytes, steps: int) -> None:
    """Restore ``snap``: the carried log is back as it was at the freeze (``frozen``), and the
    copy writes ``steps`` more ticks into it, continuous with those before."""
    proc = tpagent("restore", str(snap), "--json")
    assert proc.returncode == 0, proc.stderr
    w.pid = json.loads(proc.stdout)["pid"]
    assert w.log.read_bytes()[: len(frozen)] == frozen
    stopped_at = int(frozen.decode().splitlines()[-1].split()[1])
    wait_until(lambda: w.ticks()[-1][0] >= stopped_at + steps, "the restored workload to write on into its log")
    assert_continuous(w.ticks())
