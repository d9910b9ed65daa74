"""Restore of a process tree; the checkpoint side is :mod:`snapshot.dump`.

Checks first, while nothing is done: verify manifest and checksums -> CRIU new enough ->
refuse if the original, or a copy restored before (:mod:`snapshot.copies`), still runs
here -> GPU map -> PIDs free.  Then the steps of :data:`RESTORE`, each with its undo: carried
files put back (as root, through no symlink: :mod:`snapshot.putback`) -> criu restore ->
CUDA restore (GPU map) -> CUDA unlock.  A failure after CRIU started the tree kills that
copy, and what was put back is removed: the snapshot, which restore never modifies, is the
one to retry.
"""

from __future__ import annotations

import json
import logging
import os
import platform
import shutil
import signal
import tempfile
from collections.abc import Mapping
from contextlib import suppress
from dataclasses import dataclass, field, replace
from pathlib import Path

import psutil

from host import gpus, proc, reopened, safefs, signals, userdirs
from host.api import UsageError
from host.safefs import private_dir
from snapshot import affinity, copies, hook, manifest, putback, stages, timers
from snapshot.api import (
    CriuError,
    DumpMode,
    Interrupted,
    ProgressFn,
    SnapshotConfig,
    SnapshotError,
    Stage,
    ToolError,
)
from snapshot.criu import Criu, RestoreOptions, pidfile
from snapshot.cuda import CudaDriver, CudaState, uuid_bytes, uuid_text
from snapshot.manifest import IMAGES_DIR, BoundSocket, Manifest
from snapshot.stages import CudaFactory, Step, Timer, check_restore_thread, quiet, require_root

log = logging.getLogger(__name__)
#: In CRIU's work directory: the files checked by name, as :func:`snapshot.hook.restored` reads them.
KNOWN = "known.json"


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


def _private_snapshot(directory: Path) -> Path:
    """``directory``, made absolute.  Root verifies its images, then CRIU reads them again by name:
    only from directories no one else can write to or swap (0700, through directories only root
    can change), its ``images`` too (one a symlink led to a user's directory: its owner could
    swap the images once verified, and CRIU restores whatever credentials they name)."""
    manifest.present(directory)  # (before private_dir makes it 0700: a directory given by mistake is left as it was)
    directory = private_dir(directory, create=False)
    private_dir(directory / IMAGES_DIR, create=False)
    return directory


