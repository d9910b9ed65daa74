"""The migrations this node receives, as their target: admitted (:mod:`tpagent.migration.admission`),
received and restored (:class:`~tpagent.migration.target.Incoming`), then started or dropped on
the source's word, or by the journal alone after a restart of this agent."""

from __future__ import annotations

import threading
from collections.abc import Callable
from pathlib import Path

from tpagent.migration import target
from tpagent.migration.admission import Admission
from tpagent.migration.api import Acceptance, Offer, Refused, Restored, TargetState, Why, is_agent_address
from tpagent.migration.context import Context
from tpagent.migration.journal import Record
from tpagent.migration.target import Incoming
from transfer.api import TransferError

T = TargetState


class Receivers:
    """``sending(mid)``: whether this node is migration ``mid``'s source; ``closed()``: whether the
    agent is shutting down (no new migration is taken).  Its lock is its own (the node's guards
    the migrations this node sends): it orders taking a migration, and deciding one known only
    from the journal, against each other."""

    def __init__(self, ctx: Context, sending: Callable[[str], bool], closed: Callable[[], bool]) -> None:
        self.ctx = ctx
        self.closed = closed
        self.lock = threading.Lock()
        self.incoming: dict[str, Incoming] = {}
        self.admission = Admission(ctx, self._reserving, sending)

    def receive(self, offer: Offer) -> Acceptance:
        return self.admission.offer(offer, lambda gpu_map: self._take(offer, gpu_map))

    def _take(self, offer: Offer, gpu_map: dict[str, str]) -> tuple[str, Path]:
        """Receive the migration ``offer`` admitted: where its snapshot is streamed to, and goes."""
        mid = offer.migration_id
        node = self.ctx.cfg.node
        if self.closed():
            raise Refused(f"the agent on {node} is shutting down", Why.PRECONDITION)
        with self.lock:
            if mid in self.incoming or self.ctx.journal.read(mid) is not None:
                raise Refused(f"migration {mid} is already known here", Why.CONFLICT)
            if offer.source_agent and not is_agent_address(offer.source_agent):
                raise Refused("source_agent is not an agent address (HOST:PORT)", Why.INVALID)
            try:
                inc = Incoming(self.ctx, mid, offer.source_node, self.settle, offer.source_agent, offer.hold)
            except TransferError as e:
                raise Refused(f"{node} cannot receive: {e}", Why.PRECONDITION) from e
            inc.gpu_map = gpu_map
            self.incoming[mid] = inc
        return inc.address, inc.dir

    def _reserving(self, mid: str) -> bool:
        """Whether migration ``mid`` still holds its reservation here: received or being
        received, not yet restored (a copy that runs uses its memory already), nor dropped."""
        inc = self.incoming.get(mid)
        if inc is None or inc.record.state not in (T.RECEIVING, T.RECEIVED, T.RESTORING):
            return False
        return not (inc.done.is_set() and isinstance(inc.result, TransferError))

    def restore(self, migration_id: str) -> Restored:
        inc = self.incoming.get(migration_id)
        if inc is None:
            raise Refused(f"no snapshot is being received for migration {migration_id!r}", Why.NOT_FOUND)
        result = inc.restore(self.finish)
        return Restored(result.pid, dict(result.timings))

    def restoring(self) -> list[str]:
        """The migrations whose copy is being restored here now."""
        return [mid for mid, inc in list(self.incoming.items()) if inc.record.state is T.RESTORING]

    def stop_restores(self, why: str) -> None:
        """Stop every restore under way here (the agent stops): each copy is dropped, its source
        told so by the Restore call it waits in, and its original runs on there."""
        for mid in self.restoring():
            self.finish(mid, False, why)

    def finish(self, mid: str, commit: bool, why: str, confirmed: bool = False) -> Record:
        """Start (commit) or drop the copy a migration restored and holds here, or confirm a held
        one that runs (``confirmed``); nothing once decided."""
        inc = self.incoming.get(mid)
        if inc is not None:
            inc.finish(commit, why, confirmed)
            return inc.record
        with self.lock:  # this agent restarted since: only the journal knows the migration
            r = self.ctx.journal.read(mid)
            assert r is not None
            target.finish_held(self.ctx, r, commit, why, self.settle, confirmed)
            return r

    def settle(self, mid: str, ran: bool, why: str) -> None:
        """End the confirmation of a started copy (:func:`tpagent.migration.target.watch_copy`)."""
        inc = self.incoming.get(mid)
        with inc.lock if inc is not None else self.lock:
            r = inc.record if inc is not None else self.ctx.journal.read(mid)
            if r is not None:
                target.settle(self.ctx, r, ran, why)

    def recover(self, r: Record) -> None:
        """A migration this node received before the agent restarted (:func:`target.recover_target`)."""
        target.recover_target(self.ctx, r, self.finish, self.settle)
