"""Restore of a process tree (and what checkpoint and restore share: the stage timer, giving a
tree and its GPU back); the checkpoint side is :mod:`snapshot.dump`.

Restore: verify manifest and checksums -> refuse if the original still runs here -> PIDs
free -> carried files put back (as root, through no symlink: :mod:`host.safefs`) ->
criu restore -> CUDA restore (GPU map) -> CUDA unlock.  A failure after CRIU started the
tree kills that copy, and what was put back is removed: the snapshot, which restore never
modifies, is the one to retry.
"""

from __future__ import annotations

import json
import logging
import os
import platform
import re
import shutil
import signal
import stat
import tarfile
import tempfile
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psutil

from host import gpus, proc, safefs
from host.api import UsageError
from host.safefs import private_dir, private_opener
from snapshot import leftovers, manifest, timers
from snapshot.api import (
    DumpMode,
    Interrupted,
    ProgressFn,
    SnapshotConfig,
    SnapshotError,
    SnapshotInvalid,
    Stage,
    ToolError,
)
from snapshot.criu import PIDFILE, Criu, RestoreOptions
from snapshot.cuda import CudaDriver, CudaState, uuid_bytes, uuid_text
from snapshot.manifest import IMAGES_DIR, Manifest
from snapshot.stages import CudaFactory, Timer, check_restore_thread, quiet, require_root

log = logging.getLogger(__name__)

#: Root's notes of the copies restored on this node, one per snapshot (by its id): a snapshot
#: restored twice would run twice.
RESTORED = Path("/run/tpagent/restored")


@dataclass(frozen=True)
class RestoreResult:
    pid: int
    pids: tuple[int, ...]
    manifest: Manifest
    timings: dict[str, float]


def _gpu_pairs(m: Manifest, pid: int, gpu_map: Mapping[str, str]) -> dict[str, str]:
    """Old -> new UUID for every GPU the process used (the driver wants them all, mapped or not)."""
    used = [str(g["uuid"]) for g in m.gpus if pid in g.get("pids", [])]
    if not used:
        return dict(gpu_map)
    return {old: gpu_map.get(old, old) for old in used}


def _check_gpu_map(m: Manifest, norm: dict[str, str]) -> dict[str, str]:
    theirs = {str(g["uuid"]) for g in m.gpus}
    for old in norm:
        if old not in theirs:
            have = ", ".join(sorted(theirs)) or "none"
            raise UsageError(f"--gpu-map names {old}, which is not a GPU of this snapshot (it has: {have}).")
    if not m.cuda_pids:
        return norm
    ours = {g.uuid for g in gpus.inventory()}
    for old in theirs:
        new = norm.get(old, old)
        if new not in ours:
            hint = "" if old in norm else f"; map it with --gpu-map {old}=<UUID of a GPU here>"
            raise UsageError(f"GPU {new} is not on this node (see `tpagent gpus`){hint}.")
    return norm


def _original_still_running(m: Manifest) -> bool:
    if m.origin["mode"] == DumpMode.KILL.value or m.host["hostname"] != platform.node():
        return False
    try:
        return abs(psutil.Process(m.root_pid).create_time() - float(m.origin["root_create_time"])) < 0.01
    except psutil.NoSuchProcess:
        return False


def _restored_pids(m: Manifest, root: int) -> dict[int, int]:
    """Snapshot PID -> PID of the restored process, as seen from here."""
    if not m.namespace:
        return {p.pid: p.pid for p in m.processes}
    inner_to_outer = {}
    for p in [psutil.Process(root), *psutil.Process(root).children(recursive=True)]:
        inner_to_outer[proc.ns_pids(p.pid)[-1]] = p.pid
    return {p.pid: inner_to_outer[p.ns_pids[-1]] for p in m.processes if p.ns_pids[-1] in inner_to_outer}


