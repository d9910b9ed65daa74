"""Small, honest stand-ins for the two things a unit test cannot have: another agent (an
in-memory :class:`~tpagent.migration.api.Peer` that keeps the target's states by the protocol's own
table and receives the snapshot with a real Receiver over loopback TCP), and CRIU (a held
dump whose "original" is a real process, stopped while frozen, continued or killed by the
decision).  Everything else in the protocol under test is the real code."""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path

from host.safefs import private_dir
from snapshot.api import SnapshotConfig
from snapshot.held import HeldDump
from snapshot.manifest import Manifest, ProcInfo, checksum_files
from tpagent.common.config import AgentConfig
from tpagent.common.threads import Threads
from tpagent.migration.api import (
    Acceptance,
    Offer,
    Peer,
    PeerStatus,
    PeerUnreachable,
    Refused,
    Restored,
    TargetState,
    Versions,
    Why,
    allowed,
)
from tpagent.migration.context import Context
from tpagent.migration.journal import Journal
from transfer.api import TransferConfig, TransferError
from transfer.receiver import Receiver
from transfer.tcp import TcpTransport

SECRET = b"unit-tier-secret-0123456789"
T = TargetState


class FakeHeldDump(HeldDump):
    """Freezes the "original" with SIGSTOP, writes a small sealed snapshot, and holds it:
    ``let_go`` continues the original, ``commit`` kills it (as CRIU would).  ``lost`` (set by
    a test): CRIU died without a decision (the test continues the original, as that does)."""

    decisions: list[str] = []
    lost = False
    stopped_at_freeze = False  # (the seal's word on the original; a test sets it with monkeypatch)

    @classmethod
    def start(
        cls,
        pid: int,
        out: Path,
        config: SnapshotConfig,
        hold: float,
        carry: Sequence[Path] = (),
        create_time: float | None = None,
    ) -> HeldDump:
        os.kill(pid, signal.SIGSTOP)
        private_dir(out, empty=True)
        (out / "images").mkdir(mode=0o700)
        (out / "log").mkdir(mode=0o700)
        (out / "images" / "pages-1.img").write_bytes(os.urandom(1 << 20))
        m = Manifest(
            root_pid=pid,
            namespace=False,
            processes=[ProcInfo(pid, 0, ("x",), (pid,), False, stopped=cls.stopped_at_freeze)],
            gpus=[],
            criu={"version": "4.2.1", "shell_job": False, "tcp_established": False},
            cuda={"driver_version": None, "pids": []},
            tpagent_version="test",
        )
        m.files = checksum_files(out)
        m.write(out)
        (out / "log" / "held").touch()
        dump = cls(out)
        dump.pid = pid
        return dump

    @classmethod
    def attach(cls, out: Path) -> HeldDump:
        dump = cls(out)
        dump.pid = 0
        return dump

    pid = 0

    def running(self) -> bool:
        return not FakeHeldDump.lost and not self.decisions

    def holder_lost(self) -> bool:
        return FakeHeldDump.lost and not self.decisions

    def pin(self, timeout: float = 30.0) -> bool:
        return self.running()

    def let_go(self, timeout: float | None = None) -> None:
        self.decisions.append("abort")
        if self.pid:
            os.kill(self.pid, signal.SIGCONT)

    def commit(self) -> None:
        self.decisions.append("commit")
        if self.pid:
            os.kill(self.pid, signal.SIGKILL)

    def drop_network_lock(self) -> None:
        pass


class StatusOnly(Peer):
    """An agent asked only how migrations stand: each Status call is noted in ``asked`` and
    answered by ``answer(migration_id)`` (which may raise, as the agent's refusal or silence);
    any other call fails the test."""

    def __init__(self, address: str, answer: Callable[[str], PeerStatus]) -> None:
        self.address = address
        self.answer = answer
        self.asked: list[tuple[str, float]] = []

    def status(self, migration_id: str, timeout: float) -> PeerStatus:
        self.asked.append((migration_id, timeout))
        return self.answer(migration_id)

    def receive(self, offer: Offer, timeout: float) -> Acceptance:
        raise AssertionError(f"{self.address} was asked to receive a snapshot")

    def restore(self, migration_id: str, timeout: float) -> Restored:
        raise AssertionError(f"{self.address} was asked to restore")

    def finish(self, migration_id: str, commit: bool, timeout: float, confirmed: bool = False) -> PeerStatus:
        raise AssertionError(f"{self.address} was asked to finish a migration")

    def versions(self, timeout: float) -> Versions:
        raise AssertionError(f"{self.address} was asked for its versions (Info)")


