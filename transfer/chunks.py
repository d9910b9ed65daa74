"""What a sender (:mod:`transfer.sender`) keeps of a snapshot while it streams it: which chunks are
still to send, which the receiver acknowledged or refused, and the snapshot's files (for a
snapshot still being written, how far each has grown)."""

from __future__ import annotations

import hashlib
import os
import threading
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from snapshot import manifest as snapmanifest
from transfer import wire
from transfer.api import IntegrityError, TransferError
from transfer.wire import Layout


@dataclass
class SendState:
    """The chunks to send and what became of each.  A followed snapshot (one still being
    written) grows: :meth:`add` appends chunks until :meth:`close`."""

    chunk_size: int
    chunk_retries: int
    cond: threading.Condition = field(default_factory=threading.Condition)
    pending: deque[int] = field(default_factory=deque)
    acked: bytearray = field(default_factory=bytearray)
    crcs: list[int] = field(default_factory=list)
    chunks: list[tuple[int, int, int]] = field(default_factory=list)
    naks: dict[int, int] = field(default_factory=dict)
    error: TransferError | None = None
    closed: bool = False
    raw_total: int = 0
    raw_acked: int = 0
    wire_bytes: int = 0

    def add(self, chunks: list[tuple[int, int, int]]) -> None:
        with self.cond:
            if len(self.chunks) + len(chunks) > wire.MAX_CHUNKS:
                self.fail(TransferError("the snapshot has too many chunks"))
                return
            self.pending.extend(range(len(self.chunks), len(self.chunks) + len(chunks)))
            self.chunks += chunks
            self.acked += bytes(len(chunks))
            self.crcs += [0] * len(chunks)
            self.raw_total += sum(length for _, _, length in chunks)
            self.cond.notify_all()

    def close(self) -> None:
        with self.cond:
            self.closed = True
            self.cond.notify_all()

    def done(self) -> bool:
        return self.error is not None or (self.closed and all(self.acked))

    def mark_have(self, have: bytes | bytearray) -> None:
        with self.cond:
            if len(have) not in (0, len(self.acked)):
                raise TransferError("the receiver's HAVE does not match this snapshot")
            for i, h in enumerate(have):
                if h and not self.acked[i]:
                    self.acked[i] = 1
                    self.raw_acked += self.chunks[i][2]
            self.cond.notify_all()

    def next(self, broken: Callable[[], bool]) -> int | None:
        with self.cond:
            while True:
                while self.pending and self.acked[self.pending[0]]:
                    self.pending.popleft()
                if self.pending:
                    return self.pending.popleft()
                if self.done() or broken():
                    return None
                self.cond.wait(0.1)

    def ack(self, index: int, ok: bool) -> None:
        with self.cond:
            if ok:
                if not self.acked[index]:
                    self.acked[index] = 1
                    self.raw_acked += self.chunks[index][2]
            else:
                self.naks[index] = self.naks.get(index, 0) + 1
                if self.naks[index] > self.chunk_retries:
                    self.fail(IntegrityError(f"chunk {index} arrived damaged {self.naks[index]} times; giving up"))
                self.pending.appendleft(index)
            self.cond.notify_all()

    def requeue(self, indices: list[int]) -> None:
        with self.cond:
            self.pending.extendleft(i for i in indices if not self.acked[i])
            self.cond.notify_all()

    def fail(self, error: TransferError) -> None:
        with self.cond:
            # The first error, unless the receiver later says why on purpose (a full disk):
            # that, not the broken streams it caused, is what the user needs to read.
            if self.error is None or (isinstance(error, wire.PeerError) and not isinstance(self.error, wire.PeerError)):
                self.error = error
            self.cond.notify_all()


class Files:
    """The snapshot's files, opened for reading; for a followed snapshot, how far each is queued."""

    def __init__(self, root: Path, chunk_size: int) -> None:
        self.root = root
        self.chunk_size = chunk_size
        self.follow = False  # chunks then say where they go (the receiver knows no layout)
        self.digested: set[int] = set()  # files whose chunks the receiver checks by SHA-256, not CRC
        self.names: list[str] = []
        self.fds: list[int] = []
        self.queued: list[int] = []

    def _open(self, name: str) -> int:
        fd = os.open(self.root / name, os.O_RDONLY | os.O_NOFOLLOW)
        self.names.append(name)
        self.fds.append(fd)
        self.queued.append(0)
        return len(self.fds) - 1

    def open_all(self, layout: Layout) -> None:
        for name, _ in layout.files:
            self._open(name)

    def grown(self, final: bool) -> list[tuple[int, int, int]]:
        """New chunks: whole ones written since the last call, and with ``final`` the tails."""
        try:
            names = [f"{snapmanifest.IMAGES_DIR}/{e.name}" for e in os.scandir(self.root / snapmanifest.IMAGES_DIR)]
        except FileNotFoundError:  # not started yet
            names = []
        if final:
            names.append(snapmanifest.MANIFEST_NAME)
        index = {n: i for i, n in enumerate(self.names)}
        out = []
        for name in sorted(names):
            fi = index[name] if name in index else self._open(name)
            size = os.fstat(self.fds[fi]).st_size
            end = size if final else size - size % self.chunk_size
            if end < self.queued[fi]:
                raise IntegrityError(f"{name} shrank while it was being sent")
            out += [(fi, off, min(self.chunk_size, end - off)) for off in range(self.queued[fi], end, self.chunk_size)]
            self.queued[fi] = end
        return out

    def layout(self) -> Layout:
        return Layout(tuple(zip(self.names, self.queued, strict=False)), self.chunk_size)

    def manifest_sha256(self) -> str:
        with open(self.root / snapmanifest.MANIFEST_NAME, "rb") as f:
            return hashlib.sha256(f.read()).hexdigest()

    def close(self) -> None:
        for fd in self.fds:
            os.close(fd)
        self.fds = []
