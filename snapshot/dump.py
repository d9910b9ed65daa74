"""Checkpoint of a process tree: the CUDA driver and CRIU, in the verified order.

CUDA lock -> CUDA checkpoint -> criu dump, during which CRIU's post-dump action
(:mod:`snapshot.hook`) checksums and fsyncs the images and writes the manifest while the
tree is still frozen -> CRIU finishes by mode (kill / leave running / leave stopped).  The
tree is killed only by CRIU and only once the snapshot is sealed; any failure before that
makes CRIU roll back (resume the tree, lift its network lock), and we give the GPU back
(CUDA restore, unlock), so a failed checkpoint never loses the workload.  A refusal CRIU
may not repeat a moment later (:data:`TRANSIENT`) is retried, the tree running meanwhile.
"""

from __future__ import annotations

import itertools
import json
import logging
import os
import shutil
import time
from collections.abc import Sequence
from contextlib import suppress
from dataclasses import dataclass, field
from pathlib import Path

import psutil

from host import ends, forked, gpus, namespaces, proc, signals
from host.api import UsageError
from host.claims import Claims
from host.safefs import private_dir, private_opener
from snapshot import failures, hook, manifest, stages
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
from snapshot.cuda import CudaDriver, has_context
from snapshot.manifest import IMAGES_DIR, Manifest
from snapshot.stages import LOG_DIR, CudaFactory, Step, Timer, quiet, require_root, resume
from snapshot.streamer import Capture

log = logging.getLogger(__name__)

#: CRIU's words for a refusal that may not recur a moment later: a worker process (a
#: DataLoader's at an epoch's end) that was exiting as the tree was seized; one forked from a
#: CUDA process between the removal of the driver's leftovers and CRIU's seizing of the tree.
TRANSIENT = ("Zombies with threads are not supported", "Can't handle non-regular mapping")
#: Seconds before the first retry of such a dump; doubled for each further one.
RETRY_BACKOFF = 0.5


def checkpoint(
    pid: int,
    out: Path,
    mode: DumpMode = DumpMode.KILL,
    config: SnapshotConfig = SnapshotConfig(),
    progress: ProgressFn = quiet,
    cuda_factory: CudaFactory = CudaDriver,
    carry: Sequence[Path] = (),
    started: str | None = None,
) -> Manifest:
    """Snapshot the tree rooted at ``pid`` into ``out``; see the module docstring.
    ``carry``: files (absolute) to archive with it, as they are while it is frozen.
    ``started``: the start of the process the caller checked under ``pid``
    (:func:`host.proc.started`); should the PID now be another's (reused), nothing is done.
    CRIU's post-dump hook checks it again while the tree is frozen.

    A dump that CRIU refuses for a passing reason (:data:`TRANSIENT`) before it wrote
    anything is tried again, once the tree runs again, up to ``config.dump_retries`` times."""
    require_root()
    with Claims() as claims:  # (held across the attempts: no other dump meanwhile)
        claims.take([pid])
        for attempt in itertools.count(1):
            try:
                return _checkpoint(pid, out, mode, config, progress, cuda_factory, carry, started, claims)
            except SnapshotError as e:
                if not e.transient or attempt > config.dump_retries:
                    raise
                delay = RETRY_BACKOFF * 2 ** (attempt - 1)
                if started is None:  # the tree was just resumed: the PID is still its root's
                    with suppress(OSError):
                        started = proc.started(pid)
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


@dataclass(frozen=True)
class _Tree:
    """What the examination of the tree found, before anything is done to it."""

    namespace: bool
    mounts: bool  # (its mount namespace is not the node's: CRIU takes every mount as external)
    procs: list[proc.ProcInfo]
    create_time: float  # (the wall clock's: shown, never compared)
    root_start: int
    shell_job: bool
    warnings: list[str]  # (found before the freeze: :func:`host.ends.shared_offsets`)


