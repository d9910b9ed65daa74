"""Unplanned recovery, as a rank sees it (issue 27, item 3): a rank of its job died without
warning, and the job goes on from its last step boundary without a restart from a checkpoint.

* **The held state.**  A rank that registered its training state (:mod:`tpagent_rank.aware`)
  calls its ``save`` at each optimizer step post-hook and holds what it returns: its numbers,
  RNG states and data positions as they were; its tensors are the live ones, which nothing
  changes until the next optimizer step (the step's collectives fill gradients, not weights),
  but for the buffers its forward pass changes in place (a BatchNorm's running statistics),
  copied as they stand (:mod:`tpagent_rank.inplace`).
  So the rank can give the state of its last boundary at any time but inside an optimizer step,
  and the training thread is held from entering one while the state is taken.
* **A failed collective is held.**  A gloo collective of a registered rank connected to its
  agent that fails (a peer's process is gone: its connections are reset) does not raise in the
  script: the training thread waits in it (``Standing.broken`` says why) until its agent says what
  comes next, or for :data:`HOLD` seconds, after which it raises as it would have.  Its agent is
  told at once, unasked (:class:`tpagent_rank.lines.Broke`): a lost node is looked for now.  An NCCL
  collective waits by itself (its peer never answers).
* **Restart.**  Told ``restart``, the rank (once nothing is being written to a file by it or its
  children, :func:`quiet`) runs its command again in its own process (``exec``:
  the same PID, the same place under its agent and stand-in, its GPU memory given back), with the
  state it held in a file in memory that stays open across the ``exec``.  The process it becomes
  is a joiner (:mod:`tpagent_rank.join`): it warms up on its own, takes that state, and stands at
  that boundary with its communicators to be built: the step that was in flight is done again.

Standard library only at import.
"""

from __future__ import annotations

import contextlib
import os
import stat
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, NoReturn

from tpagent_rank import env, inplace, lines
from tpagent_rank import protocol as P
from tpagent_rank.notice import PREFIX

#: A rank is a :class:`tpagent_rank.agent.Rank` (not imported: that module imports this one).
Rank = Any
#: How long a failed collective is held from the script for its job to recover (seconds).
HOLD = float(os.environ.get("TPAGENT_RANK_HOLD", "300"))
IN_STEP = "it is inside an optimizer step that does not end"
#: How long a restart waits for the files its process writes to be written (:func:`quiet`).
QUIET = 120.0
#: How often the files being written are looked at (seconds).
LOOK = 0.1
#: How long ago a file must have last been written to count as written (seconds): a writer's
#: pauses between its writes (torch.save pickling, its thread waiting for the interpreter) are
#: shorter; a file written more often than this (a log opened for writing, not appending, and
#: written each second) is never quiet, and its restart refused after ``within``.
STILL = 1.0


@dataclass
class Held:
    """The registered state as ``save`` returned it at a step boundary, and where the rank stood."""

    step: int
    collectives: int
    groups: int
    state: Any
    saved: Any = None  # that state written into a file in memory (once asked for)


def capture(rank: Rank, groups: Callable[[], int]) -> None:
    """The training thread, at an optimizer step post-hook (the step counted; ``groups``: how many
    process groups it has, asked only of a registered rank): the state of this boundary held, and
    the thread out of the step only then (never a new step's tensors beside the numbers of the last)."""
    from tpagent_rank import aware

    reg = aware.registration()
    state = reg.save() if reg is not None else None
    if reg is not None and aware.check(reg, state):
        reg = None  # (one another process cannot read back is never held)
    if reg is not None:  # (what the next step's forward pass changes in place, its buffers, copied as it stands)
        state = inplace.held_copy(state)
    with rank.cond:
        if reg is not None:
            rank.held = Held(rank.step, rank.collectives, groups(), state)
        rank.in_step = False
        rank.cond.notify_all()


def before_step(rank: Rank) -> None:
    """The training thread, at an optimizer step pre-hook: into the step, unless the state it
    holds is being taken (then it waits for its process to be replaced, or for the word that the
    job cannot go on, or :data:`HOLD` seconds)."""
    deadline = time.monotonic() + HOLD
    with rank.cond:
        while rank.restarting and not rank.ended and not BROKEN.given_up and time.monotonic() < deadline:
            rank.cond.wait(1.0)
        rank.in_step = True


def settle(rank: Rank, _: P.Settle) -> P.Answer:
    """The answer to :class:`~tpagent_rank.protocol.Settle`: where the rank stands, once its
    training thread is out of its optimizer step and kept out of the next."""
    with rank.cond:
        if not _kept_out(rank):
            return P.failed(IN_STEP)
    answer: P.Answer = rank.handlers[P.Op.WHERE](P.Where())
    return answer


