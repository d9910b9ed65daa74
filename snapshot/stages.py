"""What the checkpoint (:mod:`snapshot.dump`) and the restore (:mod:`snapshot.restore`) share:
their named steps and how they are undone (:class:`Step`), the stage timer (with its test hook
that fails after a stage), the root check, and giving a stopped tree and its GPU back."""

from __future__ import annotations

import logging
import os
import signal
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Generic, TypeVar

from host import proc, signals
from host.api import UsageError
from snapshot.api import CudaError, ProgressFn, Stage, ToolError
from snapshot.cuda import CudaDriver

log = logging.getLogger(__name__)

CudaFactory = Callable[[], CudaDriver]
LOG_DIR = "log"

#: The state a sequence of steps reads and fills in (one checkpoint attempt, one restore).
S = TypeVar("S")


@dataclass(frozen=True)
class Step(Generic[S]):
    """One named step of a long sequence, as CRIU's CUDA plugin has one hook per step.

    ``name`` says what the step does, so that the sequence reads as a list.  ``undo`` takes
    back what ``do`` did: all of it, the part done (a step may fail half-way), or nothing,
    judging by the state alone, so that a rollback need not know how far the sequence got.
    None: the step leaves nothing to take back (or a tool takes it back itself)."""

    name: str
    do: Callable[[S], None]
    undo: Callable[[S], None] | None = None


def run(steps: Sequence[Step[S]], state: S) -> None:
    """Do ``steps`` in order; should one fail, its error goes to the caller, which rolls back
    with :func:`undo` (and says what failed in its own words)."""
    for step in steps:
        step.do(state)


def undo(steps: Sequence[Step[S]], state: S) -> None:
    """Roll ``steps`` back: every step's undo, the last step's first, whether or not the
    sequence got that far (each undo finds in the state what there is to take back).  An undo
    that fails ends the rollback with its error."""
    for step in reversed(steps):
        if step.undo is not None:
            step.undo(state)


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
    signals.signal_listed(pids, signal.SIGCONT)
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
