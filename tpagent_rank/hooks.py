"""Where the rank runtime meets the training process: the first delegating group (the default
group) starts this process's :class:`~tpagent_rank.agent.Rank`; torch's optimizer step
post-hook and each collective of the default group reach it from the training thread; a forked
child (a DataLoader worker) forgets it; at exit its connection's thread is ended."""

from __future__ import annotations

import atexit
import contextlib
import os
import time
from typing import Any

from tpagent_rank import protocol as P
from tpagent_rank.agent import Rank

RANK: Rank | None = None


def group_created(group: Any, store: Any, rank: int, size: int, spec: str | None) -> None:
    """Called for every delegating group; the first (the default group) starts the rank, and
    the first after that group was destroyed is the default group again."""
    global RANK
    from tpagent_rank import owned
    from tpagent_rank import store as stores

    if RANK is not None:
        if RANK.group.destroyed:  # (destroy_process_group(), then init_process_group again: the default one)
            owned.note(stores.held(store))
            RANK.group = group
            RANK.store = store
            RANK.spec = spec
        return
    from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook

    from tpagent_rank import backend, recover

    owned.note(stores.held(store))  # (a forked child lets go of them)
    name = os.environ.get("TPAGENT_RANK_SOCKET", "")
    job = P.job_id(os.environ)
    RANK = Rank(job, rank, size, store, spec, name)
    RANK.group = group
    recover.BROKEN.rank = RANK
    register_optimizer_step_pre_hook(lambda opt, args, kwargs: _before_step())
    register_optimizer_step_post_hook(lambda opt, args, kwargs: _after_step())
    backend.BEFORE.append(_before_collective)
    os.register_at_fork(after_in_child=_forget)
    atexit.register(RANK.stop)  # (registered after the backends' release_all: it runs before it)
    RANK.start()


def _before_step() -> None:
    if RANK is not None and RANK.pid == os.getpid() and RANK.join is None:
        from tpagent_rank import recover

        recover.before_step(RANK)


def _after_step() -> None:
    if RANK is not None and RANK.pid == os.getpid():
        RANK.after_step()


def _before_collective(group: Any, p2p: bool) -> None:
    if RANK is None:  # (a forked child has none: _forget)
        return
    RANK.progress = time.monotonic()  # (any group's: a rank issuing collectives waits on no one)
    if RANK.retired or (RANK.quiet and RANK.join is None):  # (a move's leaving rank, or its joiner, now in)
        from tpagent_rank import join

        if RANK.retired:
            join.leave(RANK)
        RANK.quiet = False
        join.speak()
    if group is RANK.group and not p2p:  # (a send or receive is each rank's own: not the job's count)
        RANK.before_collective()


def _forget() -> None:
    """In a forked child (a DataLoader worker): none of this is its own."""
    global RANK
    if RANK is not None and RANK.sock is not None:
        with contextlib.suppress(OSError):
            os.close(RANK.sock.detach())
    RANK = None
    from tpagent_rank import recover

    recover.BROKEN.rank = None
