"""The migration protocol's decisions against a real target agent (gRPC, authenticated, its
journal on disk), with the source's side called directly: what a source that comes back does
with what the target says, and what a restarted target does with a copy it held."""

from __future__ import annotations

import os
import signal
import subprocess
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest

from host.safefs import private_dir
from support.agents import agent_config, node_of, serving
from support.helpers import alive, kill_and_wait, wait_until
from tpagent.common.config import AgentConfig
from tpagent.daemon.client import GrpcPeer
from tpagent.daemon.node import Node
from tpagent.migration.api import Role, SourceState, TargetState
from tpagent.migration.decide import target_dropped_copy, target_state
from tpagent.migration.journal import Journal, Record
from tpagent.migration.resolve import resolve_source

MID = "b" * 32


def _target_record(cfg: AgentConfig, mid: str, state: TargetState, **kw: object) -> Record:
    return Record(mid, Role.TARGET, state, peer="source", snapshot=str(cfg.work_dir / "incoming" / mid), **kw)  # type: ignore[arg-type]


@pytest.fixture
def target(tmp_path: Path) -> AgentConfig:
    """A target agent's configuration; tests put its journal records in place, then serve it."""
    cfg = agent_config(tmp_path, "target", takeover_after=0.0)
    private_dir(cfg.work_dir / "migrations")
    return cfg


@pytest.fixture
def original() -> Iterator[psutil.Process]:
    """Stands in for a source's frozen original (CRIU's hook would hold it)."""
    p = subprocess.Popen(["sleep", "600"], start_new_session=True)
    yield psutil.Process(p.pid)
    kill_and_wait(p.pid)
    p.wait()


def _resolve(target: AgentConfig, original: psutil.Process, tmp: Path) -> Node:
    """A source agent whose journal says: rolling back, after the restore was asked for."""
    source = node_of(agent_config(tmp, "source"))
    r = Record(
        MID,
        Role.SOURCE,
        SourceState.ROLLING_BACK,
        pid=original.pid,
        peer=target.listen,
        restore_sent=True,
        snapshot=str(source.cfg.work_dir / "outgoing" / MID),
        create_time=original.create_time(),
    )
    source.journal.write(r)
    resolve_source(source.ctx, r)
    return source


def test_a_source_rolling_back_ends_its_original_when_the_target_made_its_copy_final(
    target: AgentConfig, original: psutil.Process, tmp_path: Path
) -> None:
    """The target took its copy over while the source could not reach it; the source, rolling
    back, learns the copy is final: it commits (ends its original) instead of waiting for ever."""
    Journal(target.work_dir / "migrations").write(_target_record(target, MID, TargetState.DONE, pid=1))
    stop = serving(target)
    try:
        source = _resolve(target, original, tmp_path)
        assert source.journal.read(MID).state is SourceState.DONE  # type: ignore[union-attr]
        wait_until(lambda: not alive(original.pid), "the original to be ended")
    finally:
        stop.set()


def test_a_source_rolling_back_resumes_its_original_once_the_copy_is_gone(
    target: AgentConfig, original: psutil.Process, tmp_path: Path
) -> None:
    Journal(target.work_dir / "migrations").write(_target_record(target, MID, TargetState.DISCARDED, pid=1))
    stop = serving(target)
    try:
        original.suspend()  # as a dead CRIU would leave it
        source = _resolve(target, original, tmp_path)
        assert source.journal.read(MID).state is SourceState.ROLLED_BACK  # type: ignore[union-attr]
        wait_until(lambda: original.status() != psutil.STATUS_STOPPED, "the original to run again")
    finally:
        stop.set()


def test_a_damaged_target_journal_is_not_a_copy_gone(target: AgentConfig) -> None:
    """Only the target's own word that its copy is gone lets a source resume its original: a
    record the target cannot read answers INTERNAL, not NOT_FOUND, so the source keeps asking."""
    damaged = "c" * 32
    (target.work_dir / "migrations" / f"{damaged}.json").write_text("{not json")
    stop = serving(target)
    try:
        t = GrpcPeer(target.listen, target.credentials())
        ctx = node_of(target).ctx
        assert target_state(ctx, t, damaged, 2.0) == (None, 0)  # not "discarded"
        assert target_dropped_copy(ctx, t, damaged, 2.0) is False
        assert target_state(ctx, t, "d" * 32, 2.0) == (TargetState.DISCARDED.value, 0)  # truly unknown there
    finally:
        stop.set()


def test_a_restarted_target_drops_a_held_copy_that_did_not_survive(target: AgentConfig) -> None:
    """After a reboot the journal may still say READY, but the copy is gone (its PID perhaps
    reused): the record becomes DISCARDED and nothing is ever started under that PID.  A record
    naming a snapshot outside the work directory is left alone, and nothing of it is removed."""
    stranger = subprocess.Popen(["sleep", "600"], start_new_session=True)
    held = subprocess.Popen(["sleep", "600"], start_new_session=True)
    outside = target.work_dir.parent / "not-the-agents"
    outside.mkdir()
    try:
        os.kill(held.pid, signal.SIGSTOP)
        j = Journal(target.work_dir / "migrations")
        j.write(
            _target_record(
                target, MID, TargetState.READY, pid=held.pid, create_time=psutil.Process(held.pid).create_time()
            )
        )
        j.write(
            _target_record(target, "e" * 32, TargetState.READY, pid=stranger.pid, create_time=1.0)
        )  # its PID reused since
        j.write(Record("f" * 32, Role.TARGET, TargetState.RECEIVING, snapshot=str(outside)))
        j.write(Record("a" * 32, Role.TARGET, TargetState.RECEIVING, snapshot=""))
        node_of(target).recover()
        assert j.read(MID).state is TargetState.READY  # type: ignore[union-attr]
        gone = j.read("e" * 32)
        assert gone is not None and gone.state is TargetState.DISCARDED and "did not outlive" in gone.message
        assert psutil.Process(held.pid).status() == psutil.STATUS_STOPPED  # still held, untouched
        assert psutil.Process(stranger.pid).status() != psutil.STATUS_STOPPED  # neither started nor killed
        assert j.read("f" * 32).state is TargetState.RECEIVING and outside.is_dir()  # type: ignore[union-attr]
        assert j.read("a" * 32).state is TargetState.RECEIVING  # type: ignore[union-attr]
    finally:
        for p in (held, stranger):
            kill_and_wait(p.pid)
            p.wait()
