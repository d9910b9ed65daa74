"""CRIU's images taken as CRIU produces them (``criu dump --stream``), hashed on the way.

With ``--stream`` CRIU writes no image file.  It connects to ``streamer-capture.sock`` in its
images directory (its image-streamer protocol, ``criu/img-streamer.c``) and, for each image,
sends the image's name (a length-prefixed ``img_streamer_request_entry``) and then, with one
byte, the read end of a pipe it writes that image into.  Several images are open at once (the
pagemap beside the pages), so each pipe is read by a thread of its own.

:class:`Capture` is that other end.  It reads each pipe in chunks of the manifest's size, hashes
each chunk with the manifest's digest as it arrives, and hands it to a sink (for a migration, the
transfer's :class:`transfer.chunks.Feed`), so the pages are never written to the source node and
read back.  Measured with
``bench/stream.py`` (a 1 GiB workload, 2-core VM): the dump and the seal took 1.07 s and 1.28
CPU seconds through files in ``/dev/shm``, 0.41 s and 0.38 CPU seconds streamed and hashed.
A page server (``criu dump --page-server``) took 1.17 s, and speaks an unauthenticated protocol.

In a dump (:func:`snapshot.dump.checkpoint` given ``SnapshotConfig.stream``) the post-dump hook
seals what the capture read.  CRIU has written every image by then but keeps its socket open
until after the hook, so the two meet in the dump's log directory: the hook makes
:data:`END_FILE`; the capture, once no request is left unread and every pipe is drained, writes
:data:`STREAMED_FILE` (each image's size and digests, or why the stream failed), and the hook
seals those digests (:func:`snapshot.hook.seal`).  CRIU finds the socket by its ``-D`` path,
which must fit a socket's name (108 bytes), so it runs in the images directory, told ``.``.

CRIU's pipes are 64 KiB; each is widened to 1 MiB (the kernel's default ``pipe-max-size``),
without which the same dump took three times as long.  A sink that fails, or :meth:`abort`,
closes the pipes: CRIU then fails the dump on a broken pipe, and rolls it back as it does for
any failed dump, so a consumer that gives up never leaves the tree frozen behind it.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import select
import socket
import struct
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from snapshot import skqueues
from snapshot.api import ImageSink, SnapshotError
from snapshot.manifest import CHUNK_SIZE, DIGEST, DIGESTS

SOCKET_NAME = "streamer-capture.sock"
#: In the dump's log directory: made by the hook once CRIU has written every image (post-dump).
END_FILE = "stream.end"
#: Then written there by the capture, for the hook to seal: each image's size and digests.
STREAMED_FILE = "streamed.json"
PIPE_SIZE = 1 << 20
_MAX_REQUEST = 4096  # an image's name, as CRIU frames it


class StreamError(SnapshotError):
    """Reading CRIU's stream failed, or its consumer gave up."""


@dataclass
class Streamed:
    """One image as it went by: its size and its chunks' digests."""

    size: int = 0
    digests: list[str] = field(default_factory=list)


