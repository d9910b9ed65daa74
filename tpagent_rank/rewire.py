"""What a rewire asks of a rank between its boundary and its resuming (:mod:`tpagent.jobs.rewire`
says the whole): tear its communicators down, and build them again under a new generation."""

from __future__ import annotations

import gc
import time
from typing import Any

from tpagent_rank import protocol as P
from tpagent_rank.notice import say

#: A rank is a :class:`tpagent_rank.agent.Rank` (not imported: that module imports this one).
Rank = Any


def boundary(rank: Rank, request: P.Boundary) -> P.AtBoundary:
    """Wait (up to ``request.timeout``) for the rank to park at the boundary it was paused for.
    A send or receive it posted before and that has not completed is refused there: its peer
    posts the other end after the boundary (a pipeline stage's), and the teardown would destroy
    it under its waiter; the move is then called off, and the job goes on."""
    from tpagent_rank import backend

    deadline = time.monotonic() + request.timeout
    with rank.cond:
        while not rank.parked:
            if not rank.cond.wait(max(0.0, deadline - time.monotonic())) and time.monotonic() >= deadline:
                at = rank.step if rank.unit == P.Unit.STEP.value else rank.collectives
                error = f"it did not reach {rank.unit} {rank.stop_at} in time (at {at})"
                return P.AtBoundary(ok=False, error=error)
    if pending := sum(not w.is_completed() for g in backend.GROUPS.live() for w in list(g.p2p)):
        error = f"{pending} send(s) or receive(s) it posted before {rank.unit} {rank.stop_at} have not completed"
        return P.AtBoundary(ok=False, error=error + " (their peers post the other end after it): it cannot move there")
    return P.AtBoundary(step=rank.step, collectives=rank.collectives)


def teardown(rank: Rank, request: P.Teardown) -> P.TornDown:
    """Destroy the communicators; ``leaving``: also let go of the store (the rank is to be frozen)."""
    from tpagent_rank import backend

    with rank.cond:
        if not rank.parked:
            return P.TornDown(ok=False, error="it is not stopped at a boundary")
    for g in backend.GROUPS.live():
        g.teardown()
    gc.collect()
    closed = 0
    if request.leaving:
        from tpagent_rank import nccladdr, store

        try:  # (where NCCL's address came from: see the rebuild)
            rank.addresses = nccladdr.local_addresses()
        except OSError as e:
            rank.addresses = {}
            say(f"this node's addresses could not be read ({e}): NCCL's will not follow the move")

        rank.detached = store.detach(rank.store)
        closed = len(rank.detached)
        if not closed:
            found = store.connections()
            error = f"no connection to the job's store ({store.address(rank.store)}) was found among {found}"
            return P.TornDown(ok=False, error=error)
    with rank.cond:
        rank.torn = True
        rank.leaving = request.leaving
        rank.came_back = False  # (leaving: it connects again only once its agent says so)
    return P.TornDown(closed=closed)


def rebuild(rank: Rank, request: P.Rebuild) -> P.Answer:
    """Build the communicators again under ``request.gen``, where the rank now runs."""
    from tpagent_rank import backend

    gen = request.gen
    if rank.detached:
        from tpagent_rank import owned, store

        with owned.noting():  # (a forked child lets go of them)
            rank.kept.extend(store.reattach(rank.detached, min(60.0, request.timeout)))
        rank.detached = []
    rank.tell_store()
    if rank.leaving and backend.NCCL_HOST is not None and rank.addresses:  # (NCCL keeps its node's address)
        from tpagent_rank import nccladdr, store

        try:
            said = nccladdr.follow(rank.addresses, store.host(rank.store))
        except (OSError, ValueError) as e:
            return P.failed(f"NCCL's address of the node it left could not be rewritten: {e}")
        if said:
            say(said)
    backend.GROUPS.gen = gen
    with rank.cond:
        torn = rank.torn
    for g in backend.GROUPS.live():
        if not torn:  # (a rewire finished after its agent restarted: this rank had not got so far)
            g.teardown()
        g.rebuild(gen)
    with rank.cond:
        if backend.GROUPS.gen != gen:  # (a later one was asked for meanwhile: it says)
            return P.failed(f"generation {gen} was given up while it was being built")
        rank.gen = gen
        rank.torn = False
        rank.leaving = False
    return P.Answer()


def by_another(rank: Rank, request: P.Request[Any]) -> P.Answer | None:
    """The refusal of what stops a rank or lets it go on (:data:`~tpagent_rank.protocol.MOVER_OPS`)
    from a move other than the one that stopped it; None where it is that move's, or none did."""
    with rank.cond:
        mover = rank.stopped_by
    if request.OP not in P.MOVER_OPS or not mover or getattr(request, "by", "") == mover:
        return None
    return request.ANSWER(ok=False, error=f"it is stopped by another move of its job ({mover}); wait for it")
