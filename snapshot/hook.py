"""CRIU's post-dump action: seal the snapshot while the tree is still frozen.

CRIU runs this (through the wrapper :func:`install` writes) at each action of a dump; at
``post-dump`` the images are complete and every task is still frozen.  It then archives the
carried files (read as root, so never through a symlink and only from a directory owned by
root or by the file's owner: see :mod:`host.safefs`), checksums and fsyncs the images,
reads the frozen process tree and writes ``manifest.json``; a dump whose queued unix messages
carry descriptors, which CRIU does not bring back whole, it refuses (:mod:`snapshot.skqueues`).  If it
fails, CRIU rolls the dump back itself: it resumes the tree and lifts its network lock
(which SIGCONT alone cannot do for TCP connections), so the workload runs on where it stood.

Inputs come through the environment, never through the command line CRIU hands to sh:
TPAGENT_HOOK_OUT (the snapshot directory), TPAGENT_HOOK_ROOT (the dumped PID),
TPAGENT_HOOK_ROOT_START (its start, see :func:`seal`), TPAGENT_HOOK_STREAMED (CRIU streamed its
images: their digests come from the capture), TPAGENT_HOOK_FAIL (tests: fail after the
checksums).  Errors go to ``log/hook.err``.

With TPAGENT_HOOK_HOLD (seconds), the hook then holds the sealed, frozen tree until a
decision appears in ``log/decision`` (:func:`decide`): ``commit`` lets CRIU finish the dump
as asked, ``abort`` (or a cancel, or no decision in time) makes CRIU roll back.  Once
pinned (:func:`pin`: a copy may run elsewhere) only a decision ends the wait, and a SIGSTOP
queued to the tree keeps it from running should CRIU or the hook die (CRIU lets the tree go as
it dies; the hook then ends too: no decision can reach it): the pinner, which knows whether the
copy runs, resumes it or ends it.  A migration holds the original this way until its copy runs
elsewhere.

While the tree is frozen the hook also checks that its root is the very process the dump was
asked for (its start time: a PID reused meanwhile is refused, and CRIU rolls back), and notes
what CRIU does not bring back intact (:mod:`snapshot.timers`, :func:`host.criu_limits.restore_warnings`).
"""

from __future__ import annotations

import contextlib
import json
import os
import shlex
import signal
import stat
import sys
import tarfile
import tempfile
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

import psutil

from host import criu_limits, ends, files, proc, reopened, safefs, signals, sockets
from snapshot import affinity, manifest, skqueues, streamer, timers
from snapshot.criu import started_in

PENDING = "manifest.pending.json"
ERROR_FILE = "hook.err"
#: Created (in log/) when the user interrupts the checkpoint: the hook then fails on purpose.
CANCEL_FILE = "cancel"
DECISION_FILE = "decision"
#: Written (in log/) once the snapshot is sealed and the hook holds the tree.
HELD_FILE = "held"
PINNED_FILE = "pinned"
PINNED_ACK = "pinned.ack"
#: How ``hook.err`` starts when the frozen root is not the process that was examined (its PID reused).
NOT_THE_PROCESS = "NotTheProcess"


class NotTheProcess(RuntimeError):
    """The PID CRIU froze is no longer the process the dump was asked for."""


#: Written (in log/) as the carried files are archived: each one's :func:`identity`.
CARRIED_IDS = "carried.json"
#: The pending manifest's key for :attr:`~snapshot.api.SnapshotConfig.carry_opened`.
OPENED = "carry_opened"
#: The pending manifest's key of the most bytes the carried files may hold (SnapshotConfig.carry_most).
MOST = "carry_most"


#: A decision's words, made (empty) as the hook begins to hold: :func:`decide` renames one into place.
WORDS = {True: "decision.commit", False: "decision.abort"}


def decide(out: Path, commit: bool) -> None:
    """Tell a holding hook what to do with the frozen tree (atomic: renamed into place).  Its
    word, made as the hook began to hold, needs no room on a disk full since (a decision written
    then failed, and the original stayed frozen for ever); before the hold, one is written.  A
    decision made stands: a later one is not said (the hook acts on the first)."""
    if decided(out) is not None:
        return
    with contextlib.suppress(FileNotFoundError):  # (not held yet, or that word said already)
        os.rename(out / "log" / WORDS[commit], out / "log" / DECISION_FILE)
        return
    tmp = out / "log" / (DECISION_FILE + ".tmp")
    tmp.write_text("commit" if commit else "abort")
    tmp.rename(out / "log" / DECISION_FILE)


