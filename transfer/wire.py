"""The tpagent transfer stream, version 3: framing, handshake and message bodies.

Every connection starts with a mutual challenge-response on the cluster secret, then
carries frames.  Integers are little-endian.

    CONNECTION ::= HELLO CHALLENGE PROOF_C PROOF_S ( CONTROL | DATA )
    HELLO      ::= "TPXFER01" VERSION:u16 ROLE:u8 0:u8 STREAM:u32 SESSION:16B NONCE_C:16B
    CHALLENGE  ::= NONCE_S:16B
    PROOF_C    ::= HMAC-SHA256(secret, "client" SESSION STREAM NONCE_S NONCE_C)
    PROOF_S    ::= FRAME(WELCOME, HMAC-SHA256(secret, "server" SESSION STREAM NONCE_C NONCE_S)) | FRAME(ERROR)
    CONTROL    ::= HEADER HAVE ( TRAILER DONE | ERROR )   (ROLE 0: one per transfer; ERROR: the sender gave up,
                                                     or the receiver cannot go on, as with a full disk)
    DATA       ::= HAVE { CHUNK ACK }                (ROLE 1: STREAM 1..N, in parallel)
    FRAME      ::= KIND:u8 CODEC:u8 0:u16 LENGTH:u32 BODY[LENGTH]
    HEADER     ::= LEN:u32 JSON{snapshot_id, chunk_size, files: [[PATH, SIZE]], manifest_sha256
                                 [, digest, digests: {PATH: [HEX]}]} MAC   (the manifest's chunk digests)
                 | LEN:u32 JSON{snapshot_id, chunk_size, follow: true, digest} MAC   (a snapshot being written)
                                                     (digest: "blake3" or "sha256", absent from older senders: sha256)
    HAVE       ::= { u8 }                            (one per chunk: 1 = received and checked; none when following)
    CHUNK      ::= INDEX:u64 RAW_LEN:u32 CRC32:u32 [ OFFSET:u64 PATH_LEN:u8 PATH ] PAYLOAD
                                                     (CODEC 0 raw, 1 zstd, 2 zeros: no payload; [..] when following)
    ACK        ::= INDEX:u64 OK:u8                   (0: damaged, send it again)
    TRAILER    ::= LEN:u32 JSON{chunks, raw_bytes, digest [, files, manifest_sha256 when following]} MAC
    MAC        ::= HMAC-SHA256(secret, "header"|"trailer" SESSION JSON)   (bound to its transfer: version 3)
    DONE       ::= OK:u8 MESSAGE
    ERROR      ::= MESSAGE

A control stream that breaks is opened again for the same SESSION with the same HEADER: the
receiver keeps the transfer for a grace period, answers with HAVE, and verifies the snapshot
once, whichever stream brings the TRAILER.

Chunks number the files' bytes in HEADER order, CHUNK_SIZE at a time (an empty file has
none).  A followed snapshot's files are sent as they grow: the sender numbers chunks as it
queues them, each chunk names its file and offset, and the authenticated TRAILER gives the
final files, which the chunks that arrived must cover exactly.  ``digest`` is SHA-256 over
every chunk's INDEX:u64 CRC32:u32, in order.  The MACs are HMAC-SHA256 under the cluster
secret; the whole snapshot is then checked against the
manifest's SHA-256s, whose own digest the authenticated HEADER carries.
"""

from __future__ import annotations

import enum
import functools
import hashlib
import hmac
import json
import re
import struct
from dataclasses import dataclass
from typing import Any

import zstandard

from transfer.api import Channel, TransferError

MAGIC = b"TPXFER01"
VERSION = 3
HELLO = struct.Struct("<8sHBBI16s16s")
FRAME = struct.Struct("<BBHI")
CHUNK = struct.Struct("<QII")
ACK = struct.Struct("<QB")
WHERE = struct.Struct("<QB")
MAC_LEN = 32
NONCE_LEN = 16
MAX_CHUNK = 64 << 20
MAX_JSON = 16 << 20
MAX_FILES = 100_000
MAX_CHUNKS = 1 << 22
MAX_FILE = 1 << 40
_PATH = re.compile(r"(?:[A-Za-z0-9._-]+/)?[A-Za-z0-9._-]+")


class Role(enum.IntEnum):
    CONTROL = 0
    DATA = 1


class Kind(enum.IntEnum):
    HEADER = 1
    HAVE = 2
    CHUNK = 3
    ACK = 4
    TRAILER = 5
    DONE = 6
    ERROR = 7
    WELCOME = 8


class Codec(enum.IntEnum):
    RAW = 0
    ZSTD = 1
    ZERO = 2


class PeerError(TransferError):
    """The peer sent ERROR: it refused, or gave up, on purpose."""


def mac(secret: bytes, *parts: bytes | bytearray) -> bytes:
    return hmac.new(secret, b"".join(parts), hashlib.sha256).digest()


