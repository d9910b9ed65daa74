"""A small, honest stand-in for the CUDA driver's checkpoint API, for machines without a GPU.

It enforces the driver's documented state machine per PID (RUNNING -lock-> LOCKED
-checkpoint-> CHECKPOINTED -restore-> LOCKED -unlock-> RUNNING) and refuses any call out of
order, so engine tests with real CRIU prove the *order* of calls and the rollback; the real
driver is exercised by tests/snapshot/test_gpu.py on a GPU machine.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

from snapshot.api import CudaError
from snapshot.cuda import CudaState

_MOVES = {
    "lock": (CudaState.RUNNING, CudaState.LOCKED),
    "checkpoint": (CudaState.LOCKED, CudaState.CHECKPOINTED),
    "restore": (CudaState.CHECKPOINTED, CudaState.LOCKED),
    "unlock": (CudaState.LOCKED, CudaState.RUNNING),
}


class FakeCudaDriver:
    def __init__(self, fail_on: str | None = None, contexts: set[int] | None = None) -> None:
        self.states: dict[int, CudaState] = {}
        #: The processes with a CUDA context (None: every process asked about has one).
        self.contexts = contexts
        self.calls: list[tuple[str, int]] = []
        self.gpu_maps: list[Mapping[str, str] | None] = []
        self.fail_on = fail_on
        #: Called as the engine asks for a process's restore thread (a test's way to stop it).
        self.on_restore_thread: Callable[[int], None] | None = None
        #: Called once a process is checkpointed (a test's way to act while the GPU is frozen).
        self.on_checkpoint: Callable[[int], None] | None = None

    def _move(self, op: str, pid: int) -> None:
        self.calls.append((op, pid))
        before, after = _MOVES[op]
        state = self.states.get(pid, CudaState.RUNNING)
        if state is not before:
            raise AssertionError(f"{op} of PID {pid} in state {state.value}: the driver would refuse")
        if op == self.fail_on:
            raise CudaError(f"CUDA {op} of PID {pid} failed", detail="CUDA_ERROR_INJECTED", code=999)
        self.states[pid] = after

    def state(self, pid: int) -> CudaState:
        if self.contexts is not None and pid not in self.contexts:
            raise CudaError(f"CUDA state query of PID {pid} failed", detail="CUDA_ERROR_NOT_FOUND", code=500)
        return self.states.get(pid, CudaState.RUNNING)

    def lock(self, pid: int, timeout: float) -> None:
        assert timeout > 0
        self._move("lock", pid)

    def checkpoint(self, pid: int) -> None:
        self._move("checkpoint", pid)
        if self.on_checkpoint is not None:
            self.on_checkpoint(pid)

    def restore(self, pid: int, gpu_map: Mapping[str, str] | None = None) -> None:
        self.gpu_maps.append(gpu_map)
        self._move("restore", pid)

    def unlock(self, pid: int) -> None:
        self._move("unlock", pid)

    def restore_thread_id(self, pid: int) -> int:
        """The real driver's restore thread is one it started inside the process; here: its main thread."""
        if self.on_restore_thread is not None:
            self.on_restore_thread(pid)
        return pid
