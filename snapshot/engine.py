"""Checkpoint and restore of a process tree: the CUDA driver and CRIU, in the verified order.

Checkpoint: CUDA lock -> CUDA checkpoint -> criu dump (tree left stopped) -> checksums and
manifest -> finish by mode (kill / resume / stay stopped).  The tree is only killed once the
snapshot is complete on disk; any failure before that resumes it where it stood
(SIGCONT, CUDA restore, CUDA unlock), so a failed checkpoint never loses the workload.

Restore: verify manifest and checksums -> PIDs free -> criu restore -> CUDA restore (with
the GPU map) -> CUDA unlock.  A failure after CRIU restored the tree kills that copy: the
snapshot, which restore never modifies, is then still the one copy to retry from.
"""

from __future__ import annotations

import logging
import os
import shutil
import signal
import time
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import psutil

from snapshot import gpus, manifest, proc
from snapshot.api import (
    CriuError,
    DumpMode,
    Interrupted,
    ProgressFn,
    SnapshotConfig,
    SnapshotError,
    Stage,
    ToolError,
    UsageError,
)
from snapshot.criu import Criu, DumpOptions, RestoreOptions
from snapshot.cuda import CudaDriver
from snapshot.manifest import IMAGES_DIR, Manifest

log = logging.getLogger(__name__)

CudaFactory = Callable[[], CudaDriver]


class InjectedFault(ToolError):
    """Raised by ``SnapshotConfig.fail_after`` (tests of the rollback path)."""

    tool = "test"


@dataclass(frozen=True)
class RestoreResult:
    pid: int
    pids: tuple[int, ...]
    manifest: Manifest
    timings: dict[str, float]


def _quiet(stage: Stage, msg: str) -> None:
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
        self.timings[stage.value] = round(time.monotonic() - t0, 4)
        self.progress(stage, f"{self.timings[stage.value]:.2f} s")
        if self.fail_after == stage:
            raise InjectedFault(f"fault injected after {stage.value}")


def _check_out(out: Path) -> None:
    if out.exists() and not out.is_dir():
        raise UsageError(f"{out} exists and is not a directory; give an empty or new directory.")
    if out.is_dir() and any(out.iterdir()):
        raise UsageError(f"output directory {out} is not empty; give an empty or new directory.")


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
        init = next(p.pid for p in target.parents() if proc.ns_pids(p.pid)[-1] == 1)
        raise UsageError(
            f"PID {target.pid} lives inside a PID namespace whose init is PID {init}; "
            f"checkpoint the whole namespace by giving PID {init}."
        )
    return True


def resume(pids: list[int], cuda_pids: list[int], cuda: CudaDriver | None) -> None:
    """Resume a tree that checkpoint left stopped: SIGCONT, then give CUDA its GPU back."""
    proc.signal_tree(pids, signal.SIGCONT)
    for pid in cuda_pids:
        assert cuda is not None
        state = cuda.state(pid)
        if state.value == "checkpointed":
            cuda.restore(pid)
            state = cuda.state(pid)
        if state.value == "locked":
            cuda.unlock(pid)


def _kill_tree(pids: list[int], timeout: float = 10.0) -> None:
    proc.signal_tree(pids, signal.SIGKILL)
    gone_by = time.monotonic() + timeout
    while time.monotonic() < gone_by and any(psutil.pid_exists(p) and _alive(p) for p in pids):
        time.sleep(0.02)


