"""A restore runs as root and opens again, by name, what the process held: its working
directory, its executable and libraries, the files it maps and has open.  Where such a path is
missing, anyone who may write to a directory above it can put their own there first: a
directory of theirs as the copy's working directory (root's relative writes then land where they
choose), their file mapped as its data or code.  The attacker here is a real unprivileged user
(``nobody``), on a node whose directory went (a cleaner of /tmp, another node's local disk)."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest

from conftest import needs_criu
from snapshot.manifest import _body_digest
from support.helpers import STATEFUL, alive, assert_one_sentence_error, kill_and_wait, tpagent, wait_until
from support.users import NOBODY, as_user

pytestmark = needs_criu

WORKLOAD = STATEFUL.parent / "cwd_mapped.py"


def as_nobody(*cmd: str) -> None:
    subprocess.run([*as_user(NOBODY), *cmd], check=True, capture_output=True, timeout=30)


SIZE = 4096


@pytest.fixture
def shared() -> Iterator[Path]:
    """A directory anyone may make things in, as /tmp is (root's, 1777), holding the job's
    directory (root's, 0755) with the file it maps."""
    d = Path(tempfile.mkdtemp(prefix="tpagent-reopened-", dir="/tmp"))
    d.chmod(0o1777)
    _job_dir(d / "job", b"A")
    yield d
    shutil.rmtree(d, ignore_errors=True)


def _job_dir(job: Path, byte: bytes) -> None:
    job.mkdir(mode=0o755)
    (job / "data.bin").write_bytes(byte * SIZE)


def _dumped(shared: Path, tmp_path: Path) -> tuple[Path, Path, int]:
    """The workload, run as root in ``shared``/job, dumped (and so ended): its log, snapshot, PID."""
    log = tmp_path / "w.log"
    with open(tmp_path / "w.out", "wb") as out:
        p = subprocess.Popen(
            [sys.executable, str(WORKLOAD), str(log), str(shared / "job")],
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=out,
            start_new_session=True,
        )
    wait_until(lambda: log.exists() and log.read_text().count("\n") >= 5, "the workload to tick")
    snap = tmp_path / "snap"
    proc = tpagent("dump", str(p.pid), "--out", str(snap))
    assert proc.returncode == 0, proc.stderr
    p.wait(30)
    noted = {r["path"] for r in json.loads((snap / "manifest.json").read_text())["reopened"]}
    assert {str(shared), str(shared / "job"), str(shared / "job" / "data.bin")} <= noted
    return log, snap, p.pid


def _refused(snap: Path, pid: int, said: str) -> None:
    proc = tpagent("restore", str(snap))
    if proc.returncode == 0:  # (restored all the same: the copy is not left running after the test)
        kill_and_wait(pid)
    assert_one_sentence_error(proc, said, "nothing was restored")
    assert proc.returncode == 2
    assert not alive(pid)
    assert not any(str(WORKLOAD) in (p.info["cmdline"] or []) for p in psutil.process_iter(["cmdline"]))


def test_a_working_directory_and_mapped_file_someone_else_put_there_are_refused(shared: Path, tmp_path: Path) -> None:
    """The job's directory is gone; nobody makes one of theirs in its place, with their own
    data.bin of the same size.  Restored, root's copy would work in nobody's directory (its
    progress.txt written there, or through nobody's symlink to any of root's files) and read
    nobody's bytes as its own.  Refused in one sentence, nothing started, nothing written; once
    the directory is root's again, the same snapshot comes back and reads its own data."""
    log, snap, pid = _dumped(shared, tmp_path)
    shutil.rmtree(shared / "job")
    as_nobody("mkdir", "-m", "755", str(shared / "job"))
    as_nobody("sh", "-c", f"head -c {SIZE} /dev/zero | tr '\\0' Z > {shared / 'job' / 'data.bin'}")
    _refused(snap, pid, f"{shared / 'job'} belongs to UID 65534 on this node, to UID 0 where it was dumped")
    assert sorted(os.listdir(shared / "job")) == ["data.bin"]  # (no progress.txt of root's in it)

    shutil.rmtree(shared / "job")
    _job_dir(shared / "job", b"A")
    proc = tpagent("restore", str(snap))
    assert proc.returncode == 0, proc.stderr
    try:
        at = log.read_text().count("\n")
        wait_until(lambda: log.read_text().count("\n") >= at + 5, "the restored copy to tick on")
        ticks = [line.split() for line in log.read_text().splitlines()]
        assert [int(t[1]) for t in ticks] == list(range(len(ticks)))
        assert {t[3] for t in ticks} == {str(ord("A"))}, "the copy read another data.bin than its own"
    finally:
        kill_and_wait(pid)


@pytest.mark.parametrize(
    "plant, said",
    [
        ("symlink", "is a symbolic link on this node, a directory where it was dumped"),
        ("file", "is a file on this node, a directory where it was dumped"),
    ],
)
def test_a_symlink_or_a_file_where_the_directory_was_is_refused(
    shared: Path, tmp_path: Path, plant: str, said: str
) -> None:
    """nobody puts a symlink to a directory of root's that holds a data.bin of the same size (so
    CRIU would open it), or a file, where the job's directory was."""
    _log, snap, pid = _dumped(shared, tmp_path)
    shutil.rmtree(shared / "job")
    elsewhere = tmp_path / "elsewhere"
    _job_dir(elsewhere, b"A")
    if plant == "symlink":
        as_nobody("ln", "-s", str(elsewhere), str(shared / "job"))
    else:
        as_nobody("touch", str(shared / "job"))
    _refused(snap, pid, f"{shared / 'job'} {said}")
    assert sorted(os.listdir(elsewhere)) == ["data.bin"]


def test_a_directory_others_may_now_write_to_is_refused(shared: Path, tmp_path: Path) -> None:
    """The job's directory is root's still, but anyone may now write to it (a careless chmod):
    anyone could have swapped the file the copy maps."""
    _log, snap, pid = _dumped(shared, tmp_path)
    (shared / "job").chmod(0o777)
    _refused(snap, pid, f"{shared / 'job'} may be written to by anyone on this node, not where it was dumped")


@pytest.mark.parametrize(
    "change, said",
    [
        ("size", f"its size ({SIZE + 1:,} bytes here, {SIZE:,} when dumped)"),
        ("mode", "its mode (0100600 here, 0100644 when dumped)"),
    ],
)
def test_a_file_the_copy_holds_changed_since_the_dump_is_named_and_restored_once_as_it_was(
    shared: Path, tmp_path: Path, change: str, said: str
) -> None:
    """CRIU reopens a file the process held only at the size and mode it had (written to or
    chmodded since: a shared file system's, or the same node's later): its restore failed in
    CRIU's own lines.  Now one sentence names the file and what changed; nothing runs; once the
    file is as it was, the same snapshot comes back and reads on from where it stood."""
    log, snap, pid = _dumped(shared, tmp_path)
    data = shared / "job" / "data.bin"
    if change == "size":
        data.write_bytes(b"A" * (SIZE + 1))
    else:
        data.chmod(0o600)
    proc = tpagent("restore", str(snap))
    if proc.returncode == 0:
        kill_and_wait(pid)
    assert_one_sentence_error(proc, f"{data}, which the process held, has changed since the dump: {said}")
    assert "nothing was restored" in proc.stderr
    assert not alive(pid)
    stopped_at = log.read_text().count("\n")
    data.write_bytes(b"A" * SIZE)
    data.chmod(0o644)
    proc = tpagent("restore", str(snap))
    assert proc.returncode == 0, proc.stderr
    try:
        wait_until(lambda: log.read_text().count("\n") >= stopped_at + 5, "the restored copy to tick on")
        ticks = [line.split() for line in log.read_text().splitlines()]
        assert [int(t[1]) for t in ticks] == list(range(len(ticks)))
        assert {t[3] for t in ticks} == {str(ord("A"))}
    finally:
        kill_and_wait(pid)


@pytest.mark.parametrize("mode", [0o755, 0o775, 0o2775], ids=oct)
def test_a_working_directory_made_again_for_its_carried_file_is_restored(tmp_path: Path, mode: int) -> None:
    """The job's directory (0755; 0775 under a user's umask 002; a project's 2775) held its data
    file, carried with the snapshot, and was its working directory: gone from the node, the
    restore makes it again to put the file back, and CRIU restores the copy's working directory
    there (before: the directory was made 0700 until CRIU was done, then 0755, and CRIU refused a
    working directory of another mode than it had)."""
    job = tmp_path / "local" / "job"
    job.mkdir(parents=True)
    job.chmod(mode)
    (job / "data.bin").write_bytes(b"A" * SIZE)
    log = tmp_path / "w.log"
    p = subprocess.Popen([sys.executable, str(WORKLOAD), str(log), str(job)], stdin=subprocess.DEVNULL,
                         start_new_session=True)  # fmt: skip
    wait_until(lambda: log.exists() and log.read_text().count("\n") >= 5, "the workload to tick")
    snap = tmp_path / "snap"
    dumped = tpagent("dump", str(p.pid), "--out", str(snap), "--carry", str(job / "data.bin"))
    assert dumped.returncode == 0, dumped.stderr
    p.wait(30)
    shutil.rmtree(tmp_path / "local")
    proc = tpagent("restore", str(snap), "--json")
    assert proc.returncode == 0, proc.stderr
    pid = json.loads(proc.stdout)["pid"]
    try:
        progress = job / "progress.txt"  # (gone with its directory: the copy writes it anew)
        wait_until(lambda: progress.exists() and progress.read_text().count("\n") >= 5, "the copy to work there")
        assert (job.stat().st_mode & 0o7777, job.stat().st_uid) == (mode, 0)
        assert log.read_text().splitlines()[-1].endswith(f"byte {ord('A')}")
    finally:
        kill_and_wait(pid)


def _swapped(shared: Path, tmp_path: Path) -> tuple[Path, Path, int, Path]:
    """The workload dumped, its notes without its job's directory and file, which then lead to a
    directory of root's: its log, snapshot, PID, and root's directory."""
    log, snap, pid = _dumped(shared, tmp_path)
    doc = json.loads((snap / "manifest.json").read_text())
    doc["reopened"] = [r for r in doc["reopened"] if not r["path"].startswith(str(shared / "job"))]
    doc["manifest_sha256"] = _body_digest(doc)
    (snap / "manifest.json").write_text(json.dumps(doc))
    (shared / "job").rename(shared / "job.old")
    roots = shared / "roots"
    _job_dir(roots, b"R")  # (root's: the same mode and size, as CRIU checks)
    (roots / "progress.txt").touch()  # (the workload opens it each tick: the dump may find it open)
    (shared / "job").symlink_to(roots)
    return log, snap, pid, roots


def test_a_name_that_leads_elsewhere_once_checked_is_refused_before_the_copy_runs(shared: Path, tmp_path: Path) -> None:
    """CRIU opens what the process held by name, as root, after the restore's checks: a name
    whose directory its owner swapped for a symlink since the check (a loop of renames wins the
    race), or one the manifest does not note (a directory renamed as the tree was frozen, after
    CRIU took its names: the notes then name the new one), led CRIU to another's files, and the
    copy ran holding them.  Simulated here without the race: the notes lose the job's directory
    and its file, which then lead to root's.  The copy, restored stopped, is checked: it holds
    another file than the one checked, and is ended before it runs a step."""
    log, snap, pid, roots = _swapped(shared, tmp_path)
    ticks = log.read_text().count("\n")
    proc = tpagent("restore", str(snap))
    if proc.returncode == 0:  # (restored all the same: the copy is not left running after the test)
        kill_and_wait(pid)
    assert_one_sentence_error(proc, f"holds {roots}", "that copy was killed before it ran")
    assert log.read_text().count("\n") == ticks and "byte 82" not in log.read_text()
    assert not alive(pid) and (roots / "progress.txt").read_text() == ""


def test_a_swapped_name_is_refused_before_the_copys_owner_can_let_it_run(shared: Path, tmp_path: Path) -> None:
    """As the test above, with the copy's owner sending it SIGCONT all the while: a copy CRIU left
    stopped, to be checked after, ran as soon as CRIU let it go (before the check), and wrote
    through the files CRIU had opened for it as root.  It is checked while CRIU still holds it,
    before any of its own code runs: it never writes a line, here or in root's directory."""
    log, snap, pid, roots = _swapped(shared, tmp_path)
    ticks = log.read_text().count("\n")
    done = threading.Event()

    def owner() -> None:  # (the copy has the dumped process's PID: its owner knows it)
        while not done.wait(0.002):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGCONT)

    sender = threading.Thread(target=owner, daemon=True)
    sender.start()
    try:
        proc = tpagent("restore", str(snap))
    finally:
        done.set()
        sender.join()
    if proc.returncode == 0:
        kill_and_wait(pid)
    assert_one_sentence_error(proc, f"holds {roots}", "that copy was killed before it ran")
    assert log.read_text().count("\n") == ticks and (roots / "progress.txt").read_text() == ""
    assert not alive(pid)


GHOST = """
import os, sys, time
fd = os.open(sys.argv[2], os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
os.write(fd, b"kept bytes")
os.unlink(sys.argv[2])
with open(sys.argv[1], "a", buffering=1) as log:
    for i in range(100000):
        log.write(f"{i} {os.pread(fd, 64, 0).decode()}\\n")
        time.sleep(0.05)
"""


def test_a_removed_files_directory_swapped_for_a_symlink_is_refused(shared: Path, tmp_path: Path) -> None:
    """A process holds a file it removed, in a directory of nobody's: CRIU keeps its bytes and,
    restoring, puts them back under the old name in that directory (as root), then removes it.
    nobody swaps the directory for a symlink to a directory of root's: the file was made there,
    as root, under nobody's name (and the copy ran).  Refused in one sentence, nothing made
    there.  With the directory gone (another node), the copy comes back holding its bytes: CRIU
    makes the directory to put them back (a missing one is no stranger's)."""
    as_nobody("mkdir", "-m", "755", str(shared / "d"))
    log = tmp_path / "w.log"
    with open(tmp_path / "w.out", "wb") as out:
        p = subprocess.Popen([sys.executable, "-c", GHOST, str(log), str(shared / "d" / "g")],
                             stdin=subprocess.DEVNULL, stdout=out, stderr=out, start_new_session=True)  # fmt: skip
    wait_until(lambda: log.exists() and log.read_text().count("\n") >= 3, "the workload to tick")
    snap = tmp_path / "snap"
    proc = tpagent("dump", str(p.pid), "--out", str(snap))
    assert proc.returncode == 0, proc.stderr
    p.wait(30)
    vault = tmp_path / "vault"
    vault.mkdir()
    as_nobody("mv", str(shared / "d"), str(shared / "d.old"))
    as_nobody("ln", "-s", str(vault), str(shared / "d"))
    proc = tpagent("restore", str(snap))
    if proc.returncode == 0:
        kill_and_wait(p.pid)
    assert_one_sentence_error(proc, f"{shared / 'd'} is a symbolic link on this node, a directory where it was dumped")
    assert proc.returncode == 2 and not alive(p.pid) and os.listdir(vault) == []

    as_nobody("rm", str(shared / "d"))
    proc = tpagent("restore", str(snap))
    assert proc.returncode == 0, proc.stderr
    try:
        at = log.read_text().count("\n")
        wait_until(lambda: log.read_text().count("\n") >= at + 3, "the restored copy to tick on")
        assert {line.split(" ", 1)[1] for line in log.read_text().splitlines()} == {"kept bytes"}
    finally:
        kill_and_wait(p.pid)
