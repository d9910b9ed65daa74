"""The sending end of a snapshot stream (see :mod:`transfer.stream`): chunks from one queue,
N authenticated streams, compressed where it pays, resumed after a broken connection (the
control stream's too)."""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
import zlib
from collections.abc import Callable
from pathlib import Path
from typing import Any

import zstandard

from host.safefs import private_dir
from snapshot import manifest as snapmanifest
from transfer import wire
from transfer.api import (
    AuthError,
    Channel,
    ChunkRefused,
    Compress,
    IntegrityError,
    TransferConfig,
    TransferError,
    TransferStats,
    Transport,
    peer_address,
    retry_pause,
)
from transfer.chunks import Feed, Files, SendState, refuse_if_damaged_here, snapshot_layout
from transfer.stream import client_handshake
from transfer.wire import ACK, CHUNK, Codec, Kind, Role

log = logging.getLogger(__name__)

#: Called with (raw bytes acknowledged, bytes on the wire, raw bytes in all).
SendProgress = Callable[[int, int, int], None]


class _Codec:
    """Per-chunk choice between zstd and raw.

    ``auto`` compresses while it pays: with c the compressor's rate per thread, r the ratio
    (compressed/raw) and l the link's rate per stream, compressing wins while c*(1-r) > l.
    Every 32nd chunk is compressed anyway to keep c and r current."""

    def __init__(self, mode: Compress, level: int) -> None:
        self.mode = mode
        self.level = level
        self.lock = threading.Lock()
        self.c = 0.0
        self.r = 1.0
        self.link = 0.0
        self.n = 0

    def want(self) -> bool:
        if self.mode is not Compress.AUTO:
            return self.mode is Compress.ZSTD
        with self.lock:
            self.n += 1
            return self.n % 32 == 1 or self.c * (1 - self.r) > self.link

    def saw_compress(self, raw: int, out: int, seconds: float) -> None:
        with self.lock:
            self.c = _ewma(self.c, raw / max(seconds, 1e-9))
            self.r = _ewma(self.r, out / raw)

    def saw_send(self, wire_bytes: int, seconds: float) -> None:
        with self.lock:
            self.link = _ewma(self.link, wire_bytes / max(seconds, 1e-9))


def _ewma(old: float, new: float, alpha: float = 0.3) -> float:
    return new if old == 0.0 else (1 - alpha) * old + alpha * new


