"""Node-local files, shared files, free space and ports across a migration between agents on
"nodes" (network namespaces).  Each node's agent here has a filesystem of its own at
/etc/tpagent-local (a tmpfs mounted in its mount namespace only, where its workloads are
launched and its CRIU runs): a file there is node-local as on real nodes, while the rest of
this machine's filesystem is shared by all test nodes."""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import stat
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from conftest import needs_criu
from support.cluster import Cluster, Node, Ticker
from support.helpers import ROOT, STATEFUL, kill_and_wait, wait_until

pytestmark = needs_criu

LOCAL = Path("/etc/tpagent-local")
NOBODY = 65534  # (its group too: nogroup)


def local_dir(node: Node) -> Path:
    """Where ``node``'s /etc/tpagent-local lies, as seen from outside the node."""
    assert node.agent is not None
    return Path(f"/proc/{node.agent.pid}/root") / LOCAL.relative_to("/")


def _with_local_fs(node: Node) -> None:
    """Start the node's agent in a mount namespace with a tmpfs of its own at LOCAL."""
    plain = node.exec
    mount = f'mount -t tmpfs -o size=512m,mode=755 tpagent-local {LOCAL} && exec "$@"'
    node.exec = lambda *args: plain("sh", "-c", mount, "sh", *args)  # type: ignore[method-assign]
    try:
        node.start_agent()
    finally:
        node.exec = plain  # type: ignore[method-assign]


@pytest.fixture
def cluster(tmp_path: Path) -> Iterator[Cluster]:
    c = Cluster(tmp_path, ["A", "B"])
    LOCAL.mkdir(mode=0o755, exist_ok=True)  # (the mount point; each agent mounts its own there)
    try:
        for node in c.nodes.values():
            _with_local_fs(node)
        yield c
    finally:
        c.close()


