"""Checkpoint and restore of a process tree: the CUDA driver and CRIU, in the verified order.

Checkpoint: CUDA lock -> CUDA checkpoint -> criu dump, during which CRIU's post-dump action
(:mod:`snapshot.hook`) checksums and fsyncs the images and writes the manifest while the
tree is still frozen -> CRIU finishes by mode (kill / leave running / leave stopped).  The
tree is killed only by CRIU and only once the snapshot is sealed; any failure before that
makes CRIU roll back (resume the tree, lift its network lock), and we give the GPU back
(CUDA restore, unlock), so a failed checkpoint never loses the workload.

Restore: verify manifest and checksums -> refuse if the original still runs here -> PIDs
free -> carried files put back (as root, through no symlink: :mod:`snapshot.safefs`) ->
criu restore -> CUDA restore (GPU map) -> CUDA unlock.  A failure after CRIU started the
tree kills that copy, and what was put back is removed: the snapshot, which restore never
modifies, is the one to retry.
"""

from __future__ import annotations

import errno
import itertools
import json
import logging
import os
import platform
import re
import shutil
import signal
import tarfile
import tempfile
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager, suppress
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psutil

from snapshot import gpus, hook, leftovers, manifest, proc, safefs, timers
from snapshot.api import (
    CriuError,
    CudaError,
    DumpMode,
    Interrupted,
    ProgressFn,
    SnapshotConfig,
    SnapshotError,
    SnapshotInvalid,
    Stage,
    ToolError,
    UsageError,
    producer_version,
)
from snapshot.criu import PIDFILE, Criu, DumpOptions, RestoreOptions
from snapshot.cuda import CudaDriver, CudaState, uuid_bytes, uuid_text
from snapshot.manifest import IMAGES_DIR, Manifest
from snapshot.safefs import private_dir, private_opener

log = logging.getLogger(__name__)

CudaFactory = Callable[[], CudaDriver]
LOG_DIR = "log"
#: CRIU's words for a refusal that may not recur a moment later: a worker process (a
#: DataLoader's at an epoch's end) that was exiting as the tree was seized.
TRANSIENT = ("Zombies with threads are not supported",)
#: Seconds before the first retry of such a dump; doubled for each further one.
RETRY_BACKOFF = 0.5
#: Root's notes of the copies restored on this node, one per snapshot (by its id): a snapshot
#: restored twice would run twice.
RESTORED = Path("/run/tpagent/restored")


class InjectedFault(ToolError):
    """Raised by ``SnapshotConfig.fail_after`` (tests of the rollback path)."""

    tool = "test"


@dataclass(frozen=True)
class RestoreResult:
    pid: int
    pids: tuple[int, ...]
    manifest: Manifest
    timings: dict[str, float]


def quiet(stage: Stage, msg: str) -> None:
    pass


def require_root() -> None:
    if os.geteuid() != 0:
        raise UsageError("checkpoint and restore need root (CRIU must ptrace and rebuild processes); run as root.")


class _Timer:
    def __init__(self, progress: ProgressFn, fail_after: Stage | None) -> None:
        self.progress = progress
        self.fail_after = fail_after
        self.timings: dict[str, float] = {}

    @contextmanager
    def stage(self, stage: Stage) -> Iterator[None]:
        self.progress(stage, "")
        t0 = time.monotonic()
        yield
        self.record(stage, time.monotonic() - t0)
        if self.fail_after == stage:
            raise InjectedFault(f"fault injected after {stage.value}")

    def record(self, stage: Stage, seconds: float) -> None:
        self.timings[stage.value] = round(seconds, 4)
        self.progress(stage, f"{seconds:.2f} s")


def _namespace_of(target: psutil.Process) -> bool:
    """True if the target is the init of its own PID namespace (a `tpagent launch` workload)."""
    mine = proc.pid_namespace(os.getpid())
    if proc.pid_namespace(target.pid) == mine:
        for child in target.children(recursive=True):
            if proc.pid_namespace(child.pid) != mine:
                raise UsageError(
                    f"PID {target.pid} has started a PID namespace whose init is PID {child.pid}; "
                    f"checkpoint the namespace by giving PID {child.pid}."
                )
        return False
    if proc.ns_pids(target.pid)[-1] != 1:
        init = next((p.pid for p in target.parents() if proc.ns_pids(p.pid)[-1] == 1), None)
        raise UsageError(
            f"PID {target.pid} lives inside a PID namespace; checkpoint the whole namespace "
            f"by giving the PID of its init{f' ({init})' if init else ''}."
        )
    return True


