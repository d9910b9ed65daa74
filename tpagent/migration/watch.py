"""What an operator watches of the migrations on this node (the agent's metrics): how long an
original has been frozen, and how many migrations wait on their peer."""

from __future__ import annotations

import time
from collections.abc import Mapping
from pathlib import Path

from tpagent.migration.api import Role, SourceState, TargetState
from tpagent.migration.context import Context
from tpagent.migration.journal import Record
from tpagent.migration.source import SourceMigration


def frozen_seconds(ctx: Context, sources: Mapping[str, SourceMigration]) -> float:
    """How long the longest-frozen original this node holds for a migration has been frozen (0:
    none).  Past CHECKING and until a final state, a source's original is frozen; ``sources``: the
    migrations this agent runs as source, by id."""

    def since(r: Record) -> float:
        m = sources.get(r.migration_id)
        if m is not None and m.freeze_t0:
            return time.time() - (time.monotonic() - m.freeze_t0)
        # An earlier run of the agent froze it: counted from when its snapshot was sealed.
        return ctx.held.attach(Path(r.snapshot)).sealed_at() or 0.0

    frozen = [
        since(r) for r in ctx.journal.unfinished() if r.role is Role.SOURCE and r.state is not SourceState.CHECKING
    ]
    return max((time.time() - t for t in frozen if t), default=0.0)


def unresolved(ctx: Context, sources: Mapping[str, SourceMigration]) -> int:
    """Unfinished migrations that wait on the peer: as source, those no migrate call drives any
    more (a resolver asks the target); as target, held copies awaiting the source's word."""
    n = 0
    for r in ctx.journal.unfinished():
        if r.role is Role.TARGET:
            n += r.state is TargetState.READY
        else:
            m = sources.get(r.migration_id)
            n += m is None or m.result is not None
    return n
