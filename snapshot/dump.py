"""Checkpoint of a process tree: the CUDA driver and CRIU, in the verified order.

CUDA lock -> CUDA checkpoint -> criu dump, during which CRIU's post-dump action
(:mod:`snapshot.hook`) checksums and fsyncs the images and writes the manifest while the
tree is still frozen -> CRIU finishes by mode (kill / leave running / leave stopped).  The
tree is killed only by CRIU and only once the snapshot is sealed; any failure before that
makes CRIU roll back (resume the tree, lift its network lock), and we give the GPU back
(CUDA restore, unlock), so a failed checkpoint never loses the workload.  A refusal CRIU
may not repeat a moment later (:data:`TRANSIENT`) is retried, the tree running meanwhile.
The restore side is :mod:`snapshot.restore`.
"""

from __future__ import annotations

import errno
import itertools
import json
import logging
import os
import shutil
import time
from collections.abc import Sequence
from contextlib import suppress
from pathlib import Path

import psutil

from host import gpus, proc
from host.api import UsageError
from host.safefs import private_dir, private_opener
from snapshot import hook, manifest
from snapshot.api import (
    CriuError,
    CudaError,
    DumpMode,
    Interrupted,
    ProgressFn,
    SnapshotConfig,
    SnapshotError,
    Stage,
    ToolError,
    producer_version,
)
from snapshot.criu import Criu, DumpOptions
from snapshot.cuda import CudaDriver
from snapshot.manifest import IMAGES_DIR, Manifest
from snapshot.stages import LOG_DIR, CudaFactory, Timer, quiet, require_root, resume

log = logging.getLogger(__name__)

#: CRIU's words for a refusal that may not recur a moment later: a worker process (a
#: DataLoader's at an epoch's end) that was exiting as the tree was seized.
TRANSIENT = ("Zombies with threads are not supported",)
#: Seconds before the first retry of such a dump; doubled for each further one.
RETRY_BACKOFF = 0.5


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
    for attempt in range(5):  # (a child that exits as it is looked at, a worker ending: look again)
        try:
            namespace = _namespace_of(target)
            procs = proc.tree(target)
            create_time = target.create_time()
            root_start = proc.start_ticks(pid)
            shell_job = not proc.is_session_leader(pid)
            hidden = [p.pid for p in procs if not proc.session_visible(p.pid)]
            break
        except (psutil.NoSuchProcess, ProcessLookupError, FileNotFoundError) as e:
            if attempt == 4 or not target.is_running():
                raise UsageError(f"PID {pid} exited while it was being examined; nothing was done.") from e
            time.sleep(0.05)
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
    timer = Timer(progress, config.fail_after)
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
