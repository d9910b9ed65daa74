"""How a source decides a migration with its target once a copy may exist: ask what the
target has (:func:`target_state`), have it drop its copy (:func:`target_dropped_copy`), or
commit (:func:`commit`: the copy starts and is confirmed, then the original ends).  Used by
the running migration (:mod:`tpagent.migration.source`) and by the resolver (:mod:`tpagent.migration.resolve`)."""

from __future__ import annotations

import logging
import signal
import time
from collections.abc import Callable

from host import proc, signals
from snapshot.held import HeldDump
from tpagent.migration.api import Outcome, Peer, PeerUnreachable, Refused, SourceState, TargetState, Why
from tpagent.migration.context import Context
from tpagent.migration.journal import Record, same_process_alive

log = logging.getLogger(__name__)
S = SourceState


class Unresolved(Exception):
    """The target cannot say whether its copy runs: the original stays frozen, asked about."""


class OperatorDecided(Exception):
    """An operator decided the migration (``tpagent resolve``): carried out by the resolver."""


class Stopping(Exception):
    """The agent shuts down: the journal keeps the state, the next run takes it up."""


#: How a target says it keeps no copy for a migration.


def target_state(ctx: Context, target: Peer, mid: str, seconds: float) -> tuple[str | None, int]:
    """The target's state for ``mid`` once it is settled (not ``restoring``), or None if it
    does not answer within ``seconds``.  Unknown there (NOT_FOUND) counts as discarded; any
    other refusal (an unreadable journal there) is no answer."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        try:
            st = target.status(mid, min(5.0, ctx.timeouts.rpc))
            if st.state != TargetState.RESTORING.value:
                return st.state, st.pid
        except Refused as e:
            if e.why is Why.NOT_FOUND:
                return TargetState.DISCARDED.value, 0
        except PeerUnreachable:
            pass
        if ctx.threads.sleep(0.5):
            break
    return None, 0


def target_dropped_copy(ctx: Context, target: Peer, mid: str, seconds: float) -> bool:
    """Ask the target to drop its copy; True once it says the copy is gone (or never was)."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline and not ctx.threads.stopping.is_set():
        tell_target_abort(target, mid)
        state, _ = target_state(ctx, target, mid, min(10.0, max(0.1, deadline - time.monotonic())))
        # Only a copy the target itself calls gone counts: one still RECEIVING may yet be
        # restored by a Restore call that is on its way there.
        if state == TargetState.DISCARDED.value:
            return True
        if state == TargetState.DONE.value:  # it made the copy final: only committing is right now
            return False
    return False


def tell_target_abort(target: Peer, mid: str) -> bool:
    """Tell the target to drop its copy; whether it heard it."""
    return tell_target(target, mid, False)


def tell_target(target: Peer, mid: str, commit: bool) -> bool:
    """Tell the target to start (``commit``) or drop its copy; whether it heard it."""
    for _ in range(3):
        try:
            target.finish(mid, commit, 5.0)
            return True
        except Refused as e:
            if e.why in (Why.NOT_FOUND, Why.UNAUTHENTICATED):
                return False
        except PeerUnreachable:
            pass
        time.sleep(0.5)
    return False


def keep_telling(ctx: Context, target: Peer, mid: str, commit: bool) -> None:
    """Until the target has heard it (at most ``hold_timeout``): start, or drop, its copy."""
    deadline = time.monotonic() + ctx.timeouts.hold
    while time.monotonic() < deadline and not tell_target(target, mid, commit):
        if ctx.threads.sleep(2.0):
            return


def withdraw(ctx: Context, r: Record, why: str) -> None:
    """An operator's decision (``tpagent resolve``) is not carried out: ``why`` (the target, silent
    when it was given, answers: the protocol decides, never a guess that may leave two copies)."""
    log.warning("migration %s: the operator's --%s is not carried out: %s", r.migration_id, r.operator, why)
    r.operator = ""
    try:
        ctx.journal.write(r)
    except Exception as e:  # (a full disk: after a restart, the target is asked again before it is carried out)
        log.error("migration %s: %s", r.migration_id, e)


