"""Failures after the freeze roll back: the workload runs on from where it stood, intact."""

from __future__ import annotations

import contextlib
import errno
import json
import re
import signal
import subprocess
import sys
from pathlib import Path

import psutil
import pytest

from conftest import needs_criu
from host import proc, signals
from snapshot import dump, restore
from snapshot.api import CriuError, DumpMode, SnapshotConfig, SnapshotError, Stage
from snapshot.dump import checkpoint
from support.helpers import (
    STATEFUL,
    Workload,
    alive,
    assert_continuous,
    assert_one_sentence_error,
    kill_and_wait,
    tpagent,
    wait_until,
)
from tpagent.migration import decide, journal
from tpagent.migration.api import Role, SourceState

pytestmark = needs_criu


def _assert_resumed(w: Workload, out: Path) -> None:
    assert alive(w.pid)
    n = w.ticks()[-1][0]
    wait_until(lambda: w.ticks()[-1][0] >= n + 10, "the workload to run on after the rollback")
    assert_continuous(w.ticks())  # no restart, no lost or repeated step
    w.verify_state()
    # No half-snapshot that could be restored, and --out as it was (it was new): the same command can run again.
    assert not out.exists()


def test_criu_dump_refuses(start, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    """An open /dev/fuse is something CRIU cannot dump (no dumper for that device, and none
    of its plugins takes it): a real refusal, found only after the freeze."""
    w = start(extra=("--device", "/dev/fuse"))
    out = tmp_path / "snap"
    proc = tpagent("dump", str(w.pid), "--out", str(out))
    assert_one_sentence_error(proc, "criu dump", "Error (", "nothing was lost")
    assert proc.returncode == 1
    _assert_resumed(w, out)


@pytest.fixture
def small_disk(tmp_path: Path):  # type: ignore[no-untyped-def]
    mnt = tmp_path / "small"
    mnt.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=48m", "tpagent-test", str(mnt)], check=True)
    yield mnt
    subprocess.run(["umount", "-l", str(mnt)], check=True)


def test_a_full_disk_that_cut_criu_s_own_line_about_it_is_still_named(start, small_disk: Path) -> None:  # type: ignore[no-untyped-def]
    """CRIU's log is in --out, on the disk that ran out: the line that says so may be cut short
    where the disk ended (a run of test_output_disk_full once read "Unable to spice data: No", and
    failed).  What CRIU left free there names the full disk all the same."""
    w = start(mib=16)
    out = small_disk / "snap"
    (out / "images").mkdir(parents=True)
    with open(out / "images" / "pages-1.img", "wb", buffering=0) as f, contextlib.suppress(OSError):
        while f.write(bytes(1 << 20)):  # until the disk is full, as CRIU left it
            pass
    cut = CriuError(
        f"criu dump of PID {w.pid} failed", detail="Error (criu/page-xfer.c:263): page-xfer: Unable to spice data: No"
    )
    attempt = dump._Dump(  # (what _rolled_back reads of an attempt that got as far as criu dump)
        w.pid,
        out,
        DumpMode.KILL,
        SnapshotConfig(),
        None,
        None,
        dump._Tree(False, False, proc.tree(psutil.Process(w.pid)), 0.0, 0, False, []),
        True,
        [w.pid],
        None,
        [],
        None,  # type: ignore[arg-type]
    )
    err = dump._rolled_back(cut, attempt)
    assert isinstance(err, CriuError) and err.code == errno.ENOSPC, err
    assert f"the disk holding {out} ran out of space" in str(err) and "criu/" not in str(err), err
    assert not out.exists() and alive(w.pid)


def test_output_disk_full(start, small_disk: Path) -> None:  # type: ignore[no-untyped-def]
    """One sentence with what the snapshot needs and what is free (no CRIU lines), and --out left
    absent: the same command, once the disk has room, then works."""
    w = start(mib=256)
    out = small_disk / "snap"
    proc = tpagent("dump", str(w.pid), "--out", str(out))
    assert_one_sentence_error(proc, f"the disk holding {out} ran out of space", "nothing was lost")
    needed, free = (int(n.replace(",", "")) for n in re.findall(r"\(([\d,]+) bytes\)", proc.stderr))
    assert 256 << 20 <= needed < 320 << 20 and free <= 48 << 20, proc.stderr  # its 256 MiB; the tmpfs, emptied again
    assert "Error (" not in proc.stderr and "criu/" not in proc.stderr
    assert proc.returncode == 1
    _assert_resumed(w, out)
    subprocess.run(["mount", "-o", "remount,size=400m", str(small_disk)], check=True)
    proc = tpagent("dump", str(w.pid), "--out", str(out))  # the very same command
    assert proc.returncode == 0, proc.stderr
    w.reap()
    assert (out / "manifest.json").exists() and not alive(w.pid)


@pytest.mark.parametrize("launched", [False, True], ids=["plain", "launched"])
def test_failure_while_sealing_resumes_the_frozen_tree(start, tmp_path: Path, launched: bool) -> None:  # type: ignore[no-untyped-def]
    """The images are written but sealing them fails (after the checksums): CRIU must roll back."""
    w = start(launched=launched)
    out = tmp_path / "snap"
    with pytest.raises(SnapshotError, match="sealing the snapshot failed") as err:
        checkpoint(w.pid, out, config=SnapshotConfig(fail_after=Stage.CHECKSUM))
    assert err.value.rolled_back
    _assert_resumed(w, out)


@pytest.mark.parametrize("how", ["rolled-back", "restored-held", "left-by-a-dead-criu"])
def test_a_child_stopped_before_the_dump_stays_stopped(tmp_path: Path, how: str) -> None:
    """A child the user stopped (SIGSTOP, ^Z) before the dump: a dump rolled back, a copy
    restored held then let go (a migration's), and a tree a dead CRIU left stopped, resumed by a
    restarted agent from its journal's record, continue the rest of the tree, never it (before:
    every process of the tree was sent SIGCONT, and the child ran again)."""
    log = tmp_path / "w.log"
    with open(tmp_path / "w.out", "wb") as out:
        parent = subprocess.Popen(
            [sys.executable, str(STATEFUL.parent / "stopped_child.py"), str(log)],
            stdin=subprocess.DEVNULL, stdout=out, stderr=out, start_new_session=True,
        )  # fmt: skip
    try:
        wait_until(lambda: psutil.Process(parent.pid).children(), "the child to start")
        (child,) = psutil.Process(parent.pid).children()
        wait_until(lambda: _count(log, "child") >= 5, "the child to tick")
        child.send_signal(signal.SIGSTOP)
        wait_until(lambda: child.status() == psutil.STATUS_STOPPED, "the child to stop")
        if how == "left-by-a-dead-criu":
            record = journal.Record("0" * 32, Role.SOURCE, SourceState.FREEZING, pid=parent.pid)
            assert journal.note_process(record, parent.pid)
            record.stopped = [child.pid]
            record = journal.Record.from_json(json.loads(json.dumps(record.to_json())))  # (as journaled)
            signals.signal_tree(parent.pid, signal.SIGSTOP)
            decide.resume_leftovers(record)
        elif how == "rolled-back":
            with pytest.raises(SnapshotError):
                checkpoint(parent.pid, tmp_path / "snap", config=SnapshotConfig(fail_after=Stage.CHECKSUM))
        else:
            checkpoint(parent.pid, tmp_path / "snap")
            parent.wait(30)
            restore.start_restored(restore.restore(tmp_path / "snap", start=False))
        ticks, stood = _count(log, "tick"), _count(log, "child")
        wait_until(lambda: _count(log, "tick") >= ticks + 10, "the parent to tick on")
        assert _count(log, "child") == stood and psutil.Process(child.pid).status() == psutil.STATUS_STOPPED
    finally:
        kill_and_wait(parent.pid)
        with contextlib.suppress(psutil.Error):
            psutil.Process(child.pid).kill()
        with contextlib.suppress(subprocess.TimeoutExpired):
            parent.wait(10)


def _count(log: Path, key: str) -> int:
    return sum(line.startswith(key + " ") for line in log.read_text().splitlines()) if log.exists() else 0


def test_tcp_connection_survives_a_rolled_back_dump(tmp_path: Path) -> None:
    """CRIU locks the network and puts sockets in repair mode during a dump; its own rollback
    (not a bare SIGCONT) must give them back, or the connection would be dead after resume."""
    from support.helpers import TcpEcho

    w = TcpEcho(tmp_path / "tcp.log").start()
    try:
        with pytest.raises(SnapshotError):
            checkpoint(w.pid, tmp_path / "snap", config=SnapshotConfig(fail_after=Stage.CHECKSUM))
        n = w.pairs()[-1][0]
        wait_until(lambda: w.pairs()[-1][0] > n + 10, "the connection to carry bytes again")
        assert all(a == b for a, b in w.pairs())
    finally:
        w.stop()


def test_ctrl_c_during_dump(start, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    """SIGINT to the CLI while CRIU works: CRIU is let finish, then the tree is resumed."""
    import signal
    import sys

    from support.helpers import ROOT

    w = start(mib=768)
    out = tmp_path / "snap"
    cli = subprocess.Popen(
        [sys.executable, "-m", "cli.main", "dump", str(w.pid), "--out", str(out)],
        cwd=ROOT,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )
    assert cli.stderr is not None
    wait_until(lambda: (out / "log" / "dump.log").exists(), "CRIU to start dumping")
    cli.send_signal(signal.SIGINT)
    err = cli.stderr.read().decode()
    cli.stderr.close()
    assert cli.wait(timeout=120) == 130
    assert "Traceback" not in err and "interrupted" in err and "nothing was lost" in err, err
    _assert_resumed(w, out)  # (CRIU ran, it was let finish, and its rollback resumed the tree)


def test_a_failure_reported_after_the_tree_was_ended_keeps_the_snapshot(start, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    """CRIU ends the tree once its hook has sealed the snapshot; if it then still reports a
    failure, the snapshot is the only copy left: it is kept, said so, and restores whole."""
    from snapshot.criu import Criu

    wrapper = tmp_path / "criu-late-failure"
    wrapper.write_text(
        f'#!/bin/sh\n{Criu().path} "$@"; rc=$?\n'
        'if [ "$1" = dump ] && [ $rc = 0 ]; then echo "Error (criu/cr-dump.c:1): a late failure" >&2; exit 1; fi\n'
        "exit $rc\n"
    )
    wrapper.chmod(0o755)
    w = start(mib=64)
    out = tmp_path / "snap"
    proc = tpagent("dump", str(w.pid), "--out", str(out), "--criu", str(wrapper))
    assert_one_sentence_error(proc, f"its sealed snapshot is kept in {out}")
    assert proc.returncode == 1 and "nothing was lost" not in proc.stderr
    w.reap()
    stopped_at = w.ticks()[-1][0]
    proc = tpagent("restore", str(out), "--json")
    assert proc.returncode == 0, proc.stderr
    wait_until(lambda: w.ticks()[-1][0] >= stopped_at + 5, "the restored workload to tick on")
    assert_continuous(w.ticks())
    w.verify_state()


def test_a_held_copy_is_found_by_its_restore_pid_until_its_target_has_noted_it(tmp_path: Path) -> None:
    """A target agent that dies between CRIU's restore of a held copy and its journal's READY
    (the record still RESTORING, its PID not yet in it): the restore had removed its work
    directory, restore.pid with it, so the agent started again found no copy to stop and
    dropped the record, and the copy stayed beside the original its source resumed.  Now a
    held copy's work directory is left to its caller, and restore.pid names the copy."""
    p = subprocess.Popen(["sleep", "600"], start_new_session=True)
    try:
        checkpoint(p.pid, tmp_path / "snap")
        p.wait(30)
        work = tmp_path / "work"
        result = restore.restore(tmp_path / "snap", start=False, work=work)
        assert psutil.Process(result.pid).status() == psutil.STATUS_STOPPED  # (held)
        assert restore.kill_restored(work) == result.pid  # (what the agent started again does)
        wait_until(lambda: not alive(result.pid), "the held copy to end")
    finally:
        kill_and_wait(p.pid)
