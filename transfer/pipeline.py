"""Dump a process and send its snapshot to a peer, the send overlapping the dump.

With ``overlap`` the sender follows the snapshot directory while CRIU writes it (see
:meth:`transfer.sender.Sender.send`): image bytes go out as soon as they are on disk, and the
transfer ends a little after the dump.  Without it the dump finishes first, then the send
starts.  ``bench/pipeline.py`` measures both; overlapping is the default.

This is the CLI's ``dump --send-to``: the dump runs in the main thread, so that Ctrl-C reaches
CRIU's post-dump hook as a rollback, and the send in a thread.  A migration's dump is held
until its copy runs, so the agent runs it the other way round (:class:`snapshot.held.HeldDump`
in a thread, the send in the migration's own thread: :mod:`tpagent.migration.source`).
"""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from snapshot import criu, stages
from snapshot.api import DumpMode, ProgressFn, SnapshotConfig
from snapshot.dump import checkpoint
from snapshot.manifest import Manifest
from transfer.api import BadAddress, TransferError, TransferStats, peer_address
from transfer.sender import Sender


@dataclass(frozen=True)
class Shipped:
    manifest: Manifest
    transfer: TransferStats
    dump_s: float  # from the start until the snapshot was sealed
    total_s: float  # from the start until the peer had verified it


class SendFailed(TransferError):
    """The snapshot was made (and is kept where it was written) but did not reach the peer."""


def _known(peer: str) -> None:
    """``peer`` is HOST:PORT, its host a name this node resolves (or an address); BadAddress if not."""
    host, port = peer_address(peer)
    try:
        socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except socket.gaierror as e:
        raise BadAddress(f"{peer!r} names no host this node knows ({e.strerror}); nothing was frozen.") from e
    except UnicodeError as e:  # (a name no DNS label can be made of)
        raise BadAddress(f"{peer!r} names no host this node knows ({e}); nothing was frozen.") from e


def dump_and_send(
    pid: int,
    out: Path,
    peer: str,
    sender: Sender,
    mode: DumpMode = DumpMode.KILL,
    config: SnapshotConfig = SnapshotConfig(),
    progress: ProgressFn = stages.quiet,
    overlap: bool = True,
    carry: Sequence[Path] = (),
) -> Shipped:
    _known(peer)  # (before anything is frozen: a mistyped address never ends the process)
    try:
        sender.reach(peer)  # (nor a receiver that is not there, or holds another secret)
    except TransferError as e:
        raise TransferError(f"nothing was frozen: {e}") from e
    t0 = time.monotonic()
    if not overlap:
        m = checkpoint(pid, out, mode, config, progress, carry=carry)
        dump_s = time.monotonic() - t0
        try:
            stats = sender.send(out, peer)
        except TransferError as e:
            raise SendFailed(f"{e} ({_kept(out, mode)})") from e
        except KeyboardInterrupt as e:
            raise SendFailed(f"the send to {peer} was interrupted ({_kept(out, mode)}; {_MAYBE_THERE})") from e
        _sent_away(out, mode)
        return Shipped(m, stats, dump_s, time.monotonic() - t0)

    sealed = threading.Event()
    dump_failed = threading.Event()
    outcome: list[TransferStats | BaseException] = []

    def is_sealed() -> bool:
        if dump_failed.is_set():
            raise TransferError("the dump failed")
        return sealed.is_set()

    def run() -> None:
        try:
            outcome.append(sender.send(out, peer, sealed=is_sealed))
        except BaseException as e:  # reported by the caller's thread
            outcome.append(e)

    thread = threading.Thread(target=run, name="send", daemon=True)
    thread.start()
    try:
        m = checkpoint(pid, out, mode, config, progress, carry=carry)
    except BaseException:
        dump_failed.set()
        thread.join()
        raise
    dump_s = time.monotonic() - t0
    sealed.set()
    try:
        thread.join()
    except KeyboardInterrupt as e:  # (the snapshot is whole here; the receiver drops its part)
        raise SendFailed(f"the send to {peer} was interrupted ({_kept(out, mode)}; {_MAYBE_THERE})") from e
    result = outcome[0]
    if isinstance(result, BaseException):
        raise SendFailed(f"{result} ({_kept(out, mode)})") from result
    _sent_away(out, mode)
    return Shipped(m, result, dump_s, time.monotonic() - t0)


#: An interrupted send's receiver may have verified the snapshot whole just before.
_MAYBE_THERE = "the receiver may have it whole too: restore one of the two, never both"


def _kept(out: Path, mode: DumpMode) -> str:
    """What a dump whose snapshot did not reach its peer left: the snapshot, and the process as
    its mode left it (ended: brought back from the snapshot)."""
    if mode is DumpMode.KILL:
        return (
            f"the process ended as it was dumped; its snapshot is kept in {out}: `tpagent restore {out}` brings it back"
        )
    left = "running" if mode is DumpMode.LEAVE_RUNNING else "stopped"
    return f"the snapshot is kept in {out}; the process was left {left}"


def _sent_away(out: Path, mode: DumpMode) -> None:
    """A process ended here and verified on the receiving node is to be restored there: the
    network lock CRIU left on its TCP connections here goes (else it would drop their
    packets if the process ever came back to this node)."""
    if mode is DumpMode.KILL:
        criu.drop_network_lock(out / stages.LOG_DIR)