def _has_context(cuda: CudaDriver, pid: int) -> bool:
    """Whether the driver knows the process: a forked worker that merely maps libcuda is not."""
    try:
        cuda.state(pid)
    except CudaError:
        return False
    return True


def _check_restore_thread(cuda: CudaDriver, pid: int) -> None:
    """The driver brings GPU memory back from inside the process, on its restore thread: if
    that thread is stopped, ``cuCheckpointProcessRestore`` would wait for good.  Refuse instead."""
    try:
        tid = cuda.restore_thread_id(pid)
    except CudaError as e:  # only a known stopped thread is refused; the restore itself will say more
        log.warning("could not ask the driver for the restore thread of %d: %s", pid, e)
        return
    if proc.thread_state(pid, tid) in ("T", "t"):
        raise CudaError(
            f"the CUDA restore thread (TID {tid}) of PID {pid} is stopped, so the driver could not restore it; "
            "let the process run (SIGCONT, or detach the debugger) and retry"
        )


def resume(pids: list[int], cuda_pids: list[int], cuda: CudaDriver | None) -> None:
    """Resume a tree left stopped and give each CUDA process its GPU back.

    Tries every process even when one fails, then raises one CudaError naming all failures."""
    proc.signal_tree(pids, signal.SIGCONT)
    failures = []
    for pid in cuda_pids:
        assert cuda is not None
        try:
            if cuda.state(pid).value == "checkpointed":
                _check_restore_thread(cuda, pid)
                cuda.restore(pid)
            if cuda.state(pid).value == "locked":
                cuda.unlock(pid)
        except CudaError as e:
            failures.append(f"PID {pid}: {e}")
    if failures:
        raise CudaError("the GPU could not be given back", detail="; ".join(failures))


def checkpoint(
    pid: int,
    out: Path,
    mode: DumpMode = DumpMode.KILL,
    config: SnapshotConfig = SnapshotConfig(),
    progress: ProgressFn = quiet,
    cuda_factory: CudaFactory = CudaDriver,
    carry: Sequence[Path] = (),
    create_time: float | None = None,
) -> Manifest:
    """Snapshot the tree rooted at ``pid`` into ``out``; see the module docstring.
    ``carry``: files (absolute) to archive with it, as they are while it is frozen.
    ``create_time``: the start time of the process the caller checked under ``pid``; should
    the PID now be another's (reused), nothing is done.  CRIU's post-dump hook checks it
    again while the tree is frozen.

    A dump that CRIU refuses for a passing reason (:data:`TRANSIENT`) before it wrote
    anything is tried again, once the tree runs again, up to ``config.dump_retries`` times."""
    require_root()
    for attempt in itertools.count(1):
        try:
            return _checkpoint(pid, out, mode, config, progress, cuda_factory, carry, create_time)
        except SnapshotError as e:
            if not e.transient or attempt > config.dump_retries:
                raise
            delay = RETRY_BACKOFF * 2 ** (attempt - 1)
            if create_time is None:  # the tree was just resumed: the PID is still its root's
                with suppress(psutil.Error):
                    create_time = psutil.Process(pid).create_time()
            why = next((t for t in TRANSIENT if t in str(e)), str(e))
            log.info("CRIU refused to dump PID %d for now (%s); retry %d in %.1f s", pid, e, attempt, delay)
            progress(Stage.CRIU_DUMP, f"refused for now ({why}); retry {attempt} in {delay:.1f} s")
            try:
                time.sleep(delay)  # (the tree runs meanwhile: CRIU resumed it)
            except KeyboardInterrupt:
                err = Interrupted(f"the checkpoint of PID {pid} was interrupted")
                err.rolled_back = proc.alive(pid)
                raise err from e
    raise AssertionError("unreachable")


