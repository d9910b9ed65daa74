"""Carried files are read (dump) and written back (restore) by root, on paths that users may
control.  The attacker here is a real unprivileged user (``nobody``) who plants symlinks,
swaps directories and owns the directories involved; CRIU and the workloads are real."""

from __future__ import annotations

import os
import pwd
import shutil
import stat
import subprocess
import tarfile
import tempfile
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest

from conftest import needs_criu
from snapshot import restore
from snapshot.api import SnapshotError
from snapshot.dump import checkpoint
from support.helpers import Workload, alive, assert_continuous, assert_one_sentence_error, tpagent, wait_until

pytestmark = needs_criu

NOBODY = pwd.getpwnam("nobody")
SECRET = b"root's secret: 7f3a9c\n"


def as_nobody(*cmd: str) -> None:
    """Run ``cmd`` as the unprivileged user ``nobody`` (no supplementary groups)."""
    subprocess.run(
        ["setpriv", f"--reuid={NOBODY.pw_uid}", f"--regid={NOBODY.pw_gid}", "--clear-groups", "--", *cmd],
        check=True,
        capture_output=True,
        timeout=30,
    )


@pytest.fixture
def arena() -> Iterator[Path]:
    """A root-owned 0755 directory that ``nobody`` can reach (pytest's tmp_path is root's alone)."""
    d = Path(tempfile.mkdtemp(prefix="tpagent-carry-", dir="/tmp"))
    d.chmod(0o755)
    yield d
    shutil.rmtree(d, ignore_errors=True)


@pytest.fixture
def vault(arena: Path) -> Path:
    """A root-only directory (0700) holding a root-only file ``log`` with a secret in it."""
    v = arena / "vault"
    v.mkdir(mode=0o700)
    (v / "log").write_bytes(SECRET)
    (v / "log").chmod(0o600)
    return v


def _users_dir(arena: Path) -> Path:
    """``arena/x``, a directory that belongs to ``nobody``."""
    x = arena / "x"
    x.mkdir()
    os.chown(x, NOBODY.pw_uid, NOBODY.pw_gid)
    return x


def _runs_where_it_stood(w: Workload) -> None:
    """The dump was rolled back: the same process ticks on, no step lost or repeated, memory intact."""
    assert alive(w.pid)
    n = w.ticks()[-1][0]
    wait_until(lambda: w.ticks()[-1][0] >= n + 10, "the workload to run on after the refused dump")
    assert_continuous(w.ticks())
    w.verify_state()


def _nothing_holds(secret: bytes, directory: Path) -> None:
    for p in directory.rglob("*"):
        if p.is_file():
            assert secret not in p.read_bytes(), f"{p} holds the secret"


@pytest.mark.parametrize("swap", ["directory", "file"])
def test_dump_reads_nothing_through_a_planted_symlink(
    workloads, arena: Path, vault: Path, tmp_path: Path, swap: str
) -> None:  # type: ignore[no-untyped-def]
    """The workload (root) writes into X/d/log, in a directory of nobody's; nobody then moves
    ``d`` (or ``log``) aside and plants a symlink to the root-only vault, where a root-only
    ``log`` is.  Carrying X/d/log must not archive the vault's file: the dump is refused in
    one sentence naming the symlink, and the workload runs on where it stood."""
    x = _users_dir(arena)
    as_nobody("mkdir", str(x / "d"))
    as_nobody("touch", str(x / "d" / "log"))  # nobody's file, in nobody's directory: carried as is
    w = Workload(x / "d" / "log", 16)
    workloads.append(w.start())
    carried = x / "d" / "log"
    if swap == "directory":
        as_nobody("mv", str(x / "d"), str(x / "d.old"))
        as_nobody("ln", "-s", str(vault), str(x / "d"))
        w.log = x / "d.old" / "log"
        link = x / "d"  # (where the workload's log now is)
    else:
        as_nobody("mv", str(carried), str(x / "d" / "log.old"))
        as_nobody("ln", "-s", str(vault / "log"), str(carried))
        w.log = x / "d" / "log.old"
        link = carried
    assert carried.read_bytes() == SECRET  # root, following the link, would read the secret
    out = tmp_path / "snap"
    _refused_before_and_at_the_freeze(w, out, carried, f"{link} is a symlink", "follows no symlink")
    assert not (out / "images" / "tpagent-files.tar").exists() and not (out / "manifest.json").exists()
    _nothing_holds(SECRET, out)
    _runs_where_it_stood(w)


