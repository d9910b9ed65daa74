"""One move, asked of its source agent as ``tpagent migrate --job J --rank R --to T`` asks it:
a dry run first (nothing stops), then the move itself.  The source agent runs it with its journal
and decides; this only hears how it ended.  A call that breaks in the middle of the move leaves
the outcome to the agents' next reports (:meth:`tpagent.orchestrator.core.Orchestrator.settle`)."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

import grpc

from tpagent.common.credentials import Credentials
from tpagent.daemon.client import UNREACHABLE, rpc_text
from tpagent.daemon.rpc import pb, stub
from tpagent.orchestrator.api import Move, MoveState, View, job_identity, job_name


@dataclass(frozen=True)
class Outcome:
    state: MoveState | None  # None: not known (the call broke mid-move): the reports will say
    message: str
    migration: str = ""
    timings: dict[str, float] = field(default_factory=dict)  # dry_run, request; the rewire's own


def run(
    m: Move,
    source: str,
    target: str,
    creds: Credentials,
    timeout: float,
    gpus: tuple[str, ...],
    began: Callable[[str], None],
    between: Callable[[], Outcome | None] = lambda: None,
) -> Outcome:
    """Move ``m`` from the agent at ``source`` to the one at ``target``, onto ``gpus`` there (none:
    any of its GPUs: the ranks use none); ``began(migration_id)``
    is told the source agent's id of the move as soon as it says it; ``between()``, asked after a
    dry run that passed, may stop it there (the scheduler did not hold the target): its outcome."""
    agent = stub(source, creds)
    last = None
    timings: dict[str, float] = {}
    for dry in (True, False):
        last = None
        t0 = time.monotonic()
        request = pb.MigrateRequest(
            target=target,
            dry_run=dry,
            job=job_name(m.job),
            ranks=list(m.ranks),
            job_identity=job_identity(m.job),
            target_gpus=list(gpus),
        )
        try:
            for event in agent.Migrate(request, timeout=timeout):
                if last is None and not dry:
                    began(event.migration_id)
                last = event
        except grpc.RpcError as e:
            if not dry and last is not None:  # (it ran: the source agent settles it, the reports tell)
                return Outcome(None, f"the call to the source agent broke mid-move ({rpc_text(e)})", last.migration_id)
            said = "cannot be reached" if e.code() in UNREACHABLE else "refused"
            text = f"{'its dry run: ' if dry else ''}the agent at {source} {said}: {rpc_text(e)}"
            if e.code() is grpc.StatusCode.ALREADY_EXISTS:  # (moved by another now: no fault of the spare's)
                return Outcome(MoveState.CANCELLED, f"{text} It is planned again once that has ended.")
            return Outcome(MoveState.FAILED, text)
        if last is None or last.state != "done":
            why = (last.message or last.state) if last is not None else "no word from the source agent"
            problems = "; ".join(last.problems) if last is not None else ""
            prefix = "its dry run: " if dry else ""
            mid = last.migration_id if last is not None and not dry else ""
            return Outcome(MoveState.FAILED, prefix + why + (f" ({problems})" if problems else ""), mid)
        timings["dry_run" if dry else "request"] = round(time.monotonic() - t0, 4)
        stopped = between() if dry else None
        if stopped is not None:
            return stopped
    assert last is not None
    timings.update({k: v for k, v in last.timings.items() if not k.startswith("rank")})
    return Outcome(MoveState.DONE, last.message, last.migration_id, timings)


def outcome_of(m: Move, view: View, fresh: set[str]) -> tuple[MoveState, str] | None:
    """How move ``m`` ended, from the reports of its ``fresh`` nodes (made after it stopped); None: not yet."""
    src = view.nodes.get(m.source)
    dst = view.nodes.get(m.target)
    ranks = set(m.ranks)
    if dst is None or m.target not in fresh:
        return None
    there = {r.rank for r in dst.ranks if r.job == m.job}
    if src is not None and m.source not in fresh and view.reachable(m.source):
        return None
    here = {r.rank for r in src.ranks if r.job == m.job} if src is not None and m.source in fresh else set()
    if ranks <= there and not ranks & here:
        return MoveState.DONE, f"settled: the ranks run on {m.target}"
    if src is not None and ranks <= here and m.job not in src.busy and not src.migrations:
        return MoveState.INTERRUPTED, f"settled: the ranks still run on {m.source}"
    # (a source gone settles nothing: where the target runs none of the ranks and receives no copy
    # of them, the move is over, and its job is the lost node's to rebuild; a copy held there waits)
    held = [i for i in dst.incoming if not m.migration or i == m.migration]
    if not view.reachable(m.source) and not ranks & there and not held:
        return (
            MoveState.INTERRUPTED,
            f"settled: {m.source} stopped reporting, and {m.target} holds no copy of the ranks",
        )
    return None