def commit(
    ctx: Context,
    r: Record,
    target: Peer,
    dump: HeldDump,
    started: Callable[[], None] = lambda: None,
    verdict: Callable[[], bool | None] | None = None,
) -> Outcome:
    """COMMITTING (journaled): the target starts its copy and watches it for the confirmation
    period; once it says DONE, the original ends.  ROLLED_BACK if the target drops its copy
    first (it died there, or it is gone), the original then runs on where it stood.  Raises
    Stopping if the agent shuts down meanwhile (the journal says COMMITTING: the next run
    goes on).  The CRIU holding the original is watched all along: if it ends without a
    decision, the original runs again, and only one of the two may go on.

    A copy the target holds for the source's word (``Offer.hold``: a rank) is confirmed once
    ``verdict`` says True after it started, or dropped if it says False (None: not decided yet);
    without a ``verdict`` (this agent restarted since) it is confirmed as soon as it runs."""
    delay = 0.2
    ran = False
    answered = False  # (the target answered the last call)
    message = ""
    keep: bool | None = True if verdict is None else None
    while True:
        if r.operator:  # (given while the target did not answer: it may have since, or its copy run)
            if not answered and not (ran and r.operator == "discard"):
                raise OperatorDecided
            withdraw(ctx, r, "the target answers again" if answered else "its copy was seen running")
        if dump.holder_lost() and same_process_alive(r):
            return _holder_lost(ctx, r, target, dump)
        if ran and keep is None and verdict is not None:
            keep = verdict()
        try:
            st = target.finish(r.migration_id, keep is not False, ctx.timeouts.rpc, confirmed=ran and keep is True)
            state = st.state
            message = st.message
            delay = 0.2
            answered = True
        except Refused as e:
            if e.why is not Why.NOT_FOUND:
                log.warning("migration %s: the target refused to start its copy (%s); asking again", r.migration_id, e)
                state = ""
                delay = min(delay * 2, 10.0)
                answered = False
            else:  # it knows no such migration (its journal lost with its disk): no copy there
                state = TargetState.DISCARDED.value
                message = f"the target does not know the migration ({e})"
        except PeerUnreachable as e:
            log.warning("migration %s: the target cannot be reached (%s); asking again", r.migration_id, e)
            state = ""
            delay = min(delay * 2, 10.0)
            answered = False
        if state in (TargetState.CONFIRMING.value, TargetState.DONE.value) and not ran:
            ran = True
            started()  # the copy runs now; the original is still frozen
        if state == TargetState.DONE.value:
            break
        if state == TargetState.DISCARDED.value:
            why = message or "the target's copy is gone"
            ctx.journal.settle(r, S.ROLLING_BACK, f"{why}; resuming the original")
            let_original_go(r, dump, ctx.timeouts.rpc)
            ctx.journal.settle(r, S.ROLLED_BACK, f"{why}; {rolled_back_without_original(ctx, r, dump)}")
            return Outcome.ROLLED_BACK
        if _sleep_watching(ctx, r, dump, delay):
            raise Stopping("the agent is shutting down while the target starts its copy")
    dump.commit()
    if same_process_alive(r):  # CRIU could not end it (it died at the last moment): end it here
        signals.kill_tree(r.pid, r.start_ticks or None)
    dump.drop_network_lock()
    ctx.remove(r.snapshot)
    if r.state is not S.DONE:
        ctx.journal.settle(r, S.DONE, f"migrated to {r.peer}")
    return Outcome.DONE


def _sleep_watching(ctx: Context, r: Record, dump: HeldDump, seconds: float) -> bool:
    """Sleep up to ``seconds``, less if the CRIU holding the original ends meanwhile (then
    each moment counts: the original runs again); True if the agent is stopping."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if ctx.threads.sleep(min(0.1, seconds)):
            return True
        if dump.holder_lost():
            return False
    return False


def _holder_lost(ctx: Context, r: Record, target: Peer, dump: HeldDump) -> Outcome:
    """The CRIU holding the original ended without a decision, letting it go: stopped (its hook
    queued a SIGSTOP once pinned; sent again here, in case), it waits while its copy is asked
    about: the copy is dropped and the original goes on, or, if the copy is final already, the
    original is ended.  Never both running at once."""
    why = "the CRIU holding the original ended without a decision"
    signals.signal_tree(r.pid, signal.SIGSTOP, r.start_ticks or None)
    log.error("migration %s: %s; it is stopped again while its copy is asked about", r.migration_id, why)
    if target_dropped_copy(ctx, target, r.migration_id, ctx.timeouts.abort_confirm):
        ctx.journal.settle(r, S.ROLLING_BACK, f"{why}; its copy on {r.peer} was dropped")
        let_original_go(r, dump, ctx.timeouts.rpc)
        ctx.remove(r.snapshot)
        ctx.journal.settle(r, S.ROLLED_BACK, f"{why}; its copy on {r.peer} was dropped, the original runs on")
        return Outcome.ROLLED_BACK
    state, _ = target_state(ctx, target, r.migration_id, ctx.timeouts.rpc)
    if state == TargetState.DONE.value:  # the copy is final: the original is the one to end
        signals.kill_tree(r.pid, r.start_ticks or None)
        dump.drop_network_lock()
        ctx.remove(r.snapshot)
        ctx.journal.settle(r, S.DONE, f"migrated to {r.peer}; {why}, so it was ended")
        return Outcome.DONE
    raise Unresolved(f"{why}, and the target does not say its copy is gone")


def rolled_back_without_original(ctx: Context, r: Record, dump: HeldDump) -> str:
    """What a rollback leaves: the original, resumed; or, if it is gone (its node restarted, or
    it was ended while frozen), the local snapshot, kept when it is whole."""
    if same_process_alive(r):
        ctx.remove(r.snapshot)
        return "the original was resumed where it stood"
    if dump.sealed() and dump.whole_here():  # the last whole image of the job: never removed by the agent
        return (
            f"the original did not survive (a restart of this node?) and no copy runs on {r.peer}; its "
            f"snapshot is kept: `tpagent restore {r.snapshot}` brings it back"
        )
    ctx.remove(r.snapshot)
    return f"the original did not survive (a restart of this node?) and no copy of it runs on {r.peer}"


def let_original_go(r: Record, dump: HeldDump, timeout: float | None = None) -> None:
    """CRIU rolls the held original back (:meth:`HeldDump.let_go`), then what is left stopped
    runs again (:func:`resume_leftovers`): a stop the hook queued once it was pinned, that it
    did not live to take back, or one :func:`_holder_lost` sent."""
    dump.let_go(timeout)
    resume_leftovers(r)


def resume_leftovers(r: Record) -> None:
    """What a dead CRIU may have left stopped runs again (what was stopped before the freeze
    stays stopped); the GPU side is given back."""
    if not same_process_alive(r):
        return  # gone (or its PID now someone else's): nothing of ours to resume
    if not signals.signal_tree(r.pid, signal.SIGCONT, r.start_ticks or None, frozenset(r.stopped)):
        return
    if r.cuda_pids:  # CRIU gave back the CPU side; the GPU side waits in host memory
        from snapshot import stages
        from snapshot.cuda import CudaDriver

        stages.resume([], [p for p in r.cuda_pids if proc.alive(p)], CudaDriver())
