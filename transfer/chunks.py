"""What a sender (:mod:`transfer.sender`) keeps of a snapshot while it streams it: which chunks are
still to send, which the receiver acknowledged or refused, and the snapshot's files (for a
snapshot still being written, how far each has grown); which files a stream of a snapshot
carries, and whether a chunk the receiver kept refusing is damaged here."""

from __future__ import annotations

import hashlib
import os
import threading
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from snapshot import manifest as snapmanifest
from snapshot.api import SnapshotError
from transfer import wire
from transfer.api import ChunkRefused, IntegrityError, SnapshotDamaged, TransferError
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
    #: Told each chunk that the receiver now has (its memory may go: a :class:`Feed`'s).
    on_acked: Callable[[int], None] | None = None

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
                    self._acked(i)
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
                    self._acked(index)
            else:
                self.naks[index] = self.naks.get(index, 0) + 1
                if self.naks[index] > self.chunk_retries:
                    self.fail(ChunkRefused(index, self.naks[index]))
                self.pending.appendleft(index)
            self.cond.notify_all()

    def _acked(self, index: int) -> None:
        self.acked[index] = 1
        self.raw_acked += self.chunks[index][2]
        if self.on_acked is not None:
            self.on_acked(index)

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

    def __init__(self, root: Path, chunk_size: int, feed: Feed | None = None) -> None:
        self.root = root
        self.chunk_size = chunk_size
        self.feed = feed  # images that are no files here: their chunks come from it (fds -1)
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
            images = os.scandir(self.root / snapmanifest.IMAGES_DIR)
            names = [f"{snapmanifest.IMAGES_DIR}/{e.name}" for e in images if e.is_file(follow_symlinks=False)]
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
        return out + self._fed(index)

    def _fed(self, index: dict[str, int]) -> list[tuple[int, int, int]]:
        """The chunks the feed took since the last call (an empty image: none, but its name)."""
        out = []
        for image, off, length in self.feed.take() if self.feed is not None else []:
            name = f"{snapmanifest.IMAGES_DIR}/{image}"
            if name not in index:
                index[name] = len(self.names)
                self.names.append(name)
                self.fds.append(-1)
                self.queued.append(0)
            fi = index[name]
            if length:
                out.append((fi, off, length))
            self.queued[fi] = max(self.queued[fi], off + length)
        return out

    def read(self, fi: int, off: int, length: int, buf: bytearray) -> bytes | bytearray | memoryview | None:
        """A chunk's bytes: from its file (into ``buf`` when it fits it exactly), or copied from
        the feed into ``buf`` (the feed reuses its memory once the chunk is acknowledged: None
        if that happened meanwhile, on another stream)."""
        if self.fds[fi] < 0:
            assert self.feed is not None
            got = self.feed.read_into(self.names[fi].removeprefix(f"{snapmanifest.IMAGES_DIR}/"), off, buf)
            return None if got is None else buf if got == len(buf) else memoryview(buf)[:got]
        if length == len(buf):  # read into the stream's buffer: sent before it is reused
            got = os.preadv(self.fds[fi], [buf], off)
            return buf if got == length else buf[:got]
        return os.pread(self.fds[fi], length, off)

    def release(self, fi: int, off: int) -> None:
        """The receiver has this chunk: a fed one's memory goes back to the feed."""
        if self.fds[fi] < 0 and self.feed is not None:
            self.feed.release(self.names[fi].removeprefix(f"{snapmanifest.IMAGES_DIR}/"), off)

    def layout(self) -> Layout:
        return Layout(tuple(zip(self.names, self.queued, strict=False)), self.chunk_size)

    def manifest_sha256(self) -> str:
        with open(self.root / snapmanifest.MANIFEST_NAME, "rb") as f:
            return hashlib.sha256(f.read()).hexdigest()

    def close(self) -> None:
        for fd in self.fds:
            if fd >= 0:
                os.close(fd)
        self.fds = []