def _alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def checkpoint(
    pid: int,
    out: Path,
    mode: DumpMode = DumpMode.KILL,
    config: SnapshotConfig = SnapshotConfig(),
    progress: ProgressFn = _quiet,
    cuda_factory: CudaFactory = CudaDriver,
) -> Manifest:
    """Snapshot the tree rooted at ``pid`` into ``out``; see the module docstring."""
    from tpagent import __version__

    require_root()
    target = proc.validate_target(pid)
    criu = Criu(config.criu)
    namespace = _namespace_of(target)
    _check_out(out)
    procs = proc.tree(target)
    pids = [p.pid for p in procs]
    cuda_pids = [p.pid for p in procs if p.uses_cuda]
    cuda = cuda_factory() if cuda_pids else None
    gpu_list = [g.to_dict() for g in gpus.gpus_of(set(pids))] if cuda_pids else []
    tcp = proc.holds_inet_sockets(pids)
    shell_job = not proc.is_session_leader(pid)
    m = Manifest(
        root_pid=pid,
        namespace=namespace,
        processes=procs,
        gpus=gpu_list,
        criu={"version": criu.version_str, "shell_job": shell_job, "tcp_established": tcp},
        cuda={"driver_version": gpus.driver_version(), "pids": cuda_pids},
        tpagent_version=__version__,
    )
    images = out / IMAGES_DIR
    try:
        images.mkdir(parents=True)
    except OSError as e:
        raise UsageError(f"cannot create {images}: {e.strerror}.") from e
    timer = _Timer(progress, config.fail_after)
    t = config.timeouts
    locked: list[int] = []
    stopped = False
    try:
        if cuda is not None:
            with timer.stage(Stage.CUDA_LOCK):
                for p in cuda_pids:
                    cuda.lock(p, t.cuda_lock)
                    locked.append(p)
            with timer.stage(Stage.CUDA_CHECKPOINT):
                for p in cuda_pids:
                    cuda.checkpoint(p)
        with timer.stage(Stage.CRIU_DUMP):
            stopped = True  # CRIU resumes the tree itself if the dump fails; SIGCONT is harmless
            criu.dump(pid, images, DumpOptions(True, shell_job, tcp, namespace), t.dump)
        with timer.stage(Stage.CHECKSUM):
            m.files = manifest.checksum_files(out)
        m.timings = timer.timings
        m.write(out)
    except BaseException as e:
        _rollback(pids if stopped else [], locked, cuda, images)
        if isinstance(e, SnapshotError):
            e.rolled_back = True
            raise
        if isinstance(e, OSError):
            err: SnapshotError = CriuError(f"writing the snapshot to {out} failed", detail=str(e), code=e.errno)
        elif isinstance(e, KeyboardInterrupt):
            err = Interrupted(f"the checkpoint of PID {pid} was interrupted")
        else:
            raise
        err.rolled_back = True
        raise err from e
    if mode is DumpMode.KILL:
        _kill_tree(pids)
    elif mode is DumpMode.LEAVE_RUNNING:
        resume(pids, cuda_pids, cuda)
    return m


def _rollback(pids: list[int], locked: list[int], cuda: CudaDriver | None, images: Path) -> None:
    """Put a half-frozen tree back to running, and drop the partial images."""
    try:
        with proc.deferred_sigint():  # a second Ctrl-C must not cut the rollback short
            resume(pids, locked, cuda)
    finally:
        for p in images.iterdir():
            if p.name != "dump.log":
                shutil.rmtree(p) if p.is_dir() else p.unlink()
        (images.parent / (manifest.MANIFEST_NAME + ".tmp")).unlink(missing_ok=True)
        log.info("checkpoint failed; the process tree was resumed where it stood")


def _check_gpu_map(m: Manifest, gpu_map: Mapping[str, str]) -> dict[str, str]:
    from snapshot.cuda import uuid_text, uuid_bytes

    norm = {uuid_text(uuid_bytes(k)): uuid_text(uuid_bytes(v)) for k, v in gpu_map.items()}
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


def _kill_restored(images: Path) -> None:
    try:
        root = int((images / "restore.pid").read_text())
        tree = [root, *(c.pid for c in psutil.Process(root).children(recursive=True))]
    except (OSError, ValueError, psutil.NoSuchProcess):
        return
    _kill_tree(tree)


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
    progress: ProgressFn = _quiet,
    cuda_factory: CudaFactory = CudaDriver,
) -> RestoreResult:
    require_root()
    timer = _Timer(progress, config.fail_after)
    with timer.stage(Stage.VERIFY):
        m = manifest.load(directory)
        manifest.verify(directory, m)
    criu = Criu(config.criu)
    theirs = tuple(int(x) for x in str(m.criu["version"]).split("."))
    if theirs[:2] > criu.version[:2]:
        raise UsageError(
            f"the snapshot was written by CRIU {m.criu['version']}, this node has CRIU "
            f"{criu.version_str}, which cannot read it: install a newer CRIU here."
        )
    norm_map = _check_gpu_map(m, gpu_map or {})
    cuda = cuda_factory() if m.cuda_pids else None
    if not m.namespace:
        proc.wait_pids_free([p.pid for p in m.processes], config.timeouts.pid_wait)
    opts = RestoreOptions(bool(m.criu["shell_job"]), bool(m.criu["tcp_established"]), m.namespace)
    try:
        with timer.stage(Stage.CRIU_RESTORE):
            root = criu.restore(directory / IMAGES_DIR, opts, config.timeouts.restore)
        mapping = _restored_pids(m, root)
        if cuda is not None:
            with timer.stage(Stage.CUDA_RESTORE):
                for p in m.cuda_pids:
                    cuda.restore(mapping[p], norm_map)
            with timer.stage(Stage.CUDA_UNLOCK):
                for p in m.cuda_pids:
                    cuda.unlock(mapping[p])
    except BaseException as e:
        # Never leave a half-restored copy (e.g. CPU side up, GPU side still in host memory):
        # kill what CRIU started; the snapshot, which restore does not modify, is the copy to retry.
        _kill_restored(directory / IMAGES_DIR)
        if isinstance(e, KeyboardInterrupt):
            raise Interrupted(f"the restore of {directory} was interrupted; nothing was left running") from e
        raise
    return RestoreResult(root, tuple(mapping.values()), m, timer.timings)