def launch(node: Node, tmp: Path, mib: int, *extra: str, cwd: Path | None = None) -> Ticker:
    """A stateful workload launched on ``node`` (working in ``cwd``, a path on the node)."""
    t = Ticker(tmp / f"w-{uuid.uuid4().hex[:6]}.log")
    assert node.agent is not None
    # Launched where its agent runs (its network and mount namespaces), without the machine's
    # /run/netns: other test runs add and remove namespaces there all the time, and a mount
    # gone between the dump and the restore fails the restore (CRIU rebuilds every mount).
    out = subprocess.run(
        [
            "nsenter",
            "-t",
            str(node.agent.pid),
            "-m",
            "-n",
            "unshare",
            "-m",
            "--propagation",
            "private",
            "sh",
            "-c",
            'umount -l /run/netns 2>/dev/null; cd "$WORK" && exec "$@"',
            "sh",
            sys.executable,
            "-m",
            "cli.main",
            "launch",
            "--stdout",
            str(tmp / "w.out"),
            "--",
            sys.executable,
            str(STATEFUL),
            str(t.log),
            str(mib),
            *extra,
        ],
        cwd=ROOT,
        env={**os.environ, "WORK": str(cwd or ROOT), "PYTHONPATH": str(ROOT)},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    t.pid = int(out.stdout)
    wait_until(lambda: len(t.ticks()) > 5, "the workload to tick", 120)
    return t


def lines(t: Ticker, kind: str) -> list[list[str]]:
    return [ln.split()[1:] for ln in t.log.read_text().splitlines() if ln.startswith(kind + " ")]


def verify(t: Ticker) -> None:
    """The workload's memory, and what it reads back from its files, are as they were."""
    kinds = [k for k in ("scratch", "shm", "listened") if lines(t, k) or (k == "listened" and lines(t, "listen"))]
    before = [len(lines(t, k)) for k in kinds]
    t.verify_state()
    wait_until(lambda: all(len(lines(t, k)) > n for k, n in zip(kinds, before, strict=True)), "the files' lines")


def migrate(cluster: Cluster, t: Ticker, src: str, dst: str) -> None:
    proc = cluster.migrate(t.pid, src, dst, "--json")
    assert proc.returncode == 0, proc.stdout + proc.stderr + cluster.nodes[dst].agent_log()[-3000:]
    doc = json.loads(proc.stdout)
    assert doc["state"] == "done", doc
    t.pid = doc["new_pid"]
    t.assert_one_copy_continuous()


def refused_before_the_freeze(cluster: Cluster, t: Ticker, said: str) -> None:
    """The move of ``t`` from A to B is refused in one sentence holding ``said``, as its dry run
    says too, and the workload was never frozen."""
    dry = cluster.migrate(t.pid, "A", "B", "--dry-run", "--json")
    assert dry.returncode == 1 and any(said in p for p in json.loads(dry.stdout)["problems"]), dry.stdout
    proc = cluster.migrate(t.pid, "A", "B", "--json")
    doc = json.loads(proc.stdout)
    assert proc.returncode == 1 and doc["state"] == "failed" and said in doc["message"], doc
    assert "\n" not in doc["message"]
    t.assert_one_copy_continuous()  # never frozen


def test_node_local_files_go_there_and_back(cluster: Cluster, tmp_path: Path) -> None:
    """A scratch file the workload keeps open and a file it only maps (mmap + close: no fd,
    as shm_open segments are) live in A's own directory.  Both travel to B (the mapped one
    was once left behind: the restore failed), and back to A, where the stale copies the
    first move left behind (the mapped file has changed since) are replaced, not in the way."""
    a = cluster.nodes["A"]
    b = cluster.nodes["B"]
    name = uuid.uuid4().hex[:6]
    scratch = LOCAL / f"scratch-{name}"
    shm = LOCAL / f"shm-{name}"
    t = launch(a, tmp_path, 16, "--scratch", str(scratch), "4", "--shm", str(shm))
    try:
        wait_until(lambda: lines(t, "scratch") and lines(t, "shm"), "the workload to report its files")
        scratch_digest = lines(t, "scratch")[0][0]
        _, shm_digest = lines(t, "shm")[0]
        migrate(cluster, t, "A", "B")
        verify(t)
        assert lines(t, "scratch")[-1][0] == scratch_digest
        counter, digest = lines(t, "shm")[-1]
        assert digest == shm_digest and int(counter) > 0  # the mapping came back with its bytes, and goes on
        on_b = (local_dir(b) / shm.name).read_bytes()
        assert int.from_bytes(on_b[:8], "little") >= int(counter)  # B's own file is the one it writes now
        stale = (local_dir(a) / shm.name).read_bytes()  # A's copy, as it was when the workload left

        migrate(cluster, t, "B", "A")
        verify(t)
        assert lines(t, "scratch")[-1][0] == scratch_digest
        back, digest = lines(t, "shm")[-1]
        assert digest == shm_digest and int(back) > int(counter)
        now = (local_dir(a) / shm.name).read_bytes()
        assert now != stale and int.from_bytes(now[:8], "little") >= int(back)  # replaced, and written on
    finally:
        kill_and_wait(t.pid)


def test_a_socket_listening_in_a_node_local_directory_listens_there(cluster: Cluster, tmp_path: Path) -> None:
    """As every DataLoader worker does (multiprocessing's pymp-XXXX/listener-XXXX), the workload
    listens on a unix socket in a private directory it made in node-local storage.  Its copy
    listens at the same path on B, in a directory made as A's was (owner, mode), and answers
    there; and back on A, where the original's socket file was left behind."""
    a = cluster.nodes["A"]
    b = cluster.nodes["B"]
    t = launch(a, tmp_path, 8, "--listen", str(LOCAL))
    try:
        wait_until(lambda: lines(t, "listen"), "the workload to listen")
        path = Path(lines(t, "listen")[0][0])
        where = path.relative_to(LOCAL)
        on_a = os.lstat(local_dir(a) / where.parent)
        migrate(cluster, t, "A", "B")
        verify(t)
        assert lines(t, "listened")[-1] == [str(path), "1"]
        made = os.lstat(local_dir(b) / where.parent)
        assert (made.st_uid, made.st_gid, made.st_mode) == (on_a.st_uid, on_a.st_gid, on_a.st_mode)
        assert stat.S_ISSOCK(os.lstat(local_dir(b) / where).st_mode)

        migrate(cluster, t, "B", "A")
        verify(t)
        assert lines(t, "listened")[-1] == [str(path), "2"]
    finally:
        kill_and_wait(t.pid)


def test_a_dropped_copy_takes_what_its_restore_made_and_the_next_move_goes_there(
    cluster: Cluster, tmp_path: Path
) -> None:
    """The copy on B dies before its migration is confirmed: it is dropped and the original
    runs on at A.  What its restore made on B goes with it: the scratch file and the mapped
    file it was given, its socket and the directory it listens in (left there, the mapped file,
    which the original has written to since, would refuse the next move to B as "other
    content").  The next move to B then works, with the original's current bytes."""
    a = cluster.nodes["A"]
    b = cluster.nodes["B"]
    name = uuid.uuid4().hex[:6]
    scratch = LOCAL / f"scratch-{name}"
    shm = LOCAL / f"shm-{name}"
    needed = LOCAL / f"needed-{name}"
    (local_dir(a) / needed.name).write_text("A's own\n")  # (the copy on B lacks it: it dies at once)
    t = launch(
        a,
        tmp_path,
        8,
        "--scratch",
        str(scratch),
        "2",
        "--shm",
        str(shm),
        "--listen",
        str(LOCAL),
        "--needs",
        str(needed),
    )
    try:
        wait_until(lambda: lines(t, "shm") and lines(t, "listen"), "the workload to report its files")
        before = sorted(os.listdir(local_dir(b)))
        proc = cluster.migrate(t.pid, "A", "B", "--json")
        doc = json.loads(proc.stdout)
        assert proc.returncode != 0 and doc["state"] == "rolled_back", proc.stdout + proc.stderr
        assert "confirmation period" in doc["message"], doc  # (it died on B: restored, then dropped)
        t.assert_one_copy_continuous()
        assert sorted(os.listdir(local_dir(b))) == before, "the dropped copy's files were left on B"

        (local_dir(b) / needed.name).write_text("B's own\n")
        migrate(cluster, t, "A", "B")  # (the mapped file is not what B was given the first time)
        verify(t)
        assert lines(t, "listened")[-1] == [lines(t, "listen")[0][0], "1"]
    finally:
        kill_and_wait(t.pid)


def test_a_carried_file_is_put_back_in_a_directory_made_as_its_owner_s_was(cluster: Cluster, tmp_path: Path) -> None:
    """The scratch file is nobody's, in a directory of nobody's (mode 710) in node-local storage:
    on B that directory is made as it was on A (before, it was made root's, 755)."""
    a = cluster.nodes["A"]
    b = cluster.nodes["B"]
    own = LOCAL / f"own-{uuid.uuid4().hex[:6]}"
    (local_dir(a) / own.name).mkdir()
    t = launch(a, tmp_path, 8, "--scratch", str(own / "scratch"), "1")
    try:
        wait_until(lambda: lines(t, "scratch"), "the workload to report its scratch file")
        os.chown(local_dir(a) / own.name / "scratch", NOBODY, NOBODY)
        os.chown(local_dir(a) / own.name, NOBODY, NOBODY)
        os.chmod(local_dir(a) / own.name, 0o710)
        migrate(cluster, t, "A", "B")
        verify(t)
        made = os.lstat(local_dir(b) / own.name)
        put = os.lstat(local_dir(b) / own.name / "scratch")
        assert (made.st_uid, made.st_gid, stat.S_IMODE(made.st_mode)) == (NOBODY, NOBODY, 0o710)
        assert (put.st_uid, put.st_gid) == (NOBODY, NOBODY)
    finally:
        kill_and_wait(t.pid)


def test_a_stale_copy_someone_changed_is_never_replaced(cluster: Cluster, tmp_path: Path) -> None:
    """The copy left on A is changed after the workload left (someone else's write): coming
    back, the migration is refused in one sentence naming the file, the workload runs on at B,
    and the changed file on A is untouched."""
    a = cluster.nodes["A"]
    shm = LOCAL / f"shm-{uuid.uuid4().hex[:6]}"
    t = launch(a, tmp_path, 16, "--shm", str(shm))
    try:
        migrate(cluster, t, "A", "B")
        with open(local_dir(a) / shm.name, "r+b") as f:  # (same size: only its change time tells)
            f.seek(4096)
            f.write(b"someone else's bytes")
        changed = (local_dir(a) / shm.name).read_bytes()
        proc = cluster.migrate(t.pid, "B", "A", "--json")
        assert proc.returncode == 1
        doc = json.loads(proc.stdout)
        assert doc["state"] == "rolled_back" and f"{shm} exists on this node with other content" in doc["message"]
        assert (local_dir(a) / shm.name).read_bytes() == changed
        t.assert_one_copy_continuous()  # on B, where it stood
        t.verify_state()
    finally:
        kill_and_wait(t.pid)


def test_a_file_that_cannot_be_taken_along_is_refused_before_the_freeze(cluster: Cluster, tmp_path: Path) -> None:
    """The workload's scratch file (root's) lies in a directory of nobody's, who could have put
    it there: the check refuses the move in one sentence naming it (the dry run lists it), and
    nothing is frozen (once it was the post-dump hook, with CRIU's lines)."""
    import pwd

    a = cluster.nodes["A"]
    theirs = local_dir(a) / "nobodys"
    theirs.mkdir()
    os.chown(theirs, pwd.getpwnam("nobody").pw_uid, -1)
    scratch = LOCAL / "nobodys" / "scratch"
    t = launch(a, tmp_path, 16, "--scratch", str(scratch), "1")
    try:
        refused_before_the_freeze(cluster, t, f"{scratch} belongs to UID 0 but its directory to UID")
    finally:
        kill_and_wait(t.pid)


def _mount_on(node: Node, vol: Path, lib: bool) -> None:
    """A tmpfs at ``vol`` on ``node`` alone (in its own filesystem, its agent's mount namespace),
    another beneath it (as a container's overlay has its /dev), and in it, with ``lib``, a file."""
    assert node.agent is not None
    script = f"mkdir {vol} && mount -t tmpfs pod {vol} && mkdir {vol}/dev && mount -t tmpfs pod-dev {vol}/dev"
    script += f" && head -c 65536 /dev/urandom > {vol}/lib.so" if lib else ""
    subprocess.run(["nsenter", "-t", str(node.agent.pid), "-m", "sh", "-c", script], check=True, timeout=30)


def test_a_mount_the_target_lacks_is_left_behind_when_the_workload_holds_nothing_in_it(
    cluster: Cluster, tmp_path: Path
) -> None:
    """A's own mounts (a container's overlay, a pod's volume, a session's /run/user) are in the
    namespace of a workload launched there; CRIU binds each back at its path, so a restore on B,
    which lacks them, failed and every such move rolled back, though its dry run passed.  The
    dump leaves out those B lacks that the workload holds nothing in, and says so; on B it runs on
    without them."""
    vol = LOCAL / f"pod-{uuid.uuid4().hex[:6]}"
    _mount_on(cluster.nodes["A"], vol, lib=False)
    t = launch(cluster.nodes["A"], tmp_path, 16)
    try:
        assert f" {vol}/dev " in Path(f"/proc/{t.pid}/mountinfo").read_text()
        dry = cluster.migrate(t.pid, "A", "B", "--dry-run", "--json")
        assert dry.returncode == 0, dry.stdout + dry.stderr
        said = " ".join(json.loads(dry.stdout)["checked"])
        assert (
            "goes without 2 mount(s) of the process's namespace that the target lacks" in said and str(vol) in said
        ), said
        migrate(cluster, t, "A", "B")
        verify(t)
        assert str(vol) not in Path(f"/proc/{t.pid}/mountinfo").read_text()
    finally:
        kill_and_wait(t.pid)


def test_a_mount_the_target_lacks_holding_a_file_the_move_carries_is_made_there(
    cluster: Cluster, tmp_path: Path
) -> None:
    """The workload maps a file shared from a mount B lacks: the file is carried, and put back on
    B in directories made for it, where CRIU binds the mount point; the mount beneath, which the
    workload holds nothing in, is left out."""
    vol = LOCAL / f"pod-{uuid.uuid4().hex[:6]}"
    _mount_on(cluster.nodes["A"], vol, lib=True)
    t = launch(cluster.nodes["A"], tmp_path, 16, "--map", str(vol / "lib.so"))
    try:
        lib = (local_dir(cluster.nodes["A"]) / vol.name / "lib.so").read_bytes()
        migrate(cluster, t, "A", "B")
        verify(t)
        assert (local_dir(cluster.nodes["B"]) / vol.name / "lib.so").read_bytes() == lib
        mounted = Path(f"/proc/{t.pid}/mountinfo").read_text()
        assert f" {vol} " in mounted and f" {vol}/dev " not in mounted, mounted
    finally:
        kill_and_wait(t.pid)


def test_a_mount_the_target_lacks_that_the_workload_works_in_is_refused_before_the_freeze(
    cluster: Cluster, tmp_path: Path
) -> None:
    """The workload's working directory is in a mount B lacks (nothing a migration carries): the
    move is refused in one sentence naming it before anything stops, as its dry run says."""
    vol = LOCAL / f"pod-{uuid.uuid4().hex[:6]}"
    _mount_on(cluster.nodes["A"], vol, lib=False)
    t = launch(cluster.nodes["A"], tmp_path, 16, cwd=vol)
    try:
        refused_before_the_freeze(cluster, t, f"the process holds {vol} in the mount at {vol}, which the target lacks")
    finally:
        kill_and_wait(t.pid)


_MAPS_IT = (
    "import mmap, sys\n"
    "with open(sys.argv[1], 'r+b') as f:\n"
    "    m = mmap.mmap(f.fileno(), 4096)\n"  # (shared, and writable: a consumer posting back)
    "print('mapped', flush=True); sys.stdin.read()\n"
)


def test_a_file_whose_name_is_not_utf8_is_refused_before_the_freeze(cluster: Cluster, tmp_path: Path) -> None:
    """A migration names the files it checks and carries in UTF-8: one whose name is not (bytes
    a Latin-1 tool wrote) failed the move with "internal error: surrogates not allowed", and a
    sentence naming it could not reach the command.  It is refused in one sentence, the name
    escaped, before anything stops."""
    scratch = LOCAL / os.fsdecode(b"scratch-\xe9t\xe9")
    t = launch(cluster.nodes["A"], tmp_path, 16, "--scratch", str(scratch), "1")
    try:
        refused_before_the_freeze(cluster, t, "scratch-\\udce9t\\udce9, whose name is not UTF-8")
    finally:
        kill_and_wait(t.pid)


def test_a_node_local_file_mapped_shared_with_a_process_outside_is_refused_before_the_freeze(
    cluster: Cluster, tmp_path: Path
) -> None:
    """The workload's shared mapping of a node-local file (a /dev/shm segment) is mapped by a
    process outside its tree too: the copy on B would map a copy of the file, the two no longer
    meeting.  The move is refused in one sentence naming both (the dry run lists it), before
    anything is frozen; once that process is gone the same workload moves."""
    a = cluster.nodes["A"]
    assert a.agent is not None
    shm = LOCAL / f"shm-{uuid.uuid4().hex[:6]}"
    t = launch(a, tmp_path, 16, "--shm", str(shm))
    try:
        with subprocess.Popen(
            ["nsenter", "-t", str(a.agent.pid), "-m", sys.executable, "-c", _MAPS_IT, str(shm)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        ) as other:
            try:
                assert other.stdout is not None and other.stdout.readline() == "mapped\n"
                refused_before_the_freeze(cluster, t, f"maps {shm} shared with PID {other.pid} (python")
            finally:
                other.kill()
        migrate(cluster, t, "A", "B")  # (that process gone)
        verify(t)
    finally:
        kill_and_wait(t.pid)


def vm_hwm(node: Node) -> int:
    assert node.agent is not None
    status = Path(f"/proc/{node.agent.pid}/status").read_text()
    return int(re.search(r"VmHWM:\s+(\d+) kB", status).group(1)) << 10  # type: ignore[union-attr]


def test_a_large_carried_file_is_streamed_and_counted(cluster: Cluster, tmp_path: Path) -> None:
    """A 200 MiB node-local file: the target reserves room for it (the dry run says so), and
    receives and puts it back in bounded pieces: its agent's peak memory grows far less than
    the file."""
    a = cluster.nodes["A"]
    b = cluster.nodes["B"]
    scratch = LOCAL / f"big-{uuid.uuid4().hex[:6]}"
    t = launch(a, tmp_path, 8, "--scratch", str(scratch), "200")
    try:
        wait_until(lambda: lines(t, "scratch"), "the workload to report its file")
        dry = cluster.migrate(t.pid, "A", "B", "--dry-run")
        assert dry.returncode == 0, dry.stderr
        reserved = re.search(r"reserves (\d+) MiB in .* with (\d+) carried file\(s\) of (\d+) MiB", dry.stderr)
        assert reserved is not None, dry.stderr
        assert int(reserved.group(3)) >= 200 and int(reserved.group(1)) >= 200  # the file is counted
        before = vm_hwm(b)
        source = vm_hwm(a)
        migrate(cluster, t, "A", "B")
        grown = vm_hwm(b) - before
        print(f"peak memory grew by {grown >> 20} MiB on B, {(vm_hwm(a) - source) >> 20} MiB on A, for a 200 MiB file")
        assert grown < 100 << 20, f"the target agent's peak memory grew by {grown >> 20} MiB"
        verify(t)
        assert lines(t, "scratch")[-1][0] == lines(t, "scratch")[0][0]
    finally:
        kill_and_wait(t.pid)


def test_a_work_dir_without_room_refuses_before_anything_freezes(cluster: Cluster, tmp_path: Path) -> None:
    """B's work directory is a 64 MiB tmpfs; the workload holds 256 MiB.  The dry run names
    the shortage, and the migration fails at admission: the workload never stops."""
    b = cluster.nodes["B"]
    b.kill_agent(signal.SIGTERM)
    work = b.work / "agent"
    work.mkdir(mode=0o700, exist_ok=True)
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64m,mode=700", "tpagent-test", str(work)], check=True)
    try:
        b.start_agent()
        t = launch(cluster.nodes["A"], tmp_path, 256)
        try:
            dry = cluster.migrate(t.pid, "A", "B", "--dry-run", "--json")
            assert dry.returncode == 1
            doc = json.loads(dry.stdout)
            assert any("work directory" in p and "MiB free" in p for p in doc["problems"]), doc
            assert any(re.search(r"reserves \d+ MiB in .* \(\d+ MiB free\)", c) for c in doc["checked"]), doc
            proc = cluster.migrate(t.pid, "A", "B", "--json")
            assert proc.returncode == 1
            doc = json.loads(proc.stdout)
            assert doc["state"] == "failed" and "No space left on device" in doc["message"], doc
            t.assert_one_copy_continuous()  # never frozen
            t.verify_state()
        finally:
            kill_and_wait(t.pid)
    finally:
        b.kill_agent(signal.SIGTERM)
        subprocess.run(["umount", "-l", str(work)], check=False)


def test_a_second_migration_waits_for_the_room_of_the_first(cluster: Cluster, tmp_path: Path) -> None:
    """With max_incoming = 1, a second migration to B while the first is in flight is refused
    in its check (it would not fit beside it); the first goes through."""
    b = cluster.nodes["B"]
    b.kill_agent(signal.SIGTERM)
    b.start_agent(max_incoming="1")
    first = launch(cluster.nodes["A"], tmp_path, 768)
    second = launch(cluster.nodes["A"], tmp_path, 16)
    try:
        mig = cluster.start_migrate(first.pid, "A", "B", "--json")
        wait_until(lambda: cluster.receiving("B", 1), "the first migration to arrive on B")
        proc = cluster.migrate(second.pid, "A", "B", "--dry-run", "--json")
        assert proc.returncode == 1 and any("max_incoming" in p for p in json.loads(proc.stdout)["problems"])
        out, err = mig.communicate(timeout=300)
        assert mig.returncode == 0, err
        first.pid = json.loads(out)["new_pid"]
        first.assert_one_copy_continuous()
        second.assert_one_copy_continuous()
        migrate(cluster, second, "A", "B")  # its room is free again
    finally:
        kill_and_wait(first.pid)
        kill_and_wait(second.pid)


def test_a_growing_log_on_a_shared_path_does_not_fail_the_check(cluster: Cluster, tmp_path: Path) -> None:
    """The workload appends to its log on a shared path every 20 ms: the check no longer
    compares its size between the nodes (it changes as the process runs; CRIU holds it against
    the size at the freeze), so the migration goes through, and the log goes on in place."""
    shared = tmp_path / "shared"
    shared.mkdir()
    for node in cluster.nodes.values():
        node.kill_agent(signal.SIGTERM)
        node.start_agent(shared_paths=str(shared))
    t = launch(cluster.nodes["A"], shared, 16)
    try:
        for src, dst in (("A", "B"), ("B", "A"), ("A", "B")):
            migrate(cluster, t, src, dst)
        t.verify_state()
    finally:
        kill_and_wait(t.pid)


def test_a_lock_on_a_shared_file_is_refused_in_one_sentence_before_anything_stops(
    cluster: Cluster, tmp_path: Path
) -> None:
    """The workload holds a flock on a file of a shared path, which the target sees too: its
    copy's restore would wait for ever behind the frozen original's lock (both journals once
    stayed `restoring` for over 12 minutes).  The dry run names the file and the holder, the
    move is refused the same way, and the workload never stops."""
    shared = tmp_path / "shared"
    shared.mkdir()
    for node in cluster.nodes.values():
        node.kill_agent(signal.SIGTERM)
        node.start_agent(shared_paths=str(shared))
    lock = shared / "checkpoint.lock"
    t = launch(cluster.nodes["A"], tmp_path, 16, "--lock", str(lock))
    try:
        for extra in (("--dry-run",), ()):
            proc = cluster.migrate(t.pid, "A", "B", "--json", *extra)
            assert proc.returncode == 1, proc.stdout + proc.stderr
            said = " ".join([json.loads(proc.stdout)["message"], *json.loads(proc.stdout)["problems"]])
            assert f"holds a flock lock on {lock}" in said and "release it before migrating" in said, said
        t.assert_one_copy_continuous()
    finally:
        kill_and_wait(t.pid)


def _listening(address: str) -> bool:
    host, port = address.rsplit(":", 1)
    try:
        socket.create_connection((host, int(port)), timeout=2).close()
    except OSError:
        return False
    return True


def test_a_fixed_transfer_port_is_freed_when_the_source_never_comes(cluster: Cluster, tmp_path: Path) -> None:
    """A source is admitted on B (fixed transfer_port) and vanishes before it sends a byte: B
    frees the port after io_timeout, not after hold_timeout (an hour), and a later migration
    uses it."""
    from tpagent.common.credentials import Credentials
    from tpagent.daemon.rpc import pb, stub

    a = cluster.nodes["A"]
    b = cluster.nodes["B"]
    b.kill_agent(signal.SIGTERM)
    b.start_agent(transfer_port="7411", io_timeout="3")
    creds = Credentials.load(cluster.secret, a.tls)
    reply = stub(b.agent_address, creds).Receive(
        pb.ReceiveRequest(
            migration_id=uuid.uuid4().hex,
            source_node="gone",
            bytes_estimate=1 << 20,
            source_agent=f"{cluster.bridge_addr}:1",
        ),
        timeout=30,
    )
    assert reply.transfer_address.endswith(":7411") and not reply.problems
    assert _listening(reply.transfer_address)
    wait_until(lambda: not _listening(reply.transfer_address), "B to free its transfer port", 60)
    t = launch(a, tmp_path, 16)
    try:
        migrate(cluster, t, "A", "B")
        t.verify_state()
    finally:
        kill_and_wait(t.pid)