def restore(
    directory: Path,
    gpu_map: Mapping[str, str] | None = None,
    config: SnapshotConfig = SnapshotConfig(),
    progress: ProgressFn = quiet,
    cuda_factory: CudaFactory = CudaDriver,
    verified: bool = False,
    work: Path | None = None,
    start: bool = True,
    clone: bool = False,
    created_note: Path | None = None,
) -> RestoreResult:
    """Restore ``directory``.  ``verified``: its checksums were just checked (a receiver does
    that as the data arrives), so only the manifest is read again.  ``work``: CRIU's work
    directory (its log and ``restore.pid``), for a caller that must find them after a crash.
    ``start`` False: the copy is restored but held — stopped (a CPU process), or with its
    GPU still locked (a CUDA process, whose driver restore needs it running) — until
    :func:`start_restored`; a migration lets it go only once the original is let go.
    ``clone``: restore although a copy restored from this snapshot still runs here (noted in
    :data:`RESTORED`): two copies then run, on purpose.  ``created_note``: where to write down
    what the restore made on this node (for :func:`take_back_created`, should the copy be
    dropped later)."""
    require_root()
    asked = {uuid_text(uuid_bytes(k)): uuid_text(uuid_bytes(v)) for k, v in (gpu_map or {}).items()}  # (syntax first)
    timer = Timer(progress, config.fail_after)
    # Root verifies the images, then CRIU reads them again by name: only from a directory no
    # one else can write to or swap (its own 0700, through directories only root can change).
    directory = private_dir(directory, create=False)
    with timer.stage(Stage.VERIFY):
        m = manifest.load(directory)
        if not verified:
            manifest.verify(directory, m)
    criu = Criu(config.criu)
    theirs = tuple(int(x) for x in str(m.criu["version"]).split("."))
    if theirs[:2] > criu.version[:2]:
        raise UsageError(
            f"the snapshot was written by CRIU {m.criu['version']}, this node has CRIU "
            f"{criu.version_str}, which cannot read it: install a newer CRIU here."
        )
    if _original_still_running(m):
        raise UsageError(
            f"the process this snapshot was taken from (PID {m.root_pid}, left {m.origin['mode']}) "
            "still runs on this node; stop it first, or two copies would run."
        )
    copy = None if clone else _copy_still_running(m)
    if copy is not None:
        raise UsageError(
            f"a copy restored from this snapshot still runs here as PID {copy}; stop it first, or pass --clone "
            "to start another on purpose (two copies then run)."
        )
    norm_map = _check_gpu_map(m, asked)
    cuda = cuda_factory() if m.cuda_pids else None
    if not m.namespace:
        proc.wait_pids_free(
            [p.pid for p in m.processes], config.timeouts.pid_wait, [t for p in m.processes for t in p.tids]
        )
    opts = RestoreOptions(
        bool(m.criu["shell_job"]),
        bool(m.criu["tcp_established"]),
        m.namespace,
        leave_stopped=not start and not m.cuda_pids,
    )
    created: list[Path] = []
    fresh = [b for b in m.sockets if not os.path.lexists(b.path)]  # (CRIU makes them)
    if work is None:
        work = Path(tempfile.mkdtemp(prefix="tpagent-restore-"))
    else:
        private_dir(work, empty=True)  # it is removed afterwards
    try:
        _put_back(directory, m, created)
        if created_note is not None:  # (before CRIU: an agent that dies now still takes them back)
            _note_created(created_note, created, [])
        with timer.stage(Stage.CRIU_RESTORE):
            root = criu.restore(directory / IMAGES_DIR, work, opts, config.timeouts.restore)
        if created_note is not None:
            _note_created(created_note, created, fresh)
        for d in m.dirs:
            if Path(d.path) in created:
                safefs.hand_over(Path(d.path), d.uid, d.gid, d.mode)
        mapping = _restored_pids(m, root)
        _rearm_timers(m, mapping)
        if cuda is not None:
            with proc.deferred_sigint():
                with timer.stage(Stage.CUDA_RESTORE):
                    for p in m.cuda_pids:
                        check_restore_thread(cuda, mapping[p])
                        cuda.restore(mapping[p], _gpu_pairs(m, p, norm_map))
                if start:
                    with timer.stage(Stage.CUDA_UNLOCK):
                        for p in m.cuda_pids:
                            cuda.unlock(mapping[p])
    except BaseException as e:
        # Never leave a half-restored copy (e.g. CPU side up, GPU side still in host memory):
        # kill what CRIU started; the snapshot, which restore does not modify, is the copy to retry.
        kill_restored(work)
        for b in fresh:
            safefs.remove_socket(Path(b.path), b.uid)
        _take_back(created)
        if isinstance(e, KeyboardInterrupt):
            raise Interrupted(f"the restore of {directory} was interrupted; nothing was left running") from e
        if isinstance(e, SnapshotError):
            raise
        raise ToolError(
            f"the restore of {directory} failed after CRIU started it ({type(e).__name__}: {e}); "
            "that copy was stopped and the snapshot is intact"
        ) from e
    finally:
        shutil.rmtree(work, ignore_errors=True)
    _note_copy(m, root)
    return RestoreResult(root, tuple(mapping.values()), m, timer.timings)