class Feed:
    """Chunks of a snapshot's images handed to a sender from memory as a dump produces them
    (:class:`snapshot.streamer.Capture`'s sink: they never become files on this node).  Each
    is kept until the receiver has it, at most ``limit`` bytes at once: past that, :meth:`put`
    waits (and CRIU behind it) for acknowledgements to free room.  Buffers are reused, so a
    transfer touches ``limit`` bytes of fresh memory however large the images."""

    def __init__(self, chunk_size: int, limit: int) -> None:
        self.chunk_size = chunk_size
        self.limit = max(limit, chunk_size)
        self.cond = threading.Condition()
        self.kept: dict[tuple[str, int], memoryview] = {}
        self.new: list[tuple[str, int, int]] = []
        self.spare: list[bytearray] = []
        self.held = 0
        self.fed = 0  # bytes put, in all
        self.error = ""

    def put(self, name: str, offset: int, chunk: memoryview) -> None:
        """Keep a chunk (the sink's call); raises TransferError once the transfer has ended."""
        if len(chunk) > self.chunk_size:
            raise TransferError(f"a chunk of {len(chunk)} bytes is larger than the transfer's chunks")
        buf = None
        if len(chunk):
            with self.cond:
                while not self.error and self.held + self.chunk_size > self.limit:
                    self.cond.wait()
                if not self.error:
                    buf = self.spare.pop() if self.spare else bytearray(self.chunk_size)
                    self.held += self.chunk_size
            if buf is not None:
                buf[: len(chunk)] = chunk
        with self.cond:
            if self.error:
                raise TransferError(self.error)
            if buf is not None:
                self.kept[(name, offset)] = memoryview(buf)[: len(chunk)]
            self.new.append((name, offset, len(chunk)))
            self.fed += len(chunk)

    def take(self) -> list[tuple[str, int, int]]:
        """The chunks (image, offset, length) put since the last call."""
        with self.cond:
            new = self.new
            self.new = []
            return new

    def read_into(self, name: str, offset: int, buf: bytearray) -> int | None:
        """Copy a chunk into ``buf``: its length, or None if it has been released."""
        with self.cond:
            view = self.kept.get((name, offset))
            if view is None:
                return None
            buf[: len(view)] = view
            return len(view)

    def release(self, name: str, offset: int) -> None:
        with self.cond:
            view = self.kept.pop((name, offset), None)
            if view is not None:
                self.spare.append(view.obj)  # type: ignore[arg-type]
                self.held -= self.chunk_size
                self.cond.notify_all()

    def fail(self, why: str) -> None:
        """No more chunks are taken: a waiting or later :meth:`put` raises ``why``."""
        with self.cond:
            self.error = self.error or why
            self.cond.notify_all()


def refuse_if_damaged_here(snapshot: Path, name: str, offset: int, length: int, e: ChunkRefused) -> None:
    """A chunk (``length`` bytes of ``name`` from ``offset``) the receiver kept refusing: where
    those bytes here do not match the snapshot's own manifest, the snapshot is said to be damaged
    (sending it again cannot help), not the network.  Only those bytes are read again."""
    try:
        m = snapmanifest.load(snapshot)
        if name not in m.files:
            return
        size = m.files[name]["size"]
        want = m.files[name]["digests"]
        step = snapmanifest.CHUNK_SIZE
        for region in range(offset // step, (offset + max(length, 1) - 1) // step + 1):
            piece = (snapshot / name, region * step, min(step, size - region * step))
            if region >= len(want) or snapmanifest.chunk_digest(piece, m.digest) != want[region]:
                raise SnapshotDamaged(
                    f"{snapshot} is damaged: {name} does not match its checksum. Not sent: the receiver refused it."
                ) from e
    except (OSError, SnapshotError):
        return  # (it cannot be told here: the receiver's refusal stands as it was)


def snapshot_layout(snapshot: Path, chunk_size: int) -> Layout:
    """The files a snapshot stream carries: manifest.json and every image the manifest lists."""
    try:
        m = snapmanifest.load(snapshot)
    except SnapshotError as e:
        raise TransferError(str(e)) from e
    names = [snapmanifest.MANIFEST_NAME, *sorted(m.files)]
    files = []
    for name in names:
        try:
            size = (snapshot / name).lstat().st_size
        except OSError as e:
            raise TransferError(f"{snapshot / name}, which its manifest lists, cannot be read ({e.strerror})") from e
        if name in m.files and size != m.files[name]["size"]:
            raise TransferError(
                f"{snapshot / name} does not have the size its manifest says; not sending a damaged snapshot"
            )
        files.append((name, size))
    return Layout(tuple(files), chunk_size)
