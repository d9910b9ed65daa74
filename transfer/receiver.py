"""The receiving end of a snapshot stream (see :mod:`transfer.stream`): chunks checked as
they arrive, the trailer checked, the snapshot verified before it appears under its name.

Connections are admitted by :class:`transfer.admission.Gate`: peers still in their handshakes
cannot crowd out those that passed them.  A transfer whose control stream breaks is kept for
as long as the sender goes on opening it again (``reconnect_window``: a partition that heals
within it resumes the transfer); then it is given up.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import shutil
import threading
import time
import zlib
from collections.abc import Callable
from pathlib import Path

import zstandard

from host.api import MOST_SECONDS, UsageError
from host.hushed import Hushed
from host.safefs import private_dir
from snapshot import manifest as snapmanifest
from snapshot.api import SnapshotError
from transfer import arrived, wire
from transfer.admission import Entry, Gate
from transfer.api import (
    MAX_STREAMS,
    AuthError,
    Channel,
    IntegrityError,
    Refusal,
    TransferConfig,
    TransferError,
    TransferStats,
    Transport,
)
from transfer.session import Session, digest_back, expected_digests, pwrite_all, zero_digest
from transfer.stream import HANDSHAKE_TIMEOUT, server_handshake
from transfer.wire import ACK, CHUNK, Codec, Kind, Layout, Role

log = logging.getLogger(__name__)
#: Refused connections (anyone on the network may open them): logged at most once a second.
REFUSED = Hushed(log)

#: Connections still in their handshakes (TLS + HMAC) at once: in all, and from one host.
MAX_STRANGERS = 2 * MAX_STREAMS
MAX_STRANGERS_PER_HOST = 16
#: Authenticated connections at once: the control stream, up to MAX_STREAMS data streams, and
#: as many reconnections again (a broken stream's old connection may linger a moment).
MAX_MEMBERS = 2 * MAX_STREAMS + 1


def checked_request(out: Path, timeout: float) -> Path:
    """``out`` and ``timeout`` of a receive, checked (by a caller, before it listens, too): a wait
    of seconds above 0; root writes someone's whole memory to ``out``, so only where no other user
    can plant or swap a directory, and only into directories of its own (made here)."""
    if not 0 < timeout <= MOST_SECONDS:  # (nan too)
        raise UsageError(
            f"the time to wait for a snapshot is a number of seconds above 0 (at most {MOST_SECONDS:g}), not {timeout}."
        )
    out = private_dir(out, empty=True, create=False)
    if not out.parent.exists():
        private_dir(out.parent)
    return out


class Receiver:
    """Listens on one address and accepts one snapshot (``receive``)."""

    def __init__(
        self, transport: Transport, config: TransferConfig, listen: str, on_refused: Callable[[str], None] | None = None
    ) -> None:
        """``on_refused`` is called with a :class:`~transfer.api.Refusal` value for each
        connection closed before it could carry a transfer (for the agent's metrics)."""
        self.transport = transport
        self.config = config
        self._on_refused = on_refused
        self.listener = transport.listen(listen)
        self.address = self.listener.address
        self._sessions: dict[bytes, Session] = {}
        self._ready = threading.Condition()
        self._publish = threading.Lock()  # the rename into --out and giving up exclude each other
        self._closed = False
        self._gate = Gate(MAX_STRANGERS, MAX_STRANGERS_PER_HOST, MAX_MEMBERS)
        self._result: TransferStats | TransferError | None = None

    def close(self) -> None:
        """Stop listening, and cut every connection still open (nothing sweeps them now)."""
        self.listener.close()
        for entry in self._gate.close():
            entry.ch.interrupt()

    def receive(self, out: Path, timeout: float) -> TransferStats:
        out = checked_request(out, timeout)
        for stale in out.parent.glob(f".{out.name}.partial-*"):
            if stale.lstat().st_uid == os.geteuid():  # (ours: left by an earlier try)
                shutil.rmtree(stale, ignore_errors=True)
        self._out = out
        started = time.monotonic()
        deadline = started + timeout
        while self._result is None:
            left = deadline - time.monotonic()
            if left <= 0:
                self._abandon()
                raise TransferError(f"no complete snapshot arrived within {timeout:.0f} s")
            first = self.config.start_timeout
            if first is not None and not self._sessions and time.monotonic() - started > first:
                # A sender that never came (its node lost after it was admitted) must not hold
                # the address (a fixed port) for the whole timeout.
                self._abandon()
                raise TransferError(f"no sender began a transfer within {first:g} s")
            self._sweep()
            ch = self.listener.accept(min(left, 0.2))
            if ch is None:
                continue
            entry, evicted = self._gate.admit(ch)
            if evicted is not None:
                evicted.ch.interrupt()
                if evicted.refused is Refusal.PER_PEER_LIMIT:
                    self._refused(
                        evicted,
                        f"it was the oldest of its host's {MAX_STRANGERS_PER_HOST} connections "
                        "still in their handshakes",
                    )
                else:
                    self._refused(
                        evicted, f"it was the oldest of {MAX_STRANGERS} connections still in their handshakes"
                    )
            threading.Thread(target=self._serve, args=(entry,), daemon=True).start()
        if isinstance(self._result, TransferError):
            self._abandon()  # a failed transfer leaves no partial snapshot behind
            raise self._result
        return self._result

    def _sweep(self) -> None:
        """Cut off strangers past the handshake deadline; give up transfers whose control
        stream broke and did not come back within the grace period."""
        for entry in self._gate.expired(HANDSHAKE_TIMEOUT):
            entry.ch.interrupt()
            self._refused(entry, f"it did not complete its handshake within {HANDSHAKE_TIMEOUT:g} s")
        grace = self.config.reconnect_window
        now = time.monotonic()
        with self._ready:
            lapsed = [
                s
                for s in self._sessions.values()
                if s.control is None
                and s.orphaned is not None
                and now - s.orphaned > grace
                and (s.outcome is not None or not s.verifying)
            ]
            for s in lapsed:
                s.orphaned = None
                if s.outcome is None:
                    with s.lock:
                        s.discarded = True  # no control stream may come back for it now
        for s in lapsed:
            if s.outcome is not None:  # verified (or refused), but the sender never heard
                self._finish(s.outcome)
                continue
            self._discard(s)
            self._finish(
                TransferError(
                    f"the sender's control stream broke and did not come back within {grace:g} s; nothing was kept"
                )
            )

    def _refused(self, entry: Entry, detail: str) -> None:
        assert entry.refused is not None
        REFUSED.warning("refused a stream from %s (%s): %s", entry.ch.peer, entry.refused.value, detail)
        if self._on_refused is not None:
            try:
                self._on_refused(entry.refused.value)
            except Exception:  # the caller's metrics must not stop the receiver
                log.exception("on_refused failed")

    def _abandon(self) -> None:
        with self._publish:
            self._closed = True
        for s in list(self._sessions.values()):
            self._discard(s)

    def _serve(self, entry: Entry) -> None:
        """One connection: its TLS and HMAC handshakes, in this thread, so that a stranger
        holds up nothing but its own place (which the gate takes back after HANDSHAKE_TIMEOUT
        however it trickles its bytes); then its stream."""
        ch = entry.ch
        try:
            ch.set_timeout(min(self.config.io_timeout, HANDSHAKE_TIMEOUT))
            step = Refusal.TLS_FAILED
            try:
                ch.establish()
                step = Refusal.AUTH_FAILED
                role, session = server_handshake(ch, self.config.secret)
            except TransferError as e:
                if isinstance(e.__cause__, TimeoutError):  # a read timed out before the gate's deadline
                    step = Refusal.HANDSHAKE_TIMEOUT
                elif step is Refusal.AUTH_FAILED and not isinstance(e, AuthError):
                    step = Refusal.HANDSHAKE_FAILED  # it closed, reset, or sent a short read
                if self._gate.refuse(entry, step):  # (not already cut off by the gate)
                    self._refused(entry, str(e))
                return
            if not self._gate.promote(entry):
                if entry.refused is Refusal.TOO_MANY_STREAMS:
                    self._refused(entry, f"{MAX_MEMBERS} authenticated streams are open already")
                return
            ch.set_timeout(self.config.io_timeout)
            try:
                if role is Role.CONTROL:
                    self._control(ch, session)
                else:
                    self._data(ch, session)
            except OSError as e:
                if e.errno == errno.ENOSPC:
                    self._tell_sender(session, ch if role is Role.CONTROL else None)
                raise
        except TransferError as e:
            log.info("stream from %s ended: %s", ch.peer, e)
        except (
            OSError,
            ValueError,
            SnapshotError,
        ) as e:  # a full disk, JSON that is signed but wrong, a refused directory...
            log.warning("stream from %s failed: %s", ch.peer, e)
            if isinstance(e, OSError) and e.errno == errno.ENOSPC:
                self._finish(self._disk_full())
            self._finish(TransferError(f"receiving failed: {e}"))
        finally:
            self._gate.release(entry)
            ch.close()

    def _tell_sender(self, session_id: bytes, control: Channel | None) -> None:
        """Say that the disk is full on the transfer's control stream (best effort): the sender
        learns why at once, not "connection refused" as it reconnects.  (A data stream is a
        poor messenger: closed with chunks unread, it is reset, and the frame with it.)"""
        if control is None:
            with self._ready:
                s = self._sessions.get(session_id)
                control = s.control if s is not None else None
        if control is not None:
            with contextlib.suppress(TransferError):
                wire.send_frame(control, Kind.ERROR, str(self._disk_full()).encode()[:2000])

    def _disk_full(self) -> TransferError:
        """One sentence for ENOSPC while receiving."""
        free = shutil.disk_usage(self._out.parent).free
        return TransferError(
            f"the disk holding {self._out.parent} is full (No space left on device, {free / 2**20:.0f} MiB free); "
            "nothing was kept: free space there, or receive into another place"
        )

    def _control(self, ch: Channel, session_id: bytes) -> None:
        _, body = wire.expect(ch, Kind.HEADER, wire.MAX_JSON)
        header = wire.open_signed_json(self.config.secret, b"header", session_id, body)
        try:
            chunk_size = int(header["chunk_size"])
            if header.get("follow") is True:
                layout = None
                sha = ""
                Layout((), chunk_size)  # checks the chunk size
            else:
                layout = Layout(tuple((str(p), int(n)) for p, n in header["files"]), chunk_size)
                sha = str(header["manifest_sha256"])
            digest = str(header.get("digest", "sha256"))  # (a sender older than format 2: SHA-256)
            if digest not in snapmanifest.DIGESTS:
                raise ValueError(f"unknown digest {digest!r}")
            expect = expected_digests(layout, header.get("digests", header.get("sha256")))
        except (KeyError, TypeError, ValueError) as e:
            raise TransferError(f"the header is malformed ({e!r})") from e
        with self._ready:
            s = self._sessions.get(session_id)
            if s is None:
                s = self._open_session(session_id, layout, chunk_size, sha, expect, digest)
                s.header = header
            elif s.discarded or s.header != header:
                raise TransferError(
                    "a control stream came back for a transfer that was given up, or with another header"
                )
            else:
                log.info("the control stream of transfer %s is back", session_id.hex()[:12])
            old = s.control
            s.control = ch
            s.orphaned = None
            self._ready.notify_all()
        if old is not None:
            old.interrupt()  # the sender only uses its newest control stream
        wire.send_frame(ch, Kind.HAVE, s.have_bitmap())
        ch.set_timeout(self.config.session_timeout)
        try:
            _, body = wire.expect(ch, Kind.TRAILER, wire.MAX_JSON)
        except wire.PeerError as e:  # the sender gave up on purpose: no need to wait for it
            if s.outcome is not None:  # (after the snapshot was verified: it is what it is)
                self._finish(s.outcome)
                raise
            self._discard(s)
            self._finish(TransferError(f"the sender gave up ({e}); nothing was kept"))
            raise
        except TransferError:
            self._orphan(s, ch)
            raise
        self._verify(s, wire.open_signed_json(self.config.secret, b"trailer", session_id, body))
        try:
            wire.send_frame(ch, Kind.DONE, s.done)
        except TransferError:
            self._orphan(s, ch)
            raise
        assert s.outcome is not None
        self._finish(s.outcome)

    def _orphan(self, s: Session, ch: Channel) -> None:
        with self._ready:
            if s.control is not ch:  # a newer control stream has taken over
                return
            s.control = None
            s.orphaned = time.monotonic()
        log.info(
            "a control stream broke; the transfer waits %g s for the sender to open it again",
            self.config.reconnect_window,
        )

    def _verify(self, s: Session, trailer: dict[str, object]) -> None:
        """Check and publish the snapshot, once: the first control stream with the trailer
        does it, one that comes back later waits for its outcome."""
        with self._ready:
            first = not s.verifying
            s.verifying = True
            if not first:
                if not self._ready.wait_for(lambda: s.outcome is not None, self.config.session_timeout):
                    raise TransferError("the snapshot's verification did not end in time")
                return
        outcome: TransferStats | TransferError
        try:
            self._check_and_publish(s, trailer)
        except (TransferError, SnapshotError, OSError, ValueError) as e:
            self._discard(s)
            outcome = e if isinstance(e, TransferError) else IntegrityError(str(e))
            done = b"\0" + str(e).encode()[:2000]
        else:
            assert s.layout is not None  # the check set it
            outcome = TransferStats(s.layout.raw_bytes, s.bytes_wire, s.layout.count, time.monotonic() - s.started)
            done = b"\1ok"
        with self._ready:
            s.outcome = outcome
            s.done = done
            self._ready.notify_all()

    def _finish(self, result: TransferStats | TransferError) -> None:
        if self._result is None:
            self._result = result

    def _open_session(
        self,
        session_id: bytes,
        layout: Layout | None,
        chunk_size: int,
        sha: str,
        expect: dict[int, list[str]],
        digest: str,
    ) -> Session:
        partial = self._out.parent / f".{self._out.name}.partial-{session_id.hex()[:12]}"
        s = arrived.start(partial, layout, chunk_size, sha, expect, digest)
        self._sessions[session_id] = s
        return s

    def _discard(self, s: Session) -> None:
        arrived.discard(s, self.config.io_timeout)

    def _check_and_publish(self, s: Session, trailer: dict[str, object]) -> None:
        arrived.check(s, trailer, self._disk_full)
        with self._publish:
            if self._closed:
                raise TransferError("the receiver stopped waiting before the snapshot was verified")
            if self._out.exists():
                self._out.rmdir()
            s.partial.rename(self._out)

    def _data(self, ch: Channel, session_id: bytes) -> None:
        with self._ready:
            if not self._ready.wait_for(lambda: session_id in self._sessions, self.config.io_timeout):
                raise TransferError("a data stream came for a transfer that never started")
            s = self._sessions[session_id]
        wire.send_frame(ch, Kind.HAVE, s.have_bitmap())
        dctx = zstandard.ZstdDecompressor()
        zero_crcs: dict[int, int] = {}
        back = bytearray(1 << 20)  # what a chunk reads back as, once written, a piece at a time
        while True:
            kind, codec, body = wire.recv_frame(
                ch, s.chunk_size + 4096 + CHUNK.size + wire.WHERE.size + 255, scratch=True
            )
            if kind is not Kind.CHUNK or len(body) < CHUNK.size:
                raise TransferError(f"expected a chunk, got {kind.name}")
            index, raw_len, crc = CHUNK.unpack_from(body)
            if s.discarded:  # (checked again below, where it counts; this spares locate() a file)
                raise TransferError("the transfer was given up")
            where, start = s.locate(index, raw_len, body)
            with s.lock:
                if s.discarded:
                    raise TransferError("the transfer was given up")
                mine = index not in s.have and index not in s.claimed
                if mine:
                    s.claimed.add(index)
            if mine:
                ok = False
                try:
                    ok = self._store(
                        s, dctx, index, where, codec, memoryview(body)[start:], raw_len, crc, zero_crcs, back
                    )
                finally:  # a store that failed (a full disk) must not leave the chunk claimed
                    with s.lock:
                        s.claimed.discard(index)
                        if ok:
                            s.have.add(index)
                            s.crcs[index] = crc
                if ok:
                    self._region_done(s, where)
            else:  # a resend while another stream stores the same chunk: answer as it ends
                deadline = time.monotonic() + self.config.io_timeout
                while index in s.claimed and time.monotonic() < deadline:
                    time.sleep(0.001)
                ok = index in s.have
            with s.lock:
                s.bytes_wire += len(body) + wire.FRAME.size
            wire.send_frame(ch, Kind.ACK, ACK.pack(index, int(ok)))

    @staticmethod
    def _region_done(s: Session, where: tuple[int, int, int]) -> None:
        if not s.waiting or s.discarded:
            return
        fi, off, _ = where
        region = off // snapmanifest.CHUNK_SIZE
        with s.lock:
            s.waiting[fi][region] -= 1
            complete = s.waiting[fi][region] == 0
        if complete and s.layout is not None:
            start = region * snapmanifest.CHUNK_SIZE
            length = min(snapmanifest.CHUNK_SIZE, s.layout.files[fi][1] - start)
            piece = (s.partial / s.layout.files[fi][0], start, length)
            s.digests[fi][region] = snapmanifest.chunk_digest(piece, s.digest)

    @staticmethod
    def _store(
        s: Session,
        dctx: zstandard.ZstdDecompressor,
        index: int,
        where: tuple[int, int, int],
        codec: Codec,
        payload: memoryview,
        raw_len: int,
        crc: int,
        zero_crcs: dict[int, int],
        back: bytearray,
    ) -> bool:
        """Write one chunk; whether it is right.  Every write's length is checked
        (:func:`_pwrite_all`), and where a SHA-256 decides (the header's digests, or the
        manifest's taken as chunks arrive) it is taken over the bytes read back from the file,
        so what is verified is what the file holds, not what the buffer held: one copy more
        than hashing the buffer, no more hashing.  (The fsync before publishing then says
        whether the disk kept it.)"""
        fi, off, _ = where
        want = s.expect[fi][off // s.chunk_size] if fi in s.expect else None
        if codec is Codec.ZERO:
            if len(payload):
                return False
            if index in s.rewrite:  # damaged bytes were written there: zeros must replace them
                pwrite_all(s.fds[fi], bytes(raw_len), off)
            if want is not None:
                return want == zero_digest(raw_len, s.digest)  # the file was created sparse: zeros are already there
            if raw_len not in zero_crcs:
                zero_crcs[raw_len] = zlib.crc32(bytes(raw_len))
            if zero_crcs[raw_len] != crc:
                return False
            if s.hash_as_received:
                s.received_sha[(fi, off)] = zero_digest(raw_len, s.digest)
            return True
        data = wire.inflate(dctx, payload, raw_len) if codec is Codec.ZSTD else payload
        if data is None or len(data) != raw_len or (want is None and zlib.crc32(data) != crc):
            return False
        pwrite_all(s.fds[fi], data, off)
        if want is None and not s.hash_as_received:
            return True  # (its region is hashed from the file once complete: _region_done)
        sha = digest_back(s.fds[fi], back, raw_len, off, s.digest)
        if want is not None and sha != want:
            with s.lock:
                s.rewrite.add(index)
            return False
        if s.hash_as_received:
            s.received_sha[(fi, off)] = sha
        return True