@dataclass
class _Dump:
    """One attempt of a checkpoint, as its steps read and fill it in."""

    pid: int
    out: Path
    mode: DumpMode
    config: SnapshotConfig
    criu: Criu
    timer: Timer
    tree: _Tree
    #: ``out`` was not there: a failed attempt removes it again (else leaves it empty).
    created: bool
    pids: list[int]
    cuda: CudaDriver | None
    cuda_pids: list[int]
    manifest: Manifest
    #: Processes without a CUDA context holding the driver's mappings (forked after CUDA started).
    leftovers: list[forked.Leftover] = field(default_factory=list)
    #: The post-dump hook CRIU runs (:func:`snapshot.hook.install`).
    script: Path | None = None
    #: The CUDA processes a lock was asked for (each is given its GPU back on a rollback).
    locked: list[int] = field(default_factory=list)
    #: CRIU has finished: from then on the snapshot is the copy to keep.
    dumped: bool = False
    #: When criu dump started (monotonic): its stage's time is CRIU's, less the hook's checksum.
    dump_started: float = 0.0
    sealed: Manifest | None = None
    #: CRIU's images went to ``config.stream`` (:mod:`snapshot.streamer`), some of them already.
    streamed: bool = False

    @property
    def log_dir(self) -> Path:
        return self.out / LOG_DIR


def _checkpoint(
    pid: int,
    out: Path,
    mode: DumpMode,
    config: SnapshotConfig,
    progress: ProgressFn,
    cuda_factory: CudaFactory,
    carry: Sequence[Path],
    checked: str | None,
    claims: Claims,
) -> Manifest:
    """One attempt of :func:`checkpoint`: look at the tree (nothing done yet: a refusal needs
    no undo), claim it, prepare ``out``, then the steps of :data:`FREEZE_AND_DUMP`, then finish."""
    target = proc.validate_target(pid)
    criu = Criu(config.criu)
    tree = _examine(target, checked, config.ghost_limit)
    claims.take([p.pid for p in tree.procs])
    job = _plan(tree, pid, out, mode, config, criu, progress, cuda_factory, carry)
    _prepare_out(job)  # undo: _clear (on its own failure; else in _rolled_back)
    script = hook.install()
    job.script = script
    try:
        sealed = _freeze_and_dump(job)  # undo: _rolled_back, until CRIU has finished
    finally:  # (the hook's script, and the manifest it was to seal, whatever happened)
        shutil.rmtree(script.parent, ignore_errors=True)
        (job.out / hook.PENDING).unlink(missing_ok=True)
    with signals.deferred_sigint() as late:  # (the tree may run again: its GPU is given back, whatever comes)
        _record_timings(job, sealed)
        if mode is DumpMode.LEAVE_RUNNING and job.cuda is not None:
            _give_gpu_back(job)
        late.consume()  # (an interrupt now comes too late: the snapshot is complete, the tree as asked)
    return sealed


def _examine(target: psutil.Process, checked: str | None, ghost_limit: int) -> _Tree:
    """Look at the tree rooted at ``target``; refuse one CRIU cannot dump, or a root that is
    no longer the process the caller checked (``checked``: its :func:`host.proc.started`)."""
    pid = target.pid
    for attempt in range(5):  # (a child that exits as it is looked at, a worker ending: look again)
        try:
            namespace = namespaces.own_pid_namespace(target)
            procs = proc.tree(target)
            mounts = namespaces.own_mounts([p.pid for p in procs], namespace)
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
    cannot = ends.unmovable([p.pid for p in procs], ghost_limit=ghost_limit)
    if cannot:
        raise UsageError(f"{cannot[0]} Nothing was done.")
    if checked is not None and not proc.is_started(pid, checked):
        raise UsageError(
            f"PID {pid} is no longer the process that was checked (that one exited and its PID was reused); "
            "nothing was done."
        )
    return _Tree(
        namespace, mounts, procs, create_time, root_start, shell_job, ends.shared_offsets([p.pid for p in procs])
    )