def _checkpoint(
    pid: int,
    out: Path,
    mode: DumpMode,
    config: SnapshotConfig,
    progress: ProgressFn,
    cuda_factory: CudaFactory,
    carry: Sequence[Path],
    checked: float | None,
) -> Manifest:
    """One attempt of :func:`checkpoint`."""
    target = proc.validate_target(pid)
    criu = Criu(config.criu)
    try:
        namespace = _namespace_of(target)
        procs = proc.tree(target)
        create_time = target.create_time()
        root_start = proc.start_ticks(pid)
        shell_job = not proc.is_session_leader(pid)
        hidden = [p.pid for p in procs if not proc.session_visible(p.pid)]
    except (psutil.NoSuchProcess, ProcessLookupError, FileNotFoundError) as e:
        raise UsageError(f"PID {pid} exited while it was being examined; nothing was done.") from e
    if hidden:
        raise UsageError(
            f"PID {hidden[0]} belongs to a session whose leader is outside its PID namespace, which CRIU "
            "cannot checkpoint; start the workload with `tpagent launch` (or under setsid) instead."
        )
    if checked is not None and create_time != checked:
        raise UsageError(
            f"PID {pid} is no longer the process that was checked (that one exited and its PID was reused); "
            "nothing was done."
        )
    created = not out.exists()
    out = private_dir(out, empty=True, create=False)  # (refused before anything is done)
    pids = [p.pid for p in procs]
    candidates = [p.pid for p in procs if p.uses_cuda]
    cuda = cuda_factory() if candidates else None
    cuda_pids = [p for p in candidates if cuda is not None and _has_context(cuda, p)]
    m = Manifest(
        root_pid=pid,
        namespace=namespace,
        processes=procs,
        gpus=[g.to_dict() for g in gpus.gpus_of(set(pids))] if cuda_pids else [],
        criu={"version": criu.version_str, "shell_job": shell_job, "tcp_established": proc.holds_inet_sockets(pids)},
        cuda={"driver_version": gpus.driver_version(), "pids": cuda_pids},
        tpagent_version=producer_version(),
        origin={"mode": mode.value, "root_create_time": create_time},
        carried=sorted({os.path.normpath(os.path.abspath(p)) for p in carry}),
    )
    try:
        private_dir(out, empty=True)  # ours, 0700, empty: never a directory someone planted
        (out / IMAGES_DIR).mkdir(mode=0o700)
        (out / LOG_DIR).mkdir(mode=0o700)
        with open(out / hook.PENDING, "w", opener=private_opener) as f:
            f.write(json.dumps(m.to_json()))
    except OSError as e:
        _clear(out, created)
        raise UsageError(f"cannot write to {out}: {e.strerror}.") from e
    script = hook.install()
    cancel = out / LOG_DIR / hook.CANCEL_FILE
    timer = _Timer(progress, config.fail_after)
    locked: list[int] = []
    t = config.timeouts
    dumped = False  # CRIU has finished: from then on the snapshot is the copy to keep
    try:
        if cuda is not None:
            with proc.deferred_sigint():  # never leave the driver half-way through a call
                with timer.stage(Stage.CUDA_LOCK):
                    for p in cuda_pids:
                        locked.append(p)  # first: a lock that times out leaves it running, which resume() sees
                        cuda.lock(p, t.cuda_lock)
                with timer.stage(Stage.CUDA_CHECKPOINT):
                    for p in cuda_pids:
                        cuda.checkpoint(p)
        env = {
            "TPAGENT_HOOK_OUT": str(out.absolute()),
            "TPAGENT_HOOK_ROOT": str(pid),
            "TPAGENT_HOOK_ROOT_START": str(root_start),
        }
        if config.fail_after is Stage.CHECKSUM:
            env["TPAGENT_HOOK_FAIL"] = "1"
        if config.hold is not None:
            env["TPAGENT_HOOK_HOLD"] = str(config.hold)
        progress(Stage.CRIU_DUMP, "")
        t0 = time.monotonic()
        opts = DumpOptions(mode, shell_job, bool(m.criu["tcp_established"]), namespace, script, env, config.ghost_limit)
        # A Ctrl-C now asks the post-dump hook to fail, so that CRIU itself rolls back; once
        # the hook has sealed the snapshot, CRIU finishes and the interrupt came too late.
        with proc.deferred_sigint(on_interrupt=cancel.touch) as interrupt:
            try:
                criu.dump(pid, out / IMAGES_DIR, out / LOG_DIR, opts, t.dump if config.hold is None else None)
            except CriuError as e:
                sealing = out / LOG_DIR / hook.ERROR_FILE
                if sealing.exists():
                    e.detail = f"sealing the snapshot failed: {sealing.read_text(errors='replace')}"
                raise
            dumped = True
            if interrupt.consume():
                log.warning("interrupted after the snapshot of %d was sealed: finishing it", pid)
        sealed = manifest.load(out)
    except BaseException as e:
        if dumped:  # the tree is ended (or left) by its mode: never delete the only copy
            raise ToolError(
                f"CRIU finished the snapshot of PID {pid} (mode {mode.value}), but reading it back failed; "
                f"the snapshot is kept in {out}",
                detail=str(e),
            ) from e
        raise _rolled_back(e, pid, out, pids, locked, cuda, created) from e
    finally:
        shutil.rmtree(script.parent, ignore_errors=True)
        (out / hook.PENDING).unlink(missing_ok=True)
    checksum = sealed.timings.get("checksum", 0.0)
    timer.record(Stage.CRIU_DUMP, time.monotonic() - t0 - checksum)
    timer.record(Stage.CHECKSUM, checksum)
    sealed.timings = timer.timings
    try:
        sealed.write(out)
    except OSError as e:  # the sealed manifest is in place; only the timings are missing
        log.warning("could not add timings to %s: %s", out, e)
    if mode is DumpMode.LEAVE_RUNNING and cuda is not None:
        try:
            with proc.deferred_sigint():
                resume([], cuda_pids, cuda)  # CRIU resumed the CPU side itself
        except CudaError as e:
            raise CudaError(
                f"the snapshot in {out} is complete, but PID {pid} could not be given its GPU back", detail=e.detail
            ) from e
    return sealed