class Capture:
    """Listens in ``images`` for one ``criu dump --stream`` and reads every image it sends."""

    def __init__(
        self,
        images: Path,
        sink: ImageSink | None = None,
        chunk_size: int = CHUNK_SIZE,
        digest: str = DIGEST,
        log_dir: Path | None = None,
    ) -> None:
        self.sink = sink
        self.log_dir = log_dir
        self.chunk_size = chunk_size
        self.hasher = DIGESTS[digest]
        self.images: dict[str, Streamed] = {}
        self.error: BaseException | None = None
        self.queues = bytearray()  # (sk-queues.img, kept for the hook's check: snapshot.skqueues)
        self._lock = threading.Lock()
        self._conn: socket.socket | None = None
        self._aborted = False
        # bound through the directory's descriptor: its path may be too long for a socket's name
        self._dir = os.open(images, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
        self._listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._listener.bind(f"/proc/self/fd/{self._dir}/{SOCKET_NAME}")
        self._listener.listen(1)
        self._listener.settimeout(0.2)  # (accept() sees an abort)
        self._thread = threading.Thread(target=self._serve, name="criu-stream", daemon=True)
        self._thread.start()

    def close(self, timeout: float | None = None) -> dict[str, Streamed]:
        """Once CRIU has ended: the images it sent; raises :class:`StreamError` if any failed."""
        self._thread.join(timeout)
        self._listener.close()
        if self._thread.is_alive():  # (its directory's descriptor stays open for it)
            self.abort()
            raise StreamError(f"CRIU's image stream did not end within {timeout:.0f} s")
        if self._dir >= 0:
            self._unlink()
            os.close(self._dir)
            self._dir = -1
        if self.error is not None:
            raise StreamError(f"streaming CRIU's images failed: {self.error}") from self.error
        return self.images

    def finish(self, timeout: float) -> bool:
        """Once CRIU has ended (so has its stream): whether any image arrived (a failure of
        the stream's own is in :attr:`error`, and CRIU has failed the dump for it)."""
        with contextlib.suppress(StreamError):
            self.close(timeout)
        return bool(self.images)

    def abort(self) -> None:
        """Stop reading: each pipe is closed once its reader wakes (at CRIU's next write to
        it), and CRIU's write after that fails, and so does its dump."""
        with self._lock:
            self._aborted = True
            self.error = self.error or StreamError("it was aborted")
            conn = self._conn
        if conn is not None:
            with contextlib.suppress(OSError):
                conn.shutdown(socket.SHUT_RDWR)

    def _fail(self, e: BaseException) -> None:
        with self._lock:
            self.error = self.error or e
        self.abort()

    def _serve(self) -> None:
        conn = self._accept()
        if conn is None:
            return
        readers: list[threading.Thread] = []
        try:
            with conn:
                uid = struct.unpack("3i", conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, 12))[1]
                if uid != os.geteuid():
                    raise StreamError(f"a process of UID {uid}, not CRIU, connected to the image stream")
                while self._pending(conn) and (head := _exact(conn, 4)):
                    (n,) = struct.unpack("<I", head)
                    if n > _MAX_REQUEST:
                        raise StreamError(f"CRIU's request is {n} bytes long")
                    name = _image_name(_exact(conn, n))
                    _, fds, _, _ = socket.recv_fds(conn, 1, 1)
                    if len(fds) != 1 or name in self.images:
                        raise StreamError(f"CRIU sent {name} without its pipe, or twice")
                    if self._aborted:
                        os.close(fds[0])
                        return
                    self.images[name] = Streamed()
                    t = threading.Thread(target=self._read, args=(name, fds[0]), name=f"stream {name}", daemon=True)
                    t.start()
                    readers.append(t)
        except Exception as e:  # (whatever it was, the hook must hear of it, never of a partial success)
            self._fail(e)
        finally:
            for t in readers:
                t.join()
            if self.log_dir is not None:
                self._publish(self.log_dir)

    def _accept(self) -> socket.socket | None:
        """CRIU's connection (then the socket's name is gone from the images); None if aborted."""
        try:
            while True:
                try:
                    conn, _ = self._listener.accept()
                    conn.settimeout(None)
                    with self._lock:
                        self._conn = conn
                    return conn
                except TimeoutError:
                    if self._aborted:
                        return None
                except OSError as e:
                    self._fail(e)
                    return None
        finally:
            self._unlink()

    def _unlink(self) -> None:
        with contextlib.suppress(OSError):
            os.unlink(SOCKET_NAME, dir_fd=self._dir)

    def _pending(self, conn: socket.socket) -> bool:
        """Whether CRIU has sent another request (or closed): it sends each before it writes
        that image, so once the hook says the dump is over (:data:`END_FILE`) and nothing is
        to be read, every image has been asked for."""
        poller = select.poll()
        poller.register(conn, select.POLLIN)
        while not self._aborted:
            ended = self.log_dir is not None and (self.log_dir / END_FILE).exists()
            if poller.poll(0 if ended else 50):
                return True
            if ended:
                return False
        return False

    def _publish(self, log_dir: Path) -> None:
        """Say what was streamed (or why it failed) in ``log_dir``, for the hook to seal."""
        if self.error is not None:
            said: dict[str, Any] = {"error": f"streaming CRIU's images failed: {self.error}"}
        else:
            said = {
                "images": {
                    n: {"size": i.size, "chunk_size": self.chunk_size, "digests": i.digests}
                    for n, i in self.images.items()
                }
            }
            queues = self.images.get(skqueues.NAME)
            try:
                if queues is not None and queues.size > len(self.queues):
                    raise ValueError(f"over {skqueues.MOST >> 20} MiB of queued messages, more than is read")
                if queues is not None:
                    said["descriptors_queued"] = skqueues.carrying_descriptors(bytes(self.queues))
            except ValueError as e:
                said = {"error": f"CRIU's {skqueues.NAME} could not be checked for descriptors: {e}"}
        tmp = log_dir / (STREAMED_FILE + ".tmp")
        tmp.write_text(json.dumps(said))
        tmp.rename(log_dir / STREAMED_FILE)

    def _read(self, name: str, fd: int) -> None:
        with contextlib.suppress(OSError):
            fcntl.fcntl(fd, fcntl.F_SETPIPE_SZ, PIPE_SIZE)
        view = memoryview(bytearray(self.chunk_size))
        image = self.images[name]
        try:
            while True:
                got = 0
                while got < len(view) and not self._aborted and (k := os.readv(fd, [view[got:]])):
                    got += k
                if got:
                    chunk = view[:got]
                    image.digests.append(self.hasher(chunk).hexdigest())
                    if name == skqueues.NAME and image.size + got <= skqueues.MOST:
                        self.queues += chunk
                    if self.sink is not None:
                        self.sink(name, image.size, chunk)
                    image.size += got
                if got < len(view) or self._aborted:
                    break
            if not image.size and self.sink is not None and not self._aborted:
                self.sink(name, 0, view[:0])  # (an empty image exists all the same)
        except BaseException as e:  # (a sink's own failure included: CRIU must not wait on a pipe no one reads)
            self._fail(e)
        finally:
            os.close(fd)


def _exact(conn: socket.socket, n: int) -> bytes:
    """``n`` bytes, or b"" where CRIU closed the stream (between requests: the dump's end)."""
    data = b""
    while len(data) < n and (part := conn.recv(n - len(data))):
        data += part
    if data and len(data) < n:
        raise StreamError("CRIU's image stream ended inside a request")
    return data


def _image_name(entry: bytes) -> str:
    """The request's one field (1, a string): tag 0x0a, a varint length, the name."""
    if entry[:1] != b"\x0a":
        raise StreamError("CRIU's request is not an image's name")
    length = 0
    i = 1
    while i < min(len(entry), 6):  # (a varint of at most 5 bytes: 35 bits)
        length |= (entry[i] & 0x7F) << (7 * (i - 1))
        i += 1
        if not entry[i - 1] & 0x80:
            break
    name = entry[i : i + length].decode(errors="replace")
    if i + length != len(entry) or not name or "/" in name or name in (".", ".."):
        raise StreamError(f"CRIU's request names no plain image file ({name[:80]!r})")
    return name
