"""Every bad request gets one sentence and a non-zero exit, never a traceback or a frozen process."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import socket
import ssl
import stat
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psutil
import pytest

from conftest import needs_criu
from host.api import UsageError
from host.proc import wait_pids_free
from support.helpers import (
    ROOT,
    alive,
    assert_continuous,
    assert_one_sentence_error,
    kernel_thread,
    kill_and_wait,
    process_with_pid,
    tpagent,
    wait_until,
)

pytestmark = needs_criu


def _fake_old_criu(tmp_path: Path) -> Path:
    """A stand-in for Debian 12's CRIU 3.17: it only answers --version, as that CRIU would."""
    fake = tmp_path / "criu"
    fake.write_text("#!/bin/sh\necho 'Version: 3.17.1'\n")
    fake.chmod(fake.stat().st_mode | stat.S_IEXEC)
    return fake


@pytest.fixture(scope="module")
def snapshot_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One real snapshot (of a short-lived workload) that the corruption tests copy and damage."""
    from support.helpers import Workload

    tmp = tmp_path_factory.mktemp("snap")
    w = Workload(tmp / "w.log", 16).start()
    try:
        proc = tpagent("dump", str(w.pid), "--out", str(tmp / "snap"))
        assert proc.returncode == 0, proc.stderr
    finally:
        w.stop()
    return tmp / "snap"


def _copy(snapshot_dir: Path, tmp_path: Path) -> Path:
    dst = tmp_path / "copy"
    shutil.copytree(snapshot_dir, dst)
    return dst


def test_no_such_pid(tmp_path: Path) -> None:
    assert_one_sentence_error(tpagent("dump", "4194000", "--out", str(tmp_path / "s")), "no process with PID 4194000")


def test_pid_1(tmp_path: Path) -> None:
    assert_one_sentence_error(tpagent("dump", "1", "--out", str(tmp_path / "s")), "init")


def test_kernel_thread(tmp_path: Path) -> None:
    pid = kernel_thread()
    if pid is None:
        pytest.skip("no kernel thread is seen in this PID namespace")
    assert_one_sentence_error(tpagent("dump", str(pid), "--out", str(tmp_path / "s")), "kernel thread")


def test_not_root(start, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    """Run the CLI's code as an unprivileged user (in a forked child that drops root)."""
    from typer.testing import CliRunner

    from cli.main import app

    w = start(mib=16)
    # Warm the lazy imports of the error path while still root: the interpreter's files
    # may live under /root, which the unprivileged child cannot read.
    CliRunner().invoke(app, ["dump", "1", "--out", str(tmp_path / "s")])
    r, wfd = os.pipe()
    child = os.fork()
    if child == 0:  # pragma: no cover - runs in the child
        os.close(r)
        os.setgid(65534)
        os.setuid(65534)
        res = CliRunner().invoke(app, ["dump", str(w.pid), "--out", str(tmp_path / "s")])
        os.write(wfd, json.dumps([res.exit_code, res.stderr + repr(res.exception)]).encode())
        os._exit(0)
    os.close(wfd)
    with os.fdopen(r) as f:
        code, err = json.loads(f.read())
    os.waitpid(child, 0)
    assert code == 2, err
    assert err.startswith("tpagent:") and "root" in err and "Traceback" not in err
    n = w.ticks()[-1][0]
    wait_until(lambda: w.ticks()[-1][0] > n + 3, "the workload to keep running")