def _rolled_back(
    e: BaseException,
    pid: int,
    out: Path,
    pids: list[int],
    locked: list[int],
    cuda: CudaDriver | None,
    created: bool,
) -> BaseException:
    """Undo a failed checkpoint; return the error to raise (``rolled_back`` says if it worked,
    ``transient`` that the same dump may work a moment later).

    CRIU has already resumed the tree and lifted its network lock on its own failure; the
    SIGCONT here only matters if CRIU itself died.  What is left is the GPU side, and ``out``:
    left as it was found (absent if ``created``, else empty), so that the same command can
    be run again."""
    if not proc.alive(pid) and (out / manifest.MANIFEST_NAME).exists():
        # CRIU failed after its hook had sealed the snapshot and the tree was ended: now the
        # snapshot is the only copy, and it is complete.
        return ToolError(
            f"CRIU reported a failure after PID {pid} had been checkpointed and ended; "
            f"its sealed snapshot is kept in {out}: restore it from there",
            detail=str(e),
        )
    problem = None
    try:
        with proc.deferred_sigint():  # a second Ctrl-C must not cut the rollback short
            resume(pids, locked, cuda)
    except (CudaError, KeyboardInterrupt) as r:
        problem = str(r) or "interrupted"
    said = f"{e} {_read(out / LOG_DIR / hook.ERROR_FILE)}"
    cancelled = isinstance(e, KeyboardInterrupt) or (out / LOG_DIR / hook.CANCEL_FILE).exists()
    let_go = cancelled or (out / LOG_DIR / hook.DECISION_FILE).exists()  # (a holder's abort)
    wrote = any((out / IMAGES_DIR).glob("*"))  # (a sender following the images may have read them)
    _clear(out, created)  # a partial snapshot must never look restorable
    if cancelled:
        err: SnapshotError = Interrupted(f"the checkpoint of PID {pid} was interrupted")
    elif "No space left on device" in said or (isinstance(e, OSError) and e.errno == errno.ENOSPC):
        err = CriuError(
            f"the disk holding {out} ran out of space: the snapshot of PID {pid} needs about "
            f"{_size(proc.dump_size_estimate(pids))}, and {_size(_free_bytes(out))} are free there; "
            "free some space or give --out on a larger disk",
            code=errno.ENOSPC,
        )
    elif hook.NOT_THE_PROCESS in said:
        err = UsageError(
            f"PID {pid} is no longer the process that was checked (that one exited and its PID was reused); "
            "nothing was done."
        )
    elif isinstance(e, SnapshotError):
        err = e
    elif isinstance(e, OSError):
        err = CriuError(f"writing the snapshot to {out} failed", detail=str(e), code=e.errno)
    else:  # a bug, or a library raising what it should not: the rollback above still ran
        log.exception("checkpoint of %d failed unexpectedly", pid)
        err = ToolError(f"the checkpoint of PID {pid} failed unexpectedly ({type(e).__name__}: {e})")
    if problem is not None:
        return ToolError(f"{err}; then resuming PID {pid} failed too: {problem}")
    err.rolled_back = proc.alive(pid)  # (it may also have exited on its own meanwhile)
    err.transient = err.rolled_back and not (let_go or wrote) and any(t in said for t in TRANSIENT)
    log.info("checkpoint of %d failed; the tree was %s", pid, "resumed where it stood" if err.rolled_back else "gone")
    return err


def _read(path: Path) -> str:
    try:
        return path.read_text(errors="replace")
    except OSError:
        return ""


