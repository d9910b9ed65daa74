"""A rank told that its job cannot go on (:class:`tpagent_rank.protocol.End`): a rank is gone
for good, or its node is lost."""

from __future__ import annotations

import time
from typing import Any

from tpagent_rank import protocol as P
from tpagent_rank.notice import say

#: A rank is a :class:`tpagent_rank.agent.Rank` (not imported: that module imports this one).
Rank = Any


def end(rank: Rank, request: P.End) -> P.Answer:
    """The job cannot go on (a rank is gone for good): better now than at a deadline.  With a
    grace, a rank that makes no progress (issues no collective, ends no step) for that long
    breaks off the collective it waits in: its communicators' connections are shut and the
    collective raises, where it would wait for its timeout (half an hour, gloo's by
    default).  A rank that goes on meanwhile is left alone: what was believed lost is not
    what it waits on."""
    why = request.why or "its agent ended the job"
    if request.hold:  # (told first; one not parked is left to the End that follows, its grace)
        with rank.cond:
            first = rank.parked and not rank.ending
            rank.ending = why if rank.parked else rank.ending
        if first:
            say(f"rank {rank.rank} of job {rank.job} stops: {why}")
        return P.Answer()
    if request.grace > 0:
        came = time.monotonic()
        while True:
            if rank.parked:  # (for a move: its agent decides, not a stall)
                return P.failed(f"rank {rank.rank} of job {rank.job} is parked for a move")
            last = max(rank.progress, rank.times[-1] if rank.times else 0.0)
            if last > came:
                return P.failed(f"rank {rank.rank} of job {rank.job} goes on: it is not waiting on {why}")
            left = max(last, came) + request.grace - time.monotonic()
            if left <= 0:
                break
            if rank.closing.wait(min(left, 0.5)):
                return P.failed("the rank is exiting")
        say(f"rank {rank.rank} of job {rank.job} stops: {why}")
    with rank.cond:
        rank.ended = why
        rank.cond.notify_all()
    from tpagent_rank import recover

    recover.BROKEN.give_up(why)  # (a collective held for a recovery that does not come raises)
    if request.grace > 0:
        from tpagent_rank import backend

        with rank.write_lock:
            keep = rank.conn.fileno() if rank.conn is not None else -1
        backend.break_off(keep)  # (not the agent's connection: it is answered on it)
    return P.Answer()