def _plan(
    tree: _Tree,
    pid: int,
    out: Path,
    mode: DumpMode,
    config: SnapshotConfig,
    criu: Criu,
    progress: ProgressFn,
    cuda_factory: CudaFactory,
    carry: Sequence[Path],
) -> _Dump:
    """Refuse an ``out`` that is not ours and empty (before anything is done), find the CUDA
    processes, and make the manifest the hook is to seal."""
    created = not out.exists()
    out = private_dir(out, empty=True, create=False)  # (refused before anything is done)
    pids = [p.pid for p in tree.procs]
    candidates = [p.pid for p in tree.procs if p.uses_cuda]
    cuda = cuda_factory() if candidates else None
    cuda_pids = [p for p in candidates if cuda is not None and has_context(cuda, p)]
    leftovers = forked.find(pids, cuda_pids, config.gpu_devices)
    refused = forked.refusals(leftovers, cuda_pids, config.gpu_devices)
    if refused:
        raise UsageError(f"{refused[0]} Nothing was done.")
    m = Manifest(
        root_pid=pid,
        namespace=tree.namespace,
        processes=tree.procs,
        gpus=[g.to_dict() for g in gpus.gpus_of(set(pids))] if cuda_pids else [],
        criu={
            "version": criu.version_str,
            "shell_job": tree.shell_job,
            "tcp_established": proc.holds_inet_sockets(pids),
            "mounts": tree.mounts,
        },
        cuda={
            "driver_version": gpus.driver_version(),
            "pids": cuda_pids,
            "forked": [left.to_dict() for left in leftovers],
        },
        tpagent_version=producer_version(),
        origin={
            "mode": mode.value,
            "root_create_time": tree.create_time,
            "root_started": f"{tree.root_start}@{proc.boot_id()}",
        },
        carried=sorted({os.path.normpath(os.path.abspath(p)) for p in carry}),
        warnings=tree.warnings,
    )
    timer = Timer(progress, config.fail_after)
    return _Dump(pid, out, mode, config, criu, timer, tree, created, pids, cuda, cuda_pids, m, leftovers)


def _prepare_out(job: _Dump) -> None:
    """Make ``out``'s folders and write the pending manifest.  Undo: :func:`_clear` (here,
    should this fail; in :func:`_rolled_back` once the hook's words are read)."""
    out = job.out
    try:
        private_dir(out, empty=True)  # ours, 0700, empty: never a directory someone planted
        (out / IMAGES_DIR).mkdir(mode=0o700)
        (out / LOG_DIR).mkdir(mode=0o700)
        with open(out / hook.PENDING, "w", opener=private_opener) as f:
            c = job.config
            f.write(json.dumps({**job.manifest.to_json(), hook.OPENED: c.carry_opened, hook.MOST: c.carry_most}))
    except OSError as e:
        _clear(out, job.created)
        raise UsageError(f"cannot write to {out}: {e.strerror}.") from e


def _strip_forked(job: _Dump) -> None:
    """Unmap and close, inside each forked child without a CUDA context, what it kept of the GPU
    driver (:mod:`host.forked`: nothing it may still use).
    Done once the GPU is frozen, just before CRIU, on the tree as it is then: a parent may have
    forked workers meanwhile (a DataLoader's next epoch; once locked, its next CUDA call waits,
    so it forks no more).  A child new since the plan that is refused (one sharing a CUDA
    process's memory) fails the checkpoint, which rolls back.  Nothing to undo: the children run
    on without them."""
    devices = job.config.gpu_devices
    now = forked.find(proc.tree_pids(job.pid), job.cuda_pids, devices) if job.cuda is not None else []
    if not now:
        return
    with job.timer.stage(Stage.FORKED_CHILDREN):
        seen = {left.pid for left in job.leftovers}
        # (the CUDA processes hold no descriptors now: whose a new child's are can no longer be told)
        refused = forked.refusals([n for n in now if n.pid not in seen], job.cuda_pids, devices, own_fds=False)
        if refused:
            raise UsageError(refused[0])
        failed = forked.remove_all(now, job.config.timeouts.stop)
        if failed is not None:
            raise ToolError(failed)


def _freeze_gpu(job: _Dump) -> None:
    """CUDA lock, then CUDA checkpoint (GPU memory into host memory), of every CUDA process."""
    if job.cuda is None:
        return
    with signals.deferred_sigint():  # never leave the driver half-way through a call
        with job.timer.stage(Stage.CUDA_LOCK):
            for p in job.cuda_pids:
                job.locked.append(p)  # first: a lock that times out leaves it running, which resume() sees
                job.cuda.lock(p, job.config.timeouts.cuda_lock)
        with job.timer.stage(Stage.CUDA_CHECKPOINT):
            for p in job.cuda_pids:
                job.cuda.checkpoint(p)