def _refused_before_and_at_the_freeze(w: Workload, out: Path, carried: Path, *said: str) -> None:
    """`dump --carry` refuses ``carried`` in one sentence before anything is frozen; and the
    dump's own hook, which checks it again while the process is frozen (what the CLI saw may
    have changed since), refuses it too and rolls the dump back."""
    proc = tpagent("dump", str(w.pid), "--out", str(out), "--carry", str(carried))
    assert_one_sentence_error(proc, *said, "nothing was done")
    assert proc.returncode == 2 and not out.exists()
    with pytest.raises(SnapshotError) as refused:
        checkpoint(w.pid, out, carry=[carried])  # (no check before: the hook's alone)
    assert all(words in str(refused.value) for words in said), refused.value


def test_restore_writes_nothing_through_a_planted_symlink(workloads, arena: Path, vault: Path, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    """A snapshot carrying nobody's X/d/log; before the restore nobody replaces ``d`` by a
    symlink to the root-only vault.  The restore must create nothing in the vault: one
    sentence naming the symlink, nothing started, nothing written anywhere."""
    x = _users_dir(arena)
    as_nobody("mkdir", str(x / "d"))
    as_nobody("touch", str(x / "d" / "log"))
    w = Workload(x / "d" / "log", 16)
    workloads.append(w.start())
    out = tmp_path / "snap"
    proc = tpagent("dump", str(w.pid), "--out", str(out), "--carry", str(w.log))
    assert proc.returncode == 0, proc.stderr
    w.reap()
    with tarfile.open(out / "images" / "tpagent-files.tar") as tar:
        assert [m.name for m in tar.getmembers()] == [str(w.log).lstrip("/")]
    (vault / "log").unlink()  # empty: anything written through the link would show
    as_nobody("mv", str(x / "d"), str(x / "d.old"))
    as_nobody("ln", "-s", str(vault), str(x / "d"))
    before = sorted(p.name for p in x.iterdir()), (x / "d.old" / "log").read_bytes()
    touched = vault.stat().st_mtime_ns  # (a file made there and removed again would change it)
    proc = tpagent("restore", str(out))
    assert os.listdir(vault) == [] and vault.stat().st_mtime_ns == touched, proc.stderr
    # (refused before the carried files are put back, whose own check would name the symlink too:
    # the copy's output, beside its log, would be opened through it)
    assert_one_sentence_error(proc, f"{x / 'd'} is a symbolic link on this node, a directory where it was dumped")
    assert proc.returncode == 2
    assert (sorted(p.name for p in x.iterdir()), (x / "d.old" / "log").read_bytes()) == before
    assert os.readlink(x / "d") == str(vault)
    assert not alive(w.pid)
    assert not any(str(w.log) in p.info["cmdline"] for p in psutil.process_iter(["cmdline"]) if p.info["cmdline"])


def test_setuid_and_setgid_are_never_restored(workloads, arena: Path, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    """Carried files of nobody's with modes 4755 and 2775 (beside the workload's log; it does
    not hold them open) come back owned by nobody, as 755 and 775: root hands them over
    first and never sets setuid/setgid, and says so."""
    app = arena / "app"  # root's directory: files of any owner may be carried from it
    app.mkdir(mode=0o755)
    w = Workload(app / "w.log", 16)
    workloads.append(w.start())
    tools = {app / "suid-tool": 0o4755, app / "sgid-tool": 0o2775}
    for tool, mode in tools.items():
        tool.write_bytes(b"#!/bin/sh\necho " + tool.name.encode() + b"\n")
        os.chown(tool, NOBODY.pw_uid, NOBODY.pw_gid)
        tool.chmod(mode)
        assert stat.S_IMODE(tool.stat().st_mode) == mode
    carry = [arg for tool in tools for arg in ("--carry", str(tool))]
    proc = tpagent("dump", str(w.pid), "--out", str(tmp_path / "snap"), "--carry", str(w.log), *carry)
    assert proc.returncode == 0, proc.stderr
    w.reap()
    stopped_at = w.ticks()[-1][0]
    contents = {tool: tool.read_bytes() for tool in tools}
    for tool in tools:
        tool.unlink()
    proc = tpagent("restore", str(tmp_path / "snap"))
    assert proc.returncode == 0, proc.stderr
    for tool, mode in tools.items():
        st = tool.stat()
        assert (st.st_uid, st.st_gid) == (NOBODY.pw_uid, NOBODY.pw_gid)
        assert stat.S_IMODE(st.st_mode) == mode & 0o777 and not st.st_mode & (stat.S_ISUID | stat.S_ISGID)
        assert tool.read_bytes() == contents[tool]
        assert f"{tool} had mode {mode:o}; it is put back as {mode & 0o777:o}" in proc.stderr, proc.stderr
    wait_until(lambda: w.ticks()[-1][0] >= stopped_at + 5, "the restored workload to tick on")
    assert_continuous(w.ticks())


def test_an_open_setuid_file_is_not_restored(workloads, arena: Path, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    """The workload's own log is nobody's, mode 4755.  It is put back as 755, which CRIU's
    check of the mode of an open file then refuses: one sentence, the copy is not left
    running, and the file put back is removed again."""
    app = arena / "app"
    app.mkdir(mode=0o755)
    w = Workload(app / "w.log", 16)
    workloads.append(w.start())
    os.chown(w.log, NOBODY.pw_uid, NOBODY.pw_gid)
    w.log.chmod(0o4755)
    proc = tpagent("dump", str(w.pid), "--out", str(tmp_path / "snap"), "--carry", str(w.log))
    assert proc.returncode == 0, proc.stderr
    w.reap()
    w.log.unlink()
    proc = tpagent("restore", str(tmp_path / "snap"))
    assert_one_sentence_error(proc, "criu restore failed", "has bad mode 0100755 (expect 0104755)")
    assert "tpagent never restores setuid/setgid bits" in proc.stderr
    assert not w.log.exists() and not alive(w.pid)


@pytest.mark.parametrize("owner", ["root", "daemon"])
def test_a_file_in_another_users_directory_is_refused(workloads, arena: Path, tmp_path: Path, owner: str) -> None:  # type: ignore[no-untyped-def]
    """The log (root's, or daemon's) sits in nobody's directory, whose owner could have put any
    file of that owner's there: the dump is refused in one sentence naming it, and the
    workload runs on where it stood."""
    x = _users_dir(arena)
    w = Workload(x / "w.log", 16)
    workloads.append(w.start())
    uid = pwd.getpwnam(owner).pw_uid
    os.chown(w.log, uid, -1)
    out = tmp_path / "snap"
    _refused_before_and_at_the_freeze(
        w, out, w.log, f"{w.log} belongs to UID {uid} but its directory to UID {NOBODY.pw_uid}"
    )
    assert not (out / "manifest.json").exists()
    _runs_where_it_stood(w)


def test_carried_files_come_back_identical_with_owner_mode_and_time(workloads, arena: Path, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    """The ordinary case: a log of nobody's (mode 640) and the workload's output (root's), in
    root's directory, which is gone on the node the snapshot is restored on.  The directory
    is made again as root's 0755; both files come back byte-identical, with owner, mode and
    mtime, before the copy runs; then it writes on into them."""
    logs = arena / "logs"
    logs.mkdir(mode=0o755)
    w = Workload(logs / "w.log", 16)
    workloads.append(w.start())
    os.chown(w.log, NOBODY.pw_uid, NOBODY.pw_gid)
    w.log.chmod(0o640)
    files = [w.log, w.log.with_suffix(".out")]
    out = tmp_path / "snap"
    proc = tpagent("dump", str(w.pid), "--out", str(out), *[a for f in files for a in ("--carry", str(f))])
    assert proc.returncode == 0, proc.stderr
    w.reap()
    frozen = {f: (f.read_bytes(), f.stat()) for f in files}
    shutil.rmtree(logs)

    result = restore.restore(out, start=False)  # held stopped: the files are as restore left them
    st = logs.stat()
    assert (st.st_uid, stat.S_IMODE(st.st_mode)) == (0, 0o755)
    for f, (data, was) in frozen.items():
        now = f.stat()
        assert f.read_bytes() == data
        assert (now.st_uid, now.st_gid, stat.S_IMODE(now.st_mode)) == (
            was.st_uid,
            was.st_gid,
            stat.S_IMODE(was.st_mode),
        )
        assert abs(now.st_mtime - was.st_mtime) < 1e-3
    assert w.log.stat().st_uid == NOBODY.pw_uid and stat.S_IMODE(w.log.stat().st_mode) == 0o640
    restore.start_restored(result)
    stopped_at = w.ticks()[-1][0]
    wait_until(lambda: w.ticks()[-1][0] >= stopped_at + 5, "the restored workload to write on into its log")
    assert_continuous(w.ticks())
    w.verify_state()