def _rearm_timers(m: Manifest, mapping: Mapping[int, int]) -> None:
    """Arm again the periodic timers CRIU brought back disarmed (:mod:`snapshot.timers`)."""
    for t in m.timers:
        try:
            if timers.rearm(mapping[t.pid], t):
                log.info("armed again the timerfd %d of PID %d (every %d ns)", t.fd, mapping[t.pid], t.interval_ns)
        except (OSError, KeyError) as e:
            raise ToolError(
                f"PID {t.pid}'s periodic timer (fd {t.fd}) came back disarmed from CRIU and could not be armed again, "
                "so it would never fire; that copy was stopped and the snapshot is intact",
                detail=str(e),
            ) from e


def _copy_path(m: Manifest) -> Path:
    if not re.fullmatch(r"[0-9a-f]{1,64}", m.snapshot_id):
        raise SnapshotInvalid(f"the snapshot's id {m.snapshot_id[:80]!r} is not hexadecimal.")
    return RESTORED / f"{m.snapshot_id}.json"


def _live_copies(m: Manifest) -> list[dict[str, Any]]:
    """The notes of copies of ``m`` restored here before whose very process still runs."""
    try:
        notes = json.loads(_copy_path(m).read_text())
    except (OSError, ValueError):
        return []
    live = []
    for note in notes if isinstance(notes, list) else []:
        try:
            p = psutil.Process(int(note["pid"]))
            if (
                p.create_time() == float(note["create_time"])
                and note["host"] == platform.node()
                and p.status() != psutil.STATUS_ZOMBIE
            ):
                live.append(note)
        except (ValueError, KeyError, TypeError, psutil.Error):
            continue
    return live


def _copy_still_running(m: Manifest) -> int | None:
    """The PID of a copy of ``m`` restored here before, if that very process still runs."""
    live = _live_copies(m)
    return int(live[0]["pid"]) if live else None


def _note_copy(m: Manifest, root: int) -> None:
    """Add the copy just restored (as PID ``root``) to the notes of ``m``'s live copies."""
    try:
        private_dir(RESTORED)
        note = {"pid": root, "create_time": psutil.Process(root).create_time(), "host": platform.node()}
        tmp = _copy_path(m).with_suffix(f".{os.getpid()}.tmp")
        with open(tmp, "w", opener=private_opener) as f:
            json.dump([*_live_copies(m), note], f)
        tmp.rename(_copy_path(m))
    except (OSError, psutil.Error, SnapshotError) as e:  # the copy runs; only the note of it is missing
        log.warning("could not note the copy of %s restored as PID %d: %s", m.snapshot_id, root, e)


def start_restored(result: RestoreResult, cuda_factory: CudaFactory = CudaDriver) -> None:
    """Let a copy restored with ``start=False`` run: unlock its GPU, or resume its tree.
    Idempotent (an agent that restarted half-way through lets it go again)."""
    m = result.manifest
    if m.cuda_pids:
        cuda = cuda_factory()
        mapping = _restored_pids(m, result.pid)
        for p in m.cuda_pids:
            if cuda.state(mapping[p]) is CudaState.LOCKED:
                cuda.unlock(mapping[p])
    else:
        proc.signal_tree(list(result.pids), signal.SIGCONT)


def _put_back(directory: Path, m: Manifest, created: list[Path]) -> None:
    """Make the directories the unix sockets are bound in, where missing, and write the
    carried files back where they were, adding what it creates to ``created``.
    A file already there must hold the same bytes (the same file, or a copy): else the restore
    stops.  As root, on paths users may control: no symlink is followed, the directory must
    belong to root or to the file's owner, setuid/setgid are never restored (:mod:`host.safefs`)."""
    try:
        for b in m.sockets:
            safefs.check_socket_path(Path(b.path), b.uid)
        for d in m.dirs:  # (for CRIU to bind the unix sockets in: root's until it has)
            safefs.make_dir(Path(d.path), created)
        _write_carried(directory, m, created)
    except (OSError, tarfile.TarError) as e:
        what = getattr(e, "filename", None) or directory / IMAGES_DIR / manifest.CARRIED_NAME
        raise ToolError(
            f"putting back the files the process had open failed at {what}",
            detail=getattr(e, "strerror", None) or str(e),
        ) from e


