"""Signals to a process, or to it and its descendants, through pidfds (pidfd_open(2)).

A process is held by a pidfd opened while it was still the one meant: the one that started at a
given clock tick, or a child of a process already held.  So a PID that another process took
since it was listed (a child that ended and was reaped, a root that ended) is never signalled
nor waited for: on a busy node PIDs come round again, and a stray SIGKILL would end someone
else's work.
"""

from __future__ import annotations

import os
import select
import signal
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager, suppress
from types import FrameType

from host import proc

#: Rounds of listing a tree's new children; a tree that still grows after them is a fork bomb,
#: and what was found of it is what is signalled.
_ROUNDS = 64


def signal_exact(pid: int, ticks: int, sig: int) -> bool:
    """Send ``sig`` to ``pid`` only if it is still the process that started at ``ticks`` (clock
    ticks since boot).  False if that process is gone."""
    fd = _hold(pid, ticks=ticks)
    if fd is None:
        return False
    try:
        return _send(fd, sig)
    finally:
        os.close(fd)


def signal_tree(pid: int, sig: int, ticks: int | None = None, spare: frozenset[int] = frozenset()) -> list[int]:
    """Send ``sig`` to ``pid`` (only if it started at ``ticks``, when given) and to each of its
    descendants but those in ``spare``, each as soon as it is found; the PIDs found, root first.
    With SIGSTOP, a process is stopped before its children are listed, so none escapes by a fork
    meanwhile."""
    with _tree(pid, ticks, sig, spare) as held:
        return list(held)


def kill_tree(pid: int, ticks: int | None = None, timeout: float = 10.0) -> bool:
    """SIGKILL ``pid`` (only if it started at ``ticks``, when given) and its descendants, and
    wait (bounded) until none is alive; whether it was there.  The whole tree is stopped first, so
    no child forked while it is being killed is left behind (reparented, it would be out of reach)."""
    with _tree(pid, ticks, signal.SIGSTOP) as held:
        for fd in held.values():
            _send(fd, signal.SIGKILL)
        waiting = select.poll()
        for fd in held.values():
            waiting.register(fd, select.POLLIN)  # (readable once the process has ended)
        left = len(held)
        deadline = time.monotonic() + timeout
        while left and (remaining := deadline - time.monotonic()) > 0:
            for fd, _ in waiting.poll(remaining * 1000):
                waiting.unregister(fd)
                left -= 1
        return bool(held)


def signal_listed(pids: list[int], sig: int) -> None:
    """Send ``sig`` to each of ``pids``, listed by the caller and kept from ending meanwhile (a
    tree it stopped itself, or processes CRIU made): those that are gone are passed over."""
    for pid in pids:
        with suppress(ProcessLookupError):
            os.kill(pid, sig)


@contextmanager
def _tree(pid: int, ticks: int | None, sig: int, spare: frozenset[int] = frozenset()) -> Iterator[dict[int, int]]:
    """The tree of ``pid``, each process held by a pidfd and sent ``sig`` as it is found (but
    those in ``spare``)."""
    held: dict[int, int] = {}
    try:  # (never this process itself: stopped, it would wait on itself for ever)
        root = _hold(pid, ticks=ticks) if pid != os.getpid() else None
        if root is not None:
            held[pid] = root
            if pid not in spare:
                _send(root, sig)
        for _ in range(_ROUNDS if held else 0):
            found = [(c, p) for c, p in _parents().items() if p in held and c not in held and c != os.getpid()]
            for child, parent in found:
                fd = _hold(child, parent=parent)
                if fd is not None:
                    held[child] = fd
                    if child not in spare:
                        _send(fd, sig)
            if not found:
                break
        yield held
    finally:
        for fd in held.values():
            os.close(fd)