def _kept_out(rank: Rank) -> bool:
    """(Under ``rank.cond``.)  The training thread kept out of its next optimizer step from now on;
    whether it is out of the one it may be in (waited for a minute at most)."""
    rank.restarting = True
    deadline = time.monotonic() + 60.0
    while rank.in_step and time.monotonic() < deadline:
        rank.cond.wait(0.5)
    return not rank.in_step


def held_file(rank: Rank) -> tuple[Held, Any] | str:
    """The state of the rank's last boundary, written into a file in memory (once: asked again,
    the same), the training thread kept out of its next optimizer step from now on; or why not."""
    from tpagent_rank import aware

    with rank.cond:
        if rank.held is None:
            return "it holds no state of a step boundary (it registered none, or has taken no optimizer step)"
        if not _kept_out(rank):
            return IN_STEP
        held = rank.held
    if held.saved is None:
        out = aware.memory_file()
        try:
            aware.write_state_of(held.state, out)
            out.flush()
        except Exception as e:  # (the user's state: whatever torch says of it)
            out.close()
            return f"its state cannot be written: {type(e).__name__}: {e}"
        held.saved = out
    return held, held.saved


def restart(rank: Rank, store: str = "", fresh: bool = False) -> None:
    """(After the agent has its answer.)  This process becomes a fresh one of its command, with
    the state it held (``fresh``: with none, to be given one); its own children (DataLoader
    workers) end first.  ``store``: where the job's store is served from now on ("": where it was)."""
    environ = {**env.START_ENV, P.JOIN_VARIABLE: "1"}
    if not fresh:
        taken = held_file(rank)
        if isinstance(taken, str):  # (checked as it was asked: not here)
            return
        held, out = taken
        fd = out.fileno()
        os.set_inheritable(fd, True)
        size = os.fstat(fd).st_size
        environ[P.STATE_VARIABLE] = f"{fd}:{size}:{held.step}:{held.collectives}:{held.groups}"
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(OSError, ValueError):
            stream.flush()
    _end_children()
    if store:
        environ[P.STORE_VARIABLE] = store
    with contextlib.suppress(OSError):
        os.chdir(env.START_CWD or "/")
    os.execve(sys.executable, list(sys.orig_argv), environ)


def _end_children() -> None:
    for pid in _children():
        with contextlib.suppress(OSError):
            os.kill(pid, 9)


def _children() -> list[int]:
    me = os.getpid()
    out = []
    for task in os.listdir(f"/proc/{me}/task"):
        with contextlib.suppress(OSError), open(f"/proc/{me}/task/{task}/children") as f:
            out += [int(pid) for pid in f.read().split()]
    return out


def quiet(within: float) -> str:
    """ "" once nothing is being written to a file by this process or its children, which the
    ``exec`` of a restart (and the end of its children) would cut short: a checkpoint that
    ``torch.save`` writes after a step, on the training thread or another, while the others wait
    in a failed collective.  Written: a regular file open for writing, not appending (its log),
    whose offset or modification time moved in :data:`LOOK` seconds, or that was modified in the
    last :data:`STILL` seconds.  Past ``within`` seconds, which ones."""
    deadline = time.monotonic() + within
    before = _writing()
    while True:
        time.sleep(LOOK)
        now = _writing()
        wall = time.time_ns()
        recent = wall - int(STILL * 1e9)  # (a time ahead of now is no write's: copied with the file, -p)
        moving = sorted({at[0] for key, at in now.items() if before.get(key) != at or recent <= at[2] <= wall})
        if not moving and now.keys() == before.keys():
            return ""
        if time.monotonic() > deadline:
            files = ", ".join(moving[:3]) or "a file"
            return f"{files} was still being written {within:.0f} s on: restarted now, the write would be cut short"
        before = now


def _writing() -> dict[tuple[int, int], tuple[str, int, int]]:
    """(PID, fd) -> (path, offset, modification time in ns) of each regular file this process or
    a child has open for writing, not appending, but its standard output and error, files in
    memory and removed files."""
    out = {}
    for pid in (os.getpid(), *_children()):
        try:
            fds = os.listdir(f"/proc/{pid}/fd")
        except OSError:  # (a child that ended)
            continue
        for fd in fds:
            with contextlib.suppress(OSError, ValueError, StopIteration):
                path = os.readlink(f"/proc/{pid}/fd/{fd}")
                if fd in ("1", "2") or not path.startswith("/") or path.startswith("/memfd:"):
                    continue
                with open(f"/proc/{pid}/fdinfo/{fd}") as f:
                    info = dict(line.split(":", 1) for line in f.read().splitlines() if ":" in line)
                flags = int(info["flags"], 8)
                if flags & os.O_ACCMODE == os.O_RDONLY or flags & os.O_APPEND:
                    continue
                st = os.stat(f"/proc/{pid}/fd/{fd}")
                if stat.S_ISREG(st.st_mode) and st.st_nlink:  # (a removed one: nobody reads it after)
                    out[(pid, int(fd))] = (path, int(info["pos"]), st.st_mtime_ns)
    return out