def _note_created(note: Path, made: list[Path], sockets: list[manifest.BoundSocket]) -> None:
    """Write down ``made`` (the directories and files a restore made, in that order) and the
    ``sockets`` CRIU bound, each as it is now (device, inode, owner; a socket only if it is
    its owner's), with this boot's id: after a reboot, inode numbers on a tmpfs start again."""
    entries = []
    for path, uid in [*((p, None) for p in made), *((Path(b.path), b.uid) for b in sockets)]:
        try:
            st = os.lstat(path)
        except OSError:
            continue
        if uid is None or (stat.S_ISSOCK(st.st_mode) and st.st_uid == uid):
            entries.append({"path": str(path), "dev": st.st_dev, "ino": st.st_ino, "uid": st.st_uid})
    tmp = note.with_name(f".{note.name}.{os.getpid()}")
    with open(tmp, "w", opener=private_opener) as f:
        json.dump({"boot": proc.boot_id(), "made": entries}, f)
    tmp.rename(note)


def take_back_created(note: Path) -> list[str]:
    """Remove what the restore noted in ``note`` made (its copy was dropped: the files, sockets
    and directories it would have found), each only if it is still that very one (a directory
    only once empty), the last made first; the paths removed."""
    if not os.path.lexists(note):
        return []  # (the restore never got so far: it took back what it made itself)
    try:
        entries = json.loads(safefs.read_private_file(note, "the note of what a restore made"))
    except (OSError, ValueError, SnapshotError) as e:
        log.warning("could not read %s: what the dropped copy's restore made is left: %s", note, e)
        return []
    if not isinstance(entries, dict) or entries.get("boot") != proc.boot_id():
        return []  # (made before a reboot: gone with a tmpfs, or another file by now)
    made = entries.get("made")
    removed = []
    for entry in reversed(made if isinstance(made, list) else []):
        try:
            path = Path(str(entry["path"]))
            if safefs.remove_same(path, (int(entry["dev"]), int(entry["ino"]), int(entry["uid"]))):
                removed.append(str(path))
        except (KeyError, TypeError, ValueError, OSError, SnapshotError) as e:
            log.warning("could not remove %r, which a dropped copy's restore had made: %s", entry, e)
    return removed


def _take_back(created: list[Path]) -> None:
    """Remove what :func:`_put_back` created (files, then the directories it made)."""
    for path in reversed(created):
        try:
            safefs.remove(path)
        except (OSError, SnapshotError) as e:  # (a directory someone has since put files in)
            log.warning("could not remove %s, which the restore had put back: %s", path, e)


def _write_carried(directory: Path, m: Manifest, created: list[Path]) -> None:
    """Write the carried files back, once the archive is checked whole: the files the manifest
    names, each (a directory made on the way to one must be its owner's or root's)."""
    if not m.carried:
        return
    wanted = {p.lstrip("/"): Path(p) for p in m.carried}
    with tarfile.open(directory / IMAGES_DIR / manifest.CARRIED_NAME) as tar:
        members = tar.getmembers()
        for member in members:
            path = wanted.get(member.name)
            if path is None or not member.isfile():
                raise SnapshotInvalid(
                    f"{directory}'s carried files hold {member.name!r}, which the manifest does not name."
                )
            if any(str(path).startswith(d.path + "/") and d.uid not in (0, member.uid) for d in m.dirs):
                raise SnapshotInvalid(f"{directory}'s manifest gives a directory on the way to {path} to another user.")
        if lacking := sorted(str(wanted[n]) for n in set(wanted) - {mb.name for mb in members}):
            raise SnapshotInvalid(f"{directory}'s carried files lack {', '.join(lacking)}.")  # (no owner vouched)
        for member in members:
            path, source = wanted[member.name], tar.extractfile(member)
            assert source is not None  # (a regular file: checked above)
            if safefs.write_file(
                path, source, member.uid, member.gid, member.mode, member.mtime, created, leftovers.left_behind
            ):
                log.info("%s replaced the stale copy a migration from this node had left behind", path)
            leftovers.forget(path)  # (what is there now is the process's own file again)


def kill_restored(work: Path) -> int:
    """Stop the tree a restore in ``work`` started (its ``restore.pid``); its PID, or 0 if none runs."""
    try:
        root = int((work / "restore.pid").read_text())
    except (OSError, ValueError):
        return 0
    if not proc.alive(root):
        return 0
    try:  # that very tree: started by the CRIU that ran there, in this boot (else its PID is someone else's now)
        criu_started = float((work / PIDFILE).read_text().split()[1])
        ours = psutil.boot_time() <= criu_started <= psutil.Process(root).create_time()
    except (OSError, ValueError, IndexError, psutil.Error):
        ours = False
    if not ours:
        log.warning("not stopping PID %d: it is not the tree CRIU restored in %s", root, work)
        return 0
    proc.kill_tree(root)
    return root
