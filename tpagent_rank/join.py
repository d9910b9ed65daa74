"""A model-aware move, as the ranks see it (issue 27, item 2): a fresh process of a rank's
command takes the place of the rank, with the rank's registered training state
(:mod:`tpagent_rank.aware`) in place of its process image.

* **The joiner** is started by an agent with ``TPAGENT_RANK_JOIN=1`` beside the usual rank
  environment.  It runs the script from its start, on its own: its groups are local
  (:mod:`tpagent_rank.solo`: no peer is reached, the job's store is only read), and its
  standard output goes nowhere (what it computes is not the job's).  So its wrappers set
  themselves up by the script's own code (DDP builds its buckets in its first step and rebuilds
  them in its second).  After ``warmup`` optimizer steps it waits at its step post-hook
  (:data:`~tpagent_rank.protocol.RankState.WAITING`) for a state (``load``), takes it on the
  training thread with the script's ``load``, and then stands as the rank it replaces stood,
  parked at the boundary with its communicators to be built (``rebuild``, ``resume``).  Its
  output is its own again from its first collective in the job.
* **The leaving rank**, parked at the agreed boundary, gives its state (``save``: its
  ``save``, on the training thread) and, once the joiner is in, is told to ``retire``: it runs
  the rest of its step (what it prints there is the job's, as the joiner's is not yet), and
  ends before its next collective or step, before any of it runs.

The state and the script's position meet at the optimizer step post-hook: the script's loop
must run on what it registers (its step, its data position), as it would to resume from a
checkpoint.  Standard library only at import.
"""

from __future__ import annotations

import contextlib
import dataclasses
import mmap
import os
import sys
import threading
import time
from typing import Any, BinaryIO

from tpagent_rank import protocol as P
from tpagent_rank.notice import PREFIX

#: A rank is a :class:`tpagent_rank.agent.Rank` (not imported: that module imports this one).
Rank = Any

#: What a joiner answers before it is in the job (the rest would act on a rank it is not yet).
ASKED_OF_A_JOINER = frozenset({P.Op.WHERE, P.Op.PEERS, P.Op.END})
#: The most steps a joiner warms up past its ``warmup`` waiting for its DDP to rebuild its
#: buckets (a module only ever run without gradients never does: then it goes on without).
SETTLE_MAX = 20
#: The joiner's own standard output while it is quiet (None: it is not).
_STDOUT: list[int | None] = [None]
#: Whether this process is a joiner not yet in the job (quiet until :func:`speak`).
_JOINING = [False]


def joining() -> bool:
    """Whether this process is a fresh one taking a rank's place in a model-aware move, not yet in
    the job: it runs the script's first steps on its own, and the rest of the step at which it
    takes the state on its own values.  What it does meanwhile is not the job's: its standard
    output goes nowhere, and a script skips its other side effects (its own log files, a metrics
    service) while this is true."""
    return _JOINING[0]


def quiet() -> None:
    """The joiner's standard output goes nowhere until :func:`speak` (called at start-up)."""
    _JOINING[0] = True
    if _STDOUT[0] is not None:
        return
    try:
        saved = os.dup(1)
        devnull = os.open(os.devnull, os.O_WRONLY | os.O_CLOEXEC)
    except OSError:  # (no standard output to speak of)
        return
    os.set_inheritable(saved, False)
    os.dup2(devnull, 1)
    os.close(devnull)
    _STDOUT[0] = saved


def speak() -> None:
    """Its standard output is its own again (what was buffered while quiet is dropped)."""
    _JOINING[0] = False
    saved = _STDOUT[0]
    if saved is None:
        return
    _STDOUT[0] = None
    with contextlib.suppress(OSError, ValueError):
        sys.stdout.flush()
    os.dup2(saved, 1)
    os.close(saved)