def pin(out: Path, alive: Callable[[], bool], seconds: float = 30.0) -> bool:
    """From now on the hook waits for a decision however long it takes: a copy of the tree
    may be running elsewhere, and resuming the original on a timeout could make two.  True
    once the holding hook has seen it; False if it did not (``alive()`` turned False: the
    hook, or CRIU, already let the tree go), and then no copy may be started."""
    (out / "log" / PINNED_FILE).touch()
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline and alive():
        if (out / "log" / PINNED_ACK).exists():
            return True
        time.sleep(0.01)
    return False


def decided(out: Path) -> str | None:
    """The decision :func:`decide` made ("commit" or "abort"); None if none was made yet."""
    try:
        said = (out / "log" / DECISION_FILE).read_text()
    except FileNotFoundError:
        return None
    return said or ("abort" if (out / "log" / WORDS[True]).exists() else "commit")  # (a word renamed)


def may_run(out: Path) -> bool:
    """Whether the tree of a dump that failed may run again: it was never pinned (no copy of it
    can have started), or its pinner said abort."""
    return not (out / "log" / PINNED_FILE).exists() or decided(out) == "abort"


def hold(out: Path, seconds: float, root: int, start: int | None) -> None:
    """Wait for :func:`decide`; anything but a commit raises, which makes CRIU roll back.

    Once pinned, a SIGSTOP is queued to every process of the frozen tree of ``root`` (started
    at ``start``): while CRIU holds them it waits, and should CRIU or this hook die, the tree it
    lets go stops at once instead of running beside its copy.  Only then is the pin acknowledged
    (never, if the tree could not be held so: its pinner then starts no copy).  An abort takes
    the stop back (a SIGCONT, while the tree is still held, removes it) before CRIU rolls back,
    which stops again what it found stopped; a commit needs nothing."""
    for word in WORDS.values():
        (out / "log" / word).touch()
    (out / "log" / HELD_FILE).touch()
    deadline = time.monotonic() + seconds
    criu = started_in(out / "log")  # (the CRIU that runs this hook; None if it cannot be told)
    stopped = False
    while (said := decided(out)) is None:
        if criu is not None and _gone(criu):  # (killed: the tree was let go with it; no decision can reach it)
            raise RuntimeError("CRIU, which held the frozen tree, is gone: nothing left to hold")
        if (out / "log" / PINNED_FILE).exists():
            stopped = stopped or bool(signals.signal_tree(root, signal.SIGSTOP, start))
            if stopped:
                (out / "log" / PINNED_ACK).touch()  # the pinner waits for this before a copy may start
        else:
            _check_cancel(out)
            if time.monotonic() > deadline:
                raise RuntimeError(f"no decision within {seconds:.0f} s: rolled back")
        time.sleep(0.02)
    if said != "commit":
        if stopped:
            signals.signal_tree(root, signal.SIGCONT, start)
        raise RuntimeError("the migration was aborted: rolled back")


def _gone(p: psutil.Process) -> bool:
    try:
        return not p.is_running() or p.status() == psutil.STATUS_ZOMBIE  # (is_running: that very process)
    except psutil.NoSuchProcess:
        return True


def install(python: str = sys.executable) -> Path:
    """Write the wrapper CRIU will run; its path is made by mkdtemp (0700, ours), so sh sees
    nothing odd.  The hook runs isolated: ``python -I`` (no PYTHONPATH, no user site, no
    current directory on sys.path) from ``/``, never from the directory CRIU is in, and imports
    this very module from the tree it lives in (by its absolute path), so that the hook is
    always the code of the engine that installed it."""
    directory = Path(tempfile.mkdtemp(prefix="tpagent-hook-"))
    script = directory / "post-dump"
    root = Path(__file__).resolve().parent.parent
    run = "import sys; sys.path.insert(0, sys.argv[1]); from snapshot import hook; sys.exit(hook.main())"
    # CRIU runs it at every action (pre-dump, network-lock, ...): only post-dump and post-restore need Python.
    script.write_text(
        '#!/bin/sh\ncase "$CRTOOLS_SCRIPT_ACTION" in post-dump|post-restore) ;; *) exit 0 ;; esac\ncd / || exit 1\n'
        f"exec {shlex.quote(str(Path(python).absolute()))} -I -c {shlex.quote(run)} {shlex.quote(str(root))}\n"
    )
    script.chmod(0o700)
    return script


