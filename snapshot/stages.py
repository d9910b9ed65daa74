"""What the checkpoint (:mod:`snapshot.dump`) and the restore (:mod:`snapshot.restore`) share:
the stage timer (with its test hook that fails after a stage), the root check, and giving a
stopped tree and its GPU back."""

from __future__ import annotations

import logging
import os
import signal
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

from host import proc
from host.api import UsageError
from snapshot.api import CudaError, ProgressFn, Stage, ToolError
from snapshot.cuda import CudaDriver

log = logging.getLogger(__name__)

CudaFactory = Callable[[], CudaDriver]
LOG_DIR = "log"


class InjectedFault(ToolError):
    """Raised by ``SnapshotConfig.fail_after`` (tests of the rollback path)."""

    tool = "test"


def quiet(stage: Stage, msg: str) -> None:
    pass


def require_root() -> None:
    if os.geteuid() != 0:
        raise UsageError("checkpoint and restore need root (CRIU must ptrace and rebuild processes); run as root.")


class Timer:
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


def check_restore_thread(cuda: CudaDriver, pid: int) -> None:
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
                check_restore_thread(cuda, pid)
                cuda.restore(pid)
            if cuda.state(pid).value == "locked":
                cuda.unlock(pid)
        except CudaError as e:
            failures.append(f"PID {pid}: {e}")
    if failures:
        raise CudaError("the GPU could not be given back", detail="; ".join(failures))
