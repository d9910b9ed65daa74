"""One transfer as a receiver holds it: where its chunks go, what has arrived and been
checked, and how a chunk is written so that what is verified is what the file holds
(:func:`pwrite_all`, :func:`digest_back`).  :mod:`transfer.receiver` drives it."""

from __future__ import annotations

import errno
import functools
import os
import re
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from snapshot import manifest as snapmanifest
from transfer import wire
from transfer.api import Channel, TransferError, TransferStats
from transfer.wire import CHUNK, Layout


@dataclass
class Session:
    """One transfer being received.  ``layout`` is None while following (files then come as
    chunks name them, and the trailer says what they add up to)."""

    layout: Layout | None
    chunk_size: int
    partial: Path
    manifest_sha256: str
    names: dict[str, int] = field(default_factory=dict)  # file -> its index in fds
    fds: list[int] = field(default_factory=list)
    #: Chunk index -> (file index, offset, length): the layout's, or as the chunks said.
    where: dict[int, tuple[int, int, int]] = field(default_factory=dict)
    have: set[int] = field(default_factory=set)
    crcs: dict[int, int] = field(default_factory=dict)
    #: Per file, per manifest chunk: transfer chunks still to come, then its SHA-256, hashed
    #: as soon as the region is complete so that verification overlaps the transfer.
    waiting: list[list[int]] = field(default_factory=list)
    claimed: set[int] = field(default_factory=set)
    digests: list[list[str]] = field(default_factory=list)
    #: Per file index: the manifest's SHA-256 of each chunk, checked on arrival (no CRC then).
    expect: dict[int, list[str]] = field(default_factory=dict)
    #: Following a snapshot (no digests yet) in chunks of the manifest's size: each chunk's
    #: SHA-256 is taken as it arrives and held against the manifest at the end.
    received_sha: dict[tuple[int, int], str] = field(default_factory=dict)
    followed: bool = False
    #: Chunks written once and then found damaged: a resend of zeros must overwrite them.
    rewrite: set[int] = field(default_factory=set)
    #: The algorithm of the digests above (the sender's header says; an older one's: SHA-256).
    digest: str = "sha256"

    @property
    def hash_as_received(self) -> bool:
        return self.layout is None and self.chunk_size == snapmanifest.CHUNK_SIZE

    lock: threading.Lock = field(default_factory=threading.Lock)
    bytes_wire: int = 0
    started: float = field(default_factory=time.monotonic)
    #: The signed header, which a control stream that comes back must repeat.
    header: dict[str, Any] = field(default_factory=dict)
    #: The control stream in use (the sender's newest), and since when there is none.
    control: Channel | None = None
    orphaned: float | None = None
    verifying: bool = False
    #: Once verified or refused: the result, and the DONE body that says it.
    outcome: TransferStats | TransferError | None = None
    done: bytes = b""
    discarded: bool = False

    def have_bitmap(self) -> bytes:
        if self.layout is None:
            return b""
        bits = bytearray(self.layout.count)
        for i in self.have:
            bits[i] = 1
        return bytes(bits)

    def open_file(self, name: str) -> int:
        path = self.partial / name
        path.parent.mkdir(mode=0o700, exist_ok=True)  # (inside the private partial directory)
        self.fds.append(os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600))
        self.names[name] = len(self.fds) - 1
        return len(self.fds) - 1

    def locate(
        self, index: int, raw_len: int, body: bytes | bytearray | memoryview
    ) -> tuple[tuple[int, int, int], int]:
        """Where chunk ``index`` goes, and where its payload starts in ``body``."""
        if self.layout is not None:
            if index >= self.layout.count or raw_len != self.where[index][2]:
                raise TransferError(f"chunk {index} does not fit this snapshot")
            return self.where[index], CHUNK.size
        if len(body) < CHUNK.size + wire.WHERE.size:
            raise TransferError("a chunk is too short to say where it goes")
        off, n = wire.WHERE.unpack_from(body, CHUNK.size)
        start = CHUNK.size + wire.WHERE.size + n
        name = bytes(body[CHUNK.size + wire.WHERE.size : start]).decode(errors="replace")
        if (
            index >= wire.MAX_CHUNKS
            or off % self.chunk_size
            or not 0 < raw_len <= self.chunk_size
            or off + raw_len > wire.MAX_FILE
        ):
            raise TransferError(f"chunk {index} ({name} at {off}) does not fit a snapshot")
        with self.lock:
            if name not in self.names:
                Layout(((name, 0),), self.chunk_size)  # checks the name
                if len(self.names) >= wire.MAX_FILES:
                    raise TransferError("the stream names too many files")
                self.open_file(name)
            where = (self.names[name], off, raw_len)
            if self.where.setdefault(index, where) != where:
                raise TransferError(f"chunk {index} was sent again for a different place")
        return where, start


def pwrite_all(fd: int, data: bytes | memoryview, offset: int) -> None:
    """All of ``data`` at ``offset``, or OSError: a short write (a disk filling up) is continued
    until the kernel says why it cannot, never taken for the whole chunk."""
    view = memoryview(data)
    while view:
        n = os.pwrite(fd, view, offset)
        if n == 0:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        view = view[n:]
        offset += n


def digest_back(fd: int, buf: bytearray, n: int, offset: int, digest: str) -> str:
    """The ``digest`` of the ``n`` bytes the file now holds at ``offset``: what was written, as
    the file has it, not as the buffer had it (read back through ``buf``, a piece at a time)."""
    h = snapmanifest.DIGESTS[digest]()
    view = memoryview(buf)
    got = 0
    while got < n:
        k = os.preadv(fd, [view[: min(len(view), n - got)]], offset + got)
        if k == 0:
            raise OSError(errno.EIO, f"{n - got} bytes just written at {offset + got} read back as missing")
        h.update(view[:k])
        got += k
    return str(h.hexdigest())


@functools.lru_cache(maxsize=8)
def zero_digest(n: int, digest: str) -> str:
    return str(snapmanifest.DIGESTS[digest](bytes(n)).hexdigest())


def expected_digests(layout: Layout | None, given: object) -> dict[int, list[str]]:
    """The header's per-chunk digests by file index, checked against the layout's shape."""
    if given is None:
        return {}
    if layout is None or not isinstance(given, dict) or layout.chunk_size != snapmanifest.CHUNK_SIZE:
        raise ValueError("digests do not fit the layout")
    index = {name: fi for fi, (name, _) in enumerate(layout.files)}
    out = {}
    for name, digests in given.items():
        size = layout.files[index[name]][1]
        if not isinstance(digests, list) or len(digests) != max(1, -(-size // layout.chunk_size)):
            raise ValueError(f"digests of {name} have the wrong number of chunks")
        if not all(isinstance(d, str) and re.fullmatch("[0-9a-f]{64}", d) for d in digests):
            raise ValueError(f"digests of {name} are not hex")
        out[index[name]] = digests
    return out