def _fsync_tree(directory: Path) -> None:
    for path in [*sorted(directory.iterdir()), directory, directory.parent]:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def _check_cancel(out: Path) -> None:
    """(CRIU rolls back on the hook's failure.)  Cancelled by the user (an empty file), or for the
    reason written in it (the dump ran out of time: :meth:`snapshot.criu.Criu.dump`)."""
    try:
        why = (out / "log" / CANCEL_FILE).read_text(errors="replace")[:500]
    except FileNotFoundError:
        return
    raise RuntimeError(why or "cancelled by the user (Ctrl-C)")


def cancelled(log_dir: Path) -> bool:
    """Whether the user cancelled the dump whose log is ``log_dir`` (not its time running out)."""
    try:
        return (log_dir / CANCEL_FILE).stat().st_size == 0
    except FileNotFoundError:
        return False


def identity(st: os.stat_result) -> list[int]:
    """What tells a file from any other, and from itself changed (:mod:`snapshot.leftovers`)."""
    return [st.st_dev, st.st_ino, st.st_size, st.st_ctime_ns]


def _archive(out: Path, paths: list[str], most: int | None = None) -> list[str]:
    """Copy the carried files, as they are while the tree is frozen, into the images: ``most``
    bytes at most (what a migration's target made room for: one grown or opened since its
    check, a file made sparse and huge, is refused rather than filling its disks).

    Each is opened without following any symlink and checked (:func:`safefs.open_to_read`),
    then archived from that same fd: what goes in is exactly the file that was checked.  A
    symlink on its path, or a directory owned by neither root nor the file's owner, raises:
    the dump is refused and rolled back."""
    kept = []
    total = 0
    ids: dict[str, list[int]] = {}  # as archived: how a committed migration knows what it left behind
    with tarfile.open(out / manifest.IMAGES_DIR / manifest.CARRIED_NAME, "w") as tar:
        for path in paths:
            fd = safefs.open_to_read(Path(path))
            if fd is None:  # deleted while open (CRIU keeps such files itself), or no regular file
                continue
            with os.fdopen(fd, "rb") as f:
                st = os.fstat(f.fileno())
                total += st.st_size  # (as it is written out there: whole, holes and all)
                if most is not None and total > most:
                    raise RuntimeError(
                        f"the files the process has open on this node, to take along, hold {total >> 20} MiB once it "
                        f"is frozen (with {path}), more than the {most >> 20} MiB the target made room for as it was "
                        "checked (a file grew, or was opened, since)"
                    )
                info = tarfile.TarInfo(path.lstrip("/"))
                info.size = st.st_size
                info.mtime = st.st_mtime
                info.mode = stat.S_IMODE(st.st_mode)
                info.uid = st.st_uid
                info.gid = st.st_gid
                tar.addfile(info, f)
                ids[path] = identity(os.fstat(f.fileno()))
            kept.append(path)
    (out / "log" / CARRIED_IDS).write_text(json.dumps(ids))
    return kept


def _relinks(pids: list[int]) -> tuple[list[str], dict[str, str]]:
    """The names CRIU gave the frozen tree's relinked files (``link_remap.N`` beside where each
    was: :class:`host.files.Relinked`), made node-independent: each becomes a link to the
    file's other name in that directory, carried with it (a POSIX semaphore's own name, which
    its other processes map); one with no other name there is carried itself.  The paths to
    carry, and the links (CRIU's name -> the other)."""
    by_dir: dict[Path, set[tuple[int, int]]] = {}
    for r in files.relinked(pids):
        by_dir.setdefault(Path(r.path).parent, set()).add((r.dev, r.ino))
    carry: list[str] = []
    links: dict[str, str] = {}
    for d, wanted in by_dir.items():
        fd = safefs.open_dir(d)
        try:
            names: dict[tuple[int, int], list[str]] = {}
            for name in sorted(os.listdir(fd)):  # (one look at the directory for all its files)
                if (key := _identity(fd, name)) in wanted:
                    names.setdefault(key, []).append(name)
        finally:
            os.close(fd)
        for found in names.values():
            others = [n for n in found if not files.LINK_REMAP.fullmatch(n)]
            for name in (n for n in found if files.LINK_REMAP.fullmatch(n)):
                if others:
                    links[str(d / name)] = str(d / others[0])
                carry.append(str(d / (others[0] if others else name)))
    return carry, links


def _identity(dir_fd: int, name: str) -> tuple[int, int] | None:
    """(device, inode) of the regular file ``name`` in ``dir_fd`` (None: none there)."""
    with contextlib.suppress(OSError):
        st = os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
        return (st.st_dev, st.st_ino) if stat.S_ISREG(st.st_mode) else None
    return None