def _hold(pid: int, *, ticks: int | None = None, parent: int | None = None) -> int | None:
    """A pidfd for ``pid``, if what holds that PID now is the process meant: the one started at
    ``ticks``, or a child of ``parent``.  None if it is gone."""
    try:
        fd = os.pidfd_open(pid)
    except OSError:
        return None
    try:  # (read after the open: the pidfd names whatever held the PID then)
        if (ticks is None or proc.start_ticks(pid) == ticks) and (parent is None or proc.parent_pid(pid) == parent):
            return fd
    except (OSError, ValueError, IndexError):
        pass
    os.close(fd)
    return None


def _parents() -> dict[int, int]:
    """Every process here -> its parent's PID, read from /proc now.  (Not psutil's process_iter:
    it keeps the processes it saw, and a tree restored under PIDs this process had seen before,
    as CRIU restores a plain process, came back from it with no children: killing the root left
    them all running, reparented.)"""
    out: dict[int, int] = {}
    for name in os.listdir("/proc"):
        if name.isdigit():
            with suppress(OSError, ValueError, IndexError):
                out[int(name)] = proc.parent_pid(int(name))
    return out


def _send(fd: int, sig: int) -> bool:
    try:
        signal.pidfd_send_signal(fd, sig)
        return True
    except OSError:  # (it has ended)
        return False


#: The signals a command may take as a Ctrl-C (:func:`terminate_as_interrupt`).
_INTERRUPTS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


def terminate_as_interrupt() -> None:
    """Make SIGTERM (``kill``, a scheduler's end of a job step) and SIGHUP (a closed terminal) end
    this command as a Ctrl-C does: its undo runs (a restore's copy, left stopped, is killed; a
    dump's frozen tree resumed), and a :func:`deferred_sigint` region holds them back as it holds
    a Ctrl-C.  By default they ended it at once, its undo never run.  (Main thread only.)"""
    for sig in _INTERRUPTS[1:]:
        if signal.getsignal(sig) == signal.SIG_DFL:  # (``nohup``'s ignored SIGHUP stays ignored)
            signal.signal(sig, signal.default_int_handler)


class Deferral:
    """What a :func:`deferred_sigint` region saw: ``interrupted``; ``consume()`` swallows it."""

    def __init__(self) -> None:
        self.interrupted = False
        self.consumed = False

    def consume(self) -> bool:
        """Take the interrupt (if any) as handled; returns whether there was one."""
        self.consumed = True
        return self.interrupted


_regions: list[tuple[Deferral, Callable[[], None] | None]] = []


@contextmanager
def deferred_sigint(on_interrupt: Callable[[], None] | None = None) -> Iterator[Deferral]:
    """Hold back Ctrl-C (SIGINT; SIGTERM and SIGHUP too, in a command that takes them as one:
    :func:`terminate_as_interrupt`) during a step that must not be cut short (a CRIU run whose
    parasite sits inside the workload, a call into the CUDA driver, a rollback).

    The interrupt is noted, ``on_interrupt`` callbacks of every open region run at once (a
    way to ask CRIU's post-dump hook to cancel), and KeyboardInterrupt is raised when the
    outermost region ends without an exception, unless a region ``consume()``d it.  Only the
    main thread owns signal handlers; elsewhere (inside a server) this only yields."""
    state = Deferral()
    if threading.current_thread() is not threading.main_thread():
        yield state
        return
    _regions.append((state, on_interrupt))
    outermost = len(_regions) == 1

    def note(signum: int, _frame: FrameType | None) -> None:
        for region, callback in _regions:
            region.interrupted = True
            if callback is not None:
                callback()

    taken = [s for s in _INTERRUPTS if s == signal.SIGINT or signal.getsignal(s) is signal.default_int_handler]
    previous = {s: signal.signal(s, note) for s in taken} if outermost else {}
    failed = True
    try:
        yield state
        failed = False
    finally:
        _regions.pop()
        for s, handler in previous.items():
            signal.signal(s, handler if handler is not None else signal.SIG_DFL)
    if outermost and not failed and state.interrupted and not state.consumed:
        raise KeyboardInterrupt
