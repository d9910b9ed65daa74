"""A dump whose original is held: the one handle on a migration's frozen original.

:func:`HeldDump.start` runs :func:`snapshot.dump.checkpoint` (mode kill) in a thread of its
own, with the post-dump hook told to hold (:mod:`snapshot.hook`): once the snapshot is sealed
the tree stays frozen, resumable, until a decision.  Only this class knows the hook's files
(``SNAPSHOT/log/{held,pinned,pinned.ack,decision}``) and its environment; an agent that
restarted gets the same handle back with :func:`HeldDump.attach` (no thread: CRIU, if it
still runs, is known by its pidfile in ``log/``)::

    start ─> sealed() ─> pin() ─> commit()    CRIU ends the original (its copy runs elsewhere)
                 └─────────┴────> let_go()    CRIU rolls back: the original runs on where it stood
"""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence
from contextlib import suppress
from dataclasses import replace
from pathlib import Path

from snapshot import criu, hook, leftovers, manifest, stages
from snapshot.api import DumpMode, SnapshotConfig, SnapshotError
from snapshot.dump import checkpoint


class HeldDump:
    def __init__(self, out: Path, thread: threading.Thread | None = None) -> None:
        self.out = out
        self.log_dir = out / stages.LOG_DIR
        self._thread = thread
        self.error: BaseException | None = None

    @classmethod
    def start(
        cls,
        pid: int,
        out: Path,
        config: SnapshotConfig,
        hold: float,
        carry: Sequence[Path] = (),
        started: str | None = None,
    ) -> HeldDump:
        """Freeze and dump ``pid`` into ``out``; the sealed tree is then held up to ``hold``
        seconds (until pinned: then until a decision, however long).  ``started``: the start
        (:func:`host.proc.started`) of the process that was checked under ``pid`` (another one
        there now is refused)."""
        dump = cls(out)

        def run() -> None:
            try:
                checkpoint(pid, out, DumpMode.KILL, replace(config, hold=hold), carry=carry, started=started)
            except BaseException as e:  # handed to whoever holds the handle
                dump.error = e

        dump._thread = threading.Thread(target=run, name=f"dump-{pid}", daemon=True)
        dump._thread.start()
        return dump

    @classmethod
    def attach(cls, out: Path) -> HeldDump:
        """The handle on a dump an earlier run of the agent started (its CRIU may be gone)."""
        return cls(out)

    def failure(self, within: float) -> BaseException | None:
        """Why the dump failed, waiting up to ``within`` for a dump that is failing to say so
        (its files are taken back before it does); None if it has not."""
        if self._thread is not None and self.error is None:
            self._thread.join(within)
        return self.error

    def running(self) -> bool:
        """Whether CRIU still works on the dump (it holds the tree, or is still dumping)."""
        if self._thread is not None:
            return self._thread.is_alive()
        return criu.running_in(self.log_dir)

    def holder_lost(self) -> bool:
        """Whether CRIU ended without a decision (killed, crashed, or the node rebooted): the
        original then runs again, if it still exists."""
        return not self.running() and not (self.log_dir / hook.DECISION_FILE).exists()

    def sealed(self) -> bool:
        """Whether the snapshot is complete on disk and the hook holds the frozen tree."""
        return (self.log_dir / hook.HELD_FILE).exists()

    def whole_here(self) -> bool:
        """Whether every image the seal names is here (a streamed dump's went to its target only)."""
        try:
            files = manifest.load(self.out).files
        except SnapshotError:
            return False
        return all(_size(self.out / name) == entry.get("size") for name, entry in files.items())

    def stopped(self) -> list[int] | None:
        """The processes stopped before the freeze, as the seal says (those a rollback leaves
        stopped); None if it cannot be read."""
        try:
            return [p.pid for p in manifest.load(self.out).processes if p.stopped]
        except SnapshotError:
            return None

    def sealed_at(self) -> float | None:
        """When the snapshot was sealed (the tree frozen and held since), in Unix seconds; None if not."""
        try:
            return (self.log_dir / hook.HELD_FILE).stat().st_mtime
        except OSError:
            return None

    def pin(self, timeout: float = 30.0) -> bool:
        """From now on only a decision ends the hold (a copy may start elsewhere).  True once
        the hook has seen it; False if CRIU let the tree go first: then no copy may start.
        Pinned, the tree stays stopped should CRIU die without a decision (a queued SIGSTOP):
        whoever pinned it sends SIGCONT once it knows the copy does not run."""
        return hook.pin(self.out, self.running, timeout)

    def let_go(self, timeout: float | None = None) -> None:
        """Abort the hold: CRIU rolls the dump back and the original runs on where it stood.
        Waits for CRIU to end (``timeout`` None: however long)."""
        if self._thread is None:
            if self.log_dir.is_dir():
                hook.decide(self.out, commit=False)
            self.wait_released(timeout)
            return
        while self._thread.is_alive():
            # The dump may not have reached its hook yet: the decision waits for it there.
            if self.log_dir.is_dir() and not (self.log_dir / hook.DECISION_FILE).exists():
                with suppress(FileNotFoundError):  # (a failed attempt's directory, removed meanwhile)
                    hook.decide(self.out, commit=False)
            self._thread.join(0.05)

    def commit(self) -> None:
        """CRIU ends the original (its copy runs elsewhere); returns once CRIU has ended."""
        if self.log_dir.is_dir():
            hook.decide(self.out, commit=True)
        if self._thread is not None:
            self._thread.join()
        else:
            self.wait_released(None)
        # Its node-local files live on with the copy: the ones here, untouched, may be replaced
        # by a later return (a stale log must not keep the workload from coming back).
        leftovers.note_left_behind(self.out)
        leftovers.clear_sockets(self.out)

    def wait_released(self, timeout: float | None = 30.0) -> None:
        """Until CRIU no longer works on the dump (``timeout`` None: however long)."""
        wait_released(self.log_dir, timeout)

    def drop_network_lock(self) -> None:
        """Remove the nftables lock CRIU left on the original's TCP connections (they live on
        elsewhere now; here the lock would drop their packets if the workload came back)."""
        criu.drop_network_lock(self.log_dir)


def _size(path: Path) -> int | None:
    try:
        return path.stat().st_size
    except OSError:
        return None


def wait_released(work: Path, timeout: float | None = 30.0) -> None:
    """Until the CRIU working in ``work`` (its -W directory: a dump's ``SNAPSHOT/log``, a
    restore's work directory) has ended (a dump's: once its hook took the decision)."""
    deadline = None if timeout is None else time.monotonic() + timeout
    while deadline is None or time.monotonic() < deadline:
        if not criu.running_in(work):
            return
        time.sleep(0.1)
