"""What both ends of a migration share: timeouts, the transfer settings, the refusal a
client sees, and how to tell that a CRIU still works on a snapshot."""

from __future__ import annotations

import logging
import shutil
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import grpc
import psutil

from snapshot import criu
from tpagent.config import AgentConfig
from tpagent.migration import Record
from tpagent.rpc import pb
from transfer.api import MAX_STREAMS, Compress, TlsFiles, TransferConfig, Transport
from transfer.tcp import TcpTransport

if TYPE_CHECKING:
    from tpagent.agent import Agent

log = logging.getLogger(__name__)

RPC_TIMEOUT = 30.0
RESTORE_TIMEOUT = 3600.0


class Refused(Exception):
    """A request this agent will not carry out; the message is for the user, as is."""

    def __init__(self, message: str, code: grpc.StatusCode = grpc.StatusCode.FAILED_PRECONDITION) -> None:
        super().__init__(message)
        self.code = code


def transport(cfg: AgentConfig) -> Transport:
    if cfg.transport == "ucx":
        from transfer.ucx import UcxTransport

        return UcxTransport(cfg.io_timeout)  # (authenticated, not encrypted: see transfer/ucx.py)
    return TcpTransport(cfg.io_timeout, tls=TlsFiles.in_dir(cfg.tls_dir))  # mutual TLS, the agent's certificates


def transfer_config(agent: Agent) -> TransferConfig:
    t = agent.cfg.io_timeout
    return TransferConfig(secret=agent.creds.secret, compress=Compress(agent.cfg.compress), io_timeout=t, connect_timeout=min(10.0, t),
                          streams=max(1, min(MAX_STREAMS, agent.cfg.streams)))  # fmt: skip



def status_of(r: Record) -> Any:
    return pb.MigrationStatus(migration_id=r.migration_id, state=r.state.value, message=r.message, pid=r.pid)



def wait_released(work: Path, seconds: float | None = 30.0) -> None:
    """Until the CRIU working in ``work`` (its -W directory: a dump's ``SNAPSHOT/log``, a
    restore's work directory) has ended (a dump's: once its hook took the decision)."""
    deadline = None if seconds is None else time.monotonic() + seconds
    while deadline is None or time.monotonic() < deadline:
        if not criu.running_in(work):
            return
        time.sleep(0.1)


def same_process_alive(r: Record) -> bool:
    """Whether the record's process (source: the original; target: the copy) still exists,
    and is the same one, not a process that reused its PID.  A record without a start time
    names no process: it is never trusted to (the agent signals what this says is there)."""
    try:
        return bool(r.pid and r.create_time) and psutil.Process(r.pid).create_time() == r.create_time
    except psutil.NoSuchProcess:
        return False


def remove(cfg: AgentConfig, *paths: Path | str) -> None:
    """Delete snapshot directories, but only inside this agent's work_dir.  Their paths come
    from journal records, which are data: an empty, relative or foreign one must never turn
    into the removal of some other directory (the agent runs as root)."""
    for p in paths:
        if not inside_work_dir(cfg, p):
            log.error("not removing %r: it is not inside the work directory %s", str(p), cfg.work_dir)
            continue
        shutil.rmtree(p, ignore_errors=True)


def inside_work_dir(cfg: AgentConfig, p: Path | str) -> bool:
    path = Path(p)
    return bool(str(p)) and path.is_absolute() and cfg.work_dir.resolve() in path.resolve().parents