def _unlinked(links: dict[str, str]) -> dict[str, str]:
    """CRIU's names of ``links`` taken off this node (the snapshot makes each again wherever it
    is restored, here too; kept here, a name would outlive a move for good): each only if it is
    still that very file.  ``links``."""
    for path, other in links.items():
        fd = safefs.open_dir(Path(path).parent, to=Path(path))
        try:
            name = os.path.basename(path)
            mine = _identity(fd, name)
            if mine is not None and mine == _identity(fd, os.path.basename(other)):
                os.unlink(name, dir_fd=fd)
        finally:
            os.close(fd)
    return links


def _bound(paths: list[str], pids: list[int]) -> list[manifest.BoundSocket]:
    """The socket files at ``paths`` with their owners: only those a process of the tree could
    have made (owned by one of their UIDs; /proc/net/unix prints names as they are, and a name
    may hold a newline).  One unlinked has none: CRIU restores it without."""
    uids = set()
    for pid in pids:
        with contextlib.suppress(OSError):
            uids.add(os.stat(f"/proc/{pid}").st_uid)
    out = []
    for path in paths:
        with contextlib.suppress(OSError):
            st = os.lstat(path)
            if stat.S_ISSOCK(st.st_mode) and st.st_uid in uids:
                out.append(manifest.BoundSocket(path, st.st_uid, st.st_dev, st.st_ino, st.st_ctime_ns))
    return out


def _owner(path: str) -> int:
    """The owner of the file at ``path`` (-1: none there)."""
    try:
        return os.lstat(path).st_uid
    except OSError:
        return -1


def _dirs_to(files: list[tuple[str, int]]) -> list[manifest.MadeDir]:
    """The directories on the way to each file of ``files`` (path, owner: the bound sockets,
    the carried files) that belong to its owner (those the process made: ``pymp-XXXX``; root's,
    such as /tmp, are every node's), parents first, as they are: what a restore elsewhere makes
    where missing.  A path through a symlink gets none (a restore there then fails as CRIU
    finds no directory, or puts the file back in a directory of root's; the original runs on)."""
    out: dict[str, manifest.MadeDir] = {}
    for path, uid in files:
        found = []
        for at in reversed(Path(path).parents[:-1]):  # (from the top; "/" is everywhere)
            try:
                st = os.lstat(at)
            except OSError:
                break
            if not stat.S_ISDIR(st.st_mode):
                break
            if st.st_uid == uid:
                found.append(manifest.MadeDir(str(at), st.st_uid, st.st_gid, stat.S_IMODE(st.st_mode)))
        else:
            out.update((d.path, d) for d in found)
    return sorted(out.values(), key=lambda d: (d.path.count("/"), d.path))


def _streamed(out: Path, seconds: float = 120.0) -> dict[str, dict[str, Any]]:
    """The images CRIU streamed (:mod:`snapshot.streamer`), as the capture read and hashed
    them: it is told that CRIU has written them all, and says so once it has read them."""
    (out / "log" / streamer.END_FILE).touch()
    said = out / "log" / streamer.STREAMED_FILE
    deadline = time.monotonic() + seconds
    while not said.exists():
        _check_cancel(out)
        if time.monotonic() > deadline:
            raise RuntimeError(f"the streamed images were not all read within {seconds:.0f} s")
        time.sleep(0.005)
    data = json.loads(said.read_text())
    if "error" in data:
        raise RuntimeError(data["error"])
    if data.get("descriptors_queued"):
        raise RuntimeError(skqueues.refusal(data["descriptors_queued"]))
    return {f"{manifest.IMAGES_DIR}/{name}": entry for name, entry in data["images"].items()}