def send_frame(
    ch: Channel, kind: Kind, body: bytes | memoryview = b"", codec: Codec = Codec.RAW, *extra: bytes | memoryview
) -> None:
    length = len(body) + sum(len(x) for x in extra)
    ch.send(FRAME.pack(kind, codec, 0, length), body, *extra)


def recv_frame(ch: Channel, limit: int, scratch: bool = False) -> tuple[Kind, Codec, bytes | bytearray | memoryview]:
    """The next frame; with ``scratch`` its body is valid only until the next receive."""
    kind, codec, _, length = FRAME.unpack(ch.recv_exact(FRAME.size))
    if length > limit:
        raise TransferError(f"the peer sent a frame of {length} bytes, over the limit of {limit}")
    try:
        k = Kind(kind)
        c = Codec(codec)
    except ValueError as e:
        raise TransferError(f"the peer sent an unknown frame (kind {kind}, codec {codec})") from e
    body = ch.recv_scratch(length) if scratch else ch.recv_exact(length)
    if k is Kind.ERROR:
        raise PeerError(f"the peer refused: {bytes(body[:500]).decode(errors='replace')}")
    return k, c, body


def expect(ch: Channel, kind: Kind, limit: int) -> tuple[Codec, bytes | bytearray]:
    k, codec, body = recv_frame(ch, limit)
    if k is not kind:
        raise TransferError(f"the peer sent {k.name} where {kind.name} was due")
    assert not isinstance(body, memoryview)  # not a scratch receive
    return codec, body


def signed_json(secret: bytes, label: bytes, session: bytes, obj: dict[str, Any]) -> bytes:
    """``obj`` with its MAC, for the transfer ``session`` only (one of another transfer, replayed
    into this one, fails)."""
    data = json.dumps(obj).encode()
    return struct.pack("<I", len(data)) + data + mac(secret, label, session, data)


def open_signed_json(secret: bytes, label: bytes, session: bytes, body: bytes | bytearray) -> dict[str, Any]:
    if len(body) < 4 + MAC_LEN:
        raise TransferError(f"a {label.decode()} frame is too short")
    (n,) = struct.unpack_from("<I", body)
    data = body[4 : 4 + n]
    tag = body[4 + n :]
    if len(data) != n or not hmac.compare_digest(tag, mac(secret, label, session, data)):
        raise TransferError(f"the {label.decode()} failed authentication (damaged, or not from a holder of the secret)")
    obj = json.loads(data)
    if not isinstance(obj, dict):
        raise TransferError(f"the {label.decode()} is not a JSON object")
    return obj


@dataclass(frozen=True)
class Layout:
    """The files of a snapshot and how their bytes are cut into numbered chunks."""

    files: tuple[tuple[str, int], ...]
    chunk_size: int

    def __post_init__(self) -> None:
        if not 4096 <= self.chunk_size <= MAX_CHUNK:
            raise TransferError(f"chunk size {self.chunk_size} is outside 4 KiB..64 MiB")
        if len(self.files) > MAX_FILES:
            raise TransferError(f"{len(self.files)} files is more than a snapshot may hold")
        for path, size in self.files:
            if not _PATH.fullmatch(path) or path.startswith(".") or "/." in path or size < 0:
                raise TransferError(f"the file name {path!r} is not allowed in a snapshot stream")
        paths = [p for p, _ in self.files]
        folders = {p.rsplit("/", 1)[0] for p in paths if "/" in p}
        if len(set(paths)) != len(paths) or folders & set(paths):
            raise TransferError("the snapshot stream names a file twice, or a file as a folder")
        if self.count > MAX_CHUNKS:
            raise TransferError("the snapshot has too many chunks")

    @functools.cached_property
    def count(self) -> int:
        return sum(-(-size // self.chunk_size) for _, size in self.files)

    @property
    def raw_bytes(self) -> int:
        return sum(size for _, size in self.files)

    def chunks(self) -> list[tuple[int, int, int]]:
        """(file index, offset, length) of every chunk, by chunk index."""
        return [
            (i, off, min(self.chunk_size, size - off))
            for i, (_, size) in enumerate(self.files)
            for off in range(0, size, self.chunk_size)
        ]


def digest(crcs: list[int]) -> str:
    h = hashlib.sha256()
    for index, crc in enumerate(crcs):
        h.update(struct.pack("<QI", index, crc))
    return h.hexdigest()


def inflate(dctx: zstandard.ZstdDecompressor, payload: bytes | memoryview, size: int) -> bytes | None:
    """A ZSTD chunk's ``size`` bytes, or None where its payload is not a frame of them.  A frame
    that states its size is decompressed whole whatever ``max_output_size`` says (one of 100 KiB
    that states 4 GiB: 4 GiB of memory, from a peer), so its statement is checked first."""
    try:
        if zstandard.frame_content_size(payload) not in (-1, size):
            return None
        data = dctx.decompress(payload, max_output_size=size)
    except zstandard.ZstdError:
        return None
    return data if len(data) == size else None