class Joining:
    """A joiner's warm-up and the state it waits for (the training thread and the connection's
    thread meet here, under the rank's ``cond``)."""

    def __init__(self) -> None:
        self.steps = 0
        self.waiting = False
        self.request: P.Load | None = None
        self.payload: BinaryIO | None = None  # (a file in memory: closed once read)
        self.outcome: str | None = None  # "" taken; else why not
        self.answered = threading.Event()  # its agent has the answer to its load
        from tpagent_rank import recover

        inherited = recover.inherited()  # (a rank restarted in its own process: the state it held)
        if inherited is not None:
            self.request, self.payload = inherited

    def stepped(self, rank: Rank) -> None:
        """The training thread, at an optimizer step post-hook of the joiner."""
        from tpagent_rank import aware

        self.steps += 1
        reg = aware.registration()
        warmup = reg.warmup if reg is not None else aware.WARMUP
        if self.steps < warmup or (self.steps < warmup + SETTLE_MAX and aware.settling()):
            return
        with rank.cond:
            self.waiting = True
            rank.cond.notify_all()
            deadline = time.monotonic() + rank.park_timeout
            while self.payload is None:
                if rank.ended or time.monotonic() > deadline:
                    why = rank.ended or f"no state came in {rank.park_timeout:.0f} s"
                    raise RuntimeError(f"{PREFIX}it was started to take a rank's place, but {why}")
                rank.cond.wait(0.5)
            request = self.request
            payload = self.payload
        assert request is not None
        try:
            error = _other_groups(request)
            if not error:
                aware.read_state(payload)
        except Exception as e:  # (the user's load, or a state it cannot read: said to the agent)
            error = f"{type(e).__name__}: {e}"
        finally:
            payload.close()
        with rank.cond:
            self.outcome = error
            rank.cond.notify_all()
            if not error:
                self._stand(rank, request)
                return
        self.answered.wait(10.0)  # (its agent hears why before the process ends)
        raise RuntimeError(f"{PREFIX}it could not take the state of rank {rank.rank}: {error}")

    @staticmethod
    def _stand(rank: Rank, request: P.Load) -> None:
        """Stand as the rank replaced stood: parked at its step, communicators to be built."""
        from tpagent_rank import backend, recover

        rank.join = None
        rank.step = request.step
        rank.collectives = request.collectives
        rank.stop_at = request.step
        rank.unit = P.Unit.STEP.value
        rank.torn = True
        backend.joined()
        # What it took is the state it holds, should its job lose a rank again.
        recover.capture(rank, lambda: len(backend.GROUPS.live()))
        rank.park(f"step {rank.step}")

    def load(self, rank: Rank, request: P.Load, payload: BinaryIO) -> P.Answer:
        """The connection's thread: hand the state over, and wait until it is taken."""
        with rank.cond:
            if self.payload is not None:
                payload.close()
                return P.failed("it was given a state already")
            self.request = request
            self.payload = payload
            rank.cond.notify_all()
            deadline = time.monotonic() + rank.park_timeout
            while self.outcome is None:
                if time.monotonic() > deadline or rank.closing.is_set():
                    if self.outcome is None and self.payload is payload:  # (not taken: never taken later)
                        self.payload = None
                        self.request = None
                        payload.close()
                    return P.failed(f"it did not take the state in {rank.park_timeout:.0f} s")
                rank.cond.wait(0.5)
        return P.failed(self.outcome) if self.outcome else P.Answer()


def save(rank: Rank, request: P.Save) -> tuple[P.Saved, bytes]:
    """A parked rank's registered state (its ``save``, run on the training thread), or
    (``held``) the state it holds of its last boundary (:mod:`tpagent_rank.recover`): offered to
    its joiner (:mod:`tpagent_rank.handover`), or returned to follow the answer's line."""
    from tpagent_rank import aware, backend, handover, recover

    if request.listen and not handover.valid_secret(request.secret):
        return P.Saved(ok=False, error="a state offered on the network needs a secret of 32 to 128 hex digits"), b""
    if aware.registration() is None:
        return P.Saved(ok=False, error="it registered no training state (tpagent_rank.register)"), b""
    if request.held:
        taken = recover.held_file(rank)
        if isinstance(taken, str):
            return P.Saved(ok=False, error=taken), b""
        held, out = taken  # (kept open: the process it restarts as takes it too)
        size = os.fstat(out.fileno()).st_size
        saved = P.Saved(size=size, step=held.step, collectives=held.collectives, groups=held.groups)
        return _offered(saved, out, request)
    if rank.unit != P.Unit.STEP.value:
        return P.Saved(ok=False, error="a state is taken at an optimizer step; it stopped at a collective"), b""
    with aware.memory_file() as out:  # (in memory, never on a disk; mapped, not copied, to be sent)
        error = rank.on_training_thread(lambda: aware.write_state(out))
        if error:
            return P.Saved(ok=False, error=error), b""
        out.flush()
        groups = len(backend.GROUPS.live())
        with rank.cond:
            saved = P.Saved(size=out.tell(), step=rank.step, collectives=rank.collectives, groups=groups)
        return _offered(saved, out, request)


