"""What arrived of a snapshot stream, checked before the receiver (:mod:`transfer.receiver`)
publishes it: a session started in its private partial directory, the chunks of a followed
snapshot held against the files its trailer names, the totals and the stream digest against the
trailer, every file synced, the manifest against the one the sender announced, and the snapshot
against its manifest (by the digests taken as the chunks arrived, where there are some)."""

from __future__ import annotations

import contextlib
import errno
import hashlib
import os
import shutil
import time
from collections.abc import Callable
from pathlib import Path

from host.safefs import private_dir
from snapshot import manifest as snapmanifest
from transfer import wire
from transfer.api import IntegrityError, TransferError
from transfer.session import Session, zero_digest
from transfer.wire import Layout


def start(
    partial: Path, layout: Layout | None, chunk_size: int, sha: str, expect: dict[int, list[str]], digest: str
) -> Session:
    """A session receiving into ``partial`` (made here, 0700: a partial snapshot is someone's
    memory too); its files sized and its regions counted when the layout is known.  If that
    fails part-way (no descriptor or inode left), what it opened and made is let go."""
    private_dir(partial, empty=True)
    s = Session(layout, chunk_size, partial, sha, expect=expect, digest=digest)
    if layout is None:
        return s
    try:
        _size_and_count(s, layout, expect)
    except BaseException:
        discard(s, 0.0)
        raise
    return s


def _size_and_count(s: Session, layout: Layout, expect: dict[int, list[str]]) -> None:
    for name, size in layout.files:
        os.ftruncate(s.fds[s.open_file(name)], size)
    s.where = dict(enumerate(layout.chunks()))
    region = snapmanifest.CHUNK_SIZE
    if not expect and region % layout.chunk_size == 0:  # hash regions as they complete
        s.waiting = [[0] * max(1, -(-size // region)) for _, size in layout.files]
        s.digests = [[""] * len(w) for w in s.waiting]
        for fi, off, _ in s.where.values():
            s.waiting[fi][off // region] += 1
        for fi, (name, size) in enumerate(layout.files):
            if size == 0:
                s.digests[fi][0] = snapmanifest.chunk_digest((s.partial / name, 0, 0), s.digest)


def discard(s: Session, io_timeout: float) -> None:
    """Store nothing more, and remove what arrived."""
    with s.lock:
        s.discarded = True  # data streams store nothing more
    deadline = time.monotonic() + io_timeout
    while s.claimed and time.monotonic() < deadline:  # a chunk being written ends before its file closes
        time.sleep(0.001)
    for fd in s.fds:
        with contextlib.suppress(OSError):
            os.close(fd)
    s.fds = []
    shutil.rmtree(s.partial, ignore_errors=True)


def check(s: Session, trailer: dict[str, object], disk_full: Callable[[], TransferError]) -> None:
    """Everything the trailer says held against what arrived, and the snapshot verified
    (IntegrityError, TransferError; ``disk_full()`` where the disk ran out as it was synced)."""
    if s.layout is None:
        settle_followed(s, trailer)
    assert s.layout is not None
    if len(s.have) != s.layout.count:
        raise IntegrityError(f"{s.layout.count - len(s.have)} chunks never arrived")
    if trailer.get("chunks") != s.layout.count or trailer.get("raw_bytes") != s.layout.raw_bytes:
        raise IntegrityError("the trailer's totals do not match what arrived")
    if trailer.get("digest") != wire.digest([s.crcs[i] for i in range(s.layout.count)]):
        raise IntegrityError("the stream digest does not match: chunks were lost, reordered or altered")
    try:
        for fd in s.fds:
            os.fsync(fd)  # (a disk that delays its allocation says ENOSPC here)
    except OSError as e:
        raise (disk_full() if e.errno == errno.ENOSPC else e) from e
    for fd in s.fds:
        os.close(fd)
    s.fds = []
    with open(s.partial / snapmanifest.MANIFEST_NAME, "rb") as f:
        if hashlib.sha256(f.read()).hexdigest() != s.manifest_sha256:
            raise IntegrityError("the manifest that arrived is not the one the sender announced")
    m = snapmanifest.load(s.partial)
    if {name for name, _ in s.layout.files} != {snapmanifest.MANIFEST_NAME, *m.files}:
        raise IntegrityError("the stream carried files that its manifest does not list")
    snapmanifest.verify(s.partial, m, _early_digests(s), s.digest)


def _early_digests(s: Session) -> dict[str, list[str]] | None:
    """The manifest chunks' SHA-256 taken as they arrived, by file (None: none was)."""
    assert s.layout is not None
    if s.expect:  # every chunk was checked against these as it arrived
        return {s.layout.files[fi][0]: d for fi, d in s.expect.items()}
    if s.followed and s.chunk_size == snapmanifest.CHUNK_SIZE:
        early = {}
        for name, size in s.layout.files:
            fi = s.names[name]
            taken = [s.received_sha.get((fi, off), "") for off in range(0, size, s.chunk_size)]
            early[name] = taken or [zero_digest(0, s.digest)]
        return early
    if s.digests:
        return {name: s.digests[fi] for fi, (name, _) in enumerate(s.layout.files)}
    return None


def settle_followed(s: Session, trailer: dict[str, object]) -> None:
    """The trailer of a followed snapshot names its files: what arrived must be exactly them."""
    try:
        files = trailer["files"]
        assert isinstance(files, list)
        layout = Layout(tuple((str(p), int(n)) for p, n in files), s.chunk_size)
        s.manifest_sha256 = str(trailer["manifest_sha256"])
    except (KeyError, TypeError, ValueError, AssertionError) as e:
        raise TransferError(f"the trailer is malformed ({e!r})") from e
    for name, _ in layout.files:
        if name not in s.names:
            s.open_file(name)  # an empty file: no chunk named it
    order = [s.names[name] for name, _ in layout.files]
    expected = {(order[fi], off, n) for fi, off, n in layout.chunks()}
    if len(s.names) != len(layout.files) or set(s.where.values()) != expected or len(s.where) != layout.count:
        raise IntegrityError("the chunks that arrived do not add up to the files the trailer names")
    if sorted(s.where) != list(range(layout.count)):
        raise IntegrityError("the chunks are not numbered 0..N-1")
    for fi, (_, size) in zip(order, layout.files, strict=False):
        os.ftruncate(s.fds[fi], size)  # a file that ends in zeros was left short (sparse)
    s.layout = layout
    s.followed = True