def inherited() -> tuple[P.Load, Any] | None:
    """In a process a restart became: the state it held and where it stood, else None."""
    if not env.STATE:
        return None
    try:
        fd, size, step, collectives, groups = (int(x) for x in env.STATE.split(":"))
        os.set_inheritable(fd, False)
        payload = os.fdopen(fd, "r+b")
    except (ValueError, OSError) as e:
        raise RuntimeError(f"{PREFIX}it was restarted with a state it cannot find ({e})") from None
    return P.Load(size=size, step=step, collectives=collectives, groups=groups), payload


class Broken:
    """The failed collectives held from the script (see the module's text)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.why = ""
        self.given_up = ""
        self.released = threading.Event()  # set once the job cannot go on: the held ones raise
        self.rank: Rank = None  # this process's rank (:mod:`tpagent_rank.hooks` sets it)

    def hold(self, error: BaseException) -> str:
        """(On the thread completing the collective that failed with ``error``.)  "" at once where
        it is not held; else, once the job cannot go on, why (its collective raises that)."""
        from tpagent_rank import aware

        rank = self.rank
        if rank is None or rank.sock is None or rank.ended or not aware.usable():
            return ""
        with self.lock:
            first = not self.why
            self.why = self.why or (str(error).strip().splitlines() or [type(error).__name__])[0][:500]
        if first:
            threading.Thread(target=self._timeout, name="tpagent-hold", daemon=True).start()
            threading.Thread(target=rank.say, args=(lines.Broke(self.why),), name="tpagent-broke", daemon=True).start()
        self.released.wait()
        return self.given_up

    def _timeout(self) -> None:
        time.sleep(HOLD)
        self.give_up(f"no recovery came in {HOLD:.0f} s after a collective failed ({self.why})")

    def give_up(self, why: str) -> None:
        """The job cannot go on: every collective held raises ``why``."""
        with self.lock:
            self.given_up = self.given_up or why
        self.released.set()


BROKEN = Broken()


def holding(work: Any) -> Any:
    """``work`` (a gloo collective's), or a work whose failure is held (see :class:`Broken`): its
    future is its own's, completed once that one is, or, failed, once the job cannot go on."""
    try:
        inner = work.get_future()
    except (RuntimeError, AttributeError):  # (a work without a future, gloo's reduce-scatter: held as waited for)
        return _holding_class()(None, work)
    return _holding_class()(inner.then(_settled), work)


def _settled(f: Any) -> Any:
    """(``then``'s: what it raises fails the future it makes, as torch's C++ waiters see it.)"""
    try:
        return f.value()
    except Exception as e:
        _held(e)


def _held(error: Exception) -> NoReturn:
    """A collective failed with ``error``: raised at once where it is not held, else once the job
    cannot go on (see :class:`Broken`)."""
    why = BROKEN.hold(error)
    if not why:
        raise error
    raise RuntimeError(f"{PREFIX}{why}") from error


_HOLDING: list[type] = []


def _holding_class() -> type:
    """The work a held collective gives (made once torch is imported: it subclasses torch's)."""
    if _HOLDING:
        return _HOLDING[0]
    import torch.distributed as dist

    class Holding(dist.Work):
        def __init__(self, future: Any, work: Any = None) -> None:
            super().__init__()
            self.future = future
            self.work = work  # (the work; one without a future: its failure is held as it is waited for)

        def wait(self, timeout: Any = None) -> bool:
            if self.future is not None:
                if timeout is not None:  # (the caller's own time: one that runs out is said as torch says it)
                    try:
                        self.work.wait(timeout)
                    except Exception:
                        if not self.work.is_completed():
                            raise
                self.future.wait()
                return True
            try:
                self.work.wait()
            except Exception as e:
                _held(e)
            return True

        def get_future(self) -> Any:
            return self.future if self.future is not None else self.work.get_future()  # (that raises, as it did)

        def is_completed(self) -> bool:
            return bool(self.future.done()) if self.future is not None else bool(self.work.is_completed())

        def is_success(self) -> bool:
            if self.future is None:
                return bool(self.work.is_success())
            return bool(self.future.done()) and not _failed(self.future)

        def result(self) -> Any:
            return self.future.value() if self.future is not None else self.work.result()

        def synchronize(self) -> None:
            self.wait()

        def _source_rank(self) -> int:  # (a receive from any source's: where it came from)
            return int(self.work._source_rank())

    _HOLDING.append(Holding)
    return Holding


def _failed(future: Any) -> bool:
    try:
        future.value()
    except Exception:
        return True
    return False
