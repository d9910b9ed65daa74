"""The agent's background threads, owned: each is named and tracked, and ``serve`` joins
them at shutdown (migrations first, up to a deadline; then the waiters, which stop at once
when asked: what they wait for is in the journal, and the next run takes it up).

Shutdown begins with ``draining``: from then on every wait on a peer (:meth:`Threads.sleep`)
gives up at once, in a running migration too (a source waiting for a target that does not
answer hands the migration to the journal), so that an unresolved migration never holds up a
SIGTERM; the migrations' own work (a dump, a transfer) goes on up to the deadline.  It ends
with ``stopping``: the running migrations roll back what they still can, the waiters return."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import Any

log = logging.getLogger(__name__)


class Threads:
    def __init__(self) -> None:
        #: Set when shutdown begins: a wait on a peer (:meth:`sleep`) gives up at once.
        self.draining = threading.Event()
        #: Set once the running migrations had their time: waiters return at once, migrations stop.
        self.stopping = threading.Event()
        self._lock = threading.Lock()
        self._running: dict[threading.Thread, str] = {}  # thread -> kind

    def spawn(self, kind: str, name: str, fn: Callable[..., Any], *args: Any) -> threading.Thread:
        """Run ``fn(*args)`` in a thread named ``name``; ``kind`` groups them for shutdown
        ("migration": waited for; anything else: asked to stop).  The threads are daemons
        only so that a forced shutdown can leave them behind (the journal has their state)."""

        def run() -> None:
            try:
                fn(*args)
            except Exception:  # a bug must not pass unseen; the journal still has the state
                log.exception("thread %s failed", name)
            finally:
                with self._lock:
                    self._running.pop(threading.current_thread(), None)

        t = threading.Thread(target=run, name=name, daemon=True)
        with self._lock:
            self._running[t] = kind
        t.start()
        return t

    def sleep(self, seconds: float) -> bool:
        """Wait ``seconds``; True once the agent shuts down (the caller returns: what it waits
        for is journaled, and the next run takes it up)."""
        deadline = time.monotonic() + seconds
        while not self.stopping.wait(min(0.1, max(0.0, deadline - time.monotonic()))):
            if self.draining.is_set():
                return True
            if time.monotonic() >= deadline:
                return False
        return True

    def running(self, kind: str | None = None) -> list[str]:
        with self._lock:
            return sorted(t.name for t, k in self._running.items() if kind is None or k == kind)

    def join(self, timeout: float, kind: str | None = None, give_up: threading.Event | None = None) -> list[str]:
        """Wait up to ``timeout`` for the threads (of ``kind``) to end, or until ``give_up``
        is set; the names of those still running."""
        deadline = time.monotonic() + timeout
        while self.running(kind) and time.monotonic() < deadline and not (give_up is not None and give_up.is_set()):
            time.sleep(0.05)
        return self.running(kind)
