"""What both ends of a migration share: timeouts, the transfer settings, the refusal a
client sees, and how to tell that a CRIU still works on a snapshot."""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import grpc
import psutil

from tpagent.config import AgentConfig
from tpagent.migration import Record
from tpagent.rpc import pb
from transfer.api import Compress, TransferConfig, Transport
from transfer.tcp import TcpTransport

if TYPE_CHECKING:
    from tpagent.agent import Agent

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

        return UcxTransport(cfg.io_timeout)
    return TcpTransport(cfg.io_timeout)


def transfer_config(agent: Agent) -> TransferConfig:
    t = agent.cfg.io_timeout
    return TransferConfig(secret=agent.secret, compress=Compress(agent.cfg.compress), io_timeout=t, connect_timeout=min(10.0, t),
                          streams=max(1, min(64, agent.cfg.streams)))  # fmt: skip



def status_of(r: Record) -> Any:
    return pb.MigrationStatus(migration_id=r.migration_id, state=r.state.value, message=r.message, pid=r.pid)



def wait_released(snap: Path, seconds: float | None = 30.0) -> None:
    """Until no CRIU works on ``snap`` any more (its hook took the decision)."""
    deadline = None if seconds is None else time.monotonic() + seconds
    while deadline is None or time.monotonic() < deadline:
        if not criu_running_on(str(snap)):
            return
        time.sleep(0.1)


def criu_running_on(path: str) -> bool:
    """Whether a CRIU (or whatever wraps it) still runs with ``path`` in its arguments."""
    me = os.getpid()
    for p in psutil.process_iter(["pid", "cmdline"]):
        cmd = p.info["cmdline"] or []
        if p.info["pid"] != me and any(path in c for c in cmd[1:]):
            return True
    return False