def seal(out: Path, root: int, fail: bool, root_start: int | None = None, streamed: bool = False) -> None:
    """Seal the snapshot in ``out`` of the frozen tree of ``root``; ``root_start``: the start
    time (in clock ticks since boot, as /proc says: never shifted by the wall clock) of the
    process that was examined under that PID; ``streamed``: CRIU's images went to a
    :class:`snapshot.streamer.Capture`, whose digests they are sealed with."""
    t0 = time.monotonic()
    _check_cancel(out)
    pending = json.loads((out / PENDING).read_text())
    if root_start is not None and proc.start_ticks(root) != root_start:  # frozen now: the process CRIU dumped
        raise NotTheProcess(f"PID {root} was started after the process that was examined (its PID was reused)")
    tree = [psutil.Process(root), *psutil.Process(root).children(recursive=True)]
    carry, links = _relinks([p.pid for p in tree])
    shared = pending.pop(OPENED, None)
    most = pending.pop(MOST, None)
    if shared is not None:  # (what it opened since it was checked: node-local ones travel too)
        since = [f for f in files.open_in(tree) if not files.under(f, shared)]
        new = [Path(f) for f in since if f not in pending.get("carried", ())]
        if new and (outside := ends.shared_maps([p.pid for p in tree], new)):
            raise RuntimeError(outside[0])  # (as its check would have said: one it mapped since)
        carry += since
    if pending.get("carried") or carry:
        pending["carried"] = _archive(out, sorted({*pending.get("carried", ()), *carry}), most)
    pending["links"] = _unlinked({k: v for k, v in links.items() if v in pending.get("carried", ())})
    if not streamed:
        skqueues.check(out / manifest.IMAGES_DIR / skqueues.NAME)
    sums = manifest.checksum_files(out) | (_streamed(out) if streamed else {})
    _fsync_tree(out / manifest.IMAGES_DIR)
    if fail:
        raise RuntimeError("fault injected after the checksums")
    m = manifest.Manifest.from_json({**pending, "files": sums, "timings": {}})
    was = {p.pid for p in m.processes if p.stopped}  # (seen before the freeze: frozen, all are stopped)
    m.processes = [replace(p, stopped=p.pid in was) for p in proc.tree(psutil.Process(root), set(m.cuda_pids))]
    pids = [p.pid for p in m.processes]
    m.sockets = _bound(sockets.unix_bound(pids), pids)
    m.dirs = _dirs_to([(b.path, b.uid) for b in m.sockets] + [(p, uid) for p in m.carried if (uid := _owner(p)) >= 0])
    m.timers = timers.expired(pids)
    m.bindings = affinity.bound(pids)
    m.warnings = [*m.warnings, *criu_limits.restore_warnings(pids)]  # (those found before the freeze first)
    m.reopened = reopened.note(pids)
    m.timings = {"checksum": round(time.monotonic() - t0, 4)}
    _check_cancel(out)  # the last moment at which CRIU can still roll back
    try:  # (what no restore could read must not end the tree: CRIU rolls back)
        manifest.Manifest.from_json(json.loads(json.dumps(m.to_json())))
    except (KeyError, TypeError, ValueError) as e:
        raise RuntimeError(f"the snapshot's manifest would not read back (field {e}), a bug of tpagent's") from e
    m.write(out)


def restored(known: Path, init: int) -> int:
    """(CRIU's post-restore action.)  Every process of the restored tree of ``init`` holds, of the
    files CRIU opened by name as root, only those checked by that name (``known``: JSON of path ->
    device and inode): one swapped since for a symlink to a file of root's would be the copy's to
    write to (:func:`host.reopened.strangers`).  The tree runs none of its own code yet, whatever
    signal its owner sends it, and a failure here makes CRIU kill it: 1, and why in
    ``ERROR_FILE`` beside ``known``, if it holds another.  CRIU's own descriptors in it (/proc,
    its log in ``known``'s directory) it closes before the tree runs."""
    try:
        checked = {path: (dev, ino) for path, (dev, ino) in json.loads(known.read_text()).items()}
        strangers = reopened.strangers(proc.tree_pids(init), checked, ("/proc", str(known.parent)))
    except Exception as e:  # (not checked: not let run)
        strangers = [f"the restored tree could not be checked ({type(e).__name__}: {e})"]
    if not strangers:
        return 0
    with contextlib.suppress(OSError):
        (known.parent / ERROR_FILE).write_text(strangers[0])
    return 1


def main() -> int:
    action = os.environ.get("CRTOOLS_SCRIPT_ACTION")
    if action == "post-restore" and "TPAGENT_HOOK_KNOWN" in os.environ:
        return restored(Path(os.environ["TPAGENT_HOOK_KNOWN"]), int(os.environ["CRTOOLS_INIT_PID"]))
    if action != "post-dump":
        return 0
    out = Path(os.environ["TPAGENT_HOOK_OUT"])
    try:
        start = int(os.environ["TPAGENT_HOOK_ROOT_START"]) if os.environ.get("TPAGENT_HOOK_ROOT_START") else None
        root = int(os.environ["TPAGENT_HOOK_ROOT"])
        seal(out, root, bool(os.environ.get("TPAGENT_HOOK_FAIL")), start, bool(os.environ.get("TPAGENT_HOOK_STREAMED")))
        if "TPAGENT_HOOK_HOLD" in os.environ:
            hold(out, float(os.environ["TPAGENT_HOOK_HOLD"]), root, start)
    except Exception as e:  # any failure must make CRIU roll back, and say why
        # (a full disk) CRIU still rolls back; the engine reports the failure
        with contextlib.suppress(OSError):
            (out / "log" / ERROR_FILE).write_text(f"{type(e).__name__}: {e}")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