def _thaw(job: _Dump) -> None:
    """Resume the tree but what was stopped before (CRIU does so itself when it fails: this
    matters only if CRIU died) and give each process whose GPU was locked its GPU back.  Not a
    held tree once pinned (its copy may run elsewhere) but on an abort: its pinner resumes it."""
    if hook.may_run(job.out):
        resume([p.pid for p in job.tree.procs if not p.stopped], job.locked, job.cuda)


def _criu_dump(job: _Dump) -> None:
    """criu dump; its post-dump hook checksums, fsyncs and seals the images while the tree is
    still frozen, then CRIU ends the tree (or leaves it) by its mode.  With ``config.stream`` CRIU
    hands its images to a :class:`~snapshot.streamer.Capture` (not a tree with a CUDA context)."""
    config = job.config
    stream = config.stream is not None and not job.cuda_pids
    capture = Capture(job.out / IMAGES_DIR, config.stream, log_dir=job.log_dir) if stream else None
    env = _hook_env(job) | ({"TPAGENT_HOOK_STREAMED": "1"} if capture is not None else {})
    job.timer.progress(Stage.CRIU_DUMP, "")
    job.dump_started = time.monotonic()
    tcp = bool(job.manifest.criu["tcp_established"])
    t = job.tree
    skip = config.skip_mounts if t.mounts else ()
    opts = DumpOptions(job.mode, t.shell_job, tcp, t.mounts, job.script, env, config.ghost_limit, stream, skip)
    # A Ctrl-C now makes the post-dump hook fail, and CRIU roll back; once the snapshot is sealed, it is too late.
    with signals.deferred_sigint(on_interrupt=(job.log_dir / hook.CANCEL_FILE).touch) as interrupt:
        try:
            timeout = config.timeouts.dump if config.hold is None else None
            job.criu.dump(job.pid, job.out / IMAGES_DIR, job.log_dir, opts, timeout, job.log_dir / hook.CANCEL_FILE)
        except CriuError as e:
            if (sealing := job.log_dir / hook.ERROR_FILE).exists():
                e.detail = f"sealing the snapshot failed: {sealing.read_text(errors='replace')}"
            elif capture is not None and capture.error is not None:
                e.detail = f"{e.detail}; streaming its images failed: {capture.error}"
            raise
        finally:
            job.streamed = capture is not None and capture.finish(30)
        job.dumped = True
        if interrupt.consume():
            log.warning("interrupted after the snapshot of %d was sealed: finishing it", job.pid)


def _hook_env(job: _Dump) -> dict[str, str]:
    """What the post-dump hook is told: where the snapshot goes, the root it must still find."""
    env = {
        "TPAGENT_HOOK_OUT": str(job.out.absolute()),
        "TPAGENT_HOOK_ROOT": str(job.pid),
        "TPAGENT_HOOK_ROOT_START": str(job.tree.root_start),
    }
    if job.config.fail_after is Stage.CHECKSUM:
        env["TPAGENT_HOOK_FAIL"] = "1"
    if job.config.hold is not None:
        env["TPAGENT_HOOK_HOLD"] = str(job.config.hold)
    return env


def _read_back(job: _Dump) -> None:
    """Load the manifest the hook sealed."""
    job.sealed = manifest.load(job.out)


#: A checkpoint once ``out`` is prepared, in order, each step with its undo: should any fail
#: before CRIU finished, :func:`_rolled_back` undoes them all; after, the snapshot is kept.
FREEZE_AND_DUMP: tuple[Step[_Dump], ...] = (
    Step("freeze the GPU (CUDA lock, CUDA checkpoint)", _freeze_gpu, undo=_thaw),
    Step("remove the GPU driver's leftovers from forked children", _strip_forked),
    # (undo: CRIU's own, on its failure: it resumes the tree and lifts its network lock)
    Step("criu dump, its hook sealing the snapshot", _criu_dump),
    Step("read the sealed manifest back", _read_back),
)


def _freeze_and_dump(job: _Dump) -> Manifest:
    """The steps of :data:`FREEZE_AND_DUMP`; the sealed manifest."""
    try:
        stages.run(FREEZE_AND_DUMP, job)
    except BaseException as e:
        if job.dumped:  # the tree is ended (or left) by its mode: never delete the only copy
            raise ToolError(
                f"CRIU finished the snapshot of PID {job.pid} (mode {job.mode.value}), but reading it back failed; "
                f"the snapshot is kept in {job.out}",
                detail=str(e),
            ) from e
        raise _rolled_back(e, job) from e
    assert job.sealed is not None
    return job.sealed


