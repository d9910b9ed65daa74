"""What the migration protocol (:mod:`tpagent.migration.source`, :mod:`tpagent.migration.target`) needs from the
agent it runs in, and no more: no gRPC, no servicer, so that it runs against an in-memory
:class:`tpagent.migration.api.Peer` in the unit tests."""

from __future__ import annotations

import logging
import os
import shutil
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from snapshot.api import SnapshotConfig
from snapshot.held import HeldDump
from tpagent.common.config import AgentConfig, Timeouts
from tpagent.common.threads import Threads
from tpagent.migration.api import Peer
from tpagent.migration.journal import Journal
from transfer.api import TransferConfig, Transport


@dataclass(frozen=True)
class Context:
    cfg: AgentConfig
    snapshot_config: SnapshotConfig
    journal: Journal
    #: The agent at an address (HOST:PORT), as a Peer.
    peer: Callable[[str], Peer]
    #: A fresh transport for one transfer, and its settings (the cluster secret among them).
    transport: Callable[[], Transport]
    transfer_config: TransferConfig
    threads: Threads = field(default_factory=Threads)
    #: How an original is frozen and held (CRIU's; a stand-in in the unit tests, which have no root).
    held: type[HeldDump] = HeldDump
    log: logging.LoggerAdapter[logging.Logger] = field(
        default_factory=lambda: logging.LoggerAdapter(logging.getLogger("tpagent"), {})
    )

    @property
    def timeouts(self) -> Timeouts:
        return self.cfg.timeouts

    def inside_work_dir(self, p: Path | str) -> bool:
        """Whether ``p`` (from a journal record: data) is a path inside this agent's work_dir."""
        path = Path(p)
        return bool(str(p)) and path.is_absolute() and self.cfg.work_dir.resolve() in path.resolve().parents

    def remove(self, *paths: Path | str) -> None:
        """Delete snapshot directories, but only inside this agent's work_dir: an empty,
        relative or foreign path in a record must never remove another directory (root)."""
        for p in paths:
            if not self.inside_work_dir(p):
                self.log.error("not removing %r: it is not inside the work directory %s", str(p), self.cfg.work_dir)
                continue
            if os.path.isdir(p) and not os.path.islink(p):
                shutil.rmtree(p, ignore_errors=True)
                continue
            try:
                Path(p).unlink(missing_ok=True)
            except OSError as e:
                self.log.error("could not remove %s: %s", p, e)