def _original_still_running(m: Manifest) -> bool:
    if m.origin["mode"] == DumpMode.KILL.value or m.host["hostname"] != platform.node():
        return False
    try:
        started = m.origin.get("root_started") or m.origin["root_create_time"]  # (older: the wall clock's)
    except KeyError:
        return False
    return proc.is_started(m.root_pid, started)


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
    directory (its log and ``restore.pid``), for a caller that must find them after a crash (a
    held copy's is left to its caller: it names the copy until the caller has noted it).
    ``start`` False: the copy is restored but held — stopped (a CPU process), or with its
    GPU still locked (a CUDA process, whose driver restore needs it running) — until
    :func:`start_restored`; a migration lets it go only once the original is let go.
    ``clone``: restore although a copy restored from this snapshot still runs here (noted in
    :data:`~snapshot.copies.RESTORED`): two copies then run, on purpose.  ``created_note``:
    where to write down what the restore made on this node (for
    :func:`~snapshot.putback.take_back_created`, should the copy be dropped later).

    The checks come first (nothing is done yet: a refusal needs no undo), then the steps of
    :data:`RESTORE`, each with its undo."""
    require_root()
    asked = {uuid_text(uuid_bytes(k)): uuid_text(uuid_bytes(v)) for k, v in (gpu_map or {}).items()}  # (syntax first)
    timer = Timer(progress, config.fail_after)
    directory = _private_snapshot(directory)
    with timer.stage(Stage.VERIFY):
        m = manifest.load(directory)
        if not verified:
            manifest.verify(directory, m)
    criu = Criu(config.criu)
    _check_criu_reads(m, criu)
    with copies.restoring(m):  # (two restores of it at once would each find no copy running)
        return _restore(directory, m, criu, asked, config, timer, cuda_factory, work, start, clone, created_note)


def _restore(
    directory: Path,
    m: Manifest,
    criu: Criu,
    asked: dict[str, str],
    config: SnapshotConfig,
    timer: Timer,
    cuda_factory: CudaFactory,
    work: Path | None,
    start: bool,
    clone: bool,
    created_note: Path | None,
) -> RestoreResult:
    """:func:`restore`'s checks (nothing is done yet: a refusal needs no undo), then its steps."""
    _check_not_running(m, clone)
    trusted = _check_reopened(m)
    norm_map = _check_gpu_map(m, asked)
    cuda = cuda_factory() if m.cuda_pids else None
    if not m.namespace:
        proc.wait_pids_free(
            [p.pid for p in m.processes], config.timeouts.pid_wait, [t for p in m.processes for t in p.tids]
        )
    stopped = not m.cuda_pids  # (a CUDA process's runs at once: its driver restore needs it running)
    mounts = m.namespace or bool(m.criu.get("mounts"))  # (a mount namespace of its own: rebuilt)
    opts = RestoreOptions(bool(m.criu["shell_job"]), bool(m.criu["tcp_established"]), mounts, stopped)
    fresh = [b for b in m.sockets if not os.path.lexists(b.path)]  # (CRIU makes them)
    kept = work is not None and not start  # (a held copy's: its caller removes it once it has noted the copy)
    if work is None:
        work = Path(tempfile.mkdtemp(prefix="tpagent-restore-"))
    else:
        private_dir(work, empty=True)  # it is removed afterwards
    job = _Restore(directory, m, config, criu, timer, cuda, norm_map, opts, start, created_note, fresh, work, trusted)
    try:
        stages.run(RESTORE, job)  # (the copy is noted as its PIDs are found: _map_pids)
    except BaseException as e:
        kept = False
        # Never leave a half-restored copy (CPU side up, GPU side still in host memory): kill what
        # CRIU started, take back what was put back; the snapshot, unmodified, is the copy to retry.
        with signals.deferred_sigint() as again:  # (a second SIGHUP of a closed terminal never cuts it short)
            stages.undo(RESTORE, job)
            again.consume()
        if isinstance(e, KeyboardInterrupt):
            raise Interrupted(f"the restore of {directory} was interrupted; nothing was left running") from e
        if isinstance(e, SnapshotError):
            raise
        raise ToolError(
            f"the restore of {directory} failed after CRIU started it ({type(e).__name__}: {e}); "
            "that copy was stopped and the snapshot is intact"
        ) from e
    finally:
        if not kept:
            shutil.rmtree(work, ignore_errors=True)
    return RestoreResult(job.root, tuple(job.mapping.values()), m, timer.timings)


def _check_criu_reads(m: Manifest, criu: Criu) -> None:
    """Refuse a snapshot written by a newer CRIU than this node's."""
    theirs = tuple(int(x) for x in str(m.criu["version"]).split("."))
    if theirs[:2] > criu.version[:2]:
        raise UsageError(
            f"the snapshot was written by CRIU {m.criu['version']}, this node has CRIU "
            f"{criu.version_str}, which cannot read it: install a newer CRIU here."
        )


def _check_not_running(m: Manifest, clone: bool) -> None:
    """Refuse to start a second copy: the original left running here, or a copy restored here
    before (unless ``clone``)."""
    if _original_still_running(m):
        raise UsageError(
            f"the process this snapshot was taken from (PID {m.root_pid}, dumped in mode {m.origin['mode']}) "
            "still runs on this node; stop it first, or two copies would run."
        )
    copy = None if clone else copies.still_running(m)
    if copy is not None:
        stopped = " (stopped)" if proc.stopped(copy) else ""
        raise UsageError(
            f"a copy restored from this snapshot still runs here as PID {copy}{stopped}; stop it first, or pass "
            "--clone to start another on purpose (two copies then run)."
        )


def _check_reopened(m: Manifest) -> dict[str, tuple[int, int]]:
    """Refuse a copy that would open again, by name, a file or directory missing here, or one
    that someone may have put here who could not have where it was dumped (:mod:`host.reopened`).
    Each path trusted, by its device and inode as checked."""
    made = {*m.carried, *m.links, *(b.path for b in m.sockets)}
    seen: dict[str, tuple[int, int]] = {}
    problems = reopened.untrusted(m.reopened, made, {d.path for d in m.dirs}, "this node", seen)
    if problems:
        more = f" (and {len(problems) - 1} more)" if len(problems) > 1 else ""
        raise UsageError(
            f"{problems[0]}{more}; the copy would open it again by name as it was (its working directory, "
            "executable, libraries and open files must be found as they were, through directories no other "
            "user could change): nothing was restored."
        )
    if held := reopened.locked(m.reopened, "this node", made):
        more = f" (and {len(held) - 1} more)" if len(held) > 1 else ""
        raise UsageError(
            f"{held[0]}{more}: the copy would take that lock again and wait for it, for ever; nothing was "
            "restored (end that process, or let it release the lock, and restore again)."
        )
    return seen


@dataclass
class _Restore:
    """One restore, once its checks passed, as its steps read and fill it in."""

    directory: Path
    manifest: Manifest
    config: SnapshotConfig
    criu: Criu
    timer: Timer
    cuda: CudaDriver | None
    #: Old -> new UUID of the GPUs mapped (checked: each new one is here).
    gpu_map: dict[str, str]
    opts: RestoreOptions
    #: Let the copy run once restored (else :func:`start_restored` does).
    start: bool
    #: Where to write down what the restore made (for :func:`putback.take_back_created`).
    created_note: Path | None
    #: The unix sockets not on disk before the restore: CRIU binds them.
    fresh: list[BoundSocket]
    #: CRIU's work directory (its log, ``restore.pid``).
    work: Path
    #: The paths the copy reopens, each trusted by its device and inode as checked.
    trusted: dict[str, tuple[int, int]]
    #: What :func:`putback.put_back` made, in order (directories, files).
    created: list[Path] = field(default_factory=list)
    #: Each of them as it was made (:func:`putback.identities`).
    made: dict[Path, tuple[int, int, int]] = field(default_factory=dict)
    #: The restored tree's root, as seen from here; 0 until CRIU has restored it.
    root: int = 0
    #: Snapshot PID -> PID of the restored process, as seen from here.
    mapping: dict[int, int] = field(default_factory=dict)


def _put_back(job: _Restore) -> None:
    """The carried files and the unix sockets' directories (:func:`putback.put_back`); a carried
    file found there already, the same, is checked for locks as the others were."""
    try:
        putback.put_back(job.directory, job.manifest, job.created)
    finally:
        job.made = putback.identities(job.created)
    for path in job.manifest.carried:  # (each made, or found the same: the file CRIU is to open)
        with suppress(OSError):
            job.trusted[path] = (st := os.lstat(path)).st_dev, st.st_ino
    kept = [r for r in job.manifest.reopened if r.path in job.manifest.carried and Path(r.path) not in job.made]
    if held := reopened.locked(kept, "this node"):
        raise UsageError(
            f"{held[0]}: the copy would take that lock again and wait for it, for ever; nothing was restored."
        )


def _take_back(job: _Restore) -> None:
    """Remove what :func:`_put_back` made, the last made first."""
    putback.take_back(job.created, job.made)


def _note_made(job: _Restore) -> None:
    """Write down what was put back: an agent that dies from now on still takes it back."""
    if job.created_note is not None:
        putback.note_created(job.created_note, job.created, [])


def _criu_restore(job: _Restore) -> None:
    """criu restore: the tree comes back (its GPU memory still in host memory).  What it opened
    by name is checked before any of it runs (:func:`snapshot.hook.restored`, CRIU's post-restore
    action: a copy stopped after, its owner could let run at once)."""
    known = job.work / KNOWN
    known.write_text(json.dumps(job.trusted | {str(p): (dev, ino) for p, (dev, ino, _) in job.made.items()}))
    script = hook.install()
    opts = replace(job.opts, action_script=script, env={"TPAGENT_HOOK_KNOWN": str(known)})
    try:
        with job.timer.stage(Stage.CRIU_RESTORE):
            job.root = job.criu.restore(job.directory / IMAGES_DIR, job.work, opts, job.config.timeouts.restore)
    except CriuError as e:
        if (stranger := job.work / hook.ERROR_FILE).exists():
            raise _unchecked(stranger.read_text(errors="replace")) from e
        raise
    finally:
        shutil.rmtree(script.parent, ignore_errors=True)


def _unchecked(said: str) -> SnapshotError:
    """Why CRIU's post-restore action killed the copy (``said``: :func:`snapshot.hook.restored`'s)."""
    if not said.startswith("PID "):  # (the check itself failed)
        return ToolError(f"{said}: that copy was killed before it ran, and the snapshot is intact")
    return UsageError(
        f"{said}, which is not the file checked by that name before CRIU opened it (it was replaced, or a "
        "directory on its way swapped, as it was restored): that copy was killed before it ran."
    )


def _stop_copy(job: _Restore) -> None:
    """Kill the tree CRIU started (if it did), and remove the unix sockets it bound."""
    kill_restored(job.work)
    for b in job.fresh:
        userdirs.remove_socket(Path(b.path), b.uid)


def _note_bound(job: _Restore) -> None:
    """Add the unix sockets CRIU bound to the note of what the restore made."""
    if job.created_note is not None:
        putback.note_created(job.created_note, job.created, job.fresh)


def _hand_over(job: _Restore) -> None:
    """Give the directories made for the sockets to their owners, now that CRIU has bound them
    (each still that very one to take back, should a later step fail, and in the note)."""
    for d in job.manifest.dirs:
        path = Path(d.path)
        if path in job.created:
            safefs.hand_over(path, d.uid, d.gid, d.mode)
            if path in job.made:
                job.made[path] = (*job.made[path][:2], d.uid)
    _note_bound(job)


def _map_pids(job: _Restore) -> None:
    """Find each snapshot PID's restored process (in a PID namespace, another PID here), and note
    the copy at once: one whose restore is cut short (SIGKILL) stays, stopped, and is the copy the
    next restore names (not a process holding its PIDs, to stop)."""
    job.mapping = _restored_pids(job.manifest, job.root)
    copies.note_copy(job.manifest, job.root)


def _let_run(job: _Restore) -> None:
    """Resume the copy, restored stopped, unless it is held (but a process stopped when dumped)."""
    if job.start and job.cuda is None:
        m = job.manifest
        signals.signal_listed([job.mapping[p.pid] for p in m.processes if not p.stopped], signal.SIGCONT)


def _rearm_timers(job: _Restore) -> None:
    """Arm again the periodic timers CRIU brought back disarmed (:mod:`snapshot.timers`)."""
    mapping = job.mapping
    for t in job.manifest.timers:
        try:
            if timers.rearm(mapping[t.pid], t):
                log.info("armed again the timerfd %d of PID %d (every %d ns)", t.fd, mapping[t.pid], t.interval_ns)
        except (OSError, KeyError) as e:
            raise ToolError(
                f"PID {t.pid}'s periodic timer (fd {t.fd}) came back disarmed from CRIU and could not be armed again, "
                "so it would never fire; that copy was stopped and the snapshot is intact",
                detail=str(e),
            ) from e


def _rebind(job: _Restore) -> None:
    """Bind the threads CRIU brought back unbound to their CPUs again (:mod:`snapshot.affinity`)."""
    affinity.rebind(job.manifest.bindings, job.mapping)


def _give_gpu_back(job: _Restore) -> None:
    """CUDA restore (onto the GPUs mapped), then CUDA unlock unless the copy is held."""
    if job.cuda is None:
        return
    m = job.manifest
    with signals.deferred_sigint():
        with job.timer.stage(Stage.CUDA_RESTORE):
            for p in m.cuda_pids:
                check_restore_thread(job.cuda, job.mapping[p])
                job.cuda.restore(job.mapping[p], _gpu_pairs(m, p, job.gpu_map))
        if job.start:
            with job.timer.stage(Stage.CUDA_UNLOCK):
                for p in m.cuda_pids:
                    job.cuda.unlock(job.mapping[p])


#: A restore once its checks passed, in order, each step with its undo: should any fail, all
#: are undone, last first (a step that did nothing leaves nothing to undo), and the error is
#: raised: the snapshot, which a restore never modifies, is the copy to retry.
RESTORE: tuple[Step[_Restore], ...] = (
    Step("put back the carried files and the sockets' directories", _put_back, undo=_take_back),
    Step("note what was put back", _note_made),
    Step("criu restore", _criu_restore, undo=_stop_copy),
    Step("note the sockets CRIU bound", _note_bound),
    Step("hand the sockets' directories over", _hand_over),
    Step("find the restored PIDs", _map_pids),
    Step("arm the periodic timers again", _rearm_timers),
    Step("bind the threads to their CPUs again", _rebind),
    Step("give the GPU back (CUDA restore, CUDA unlock)", _give_gpu_back),
    Step("let the copy run", _let_run),
)


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
    else:  # (not one that was stopped before the dump: it stays so)
        mapping = _restored_pids(m, result.pid)
        kept = {mapping[p.pid] for p in m.processes if p.stopped and p.pid in mapping}
        # (every one CRIU brought back, listed or not: one that died as the tree was sealed, after
        # CRIU had its images, is in them but not in the manifest's list, and stayed stopped for ever)
        going = [pid for pid in proc.tree_pids(result.pid) if pid not in kept]
        signals.signal_listed(going, signal.SIGCONT)


def kill_restored(work: Path) -> int:
    """Stop the tree a restore in ``work`` started (its ``restore.pid``); its PID, or 0 if none runs."""
    try:
        root = int((work / "restore.pid").read_text())
    except (OSError, ValueError):
        return 0
    if not proc.alive(root):
        return 0
    # That very tree: started by the CRIU that ran there, in this boot, and after it (else its PID
    # is someone else's now).
    written = pidfile(work)
    ticks, _, boot = written[1].partition("@") if written else ("", "", "")
    try:
        ours = boot == proc.boot_id() and ticks.isdigit() and int(ticks) <= proc.start_ticks(root)
    except (OSError, ValueError, IndexError):
        ours = False
    if not ours:
        log.warning("not stopping PID %d: it is not the tree CRIU restored in %s", root, work)
        return 0
    signals.kill_tree(root)
    return root