def _record_timings(job: _Dump, sealed: Manifest) -> None:
    """Add the stages' times to the sealed manifest (CRIU's own without the hook's checksum)."""
    checksum = sealed.timings.get("checksum", 0.0)
    job.timer.record(Stage.CRIU_DUMP, time.monotonic() - job.dump_started - checksum)
    job.timer.record(Stage.CHECKSUM, checksum)
    sealed.timings = job.timer.timings
    try:
        sealed.write(job.out)
    except OSError as e:  # the sealed manifest is in place; only the timings are missing
        log.warning("could not add timings to %s: %s", job.out, e)


def _give_gpu_back(job: _Dump) -> None:
    """Mode leave-running: CRIU resumed the CPU side itself; give the GPU back."""
    try:
        resume([], job.cuda_pids, job.cuda)  # (in checkpoint's region that holds an interrupt back)
    except CudaError as e:
        raise CudaError(
            f"the snapshot in {job.out} is complete, but PID {job.pid} could not be given its GPU back",
            detail=e.detail,
        ) from e


def _rolled_back(e: BaseException, job: _Dump) -> BaseException:
    """Undo a failed checkpoint; return the error to raise (``rolled_back`` says if it worked,
    ``transient`` that the same dump may work a moment later).

    CRIU has already resumed the tree and lifted its network lock on its own failure; the
    SIGCONT here only matters if CRIU itself died.  What is left is the GPU side, and ``out``:
    left as it was found (absent if ``created``, else empty), so that the same command can
    be run again."""
    pid = job.pid
    out = job.out
    if not proc.alive(pid) and (out / manifest.MANIFEST_NAME).exists():
        # CRIU failed after its hook sealed the snapshot and the tree ended: the only copy, and complete.
        return ToolError(
            f"CRIU reported a failure after PID {pid} had been checkpointed and ended; "
            f"its sealed snapshot is kept in {out}: restore it from there",
            detail=str(e),
        )
    problem = None
    try:
        with signals.deferred_sigint():  # a second Ctrl-C must not cut the rollback short
            stages.undo(FREEZE_AND_DUMP, job)
    except (CudaError, KeyboardInterrupt) as r:
        problem = str(r) or "interrupted"
    said = f"{e} {failures.read(job.log_dir / hook.ERROR_FILE)}"
    cancelled = isinstance(e, KeyboardInterrupt) or hook.cancelled(job.log_dir)
    let_go = cancelled or (job.log_dir / hook.DECISION_FILE).exists()  # (a holder's abort)
    wrote = job.streamed or any((out / IMAGES_DIR).glob("*"))  # (a sender may have read or sent them)
    # CRIU's log is in ``out`` too: the disk that ran out may have cut the very line that says so
    # ("Unable to spice data: No", in its words), so what CRIU left free there says it as well.
    full = isinstance(e, CriuError) and failures.free_bytes(out, as_root=True) == 0
    _clear(out, job.created)  # a partial snapshot must never look restorable
    err = failures.why(e, job.pid, out, job.pids, said, cancelled, full)
    if problem is not None:
        return ToolError(f"{err}; then resuming PID {pid} failed too: {problem}")
    err.rolled_back = proc.alive(pid)  # (it may also have exited on its own meanwhile)
    err.transient = err.rolled_back and not (let_go or wrote) and any(t in said for t in TRANSIENT)
    log.info("checkpoint of %d failed; the tree was %s", pid, "resumed where it stood" if err.rolled_back else "gone")
    return err


def _clear(out: Path, created: bool) -> None:
    """Empty what a failed checkpoint wrote into ``out``, and remove ``out`` if it made it."""
    for name in (IMAGES_DIR, LOG_DIR):
        shutil.rmtree(out / name, ignore_errors=True)
    for name in (hook.PENDING, manifest.MANIFEST_NAME, manifest.MANIFEST_NAME + ".tmp"):
        with suppress(OSError):  # (nothing there, or a filesystem that takes no change: a read-only one)
            (out / name).unlink()
    if created:
        with suppress(OSError):
            out.rmdir()