def test_criu_missing(start, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    w = start(mib=16)
    proc = tpagent("dump", str(w.pid), "--out", str(tmp_path / "s"), "--criu", str(tmp_path / "nope"))
    assert_one_sentence_error(proc, "not found", "install-criu.sh")
    assert alive(w.pid)


def test_criu_too_old(start, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    w = start(mib=16)
    proc = tpagent("dump", str(w.pid), "--out", str(tmp_path / "s"), "--criu", str(_fake_old_criu(tmp_path)))
    assert_one_sentence_error(proc, "3.17.1", "too old", ">= 4.2")
    assert alive(w.pid)
    doctor = tpagent("doctor", "--criu", str(_fake_old_criu(tmp_path)))
    assert doctor.returncode == 1 and "FAIL  criu" in doctor.stdout


def test_output_dir_not_empty(start, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    w = start(mib=16)
    out = tmp_path / "s"
    out.mkdir()
    (out / "precious.txt").write_text("keep me")
    assert_one_sentence_error(tpagent("dump", str(w.pid), "--out", str(out)), "not empty")
    assert (out / "precious.txt").read_text() == "keep me"
    assert alive(w.pid)


@pytest.mark.parametrize("given", ["process", "thread"])
def test_dump_of_a_process_inside_a_namespace_names_its_init(start, tmp_path: Path, given: str) -> None:  # type: ignore[no-untyped-def]
    w = start(mib=16, launched=True)
    pid = w.worker_pid
    if given == "thread":  # a thread of the workload: the namespace's init is still the PID to give
        pid = next(t.id for t in psutil.Process(pid).threads() if t.id != pid)
    proc = tpagent("dump", str(pid), "--out", str(tmp_path / "s"))
    assert_one_sentence_error(proc, "inside a PID namespace", f"by giving the PID of its init ({w.pid})")
    assert proc.returncode == 2 and not (tmp_path / "s").exists()


def test_session_leader_outside_the_pid_namespace_is_refused_before_any_freeze(tmp_path: Path) -> None:
    """CRIU cannot dump a process whose session id reads 0 in its own PID namespace: say so, touch nothing."""
    holder = subprocess.Popen(["unshare", "--pid", "--fork", "--kill-child", "--mount-proc", "sleep", "600"])
    try:
        wait_until(lambda: bool(psutil.Process(holder.pid).children()), "unshare to fork its child")
        inner = psutil.Process(holder.pid).children()[0]
        proc = tpagent("dump", str(inner.pid), "--out", str(tmp_path / "s"))
        assert_one_sentence_error(proc, "session whose leader is outside its PID namespace")
        assert inner.status() != psutil.STATUS_STOPPED and not (tmp_path / "s").exists()
    finally:
        holder.kill()  # --kill-child: the namespace's init goes with it
        holder.wait()


def test_restore_missing_dir(tmp_path: Path) -> None:
    assert_one_sentence_error(tpagent("restore", str(tmp_path / "nope")), "does not exist")
    assert_one_sentence_error(tpagent("inspect", str(tmp_path / "nope")), "does not exist")


def test_restore_dir_without_manifest(tmp_path: Path) -> None:
    assert_one_sentence_error(tpagent("restore", str(tmp_path)), "no manifest.json")


@pytest.mark.parametrize("command", [("restore",), ("send", "127.0.0.1:9", "--plaintext"), ("inspect",)])
def test_a_directory_that_is_no_snapshot_is_left_as_it_was(tmp_path: Path, command: tuple[str, ...]) -> None:
    """A home or a project's directory given by mistake (`tpagent restore .`) is said to be no
    snapshot, exit 3, and keeps its mode: it was made 0700 (its other users locked out) before."""
    given = tmp_path / "project"
    given.mkdir()
    given.chmod(0o755)
    (given / "notes.txt").write_text("mine")
    secret = ("--secret-file", str(_secret(tmp_path))) if command[0] == "send" else ()
    said = tpagent(command[0], str(given), *command[1:], *secret)
    assert_one_sentence_error(said, f"{given} is not a tpagent snapshot: it has no manifest.json")
    assert said.returncode == 3
    assert stat.S_IMODE(given.stat().st_mode) == 0o755 and (given / "notes.txt").read_text() == "mine"
    said = tpagent(command[0], str(given / "notes.txt"), *command[1:], *secret)  # (a file: no snapshot either)
    assert_one_sentence_error(said, "does not exist or is not a directory")
    assert said.returncode == 3


@pytest.mark.parametrize(
    "command", [("restore",), ("inspect",), ("receive", "--plaintext", "--listen", "127.0.0.1:0", "--out")]
)
def test_a_path_longer_than_the_system_takes_is_said_in_one_sentence(tmp_path: Path, command: tuple[str, ...]) -> None:
    too_long = str(tmp_path / ("a" * 5000))
    said = tpagent(*command, too_long, *(("--secret-file", str(_secret(tmp_path))) if command[0] == "receive" else ()))
    assert_one_sentence_error(said, "File name too long")


def test_the_root_directory_is_no_snapshot_directory(start, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    """`--out /` was taken for a new directory (no component of it was checked): the snapshot was
    written into /, images/, log/ and manifest.json beside /etc."""
    w = start(mib=16)
    written = [Path("/manifest.json"), Path("/images"), Path("/log")]
    assert not any(p.exists() for p in written)
    try:
        said = tpagent("dump", str(w.pid), "--out", "/", "--leave-running")
        assert_one_sentence_error(said, "/ cannot be a private directory")
        assert said.returncode == 2 and not any(p.exists() for p in written)
        assert alive(w.pid)
    finally:
        for p in written:
            with contextlib.suppress(FileNotFoundError):
                shutil.rmtree(p) if p.is_dir() else p.unlink()


@pytest.mark.parametrize(
    "damage, needle",
    [
        (lambda d: (d / "manifest.json").write_text("{not json"), "not valid JSON"),
        (lambda d: _edit(d, format="something-else"), "not a tpagent snapshot manifest"),
        (lambda d: _edit(d, format_version=99), "newer tpagent"),
        (lambda d: _edit(d, processes=None), "malformed"),
        (lambda d: _edit(d, root_pid=1, rehash=False), "its own checksum"),
        (
            lambda d: _edit(d, root_pid=2**40),
            "is corrupt: root_pid names a process not in processes.",
        ),  # (was "field root_pid names ... is missing or malformed")
        (lambda d: _edit(d, processes=[{**p, "ns_pids": []} for p in _manifest(d)["processes"]]), "ns_pids is empty"),
        (lambda d: _edit(d, cuda={**_manifest(d)["cuda"], "forked": [1]}), "cuda.forked"),
        (lambda d: _edit(d, gpus=[{"uuid": "GPU-1", "name": "x", "memory_used": 10**400}]), "memory_used"),
        (lambda d: (d / "manifest.json").write_text("[" * 100_000 + "]" * 100_000), "not valid JSON"),
        (lambda d: (d / "manifest.json").write_text('{"format": ' + "9" * 5000 + "}"), "not valid JSON"),
        (lambda d: _edit(d, timings={"dump": 10**400}), "field timings.dump is missing or malformed"),
        (lambda d: _edit(d, timings={"dump": float("nan")}), "field timings.dump is missing or malformed"),
        (lambda d: _edit(d, files={k: {**f, "size": 10**400} for k, f in _manifest(d)["files"].items()}), ".size is"),
        (
            lambda d: _edit(d, files={"../../etc/passwd": {"size": 1, "chunk_size": 1, "sha256": []}}),
            "directly under images/",
        ),
        (lambda d: _swap_for_symlink(d), "not a regular file"),
        (lambda d: _truncate(d), "truncated"),
        (lambda d: _flip_byte(d), "does not match its checksum"),
        (lambda d: _largest(d).unlink(), "is missing"),
        (lambda d: (d / "images" / "extra.img").write_bytes(b"x"), "does not list"),
    ],
    ids=[
        "corrupt-json",
        "foreign",
        "newer-format",
        "malformed",
        "edited",
        "root-elsewhere",
        "no-ns-pids",
        "forked-not-rows",
        "huge-gpu-memory",
        "deeply-nested",
        "number-of-5000-digits",
        "time-past-a-float",
        "time-not-a-number",
        "size-past-64-bits",
        "traversal",
        "symlink",
        "truncated",
        "flipped-byte",
        "missing-file",
        "extra-file",
    ],
)
def test_damaged_snapshot_is_refused_before_anything_starts(
    snapshot_dir: Path, tmp_path: Path, damage, needle: str
) -> None:  # type: ignore[no-untyped-def]
    snap = _copy(snapshot_dir, tmp_path)
    pid = json.loads((snap / "manifest.json").read_text())["root_pid"]
    damage(snap)
    proc = tpagent("restore", str(snap))
    assert_one_sentence_error(proc, needle)
    assert proc.returncode == 3
    assert not alive(pid)  # nothing was started from it


def test_gpu_map_unknown_uuid(snapshot_dir: Path) -> None:
    proc = tpagent(
        "restore",
        str(snapshot_dir),
        "--gpu-map",
        "GPU-8e8a3c4b-1111-2222-3333-444455556666=GPU-00000000-1111-2222-3333-444455556666",
    )
    assert_one_sentence_error(proc, "not a GPU of this snapshot")
    assert_one_sentence_error(tpagent("restore", str(snapshot_dir), "--gpu-map", "GPU-1"), "OLD_UUID=NEW_UUID")
    assert_one_sentence_error(tpagent("restore", str(snapshot_dir), "--gpu-map", "abc=def"), "is not a GPU UUID")


def test_pid_held_as_session_id_of_an_orphan_is_found() -> None:
    """A dead session leader's PID, still the session id of its orphan, is not free for restore."""
    leader = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import os,time\nos.setsid()\nc = os.fork()\nif c: print(c, flush=True)\nelse: time.sleep(60)",
        ],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert leader.stdout is not None
    orphan = int(leader.stdout.readline())
    leader.stdout.close()
    leader.wait(timeout=10)
    try:
        with pytest.raises(UsageError, match=f"PID {leader.pid}.*process {orphan} .*session id"):
            wait_pids_free([leader.pid], timeout=0.3)
    finally:
        kill_and_wait(orphan)
    wait_pids_free([leader.pid], timeout=5)  # free once the orphan is gone


def test_launch_needs_a_command() -> None:
    assert_one_sentence_error(tpagent("launch"), "give the command")
    assert_one_sentence_error(tpagent("launch", "--", "/no/such/program"), "was not found")


@pytest.mark.parametrize("flag", ["--stdout", "--stderr"])
def test_a_launch_log_that_cannot_be_written_is_named_not_the_command(tmp_path: Path, flag: str) -> None:
    """(A directory given as the log was "cannot start sleep: Is a directory (d)": the command blamed.)"""
    logs = tmp_path / "d"
    logs.mkdir()
    said = tpagent("launch", flag, str(logs), "--", "sh", "-c", f"touch {tmp_path / 'ran'}")
    assert_one_sentence_error(said, f"cannot write its {flag} {logs}: Is a directory")
    assert said.returncode == 2 and list(logs.iterdir()) == [] and not (tmp_path / "ran").exists()


def _edit(d: Path, rehash: bool = True, **fields: object) -> None:
    """Change manifest fields; ``rehash`` keeps its self-checksum consistent, as a buggy or
    hostile writer would, so the field checks themselves are what must catch it."""
    from snapshot.manifest import _body_digest

    data = json.loads((d / "manifest.json").read_text())
    data.update(fields)
    if rehash:
        data["manifest_sha256"] = _body_digest(data)
    (d / "manifest.json").write_text(json.dumps(data))


def _manifest(d: Path) -> dict[str, Any]:
    return dict(json.loads((d / "manifest.json").read_text()))


def _swap_for_symlink(d: Path) -> None:
    """An image replaced by a symlink (to a file of the same size): CRIU, as root, would follow it."""
    p = _largest(d)
    target = d.parent / "elsewhere.img"
    p.rename(target)
    p.symlink_to(target)


def _largest(d: Path) -> Path:
    return max((d / "images").iterdir(), key=lambda p: p.stat().st_size)


def _truncate(d: Path) -> None:
    p = _largest(d)
    os.truncate(p, p.stat().st_size // 2)


def _flip_byte(d: Path) -> None:
    p = _largest(d)
    with open(p, "r+b") as f:
        f.seek(p.stat().st_size // 3)
        b = f.read(1)
        f.seek(-1, 1)
        f.write(bytes([b[0] ^ 0xFF]))


def test_gpu_process_without_a_usable_driver_is_refused_before_any_freeze(start, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    """Here there is no NVIDIA driver: a process that has "libcuda.so" mapped is refused whole."""
    import mmap

    from host.proc import uses_cuda

    lib = tmp_path / "libcuda.so.1"
    lib.write_bytes(b"\0" * mmap.PAGESIZE)
    w = start(mib=16, extra=("--map", str(lib)))
    assert uses_cuda(w.pid)
    if Path("/dev/nvidiactl").exists():
        pytest.skip("this machine has an NVIDIA driver")
    proc = tpagent("dump", str(w.pid), "--out", str(tmp_path / "s"))
    assert_one_sentence_error(proc, "uses the GPU", "libcuda.so")
    n = w.ticks()[-1][0]
    wait_until(lambda: w.ticks()[-1][0] > n + 3, "the workload to keep running")
    assert not (tmp_path / "s").exists()  # nothing was started, nothing written


@pytest.mark.parametrize("held", ["pid", "thread-id", "unreaped"])
def test_restore_while_the_original_ids_are_taken(start, tmp_path: Path, held: str) -> None:  # type: ignore[no-untyped-def]
    """A plain process comes back under its own PID and thread IDs: while another process holds
    one (or the dumped process itself, ended, its parent not having reaped it), the restore
    waits (--pid-wait), names the holder, starts nothing; once it is gone the same snapshot
    restores and the workload goes on where it stood."""
    w = start(mib=16)
    snap = tmp_path / "snap"
    assert tpagent("dump", str(w.pid), "--out", str(snap)).returncode == 0
    if held == "unreaped":  # (this test is its parent)
        proc = tpagent("restore", str(snap), "--pid-wait", "1")
        said = f"held by process {w.pid} (", f"), ended but not yet reaped by its parent, PID {os.getpid()}"
        assert_one_sentence_error(proc, f"PID {w.pid}", *said)
        assert proc.returncode == 2
    w.reap()
    m = json.loads((snap / "manifest.json").read_text())
    assert m["processes"][0]["tids"], "the workload's threads are in the manifest"
    wanted = w.pid if held == "pid" else m["processes"][0]["tids"][0]
    holder = process_with_pid(wanted) if held != "unreaped" else None
    try:
        if holder is not None:
            proc = tpagent("restore", str(snap), "--pid-wait", "1")
            kind = "PID" if held == "pid" else "thread ID"
            assert_one_sentence_error(proc, f"{kind} {wanted}", f"held by process {wanted} (sleep)")
            assert proc.returncode == 2
            assert holder.poll() is None and len(w.ticks()) == w.ticks()[-1][0] + 1  # nothing started
    finally:
        if holder is not None:
            holder.kill()
            holder.wait()
    proc = tpagent("restore", str(snap), "--json")
    assert proc.returncode == 0, proc.stderr
    stopped_at = w.ticks()[-1][0]
    wait_until(lambda: w.ticks()[-1][0] >= stopped_at + 5, "the restored workload to tick on")
    assert_continuous(w.ticks())
    w.verify_state()


def test_a_thread_id_is_not_a_pid(start, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    w = start(mib=16)
    tid = next(t.id for t in psutil.Process(w.pid).threads() if t.id != w.pid)
    assert_one_sentence_error(
        tpagent("dump", str(tid), "--out", str(tmp_path / "s")), f"is a thread of process {w.pid}"
    )
    assert not (tmp_path / "s").exists() and psutil.Process(w.pid).status() != psutil.STATUS_STOPPED


@pytest.mark.parametrize("prints", ["", "Version: \\377"], ids=["nothing", "not-utf8"])
def test_a_program_that_is_not_criu(start, tmp_path: Path, prints: str) -> None:  # type: ignore[no-untyped-def]
    w = start(mib=16)
    fake = tmp_path / "criu"
    fake.write_text(f"#!/bin/sh\nprintf '{prints}\\n'\n")
    fake.chmod(0o755)
    proc = tpagent("dump", str(w.pid), "--out", str(tmp_path / "s"), "--criu", str(fake))
    assert_one_sentence_error(proc, f"{fake} does not look like CRIU")
    assert proc.returncode == 2 and alive(w.pid)


def test_json_errors_are_json(tmp_path: Path) -> None:
    proc = tpagent("restore", str(tmp_path / "nope"), "--json")
    assert_one_sentence_error(proc, "does not exist")
    doc = json.loads(proc.stdout)
    assert doc["exit_code"] == proc.returncode == 3 and "does not exist" in doc["error"] and doc["rolled_back"] is False


def test_carried_files_named_without_their_archive(snapshot_dir: Path, tmp_path: Path) -> None:
    """A manifest (self-checksum kept consistent) that names carried files the snapshot lacks."""
    snap = _copy(snapshot_dir, tmp_path)
    _edit(snap, carried=[str(tmp_path / "x.log")])
    proc = tpagent("restore", str(snap))
    assert_one_sentence_error(proc, "tpagent-files.tar is not among the files")
    assert proc.returncode == 3 and not (tmp_path / "x.log").exists()


@pytest.mark.parametrize("driver", ["no-cuda-python", "driver-560"])
def test_gpu_process_without_the_checkpoint_api_is_refused_before_any_freeze(
    start, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, driver: str
) -> None:  # type: ignore[no-untyped-def]
    """cuda-python missing, or a driver older than 570 (no checkpoint API): refused whole,
    the process never stops.  The driver module is replaced here in-process (no such driver exists here)."""
    import mmap
    from types import SimpleNamespace

    from snapshot.dump import checkpoint

    lib = tmp_path / "libcuda.so.1"
    lib.write_bytes(b"\0" * mmap.PAGESIZE)
    w = start(mib=16, extra=("--map", str(lib)))
    if driver == "no-cuda-python":
        monkeypatch.setitem(sys.modules, "cuda.bindings", None)  # import fails as if not installed
        needle = "cuda-python is not installed"
    else:
        ok = 0
        old = SimpleNamespace(
            CUresult=SimpleNamespace(CUDA_SUCCESS=ok),
            cuInit=lambda flags: (ok,),
            cuDriverGetVersion=lambda: (ok, 12060),
        )
        monkeypatch.setitem(sys.modules, "cuda.bindings", SimpleNamespace(driver=old))
        needle = "supports CUDA 12.6; the checkpoint API needs driver 570"
    with pytest.raises(UsageError, match=needle):
        checkpoint(w.pid, tmp_path / "s")
    assert not (tmp_path / "s").exists()
    n = w.ticks()[-1][0]
    wait_until(lambda: w.ticks()[-1][0] > n + 3, "the workload to keep running")
    assert_continuous(w.ticks())


def test_criu_not_installed_at_all(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """No --criu, no TPAGENT_CRIU, nothing in /opt/tpagent, nothing on PATH."""
    from snapshot import criu

    monkeypatch.delenv("TPAGENT_CRIU", raising=False)
    monkeypatch.setattr(criu, "INSTALLED_CRIU", tmp_path / "absent" / "criu")
    monkeypatch.setenv("PATH", str(tmp_path))
    with pytest.raises(UsageError, match="CRIU is not installed; run scripts/install-criu.sh"):
        criu.Criu()


@pytest.mark.parametrize(
    "address", ["127.0.0.1:99999", "127.0.0.1", "[::1]:x", "127.0.0.1:0", ":7411", "127.0.0.1:²", "127.0.0.1:٣"]
)
def test_a_malformed_send_to_address_is_refused_before_anything_is_frozen(  # type: ignore[no-untyped-def]
    start, snapshot_dir: Path, tmp_path: Path, address: str
) -> None:
    """A mistyped --send-to is said once, before the freeze (it was found by the sender only,
    which retried it six times while the dump, in its kill mode, ended the process); `send` says
    it once too, never retried.  Digits are ASCII (before: "²" was "unexpected error", and "٣"
    port 3)."""
    secret = _secret(tmp_path)
    w = start(mib=16)
    out = tmp_path / "s"
    said = tpagent(
        "dump", str(w.pid), "--out", str(out), "--secret-file", str(secret), "--plaintext", "--send-to", address
    )
    assert_one_sentence_error(said, f"{address!r} is not HOST:PORT")
    assert said.returncode == 2 and alive(w.pid) and not out.exists()
    said = tpagent("send", str(snapshot_dir), address, "--secret-file", str(secret), "--plaintext")
    assert_one_sentence_error(said, f"{address!r} is not HOST:PORT")
    assert (
        said.returncode == 2 and "failed" not in said.stderr and said.stderr.startswith("tpagent:")
    )  # (no blank line)


class _InterruptedSend:
    """A sender whose send is cut short by a Ctrl-C (its timing is what is made up here: the
    snapshot is real, sealed and kept)."""

    def reach(self, peer: str) -> None:
        pass

    def send(self, snapshot: Path, peer: str, **_: Any) -> None:
        raise KeyboardInterrupt


def test_a_send_interrupted_once_the_snapshot_is_sealed_says_where_it_is_kept(start, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    """A Ctrl-C while `dump --send-to` sends a sealed snapshot (the process ended as dumped): the
    command ended with exit 130 and not a word.  Now it says that the snapshot is kept, and how to
    bring the process back, which then works."""
    from transfer import pipeline

    w = start(mib=16)
    out = tmp_path / "s"
    kept = f"the process ended as it was dumped; its snapshot is kept in {out}: `tpagent restore {out}` brings it back"
    with pytest.raises(pipeline.SendFailed, match="the send to 127.0.0.1:9 was interrupted") as said:
        pipeline.dump_and_send(w.pid, out, "127.0.0.1:9", _InterruptedSend(), overlap=False)  # type: ignore[arg-type]
    assert kept in str(said.value)
    w.reap()
    stopped_at = w.ticks()[-1][0]
    proc = tpagent("restore", str(out), "--json")
    assert proc.returncode == 0, proc.stderr
    w.pid = json.loads(proc.stdout)["pid"]
    wait_until(lambda: w.ticks()[-1][0] > stopped_at + 3, "the workload to run on from its snapshot")


def test_a_ctrl_c_no_step_took_is_said_in_one_sentence() -> None:
    """(typer made a Ctrl-C outside every step that handles one an exit 130 without a word.)"""
    code = (
        "import sys, typer\n"
        "from cli.common import guarded\n"
        "app = typer.Typer()\n"
        "@app.command()\n"
        "def x() -> None:\n"
        "    raise KeyboardInterrupt\n"
        "guarded(lambda: app(args=[], standalone_mode=False))\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert (proc.returncode, proc.stderr) == (130, "tpagent: interrupted.\n")


@pytest.mark.parametrize(
    ("address", "says"),
    [
        ("nosuchhost.invalid:7500", "names no host this node knows"),
        ("256.1.1.1:7500", "names no host this node knows"),
        ("127.0.0.1:" + "9" * 5000, "is not HOST:PORT"),  # (was "unexpected error": int() of 5000 digits)
    ],
)
def test_a_send_to_naming_no_host_is_refused_before_anything_is_frozen(  # type: ignore[no-untyped-def]
    start, tmp_path: Path, address: str, says: str
) -> None:
    """(A host no node resolves passed the check of its form: the dump ended the process, and
    the sender then failed six times.)"""
    w = start(mib=16)
    out = tmp_path / "s"
    for overlap in ("--overlap", "--no-overlap"):
        said = tpagent(
            "dump", str(w.pid), "--out", str(out), "--secret-file", str(_secret(tmp_path)), "--plaintext",
            "--send-to", address, overlap,
        )  # fmt: skip
        assert_one_sentence_error(said, says)
        assert said.returncode == 2 and alive(w.pid) and not out.exists() and len(said.stderr) < 400


def test_a_dump_whose_receiver_is_not_there_or_holds_another_secret_freezes_nothing(  # type: ignore[no-untyped-def]
    start, tmp_path: Path
) -> None:
    """--send-to a port nobody listens on, or a receiver of another cluster's secret: said
    before the freeze, the process runs on untouched (the dump, in its kill mode, ended it, and
    kept its snapshot here: nobody then ran it until a `tpagent restore`)."""
    w = start(mib=16)
    out = tmp_path / "s"
    said = tpagent(
        "dump", str(w.pid), "--out", str(out), "--send-to", "127.0.0.1:1", "--secret-file", str(_secret(tmp_path)),
        "--plaintext",
    )  # fmt: skip
    assert_one_sentence_error(said, "nothing was frozen: no receiver answered at 127.0.0.1:1 in 6 tries")
    assert said.returncode == 1 and alive(w.pid) and not out.exists()
    with _receiver(tmp_path / "theirs", tmp_path / "received") as address:
        said = tpagent(
            "dump", str(w.pid), "--out", str(out), "--send-to", address, "--secret-file", str(_secret(tmp_path)),
            "--plaintext", "--no-overlap",
        )  # fmt: skip
    assert_one_sentence_error(said, "nothing was frozen: the receiver refused this sender")
    assert said.returncode == 1 and alive(w.pid) and not out.exists() and not (tmp_path / "received").exists()
    ticks = len(w.ticks())
    wait_until(lambda: len(w.ticks()) > ticks, "the workload to tick on")
    w.verify_state()


def test_a_dump_whose_receiver_goes_away_says_the_process_ended_and_how_to_bring_it_back(  # type: ignore[no-untyped-def]
    start, tmp_path: Path
) -> None:
    """A receiver that answers the dump's check of it, then is gone before the images go: in
    dump's kill mode the process ends as dumped (the snapshot is whole), and the one sentence
    says so and how to bring it back (it said only that the snapshot was kept, under an exit code
    read as 'the process was resumed'); it comes back from there, its memory as it was."""
    w = start(mib=16)
    out = tmp_path / "s"
    secret = _secret(tmp_path)
    with _answering_once(secret) as address:
        said = tpagent(
            "dump", str(w.pid), "--out", str(out), "--send-to", address, "--secret-file", str(secret), "--plaintext"
        )
    assert_one_sentence_error(
        said,
        f"the process ended as it was dumped; its snapshot is kept in {out}: `tpagent restore {out}` brings it back",
    )
    w.reap()
    assert not alive(w.pid)
    came_back = tpagent("restore", str(out))
    assert came_back.returncode == 0, came_back.stderr
    ticks = len(w.ticks())
    wait_until(lambda: len(w.ticks()) > ticks, "the restored workload to tick on")
    w.verify_state()


@contextlib.contextmanager
def _receiver(secret_dir: Path, out: Path) -> Iterator[str]:
    """A `tpagent receive` (plaintext) of its own secret; its address."""
    secret_dir.mkdir()
    with subprocess.Popen(
        [sys.executable, "-m", "cli.main", "receive", "--listen", "127.0.0.1:0", "--out", str(out), "--timeout", "60",
         "--secret-file", str(_secret(secret_dir)), "--plaintext"],
        stderr=subprocess.PIPE, text=True,
    ) as receiver:  # fmt: skip
        try:
            assert receiver.stderr is not None
            yield receiver.stderr.readline().split()[-1]  # "listening on HOST:PORT"
        finally:
            receiver.kill()


@contextlib.contextmanager
def _answering_once(secret: Path) -> Iterator[str]:
    """A receiver's port that answers one stream's handshake, then is closed; its address."""
    from transfer.api import read_secret
    from transfer.stream import server_handshake
    from transfer.tcp import TcpListener

    listener = TcpListener("127.0.0.1:0", 30.0)

    def answer() -> None:
        ch = listener.accept(60.0)
        listener.close()
        if ch is not None:
            server_handshake(ch, read_secret(secret))
            ch.close()

    t = threading.Thread(target=answer, daemon=True)
    t.start()
    try:
        yield listener.address
    finally:
        listener.close()
        t.join(60)


def test_send_of_a_snapshot_missing_an_image_says_so(snapshot_dir: Path, tmp_path: Path) -> None:
    snap = _copy(snapshot_dir, tmp_path)
    gone = _largest(snap)
    gone.unlink()
    said = tpagent("send", str(snap), "127.0.0.1:9", "--secret-file", str(_secret(tmp_path)), "--plaintext")
    assert_one_sentence_error(said, f"{gone}, which its manifest lists, cannot be read (No such file or directory)")


def test_send_of_a_snapshot_altered_here_says_it_is_damaged_not_the_network(snapshot_dir: Path, tmp_path: Path) -> None:
    """An image altered in place (its size kept): the receiver refuses each resend of it, and the
    sender blamed the network ("chunk N arrived damaged 4 times", exit 1).  It now says the
    snapshot is damaged (exit 3, as restore and inspect do); the receiver keeps nothing."""
    snap = _copy(snapshot_dir, tmp_path)
    with open(_largest(snap), "r+b") as f:
        f.seek(1000)
        f.write(b"XXXX")
    secret = str(_secret(tmp_path))
    out = tmp_path / "received"
    receiver = subprocess.Popen(
        [sys.executable, "-m", "cli.main", "receive", "--listen", "127.0.0.1:0", "--out", str(out), "--timeout", "60",
         "--secret-file", secret, "--plaintext"],
        stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        assert receiver.stderr is not None
        address = receiver.stderr.readline().split()[-1]  # "listening on HOST:PORT"
        said = tpagent("send", str(snap), address, "--secret-file", secret, "--plaintext", "--json")
        assert_one_sentence_error(said, f"{snap} is damaged: images/{_largest(snap).name} does not match its checksum")
        assert said.returncode == 3 and json.loads(said.stdout)["exit_code"] == 3
        assert receiver.wait(timeout=60) != 0 and not out.exists()
    finally:
        receiver.kill()
        receiver.communicate()


def _secret(tmp_path: Path) -> Path:
    from transfer.api import MIN_SECRET

    secret = tmp_path / "secret"
    secret.write_text(os.urandom(MIN_SECRET).hex())  # (text: a secret is read stripped of whitespace)
    secret.chmod(0o600)
    return secret


@pytest.mark.parametrize("case", ["not-empty", "nan", "negative", "inf", "1e300"])
def test_receive_given_what_it_cannot_do_says_so_with_exit_2(tmp_path: Path, case: str) -> None:
    out = tmp_path / "out"
    out.mkdir()
    if case == "not-empty":
        (out / "keep").write_text("x")
    timeout = {"not-empty": "5", "negative": "-1"}.get(case, case)  # (inf, 1e300: a wait past what Python's take)
    said = tpagent(
        "receive", "--listen", "127.0.0.1:0", "--out", str(out), "--timeout", timeout,
        "--secret-file", str(_secret(tmp_path)), "--plaintext",
    )  # fmt: skip
    assert_one_sentence_error(said, "is not empty" if case == "not-empty" else "a number of seconds above 0")
    assert said.returncode == 2 and said.stderr.count("\n") == 1, said.stderr  # (said before it listens)


@pytest.mark.parametrize("transport", ["tcp", "ucx"])
@pytest.mark.parametrize("listen", ["256.1.1.1:7500", "[zz]:1", "10.255.255.254:7500"])
def test_receive_on_an_address_that_is_none_of_this_nodes_says_so_with_exit_2(
    tmp_path: Path, listen: str, transport: str
) -> None:
    """(It was exit 1, as a failure of the moment; UCX, which listens on every interface whatever
    the host, waited out its --timeout for a sender that could never come.)"""
    if transport == "ucx":
        pytest.importorskip("ucxx")
    said = tpagent(
        "receive", "--listen", listen, "--out", str(tmp_path / "out"), "--secret-file", str(_secret(tmp_path)),
        "--plaintext", "--transport", transport, "--timeout", "60",
    )  # fmt: skip
    assert_one_sentence_error(said, f"cannot listen on {listen}")
    assert said.returncode == 2


def test_an_out_on_a_read_only_filesystem_is_said_in_one_sentence(start, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    """(The undo of what it could not write, a file removed on a filesystem that takes no change, was a traceback.)"""
    w = start(mib=16)
    mount = tmp_path / "ro"
    mount.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m,mode=700", "tmpfs", str(mount)], check=True)
    try:
        (mount / "e").mkdir(mode=0o700)
        subprocess.run(["mount", "-o", "remount,ro", str(mount)], check=True)
        said = tpagent("dump", str(w.pid), "--out", str(mount / "e"))
        assert_one_sentence_error(said, f"cannot write to {mount / 'e'}: Read-only file system")
        assert alive(w.pid)
    finally:
        subprocess.run(["umount", str(mount)], check=True)


@pytest.mark.parametrize(
    "args",
    [
        ("migrate", str(10**20), "--to", "127.0.0.1:2", "--from", "127.0.0.1:1"),
        ("migrate", "--job", "j", "--rank", str(10**20), "--to", "127.0.0.1:2", "--from", "127.0.0.1:1"),
        ("events", "--after", str(10**23), "--orchestrator", "127.0.0.1:1"),
    ],
    ids=["pid", "rank", "after"],
)
def test_a_number_too_large_for_the_call_is_refused_as_given(tmp_path: Path, args: tuple[str, ...]) -> None:
    """(A number past what the call carries was a protobuf ValueError, a traceback.)"""
    from support.certs import node_certs

    said = tpagent(*args, "--secret-file", str(_secret(tmp_path)), "--tls-dir", str(node_certs(tmp_path, "n")))
    assert_one_sentence_error(said, "invalid value for")
    assert said.returncode == 2


@pytest.mark.parametrize(
    "agent",
    ["h\udcff:1", "127.0.0.1:99999", "localhost", ":7400", "http://127.0.0.1:7410", "a b:7410", "[::1"],
    ids=["not-utf8", "port", "no-port", "no-host", "url", "space", "bracket"],
)
def test_an_agent_address_that_is_no_host_port_is_refused_as_given(tmp_path: Path, agent: str) -> None:
    """(Bytes of no encoding were a UnicodeEncodeError traceback; gRPC took 99999 as port 34463,
    and no port as 443; a URL, a space or a bracket left open reached gRPC, and were said to be
    unreachable, "misformatted domain name".)"""
    from support.certs import node_certs

    tls = str(node_certs(tmp_path, "n"))
    creds = ("--secret-file", str(_secret(tmp_path)), "--tls-dir", tls)
    commands = [("node", "--agent", agent), ("migrate", "4242", "--to", "127.0.0.1:9", "--from", agent)]
    for command in [*commands, ("cluster", "--orchestrator", agent)]:
        said = tpagent(*command, *creds)  # (migrate --from: a traceback before)
        assert_one_sentence_error(said, "is not HOST:PORT")
        assert said.returncode == 2


@pytest.mark.parametrize(
    ("args", "said"),
    [
        (("status", "\udcff"), "32 hex digits"),
        (("cancel", "a" * 100_000), "32 hex digits"),
        (("resolve", "0" * 31 + "G", "--commit"), "32 hex digits"),
        (("taint", "n\udcff", "--reason", "x", "--orchestrator", "127.0.0.1:1"), "not UTF-8"),
        (("taint", "n", "--reason", "\udcff", "--orchestrator", "127.0.0.1:1"), "not UTF-8"),
        (("untaint", "n", "--gpu", "GPU-\udcff", "--orchestrator", "127.0.0.1:1"), "not UTF-8"),
        (("migrate", "--job", "j\udcff", "--rank", "0", "--to", "127.0.0.1:2", "--from", "127.0.0.1:1"), "not UTF-8"),
    ],
    ids=["status", "cancel-100k", "resolve-not-hex", "taint-node", "taint-reason", "untaint-gpu", "migrate-job"],
)
def test_a_name_or_id_the_call_cannot_carry_is_refused_as_given(
    tmp_path: Path, args: tuple[str, ...], said: str
) -> None:
    """(Bytes of no encoding, which a shell passes as they are, were a protobuf ValueError
    traceback; so was any id not a migration's, and 100 000 characters went to the agent.)"""
    from support.certs import node_certs

    out = tpagent(*args, "--secret-file", str(_secret(tmp_path)), "--tls-dir", str(node_certs(tmp_path, "n")))
    assert out.returncode == 2 and "Traceback" not in out.stderr and said in out.stderr, out.stderr


@pytest.mark.parametrize("carry", ["missing", "directory", "symlink", "proc", "sys"])
def test_a_carry_that_cannot_be_taken_along_is_refused_before_anything_is_frozen(  # type: ignore[no-untyped-def]
    start, tmp_path: Path, carry: str
) -> None:
    """(A --carry naming no file was left out without a word: the process was frozen and moved
    without the file its user had asked to take along.  One of the kernel's, /proc/1/status, was
    taken: the process ended as dumped, and no restore could then put it back; /sys's failed
    once the tree was frozen.)"""
    w = start(mib=16)
    named = {
        "missing": tmp_path / "nope.txt",
        "directory": tmp_path,
        "symlink": tmp_path / "link",
        "proc": Path("/proc/1/status"),
        "sys": Path("/sys/kernel/mm/transparent_hugepage/enabled"),
    }[carry]
    if carry == "symlink":
        (tmp_path / "real.txt").write_text("x")
        named.symlink_to(tmp_path / "real.txt")
    out = tmp_path / "s"
    said = tpagent("dump", str(w.pid), "--out", str(out), "--carry", str(named))
    assert_one_sentence_error(said, "--carry", str(named), "nothing was done")
    assert said.returncode == 2 and alive(w.pid) and not out.exists()
    n = w.ticks()[-1][0]
    wait_until(lambda: w.ticks()[-1][0] > n, "the workload to keep running")


@pytest.mark.parametrize("command", [("node", "--agent"), ("cluster", "--orchestrator")])
def test_a_peer_whose_certificate_is_another_cas_is_said_once(tmp_path: Path, command: tuple[str, str]) -> None:
    """A server whose certificate this cluster's CA did not sign (another cluster's agent, a
    stale certificate): one sentence that says so (before: gRPC's C core printed its own INFO
    line of the handshake first, and the sentence ended in gRPC's "failed to connect to all
    addresses; last error: UNKNOWN: ... : OK")."""
    from support.certs import node_certs

    theirs = node_certs(tmp_path / "theirs", "x")
    server = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    server.load_cert_chain(theirs / "tls.crt", theirs / "tls.key")
    listener = socket.create_server(("127.0.0.1", 0))

    def serve() -> None:
        with contextlib.suppress(OSError):  # (closed at the end)
            while True:
                conn, _ = listener.accept()
                with contextlib.suppress(OSError), conn:
                    server.wrap_socket(conn, server_side=True).close()

    threading.Thread(target=serve, daemon=True).start()
    try:
        address = f"127.0.0.1:{listener.getsockname()[1]}"
        tls = str(node_certs(tmp_path / "ours", "n"))
        said = tpagent(*command, address, "--secret-file", str(_secret(tmp_path)), "--tls-dir", tls)
    finally:
        listener.close()
    assert_one_sentence_error(said, address, "not one this cluster's CA signed")
    assert said.returncode == 2 and said.stderr.count("\n") == 1, said.stderr


@pytest.mark.parametrize("whose", ["owned", "writable"])
def test_a_snapshot_another_user_could_have_written_is_not_sent(snapshot_dir: Path, tmp_path: Path, whose: str) -> None:
    """A user who wrote a snapshot of their own making (its manifest's checksum is no secret;
    its carried files root's, say /etc/ld.so.preload) had an operator's `send` make it a
    verified snapshot of root's on the receiving node, which a restore put back as root: the
    user's code ran as root.  `send` now takes only a directory no other user could have
    written to, as `restore` does, and connects to nothing otherwise."""
    snap = _copy(snapshot_dir, tmp_path / "theirs")
    os.chmod(tmp_path / "theirs", 0o755)
    if whose == "owned":
        for p in [snap, *snap.rglob("*")]:
            os.chown(p, 65534, 65534)
    else:
        os.chmod(snap, 0o777)
    listener = socket.create_server(("127.0.0.1", 0))
    listener.settimeout(0.5)
    try:
        said = tpagent(
            "send", str(snap), f"127.0.0.1:{listener.getsockname()[1]}",
            "--secret-file", str(_secret(tmp_path)), "--plaintext",
        )  # fmt: skip
        assert_one_sentence_error(said, str(snap), "no one else could write to")
        assert said.returncode == 2
        with pytest.raises(TimeoutError):
            listener.accept()  # (nobody connected)
    finally:
        listener.close()


def test_a_refusal_shows_no_escape_sequence_another_process_put_in_its_name(tmp_path: Path) -> None:
    """A dump refused for a tie to another process names it, by the name that process gave
    itself: an escape sequence in it reached root's terminal as it was (the colours, a title, or
    worse); each character that does not print is now shown escaped, as Python writes it."""
    writer = subprocess.Popen(
        ["sleep", "600"], stdout=subprocess.PIPE, stdin=subprocess.DEVNULL, start_new_session=True
    )
    named = (
        "import sys, time; open('/proc/self/comm', 'w').write('\\x1b]0;owned\\x07RED'); "
        "print(1, flush=True); time.sleep(600)"
    )
    reader = subprocess.Popen(
        [sys.executable, "-c", named], stdin=writer.stdout, stdout=subprocess.PIPE, start_new_session=True
    )
    try:
        assert writer.stdout is not None and reader.stdout is not None
        writer.stdout.close()  # (its reader is the named process alone)
        reader.stdout.readline()
        said = tpagent("dump", str(writer.pid), "--out", str(tmp_path / "s"))
        assert_one_sentence_error(said, f"that PID {reader.pid} (\\x1b]0;owned\\x07RED) outside its tree reads")
        assert "\x1b" not in said.stderr and "\x07" not in said.stderr
    finally:
        for p in (writer, reader):
            p.kill()
            p.wait()
        assert reader.stdout is not None
        reader.stdout.close()


def test_inspect_shows_no_escape_sequence_a_user_put_in_a_command_line(snapshot_dir: Path, tmp_path: Path) -> None:
    """A process's command line is its user's choice (`exec -a`): an escape sequence in it (here
    one that sets the terminal's title) reached root's terminal as it was."""
    snap = _copy(snapshot_dir, tmp_path)
    processes = _manifest(snap)["processes"]
    processes[0]["cmdline"] = ["python", "\x1b]0;pwned\x07train.py", "\x1b[2J"]
    _edit(snap, processes=processes)
    said = tpagent("inspect", str(snap))
    assert said.returncode == 0, said.stderr
    assert "\x1b" not in said.stdout and "\x07" not in said.stdout and "train.py" in said.stdout, said.stdout


def test_a_launch_log_refused_in_a_users_directory_leaves_nothing_of_roots_there(tmp_path: Path) -> None:
    """Root does not write its workload's log in a directory another user owns (they could swap
    the file); it refused only once it had made the file, and the empty root file stayed."""
    theirs = tmp_path / "theirs"
    theirs.mkdir()
    os.chmod(tmp_path, 0o755)
    os.chown(theirs, 65534, 65534)
    said = tpagent("launch", "--stdout", str(theirs / "new.log"), "--", "sleep", "1")
    assert_one_sentence_error(said, str(theirs / "new.log"))
    assert list(theirs.iterdir()) == []


def test_a_host_name_of_no_encoding_and_a_bad_listen_address_are_said_before_anything_is_made(
    snapshot_dir: Path, tmp_path: Path
) -> None:
    """A host of bytes no encoding reads (a shell passes them) ended `send` in "unexpected error
    (UnicodeError ...)" and `receive --listen` in one of a TypeError; and `receive` made --out's
    parent directories before it found its --listen address bad."""
    secret = _secret(tmp_path)
    said = tpagent("send", str(snapshot_dir), "\udcff:7411", "--secret-file", str(secret), "--plaintext")
    assert_one_sentence_error(said, "'\\udcff:7411' names no host: a host name is text DNS can hold")
    assert said.returncode == 2
    out = tmp_path / "made" / "snap"
    for listen, says in (("\udcff:0", "names no host"), ("127.0.0.1:99999", "is not HOST:PORT")):
        args = ("--listen", listen, "--out", str(out), "--secret-file", str(secret), "--plaintext")
        said = tpagent("receive", *args, "--timeout", "5")
        assert_one_sentence_error(said, says)
        assert said.returncode == 2 and not out.parent.exists()
