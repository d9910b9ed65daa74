"""The transfer layer's contract: move a snapshot directory from one node to another.

Implementations (TCP, UCX) come with the transfer issue; this module fixes what they
promise so the agent can be written against it.
"""

from __future__ import annotations

import abc
from dataclasses import dataclass
from pathlib import Path


class TransferError(Exception):
    """The transport or the peer failed; ``str(e)`` is one sentence for the user."""


@dataclass(frozen=True)
class TransferStats:
    bytes_raw: int
    bytes_wire: int
    seconds: float


class Sender(abc.ABC):
    @abc.abstractmethod
    def send(self, snapshot: Path, peer: str, timeout: float) -> TransferStats:
        """Stream ``snapshot`` to ``peer`` (HOST:PORT); return once the peer verified it."""


class Receiver(abc.ABC):
    @abc.abstractmethod
    def receive(self, out: Path, timeout: float) -> TransferStats:
        """Accept one authenticated stream and write a verified snapshot into ``out``."""
