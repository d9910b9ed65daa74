"""How `tpagent migrate` follows a migration to its end once the stream of its events ended
early: the source agent died mid-migration and settles it from its journal as it runs again,
or the last event came before the end."""

from __future__ import annotations

import time
from typing import Any

import grpc
import typer

from cli.common import EXIT_FAILED, die

#: How long the CLI waits for a source agent that stopped answering mid-migration to come back
#: (systemd restarts it in seconds), and how long it then follows the migration it settles from
#: its journal (a rewire's ranks rebuild within their own deadlines) before it leaves it to
#: `tpagent status`.
SOURCE_BACK_WITHIN = 120.0
SETTLED_WITHIN = 600.0


def source_lost(agent: Any, pb: Any, source: str, last: Any, migration_id: str, as_json: bool) -> Any:
    """The source agent stopped answering in the middle of the migration (it died, or its node
    did): it settles the migration from its journal as it starts again.  Its last word then,
    or a sentence saying where things stand."""
    if not as_json:
        typer.echo(
            f"\nthe agent at {source} stopped answering during migration {migration_id} ({last.state}); "
            "waiting for it to settle the migration from its journal...",
            err=True,
        )
    settled, said = _final(agent, pb, migration_id, SETTLED_WITHIN, SOURCE_BACK_WITHIN)
    if settled is None:
        see = f"tpagent status {migration_id} --agent {source}"
        if said:
            why = f"answers again, but not about it: {said.rstrip('.')}; see {see}"
        elif said is not None:
            why = f"answers again but has not settled it within {SETTLED_WITHIN:.0f} s; it goes on: {see}"
        else:
            why = (
                f"did not answer again within {SOURCE_BACK_WITHIN:.0f} s; it settles the migration from its "
                f"journal once it runs: {see}"
            )
        die(
            f"the agent at {source} stopped answering during migration {migration_id} ({last.state}) and {why}",
            EXIT_FAILED,
            as_json,
        )
    return settled


def wait_final(agent: Any, pb: Any, last: Any, migration_id: str, seconds: float = 120.0) -> Any:
    if last is None:
        return None
    settled, _ = _final(agent, pb, migration_id, seconds)
    return last if settled is None else settled


def _final(
    agent: Any, pb: Any, migration_id: str, seconds: float, answer_within: float | None = None
) -> tuple[Any, str | None]:
    """The migration's last event once ``agent`` says it has ended (None: not within ``seconds``,
    nor within ``answer_within`` while the agent does not answer at all, nor once it refuses to
    say), and what it said: None, nothing yet; "", that it goes on (or is too busy to say); else
    its refusal (no such migration, not yours), which waiting does not change."""
    from tpagent.daemon.client import UNREACHABLE, broke, rpc_text

    start = time.monotonic()
    said: str | None = None
    while True:
        waited = time.monotonic() - start
        if waited >= seconds or (said is None and answer_within is not None and waited >= answer_within):
            return None, said
        try:
            status = agent.Status(pb.MigrationRef(migration_id=migration_id), timeout=10)
        except grpc.RpcError as e:
            if e.code() in UNREACHABLE or broke(e):
                pass  # (not back yet)
            elif e.code() in (grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.ABORTED):
                said = ""  # (back, too busy to say)
            else:
                return None, rpc_text(e)
            time.sleep(0.5)
            continue
        said = ""
        if status.state in ("done", "rolled_back", "failed"):
            return pb.MigrationEvent(migration_id=status.migration_id, state=status.state, message=status.message), ""
        time.sleep(0.2)