class _Control:
    """The control stream, opened again when it breaks, like a data stream: each connection
    sends the same HEADER for the same session and learns from HAVE what has arrived; once
    the trailer is due, it is sent on whichever connection is current.  A reader thread waits
    on the connection for DONE, so that a break is noticed, and mended, while the data
    streams still run (the receiver keeps the transfer for a grace period meanwhile)."""

    def __init__(self, sender: Sender, address: str, session: bytes, header: bytes, state: SendState) -> None:
        self.sender = sender
        self.address = address
        self.session = session
        self.header = header
        self.state = state
        self.lock = threading.Lock()
        self.ch: Channel | None = None
        self.trailer: bytes | None = None
        self.reply: bytes | None = None
        self.error: TransferError | None = None
        self.ended = threading.Event()  # reply or error
        self.closed = False

    def open(self) -> None:
        self.ch = self._connect()
        threading.Thread(target=self._read, args=(self.ch,), daemon=True).start()

    def _connect(self) -> Channel:
        cfg = self.sender.config
        attempts = 0
        while True:
            try:
                ch = self.sender._open(self.address, Role.CONTROL, 0, self.session)
                try:
                    wire.send_frame(ch, Kind.HEADER, self.header)
                    _, have = wire.expect(ch, Kind.HAVE, len(self.state.acked))
                    self.state.mark_have(have)
                    ch.set_timeout(cfg.session_timeout)  # nothing comes until DONE, after the receiver's verification
                except BaseException:
                    ch.close()
                    raise
                return ch
            except AuthError:
                raise
            except TransferError as e:
                attempts += 1
                if attempts > cfg.retries or self.closed:
                    raise TransferError(f"the control stream failed {attempts} times, last: {e}") from e
                log.info("the control stream failed (%s); connecting again", e)
                time.sleep(retry_pause(attempts))

    def _read(self, ch: Channel) -> None:
        breaks = 0
        acked = self.state.raw_acked
        while True:
            try:
                kind, _, body = wire.recv_frame(ch, 4096)
                if kind is not Kind.DONE:
                    raise TransferError(f"the receiver sent {kind.name} on the control stream")
                self.reply = bytes(body)
                self.ended.set()
                return
            except wire.PeerError as e:  # the receiver gave up, and says why
                self.error = e
                self.state.fail(e)
                self.ended.set()
                return
            except TransferError as e:
                if self.closed or self.ended.is_set():
                    return
                # Each break counts against the retries, unless chunks got through since the last.
                breaks = 1 if self.state.raw_acked > acked else breaks + 1
                acked = self.state.raw_acked
                log.info("the control stream broke (%s); opening it again", e)
            ch.close()
            try:
                if breaks > self.sender.config.retries:
                    raise TransferError(f"the control stream broke {breaks} times without progress")
                ch = self._connect()
            except TransferError as e:
                self.error = e
                self.state.fail(e)
                self.ended.set()
                return
            with self.lock:
                if self.closed:
                    ch.close()
                    return
                self.ch = ch
                trailer = self.trailer
            if trailer is not None:
                self._send(ch, Kind.TRAILER, trailer)

    def finish(self, trailer: bytes, timeout: float) -> bytes:
        """Send the trailer (again after a break) and return the receiver's DONE."""
        with self.lock:
            self.trailer = trailer
            ch = self.ch
        assert ch is not None
        self._send(ch, Kind.TRAILER, trailer)
        if not self.ended.wait(timeout):
            raise TransferError(f"the receiver did not confirm the snapshot within {timeout:g} s")
        if self.error is not None:
            raise self.error
        assert self.reply is not None
        return self.reply

    def abort(self, why: str) -> None:
        """Tell the receiver that this sender gives up (best effort)."""
        with self.lock:
            self.closed = True  # the receiver closes the stream now: that is no break to mend
            ch = self.ch
        if ch is not None and not self.ended.is_set():
            self._send(ch, Kind.ERROR, why.encode()[:2000])

    def close(self) -> None:
        with self.lock:
            self.closed = True
            ch = self.ch
        if ch is not None:
            ch.close()

    @staticmethod
    def _send(ch: Channel, kind: Kind, body: bytes) -> None:
        # a broken connection: the reader notices, opens another and sends the trailer there
        with contextlib.suppress(TransferError):
            wire.send_frame(ch, kind, body)