def _offered(saved: P.Saved, out: BinaryIO, request: P.Save) -> tuple[P.Saved, bytes]:
    """The state in ``out`` offered on ``request.listen``, or to follow the answer's line."""
    from tpagent_rank import handover

    if not request.listen:
        return saved, os.pread(out.fileno(), saved.size, 0)
    data = mmap.mmap(out.fileno(), saved.size, prot=mmap.PROT_READ) if saved.size else b""
    try:
        offer = handover.Offer(data, request.listen, request.secret, request.timeout)
    except OSError as e:
        if isinstance(data, mmap.mmap):
            data.close()
        return P.Saved(ok=False, error=f"it cannot offer its state on {request.listen} ({e.strerror or e})"), b""
    return dataclasses.replace(saved, port=offer.port), b""


def fetched(request: P.Load) -> BinaryIO:
    """The state a joiner is told to fetch (:mod:`tpagent_rank.handover`), in a file in memory;
    ValueError or OSError."""
    from tpagent_rank import handover

    if not handover.valid_secret(request.secret) or request.source.count(":") < 1:
        raise ValueError("a state fetched from the network needs its HOST:PORT and a secret of 32 to 128 hex digits")
    from tpagent_rank import aware

    into = aware.memory_file()
    try:
        handover.fetch(request.source, request.secret, request.size, into, timeout=60.0)
        into.flush()
    except BaseException:
        into.close()
        raise
    return into


def retire(rank: Rank) -> P.Answer:
    """A parked rank whose joiner has its place: on with the rest of its step, then ended."""
    with rank.cond:
        if not rank.parked or rank.unit != P.Unit.STEP.value:
            return P.failed("it is not stopped at an optimizer step's boundary")
        rank.retired = True
        rank.stop_at = None
        rank.parked = False
        rank.cond.notify_all()
    return P.Answer()


def _other_groups(request: P.Load) -> str:
    """Why the joiner's groups are not the rank's (a script that makes groups as it goes, later
    than the joiner's warm-up reached), or ""."""
    from tpagent_rank import backend

    have = len(backend.GROUPS.live())
    if request.groups and have != request.groups:
        return f"it made {have} process groups in its warm-up, where the rank it replaces has {request.groups}"
    return ""


def leave(rank: Rank) -> None:
    """A retired rank, at its next collective or step: ended before any of it runs (once its
    agent has its answer to ``retire``).  Its output is flushed; nothing else of it is the job's
    any more (its communicators are gone)."""
    rank.retire_answered.wait(10.0)
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(OSError, ValueError):
            stream.flush()
    os._exit(0)


def exactly(f: Any, size: int) -> BinaryIO:
    """The ``size`` bytes that follow a line (a state, within :data:`~P.STATE_MAX`), in a file
    in memory, read a piece at a time."""
    if not 0 <= size <= P.STATE_MAX:
        raise ValueError(f"a state of {size} bytes")
    from tpagent_rank import aware

    into = aware.memory_file()
    left = size
    while left:
        piece = f.read(min(left, 8 << 20))
        if not piece:
            into.close()
            raise ValueError("the connection closed inside a state")
        into.write(piece)
        left -= len(piece)
    into.flush()
    return into
