"""Bringing a source migration to an end when its run could not: after a restart or a
reboot of this node, when the target went quiet, or on an operator's word (``tpagent
resolve``).  What each state means then is in :mod:`tpagent.migration.api`."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from host import signals
from snapshot.held import HeldDump
from tpagent.migration.api import (
    HAS_COPY,
    AgentError,
    JournalError,
    Peer,
    Refused,
    Role,
    SourceState,
    TargetState,
    Why,
    is_final,
)
from tpagent.migration.context import Context
from tpagent.migration.decide import (
    OperatorDecided,
    Stopping,
    Unresolved,
    commit,
    keep_telling,
    let_original_go,
    rolled_back_without_original,
    target_dropped_copy,
    target_state,
    tell_target_abort,
    withdraw,
)
from tpagent.migration.journal import Record, same_process_alive
from tpagent.migration.target import Finisher
from tpagent.migration.target import operator_may as target_may

S = SourceState


def resolve_source(ctx: Context, r: Record, release: Callable[[], None] = lambda: None) -> None:
    """Bring a source migration to an end (after a restart, or when the target went quiet):
    commit if the copy runs and was meant to, else roll back once no copy can run.  After a
    reboot of this node the original is gone: whatever copy the target has or can make goes
    on (what each state means then: :mod:`tpagent.migration.api`).  Waits as long as it must (the
    original stays frozen meanwhile, never resumed on a guess), or until the agent stops (the
    journal keeps where it stood)."""
    target = ctx.peer(r.peer)
    dump = ctx.held.attach(Path(r.snapshot))
    delay = 1.0
    rebooted = r.rebooted()
    try:
        while not is_final(r.state):
            before = r.state
            try:
                if _step(ctx, r, target, dump, rebooted):
                    break
            except (Unresolved, JournalError) as e:  # (a full disk: asked again until it can be written)
                ctx.log.error("migration %s: %s; asking again", r.migration_id, e)
            else:
                if r.state is not before:
                    continue  # (a step taken: the next one at once)
            if ctx.threads.sleep(delay):
                return  # (stopping: the next run of the agent takes it up from the journal)
            delay = min(delay * 2, 10.0)
    except Stopping:
        return
    release()
    ctx.log.info("migration %s resolved: %s", r.migration_id, r.state.value)


def _step(ctx: Context, r: Record, target: Peer, dump: HeldDump, rebooted: bool) -> bool:
    """One look at a migration not yet final: True once it is settled, else the state it moved
    to is journaled (or it waits for the next look).  A step that lets the original run again,
    or ends it, is taken even where the journal cannot be written (its peer's answer is final)."""
    t = ctx.timeouts
    try:
        if r.operator:
            raise OperatorDecided
        if r.state is S.COMMITTING:
            commit(ctx, r, target, dump)
            return True
    except OperatorDecided:
        state, _ = target_state(ctx, target, r.migration_id, t.rpc)
        if state is None:
            _carry_out(ctx, r, target, dump)
            return True
        withdraw(ctx, r, f"the target answers again (its copy is {state})")
        return False
    if r.state is S.RESTORING:
        state, _ = target_state(ctx, target, r.migration_id, t.rpc)
        if state in HAS_COPY:
            ctx.journal.move(r, S.COMMITTING, "the copy is restored on the target")
        elif rebooted and state == TargetState.RECEIVING.value:  # (the Restore call died with this node)
            _restore_after_reboot(ctx, r, target)
        elif state is not None:
            ctx.journal.settle(r, S.ROLLING_BACK, f"the target reports {state}")
    elif r.state is S.CHECKING:
        ctx.journal.settle(r, S.FAILED, "the agent restarted before anything was frozen")
        return True
    elif r.state in (S.FREEZING, S.HELD) and rebooted:
        _restore_after_reboot(ctx, r, target)
    elif (
        r.state is S.ROLLING_BACK
        and r.restore_sent
        and target_state(ctx, target, r.migration_id, t.rpc)[0] in (HAS_COPY if rebooted else {TargetState.DONE.value})
    ):
        # The target made its copy final (it took over while this agent could not be
        # reached), or this node rebooted and the original is gone with it: the only
        # way left is forward (ending the original, if it is still there).
        ctx.journal.move(r, S.COMMITTING, "the target's copy goes on instead of the original")
    elif not r.restore_sent or target_dropped_copy(ctx, target, r.migration_id, t.rpc):
        if r.state in (S.FREEZING, S.HELD):
            ctx.journal.settle(r, S.ROLLING_BACK, "the agent restarted mid-migration")
        tell_target_abort(target, r.migration_id)
        let_original_go(r, dump)  # the hook still holds the tree: CRIU rolls it back
        ctx.journal.settle(
            r, S.ROLLED_BACK, "rolled back after the agent restarted; " + rolled_back_without_original(ctx, r, dump)
        )
        return True
    return False


def operator_may(ctx: Context, r: Record, commit: bool) -> str:
    """Why an operator may not decide this source migration (``tpagent resolve``), or "".  The
    same rule as the protocol's: the original runs again only if no copy runs, and is ended
    only if one may, so the operator decides only what the target cannot answer itself."""
    if is_final(r.state):
        return f"migration {r.migration_id} is {r.state.value} already: there is nothing to resolve"
    if commit and not r.restore_sent:
        return "no copy was restored on the target: the original cannot be ended (only --discard)"
    state, _ = target_state(ctx, ctx.peer(r.peer), r.migration_id, ctx.timeouts.rpc)
    if state is not None:
        return (
            f"the target {r.peer} answers (its copy is {state}): this agent resolves the migration with it, "
            "no operator decision is needed"
        )
    return ""


def _carry_out(ctx: Context, r: Record, target: Peer, dump: HeldDump) -> None:
    """The operator's decision, the target having given none: --discard resumes the original
    (the target is told to drop its copy whenever it is back), --commit ends it."""
    who = f"resolved by the operator, {r.peer} giving no answer"
    if r.operator == "discard":
        if r.state is not S.ROLLING_BACK:
            ctx.journal.settle(r, S.ROLLING_BACK, who)
        ctx.threads.spawn("waiter", f"abort-{r.migration_id[:8]}", keep_telling, ctx, target, r.migration_id, False)
        let_original_go(r, dump)
        ctx.remove(r.snapshot)
        ctx.journal.settle(r, S.ROLLED_BACK, f"{who}: the original runs on where it stood")
    else:
        if r.state is not S.COMMITTING:
            ctx.journal.move(r, S.COMMITTING, who)
        dump.commit()
        if same_process_alive(r):
            signals.kill_tree(r.pid, r.start_ticks or None)
        dump.drop_network_lock()
        ctx.remove(r.snapshot)
        ctx.journal.settle(r, S.DONE, f"{who}: the original was ended, its copy runs on {r.peer}")
        # The target starts its held copy once it hears this (its own waiter asks too).
        ctx.threads.spawn("waiter", f"start-{r.migration_id[:8]}", keep_telling, ctx, target, r.migration_id, True)


def _restore_after_reboot(ctx: Context, r: Record, target: Peer) -> None:
    """FREEZING, HELD, or RESTORING with the target still RECEIVING, and this node rebooted: the
    original died with it.  If the target holds the whole snapshot, its copy is the job now:
    restore it there (RESTORING, then COMMITTING); else ROLLING_BACK (nothing can run: said so
    when it ends)."""
    if r.state is S.FREEZING:
        ctx.journal.move(r, S.HELD, "this node rebooted while the original was frozen; asking the target for a copy")
    if r.state is not S.RESTORING:  # (RESTORING: its Restore call never reached the target)
        r.restore_sent = True  # (journaled with RESTORING, before the call: a copy may exist from now on)
        why = "this node rebooted with the original frozen: restoring its copy on the target"
        ctx.journal.move(r, S.RESTORING, why)
    try:
        pid = target.restore(r.migration_id, ctx.timeouts.restore).pid
    except AgentError as e:
        state, pid = target_state(ctx, target, r.migration_id, ctx.timeouts.rpc)
        if state is None:
            return  # RESTORING: asked again on the next round
        if state not in HAS_COPY:
            ctx.journal.move(r, S.ROLLING_BACK, f"the target has no whole copy to restore ({e})")
            return
    ctx.journal.move(r, S.COMMITTING, f"restored on the target as PID {pid} after this node rebooted")


def operator_decides(
    ctx: Context, r: Record, commit: bool, live: Record | None, running: bool, finish: Finisher
) -> Record:
    """An operator's decision on a migration its peer gives no answer about (``tpagent resolve``),
    carried out or refused (Refused, CONFLICT): refused whenever the peer answers, or the decision
    could leave two copies running, or none, that the protocol itself would not.  ``r``: the
    journal's record; ``live``: the source's record a finished run or a resolver holds (None:
    none); ``running``: a run of it is still under way.  The record to report."""
    mid = r.migration_id
    how = "--commit" if commit else "--discard"
    if r.role is Role.TARGET:
        why = target_may(ctx, r, commit)
        if why:
            raise Refused(f"{how} refused: {why}", Why.CONFLICT)
        finish(mid, commit, f"resolved by the operator ({how}), the source agent {r.peer_agent} giving no answer")
        return ctx.journal.read(mid) or r
    if live is None:
        if running:
            raise Refused(
                f"{how} refused: migration {mid} is still running; `tpagent cancel` it, or wait", Why.CONFLICT
            )
        live = r
    why = operator_may(ctx, live, commit)
    if why:
        raise Refused(f"{how} refused: {why}", Why.CONFLICT)
    live.operator = "commit" if commit else "discard"
    ctx.journal.write(live)  # (the resolver takes it up within seconds)
    return live