class FakeTarget(Peer):
    """A target agent in memory.  ``restore_does`` scripts its Restore: "ok", "refuse" (it
    drops the copy: PRECONDITION), "vanish" (the call breaks after the copy is READY) or
    "silent" (the call breaks and the target stops answering until ``reachable`` is set).
    ``confirm_does`` scripts how the started copy's confirmation ends: "ok" (DONE), "die"
    (DISCARDED), or "wait" (it stays CONFIRMING until a test moves it)."""

    def __init__(self, tmp: Path, problems: tuple[str, ...] = (), restore_does: str = "ok") -> None:
        self.address = "target.test:7400"
        self.tmp = tmp
        self.problems = problems
        self.restore_does = restore_does
        self.states: dict[str, TargetState] = {}
        self.history: list[tuple[str, TargetState]] = []
        self.calls: list[str] = []
        self.reachable = threading.Event()
        self.reachable.set()
        self.finish_answer: TargetState | None = None  # a finish(commit) that finds the copy gone
        self.confirm_does = "ok"  # or "die", "wait", "hold" (CONFIRMING until the source confirms it)
        self.offers: dict[str, Offer] = {}
        self._received: dict[str, threading.Thread] = {}
        self._results: dict[str, object] = {}

    def _move(self, mid: str, to: TargetState) -> None:
        now = self.states.get(mid)
        assert now is None or allowed(now, to), f"the fake target itself broke the protocol: {now} -> {to}"
        self.states[mid] = to
        self.history.append((mid, to))

    def _up(self, call: str) -> None:
        self.calls.append(call)
        if not self.reachable.is_set():
            raise PeerUnreachable("unavailable")

    def receive(self, offer: Offer, timeout: float) -> Acceptance:
        self._up("receive")
        self.offers[offer.migration_id] = offer
        if self.problems or offer.dry_run:
            return Acceptance(problems=self.problems)
        rx = Receiver(TcpTransport(5.0), TransferConfig(secret=SECRET, io_timeout=5.0), "127.0.0.1:0")
        out = private_dir(self.tmp / "target") / offer.migration_id

        def run() -> None:
            try:
                self._results[offer.migration_id] = rx.receive(out, 30.0)
            except TransferError as e:
                self._results[offer.migration_id] = e
            finally:
                rx.close()

        self._move(offer.migration_id, T.RECEIVING)
        self._received[offer.migration_id] = threading.Thread(target=run, daemon=True)
        self._received[offer.migration_id].start()
        return Acceptance(rx.address, {})

    def restore(self, migration_id: str, timeout: float) -> Restored:
        self._up("restore")
        self._received[migration_id].join(timeout)
        assert not isinstance(self._results.get(migration_id), TransferError), self._results[migration_id]
        self._move(migration_id, T.RECEIVED)
        self._move(migration_id, T.RESTORING)
        if self.restore_does == "refuse":
            self._move(migration_id, T.DISCARDED)
            raise Refused("restoring on the target failed: (scripted)", Why.PRECONDITION)
        self._move(migration_id, T.READY)
        if self.restore_does == "vanish":
            raise PeerUnreachable("the connection broke")
        if self.restore_does == "silent":
            self.reachable.clear()
            raise PeerUnreachable("the connection broke")
        return Restored(4242, {"restore": 0.1})

    def finish(self, migration_id: str, commit: bool, timeout: float, confirmed: bool = False) -> PeerStatus:
        self._up("finish-commit" if commit else "finish-abort")
        state = self.states.get(migration_id)
        if state is None:
            raise Refused(f"no migration {migration_id!r}", Why.NOT_FOUND)
        if commit and self.finish_answer is not None and state is T.READY:
            self._move(migration_id, self.finish_answer)
        elif commit and state is T.READY:
            self._move(migration_id, T.STARTING)
            self._move(migration_id, T.CONFIRMING)
            if self.confirm_does not in ("wait", "hold"):
                self._move(migration_id, T.DONE if self.confirm_does == "ok" else T.DISCARDED)
        elif commit and confirmed and state is T.CONFIRMING and self.confirm_does == "hold":
            self._move(migration_id, T.DONE)
        elif not commit and state not in (T.DONE, T.DISCARDED):
            self._move(migration_id, T.DISCARDED)
        return self.status(migration_id, timeout)

    def status(self, migration_id: str, timeout: float) -> PeerStatus:
        self._up("status")
        state = self.states.get(migration_id)
        if state is None:
            raise Refused(f"no migration {migration_id!r}", Why.NOT_FOUND)
        return PeerStatus(
            migration_id, state.value, "", 4242 if state in (T.READY, T.STARTING, T.CONFIRMING, T.DONE) else 0
        )

    def versions(self, timeout: float) -> Versions:
        self._up("versions")
        return Versions("0", "0")


def unit_context(tmp: Path, peer: Peer, **timeouts: float) -> Context:
    """A real protocol context on ``tmp``: real journal, real sender over loopback TCP, the
    stand-ins above for the peer and CRIU."""
    secret = tmp / "secret"
    secret.write_text("x" * 32)
    settings = {"rpc_timeout": 1.0, "restore_timeout": 5.0, "abort_confirm_timeout": 2.0, "io_timeout": 5.0, **timeouts}
    cfg = AgentConfig(
        secret_file=secret,
        node="source",
        listen="127.0.0.1:7400",
        work_dir=private_dir(tmp / "work"),
        metrics_listen="",
        health_listen="",
        **settings,
    )  # type: ignore[arg-type]
    FakeHeldDump.decisions = []
    FakeHeldDump.lost = False
    return Context(
        cfg=cfg,
        snapshot_config=SnapshotConfig(),
        journal=Journal(cfg.work_dir / "migrations"),
        peer=lambda address: peer,
        transport=lambda: TcpTransport(5.0),
        transfer_config=TransferConfig(secret=SECRET, io_timeout=5.0),
        threads=Threads(),
        held=FakeHeldDump,
        log=logging.LoggerAdapter(logging.getLogger("unit"), {}),
    )


def sleeper() -> subprocess.Popen[bytes]:
    """The "original": a real process whose state the tests read."""
    return subprocess.Popen(["sleep", "600"], start_new_session=True)


def wait(cond: Callable[[], bool], seconds: float = 10.0) -> bool:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if cond():
            return True
        time.sleep(0.02)
    return cond()
