"""CRIU's images streamed (``criu dump --stream``) into :class:`snapshot.streamer.Capture`: a
snapshot that restores, hashed chunk by chunk on the way, and a consumer that fails leaves the
workload running where it stood."""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from conftest import needs_criu
from snapshot import manifest
from snapshot.api import CriuError, SnapshotConfig, SnapshotInvalid
from snapshot.criu import Criu, DumpOptions, RestoreOptions
from snapshot.dump import checkpoint
from snapshot.restore import restore
from snapshot.streamer import Capture, StreamError
from support.helpers import NOBODY, alive, assert_continuous, wait_until

pytestmark = needs_criu


def test_streamed_images_restore_the_workload(start, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    """The chunks, written where they say (as a target would), are a snapshot CRIU restores:
    the workload goes on from its last tick with its memory byte-identical; and each chunk's
    digest is the one its bytes have (the seal's digest, chunk by chunk)."""
    w = start(64)
    w.verify_state()
    (tmp_path / "images").mkdir()
    (tmp_path / "out").mkdir()
    written: dict[str, bytearray] = {}

    def write(name: str, offset: int, chunk: memoryview) -> None:
        data = written.setdefault(name, bytearray())
        assert offset == len(data)
        data += chunk

    capture = Capture(tmp_path / "images", write, chunk_size=1 << 20)
    Criu().dump(w.pid, tmp_path / "images", tmp_path, DumpOptions(stream=True), 120)
    streamed = capture.close(60)
    w.reap()
    stopped_at = w.ticks()[-1][0]

    assert not [p for p in (tmp_path / "images").iterdir() if p.name.endswith(".img")]  # nothing written here
    assert {"inventory.img", "pstree.img"} <= set(streamed) and set(written) == {
        n for n in streamed if streamed[n].size
    }
    assert sum(streamed[n].size for n in streamed if n.startswith("pages-")) >= 64 << 20
    mib = 1 << 20
    for name, data in written.items():
        assert streamed[name].size == len(data)
        digest = manifest.DIGESTS[manifest.DIGEST]
        assert streamed[name].digests == [digest(data[o : o + mib]).hexdigest() for o in range(0, len(data), mib)]
        (tmp_path / "out" / name).write_bytes(data)
    for name in set(streamed) - set(written):
        (tmp_path / "out" / name).touch()

    w.pid = Criu().restore(tmp_path / "out", tmp_path, RestoreOptions(), 120)
    wait_until(lambda: w.ticks()[-1][0] >= stopped_at + 5, "the restored workload to tick on")
    assert_continuous(w.ticks())
    w.verify_state()


@pytest.mark.parametrize("how", ["sink fails", "aborted"])
def test_a_consumer_that_gives_up_fails_the_dump_and_the_workload_runs_on(start, tmp_path: Path, how: str) -> None:  # type: ignore[no-untyped-def]
    w = start(256)
    (tmp_path / "images").mkdir()
    capture: Capture

    def give_up(name: str, offset: int, chunk: memoryview) -> None:
        if name.startswith("pages-") and offset >= 16 << 20:
            if how == "aborted":
                capture.abort()
            else:
                raise OSError("the peer went away")

    capture = Capture(tmp_path / "images", give_up)
    with pytest.raises(CriuError):
        Criu().dump(w.pid, tmp_path / "images", tmp_path, DumpOptions(stream=True), 120)
    with pytest.raises(StreamError, match="the peer went away" if how == "sink fails" else "aborted"):
        capture.close(60)
    before = len(w.ticks())
    wait_until(lambda: len(w.ticks()) > before + 3, "the workload to tick on")
    assert_continuous(w.ticks())
    w.verify_state()


def test_a_streamed_checkpoint_is_sealed_with_what_went_by(start, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    """checkpoint() with a sink: nothing is written into the snapshot's images, the hook seals
    the digests the capture took; the chunks put where they belong restore (verified against
    that seal), and one flipped byte among them is refused before anything is restored."""
    w = start(64)
    w.verify_state()
    got: dict[str, bytearray] = {}

    def keep(name: str, offset: int, chunk: memoryview) -> None:
        got.setdefault(name, bytearray())[offset:] = chunk

    snap = tmp_path / "snap"
    sealed = checkpoint(w.pid, snap, config=SnapshotConfig(stream=keep))
    w.reap()
    stopped_at = w.ticks()[-1][0]
    images = snap / manifest.IMAGES_DIR
    assert not list(images.iterdir())
    assert {f"{manifest.IMAGES_DIR}/{n}" for n in got} == set(sealed.files)
    for name, data in got.items():
        (images / name).write_bytes(data)

    pages = next(images.glob("pages-*.img"))
    good = pages.read_bytes()
    pages.write_bytes(good[:4096] + bytes([good[4096] ^ 1]) + good[4097:])
    with pytest.raises(SnapshotInvalid):
        restore(snap)
    assert not alive(w.pid)
    pages.write_bytes(good)
    w.pid = restore(snap).pid
    wait_until(lambda: w.ticks()[-1][0] >= stopped_at + 5, "the restored workload to tick on")
    assert_continuous(w.ticks())
    w.verify_state()


_CONNECT = """
import socket, sys
s = socket.socket(socket.AF_UNIX)
try:
    s.connect(sys.argv[1])
except OSError as e:
    print("refused", e.errno)
    sys.exit(0)
print("connected", flush=True)  # (the capture may drop it before the bytes below are sent)
try:
    s.sendall(b"\\x05\\x00\\x00\\x00\\x0a\\x03abc")
    print("read", s.recv(1))
except (BrokenPipeError, ConnectionResetError):
    print("dropped")
"""


def test_another_user_cannot_feed_the_capture() -> None:
    """The capture's socket lies in the dump's images (root's, 0700): another user cannot reach
    it; and were the directory open, the capture would still take only a peer of its own UID."""
    top = Path(tempfile.mkdtemp(prefix="tp-stream-"))  # (in /tmp: pytest's own folders are root's alone)
    capture: Capture | None = None
    try:
        images = top / "images"
        images.mkdir(mode=0o700)
        os.chmod(top, 0o755)
        capture = Capture(images)
        sock = str(images / "streamer-capture.sock")
        connect = [*NOBODY, sys.executable, "-c", _CONNECT, sock]
        out = subprocess.run(connect, capture_output=True, text=True, timeout=30)
        assert out.stdout.startswith("refused 13"), out.stdout + out.stderr  # EACCES: the directory stops it

        os.chmod(images, 0o777)
        os.chmod(sock, 0o777)
        out = subprocess.run(connect, capture_output=True, text=True, timeout=30)
        assert out.stdout.startswith("connected"), out.stdout + out.stderr  # taken, then dropped unread
        with pytest.raises(StreamError, match="UID 65534, not CRIU"):
            capture.close(10)
        assert capture.images == {}
    finally:
        if capture is not None:  # (a failed check above must not leave it listening)
            with contextlib.suppress(StreamError):
                capture.close(10)
        shutil.rmtree(top)