def _clear(out: Path, created: bool) -> None:
    """Empty what a failed checkpoint wrote into ``out``, and remove ``out`` if it made it."""
    for name in (IMAGES_DIR, LOG_DIR):
        shutil.rmtree(out / name, ignore_errors=True)
    for name in (hook.PENDING, manifest.MANIFEST_NAME, manifest.MANIFEST_NAME + ".tmp"):
        (out / name).unlink(missing_ok=True)
    if created:
        with suppress(OSError):
            out.rmdir()


def _free_bytes(out: Path) -> int:
    """Free bytes on the file system ``out`` is (or would be) on."""
    for at in (out, *out.parents):
        with suppress(OSError):
            return shutil.disk_usage(at).free
    return 0


def _size(n: int) -> str:
    return f"{n / 2**20:.1f} MiB ({n:,} bytes)"


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
) -> RestoreResult:
    """Restore ``directory``.  ``verified``: its checksums were just checked (a receiver does
    that as the data arrives), so only the manifest is read again.  ``work``: CRIU's work
    directory (its log and ``restore.pid``), for a caller that must find them after a crash.
    ``start`` False: the copy is restored but held — stopped (a CPU process), or with its
    GPU still locked (a CUDA process, whose driver restore needs it running) — until
    :func:`start_restored`; a migration lets it go only once the original is let go.
    ``clone``: restore although a copy restored from this snapshot still runs here (noted in
    :data:`RESTORED`): two copies then run, on purpose."""
    require_root()
    asked = {uuid_text(uuid_bytes(k)): uuid_text(uuid_bytes(v)) for k, v in (gpu_map or {}).items()}  # (syntax first)
    timer = _Timer(progress, config.fail_after)
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
    if work is None:
        work = Path(tempfile.mkdtemp(prefix="tpagent-restore-"))
    else:
        private_dir(work, empty=True)  # it is removed afterwards
    try:
        _put_back(directory, m, created)
        with timer.stage(Stage.CRIU_RESTORE):
            root = criu.restore(directory / IMAGES_DIR, work, opts, config.timeouts.restore)
        mapping = _restored_pids(m, root)
        _rearm_timers(m, mapping)
        if cuda is not None:
            with proc.deferred_sigint():
                with timer.stage(Stage.CUDA_RESTORE):
                    for p in m.cuda_pids:
                        _check_restore_thread(cuda, mapping[p])
                        cuda.restore(mapping[p], _gpu_pairs(m, p, norm_map))
                if start:
                    with timer.stage(Stage.CUDA_UNLOCK):
                        for p in m.cuda_pids:
                            cuda.unlock(mapping[p])
    except BaseException as e:
        # Never leave a half-restored copy (e.g. CPU side up, GPU side still in host memory):
        # kill what CRIU started; the snapshot, which restore does not modify, is the copy to retry.
        kill_restored(work)
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
    """Write the carried files back where they were, adding what it creates to ``created``.
    A file already there must hold the same bytes (the same file, or a copy): else the restore
    stops.  As root, on paths users may control: no symlink is followed, the directory must
    belong to root or to the file's owner, setuid/setgid are never restored (:mod:`snapshot.safefs`)."""
    try:
        _write_carried(directory, m, created)
    except (OSError, tarfile.TarError) as e:
        what = getattr(e, "filename", None) or directory / IMAGES_DIR / manifest.CARRIED_NAME
        raise ToolError(
            f"putting back the files the process had open failed at {what}",
            detail=getattr(e, "strerror", None) or str(e),
        ) from e


def _take_back(created: list[Path]) -> None:
    """Remove what :func:`_put_back` created (files, then the directories it made for them)."""
    for path in reversed(created):
        try:
            safefs.remove(path)
        except (OSError, SnapshotError) as e:  # (a directory someone has since put files in)
            log.warning("could not remove %s, which the restore had put back: %s", path, e)


def _write_carried(directory: Path, m: Manifest, created: list[Path]) -> None:
    if not m.carried:
        return
    wanted = {p.lstrip("/"): Path(p) for p in m.carried}
    with tarfile.open(directory / IMAGES_DIR / manifest.CARRIED_NAME) as tar:
        for member in tar.getmembers():
            path = wanted.get(member.name)
            source = tar.extractfile(member) if member.isfile() else None
            if path is None or source is None:
                raise SnapshotInvalid(
                    f"{directory}'s carried files hold {member.name!r}, which the manifest does not name."
                )
            if safefs.write_file(path, source, member.uid, member.gid, member.mode, member.mtime, created,
                                 leftovers.left_behind):  # fmt: skip
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