class Sender:
    def __init__(self, transport: Transport, config: TransferConfig, progress: SendProgress | None = None) -> None:
        self.transport = transport
        self.config = config
        self.progress = progress

    def _open(self, address: str, role: Role, stream: int, session: bytes) -> Channel:
        ch = self.transport.connect(address, self.config.connect_timeout)
        try:
            # A receiver answers the handshake at once (its gate gives a stranger 10 s in all); a
            # port that says nothing is no receiver's: each try of it costs this, not io_timeout.
            ch.set_timeout(self.config.connect_timeout)
            client_handshake(ch, self.config.secret, role, stream, session)
            ch.set_timeout(self.config.io_timeout)
        except TransferError as e:
            ch.close()
            if isinstance(e, AuthError):
                raise
            said = f"{address} took the connection but not tpagent's handshake ({e}); is a receiver there?"
            raise TransferError(said) from e
        except BaseException:
            ch.close()
            raise
        return ch

    def reach(self, address: str) -> None:
        """A receiver that holds this node's secret listens at ``address`` (else TransferError,
        AuthError for another secret): a control stream's handshake, tried again as a send tries
        its streams, then closed (the receiver takes it for a stream that ended before its
        header).  Before a dump whose snapshot goes there, so that a receiver not there (yet), or
        another cluster's, is said before anything is frozen."""
        attempts = 0
        while True:
            try:
                self._open(address, Role.CONTROL, 0, os.urandom(16)).close()
                return
            except AuthError:
                raise
            except TransferError as e:
                attempts += 1
                if attempts > self.config.retries:
                    raise TransferError(f"no receiver answered at {address} in {attempts} tries, last: {e}") from e
                time.sleep(retry_pause(attempts))

    def send(
        self, snapshot: Path, address: str, sealed: Callable[[], bool] | None = None, feed: Feed | None = None
    ) -> TransferStats:
        """Send ``snapshot``.  With ``sealed``, the snapshot is still being written: its
        files are sent as they grow, and it is complete once ``sealed()`` returns True
        (it raises to give up: the receiver then keeps nothing).  With ``feed`` too, images
        that are no files here come from it (a streamed dump); it is failed once the send
        ends, so that a dump still streaming into it fails too.  Only from a directory no other
        user could have written to: what arrives is a verified snapshot of root's, which a
        restore trusts (a user's made-up images and carried files would be put back as root's)."""
        peer_address(address)  # (one that is no address is said once, before anything: never retried)
        if sealed is None:  # (a snapshot still being written has its manifest last)
            snapmanifest.present(snapshot)  # (before private_dir makes it 0700: a directory given by mistake is kept)
        snapshot = private_dir(snapshot, create=False)
        cfg = self.config
        session = os.urandom(16)
        files = Files(snapshot, cfg.chunk_size, feed)
        state = SendState(cfg.chunk_size, cfg.chunk_retries)
        state.on_acked = lambda i: files.release(*state.chunks[i][:2])
        codec = _Codec(cfg.compress, cfg.zstd_level)
        t0 = time.monotonic()
        try:
            header = self._header(snapshot, files, state, follow=sealed is not None)
            control = _Control(self, address, session, wire.signed_json(cfg.secret, b"header", session, header), state)
            try:
                control.open()
                workers = [
                    threading.Thread(
                        target=self._worker, args=(address, session, i + 1, state, files, codec), daemon=True
                    )
                    for i in range(max(1, cfg.streams))
                ]
                for w in workers:
                    w.start()
                try:
                    if sealed is not None:
                        self._follow(files, state, sealed)
                finally:
                    for w in workers:  # before the files close under them
                        w.join(None if state.error is None else cfg.io_timeout + 1)
                if state.error is not None:
                    raise state.error
                trailer = {"chunks": len(state.chunks), "raw_bytes": state.raw_total, "digest": wire.digest(state.crcs)}
                if sealed is not None:
                    trailer |= {
                        "files": [list(f) for f in files.layout().files],
                        "manifest_sha256": files.manifest_sha256(),
                    }
                done = control.finish(wire.signed_json(cfg.secret, b"trailer", session, trailer), cfg.session_timeout)
                if not done or done[0] != 1:
                    raise IntegrityError(f"the receiver rejected the snapshot: {done[1:].decode(errors='replace')}")
            except BaseException as e:
                control.abort(str(e) or type(e).__name__)  # the receiver discards at once, not after its grace period
                raise
            finally:
                state.fail(TransferError("the transfer ended"))  # stops a worker still waiting for chunks
                control.close()
        except ChunkRefused as e:
            if sealed is None:
                fi, offset, length = state.chunks[e.index]
                refuse_if_damaged_here(snapshot, files.layout().files[fi][0], offset, length, e)
            raise
        finally:
            if feed is not None:
                feed.fail("the transfer ended before the dump did")
            files.close()
        return TransferStats(state.raw_total, state.wire_bytes, len(state.chunks), time.monotonic() - t0)

    def _header(self, snapshot: Path, files: Files, state: SendState, follow: bool) -> dict[str, Any]:
        """The transfer's header; a complete snapshot's files opened and its chunks queued."""
        cfg = self.config
        if follow:
            files.follow = True
            return {
                "snapshot_id": snapshot.name,
                "chunk_size": cfg.chunk_size,
                "follow": True,
                "digest": snapmanifest.DIGEST,  # (the dump followed is sealed with it)
            }
        layout = snapshot_layout(snapshot, cfg.chunk_size)
        files.open_all(layout)
        state.add(layout.chunks())
        state.close()
        header = {
            "snapshot_id": snapshot.name,
            "chunk_size": cfg.chunk_size,
            "files": [list(f) for f in layout.files],
            "manifest_sha256": files.manifest_sha256(),
        }
        if cfg.chunk_size == snapmanifest.CHUNK_SIZE:  # the manifest's digests check each chunk
            m = snapmanifest.load(snapshot)
            digests = {name: e["digests"] for name, e in m.files.items()}
            header |= {"digest": m.digest, "digests": digests}
            files.digested = {fi for fi, name in enumerate(files.names) if name in digests}
        return header

    def _follow(self, files: Files, state: SendState, sealed: Callable[[], bool]) -> None:
        """Queue each file's bytes as they are written; once sealed, the tails too."""
        try:
            while True:
                done = sealed()  # read before the scan: what it sees after sealing is final
                state.add(files.grown(final=done))
                if done:
                    state.close()
                    return
                if state.error is not None:
                    return
                time.sleep(0.01)
        except (TransferError, OSError) as e:
            state.fail(e if isinstance(e, TransferError) else TransferError(f"reading the snapshot failed: {e}"))
        except Exception as e:  # the writer gave up (its error is the caller's to report)
            state.fail(TransferError(f"the snapshot was not completed: {e}"))
            raise

    def _worker(self, address: str, session: bytes, stream: int, state: SendState, files: Files, codec: _Codec) -> None:
        attempts = 0
        cctx = zstandard.ZstdCompressor(level=self.config.zstd_level)
        while not state.done():
            inflight: dict[int, None] = {}
            try:
                ch = self._open(address, Role.DATA, stream, session)
                try:
                    _, have = wire.expect(ch, Kind.HAVE, len(state.acked))
                    state.mark_have(have)
                    attempts = 0
                    self._pump(ch, state, files, codec, cctx, inflight)
                finally:
                    ch.close()
            except (AuthError, wire.PeerError) as e:  # (the receiver refused on purpose: a full disk)
                state.fail(e)
                return
            except (OSError, zstandard.ZstdError, MemoryError) as e:  # our side broke: stop, do not hang the others
                state.fail(TransferError(f"stream {stream} failed on this side: {e}"))
                return
            except TransferError as e:
                state.requeue(list(inflight))
                attempts += 1
                if attempts > self.config.retries:
                    state.fail(TransferError(f"stream {stream} failed {attempts} times, last: {e}"))
                    return
                log.info("stream %d broke (%s); reconnecting", stream, e)
                time.sleep(retry_pause(attempts))

    def _pump(
        self,
        ch: Channel,
        state: SendState,
        files: Files,
        codec: _Codec,
        cctx: zstandard.ZstdCompressor,
        inflight: dict[int, None],
    ) -> None:
        window = threading.Semaphore(self.config.window)
        broken: list[TransferError] = []
        zeros = bytes(state.chunk_size)
        buf = bytearray(state.chunk_size)

        def read_acks() -> None:
            try:
                while True:
                    _, body = wire.expect(ch, Kind.ACK, ACK.size)
                    index, ok = ACK.unpack(body)
                    if index not in inflight:
                        raise TransferError(
                            f"the receiver acknowledged chunk {index}, which was not sent on this stream"
                        )
                    del inflight[index]
                    state.ack(index, bool(ok))
                    window.release()
                    if self.progress:
                        self.progress(state.raw_acked, state.wire_bytes, state.raw_total)
            except TransferError as e:
                broken.append(e)
                window.release()

        reader = threading.Thread(target=read_acks, daemon=True)
        reader.start()
        while True:
            window.acquire()
            if broken:
                raise broken[0]
            index = state.next(lambda: bool(broken))
            if index is None:
                if broken and not state.done():
                    raise broken[0]
                return
            fi, off, length = state.chunks[index]
            data = files.read(fi, off, length, buf)
            if data is None:  # (fed, and acknowledged meanwhile through another stream)
                window.release()
                continue
            if len(data) != length:
                state.fail(IntegrityError(f"{files.names[fi]} shrank while it was being sent"))
                return
            crc = 0 if fi in files.digested else zlib.crc32(data)
            state.crcs[index] = crc
            kind = Codec.RAW
            payload = data
            if data == (zeros if length == len(zeros) else bytes(length)):
                kind = Codec.ZERO
                payload = b""
            elif codec.want():
                t = time.monotonic()
                packed = cctx.compress(data)
                codec.saw_compress(length, len(packed), time.monotonic() - t)
                if len(packed) < 0.9 * length:
                    kind = Codec.ZSTD
                    payload = packed
            inflight[index] = None
            t = time.monotonic()
            head = CHUNK.pack(index, length, crc)
            if files.follow:
                name = files.names[fi].encode()
                head += wire.WHERE.pack(off, len(name)) + name
            wire.send_frame(ch, Kind.CHUNK, head, kind, memoryview(payload))
            codec.saw_send(len(payload) + len(head), time.monotonic() - t)
            with state.cond:
                state.wire_bytes += len(payload) + len(head) + wire.FRAME.size
