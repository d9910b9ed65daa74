"""transfer.wire: the frame grammar, its limits, and frames that are refused (over real loopback TCP)."""

from __future__ import annotations

import hashlib
import json
import os
import socket
import struct
from collections.abc import Iterator
from typing import cast

import pytest
import zstandard

from transfer import wire
from transfer.api import TransferError
from transfer.tcp import TcpChannel
from transfer.wire import Codec, Kind, Layout, PeerError

SECRET = b"s" * 32
SESSION = b"S" * 16


@pytest.fixture
def pair() -> Iterator[tuple[TcpChannel, TcpChannel]]:
    """Two ends of one loopback TCP connection: (sender, receiver)."""
    with socket.create_server(("127.0.0.1", 0)) as server:
        client = socket.create_connection(server.getsockname(), timeout=5)
        accepted, _ = server.accept()
    a = TcpChannel(client, timeout=5)
    b = TcpChannel(accepted, timeout=5)
    yield a, b
    a.close()
    b.close()


def test_a_frame_is_kind_codec_zero_length_then_body(pair: tuple[TcpChannel, TcpChannel]) -> None:
    a, b = pair
    wire.send_frame(a, Kind.CHUNK, b"head", Codec.ZSTD, b"-", b"tail")
    raw = b.recv_exact(8 + 9)
    assert raw[:8] == bytes([3, 1, 0, 0]) + (9).to_bytes(4, "little")
    assert raw[8:] == b"head-tail"


def test_frames_round_trip_in_order(pair: tuple[TcpChannel, TcpChannel]) -> None:
    a, b = pair
    wire.send_frame(a, Kind.HAVE, b"\x01\x00\x01")
    wire.send_frame(a, Kind.ACK, wire.ACK.pack(7, 1))
    wire.send_frame(a, Kind.WELCOME)
    assert wire.recv_frame(b, 3) == (Kind.HAVE, Codec.RAW, b"\x01\x00\x01")
    codec, body = wire.expect(b, Kind.ACK, wire.ACK.size)
    assert (codec, wire.ACK.unpack(body)) == (Codec.RAW, (7, 1))
    assert wire.expect(b, Kind.WELCOME, 0) == (Codec.RAW, b"")


def test_a_frame_over_the_limit_is_refused_before_its_body_is_read(pair: tuple[TcpChannel, TcpChannel]) -> None:
    a, b = pair
    a.send(wire.FRAME.pack(Kind.HEADER, Codec.RAW, 0, wire.MAX_JSON + 1))
    with pytest.raises(TransferError, match=f"frame of {wire.MAX_JSON + 1} bytes, over the limit of {wire.MAX_JSON}"):
        wire.recv_frame(b, wire.MAX_JSON)


@pytest.mark.parametrize(("kind", "codec"), [(0, 0), (9, 0), (255, 0), (3, 3), (3, 255)])
def test_an_unknown_kind_or_codec_is_refused(pair: tuple[TcpChannel, TcpChannel], kind: int, codec: int) -> None:
    a, b = pair
    a.send(wire.FRAME.pack(kind, codec, 0, 1), b"x")
    with pytest.raises(TransferError, match=rf"unknown frame \(kind {kind}, codec {codec}\)"):
        wire.recv_frame(b, 100)


def test_a_truncated_frame_is_refused(pair: tuple[TcpChannel, TcpChannel]) -> None:
    a, b = pair
    a.send(wire.FRAME.pack(Kind.CHUNK, Codec.RAW, 0, 100), b"only ten b")
    a.close()
    with pytest.raises(TransferError, match="closed the connection"):
        wire.recv_frame(b, 1000)


def test_a_truncated_frame_header_is_refused(pair: tuple[TcpChannel, TcpChannel]) -> None:
    a, b = pair
    a.send(wire.FRAME.pack(Kind.CHUNK, Codec.RAW, 0, 100)[:5])
    a.close()
    with pytest.raises(TransferError, match="closed the connection"):
        wire.recv_frame(b, 1000)


def test_an_error_frame_raises_the_peers_words(pair: tuple[TcpChannel, TcpChannel]) -> None:
    a, b = pair
    wire.send_frame(a, Kind.ERROR, b"disk full on node-b")
    with pytest.raises(PeerError, match="the peer refused: disk full on node-b"):
        wire.expect(b, Kind.TRAILER, 1000)


def test_a_frame_of_another_kind_than_due_is_refused(pair: tuple[TcpChannel, TcpChannel]) -> None:
    a, b = pair
    wire.send_frame(a, Kind.TRAILER, b"{}")
    with pytest.raises(TransferError, match="the peer sent TRAILER where HEADER was due"):
        wire.expect(b, Kind.HEADER, 1000)


def test_struct_sizes_match_the_grammar() -> None:
    assert wire.MAGIC == b"TPXFER01" and len(wire.MAGIC) == 8
    assert wire.HELLO.size == 8 + 2 + 1 + 1 + 4 + 16 + 16
    assert (wire.FRAME.size, wire.CHUNK.size, wire.ACK.size) == (8, 16, 9)
    hello = wire.HELLO.pack(wire.MAGIC, wire.VERSION, wire.Role.DATA, 0, 3, b"S" * 16, b"N" * 16)
    assert (
        hello[8:10] == wire.VERSION.to_bytes(2, "little")
        and hello[10] == 1
        and hello[12:16] == (3).to_bytes(4, "little")
    )


def test_signed_json_round_trips_and_is_length_prefixed() -> None:
    body = wire.signed_json(SECRET, b"header", SESSION, {"snapshot_id": "ab", "chunk_size": 4096})
    (n,) = struct.unpack_from("<I", body)
    assert json.loads(body[4 : 4 + n]) == {"snapshot_id": "ab", "chunk_size": 4096}
    assert len(body) == 4 + n + wire.MAC_LEN
    assert wire.open_signed_json(SECRET, b"header", SESSION, body) == {"snapshot_id": "ab", "chunk_size": 4096}


def test_signed_json_refuses_a_flipped_bit_anywhere() -> None:
    body = wire.signed_json(SECRET, b"trailer", SESSION, {"chunks": 3})
    for i in range(len(body)):
        garbled = bytearray(body)
        garbled[i] ^= 0x04
        with pytest.raises(TransferError):
            wire.open_signed_json(SECRET, b"trailer", SESSION, garbled)


@pytest.mark.parametrize(
    ("secret", "label", "session"),
    [(b"t" * 32, b"header", SESSION), (SECRET, b"trailer", SESSION), (SECRET, b"header", b"T" * 16)],
    ids=["another secret", "another label", "another transfer"],
)
def test_signed_json_is_bound_to_secret_label_and_transfer(secret: bytes, label: bytes, session: bytes) -> None:
    """A header or trailer of one transfer, replayed into another on a plain TCP or UCX stream, fails."""
    body = wire.signed_json(SECRET, b"header", SESSION, {"chunks": 1})
    with pytest.raises(TransferError, match="failed authentication"):
        wire.open_signed_json(secret, label, session, body)


def test_signed_json_refuses_a_short_body_and_a_non_object() -> None:
    with pytest.raises(TransferError, match="too short"):
        wire.open_signed_json(SECRET, b"header", SESSION, b"\x00" * (4 + wire.MAC_LEN - 1))
    data = json.dumps([1, 2]).encode()
    listed = struct.pack("<I", len(data)) + data + wire.mac(SECRET, b"header", SESSION, data)
    with pytest.raises(TransferError, match="not a JSON object"):
        wire.open_signed_json(SECRET, b"header", SESSION, listed)


def test_layout_numbers_chunks_across_files_in_order() -> None:
    layout = Layout((("images/a", 10_000), ("images/empty", 0), ("manifest.json", 4096)), 4096)
    assert layout.chunks() == [(0, 0, 4096), (0, 4096, 4096), (0, 8192, 1808), (2, 0, 4096)]
    assert (layout.count, layout.raw_bytes) == (4, 14_096)


@pytest.mark.parametrize("chunk_size", [4095, wire.MAX_CHUNK + 1, 0])
def test_layout_refuses_a_chunk_size_out_of_range(chunk_size: int) -> None:
    with pytest.raises(TransferError, match="outside 4 KiB..64 MiB"):
        Layout((("a", 1),), chunk_size)


def test_layout_accepts_the_chunk_size_bounds() -> None:
    assert Layout((("a", 1),), 4096).count == Layout((("a", 1),), wire.MAX_CHUNK).count == 1


@pytest.mark.parametrize(
    "name", ["../etc/passwd", "/etc/passwd", ".hidden", "images/.x", "a/b/c", "a b", "", "images/"]
)
def test_layout_refuses_a_file_name_outside_the_grammar(name: str) -> None:
    with pytest.raises(TransferError, match="is not allowed in a snapshot stream"):
        Layout(((name, 1),), 4096)


def test_layout_refuses_a_negative_size() -> None:
    with pytest.raises(TransferError, match="is not allowed"):
        Layout((("a", -1),), 4096)


@pytest.mark.parametrize(
    "files", [(("a", 1), ("a", 2)), (("images", 1), ("images/a", 2))], ids=["twice", "as a folder"]
)
def test_layout_refuses_a_name_twice_or_a_file_as_a_folder(files: tuple[tuple[str, int], ...]) -> None:
    with pytest.raises(TransferError, match="names a file twice, or a file as a folder"):
        Layout(files, 4096)


def test_layout_refuses_too_many_files_and_too_many_chunks() -> None:
    with pytest.raises(TransferError, match=f"{wire.MAX_FILES + 1} files is more"):
        Layout(tuple((f"f{i}", 0) for i in range(wire.MAX_FILES + 1)), 4096)
    with pytest.raises(TransferError, match="too many chunks"):
        Layout((("a", (wire.MAX_CHUNKS + 1) * 4096),), 4096)
    assert Layout((("a", wire.MAX_CHUNKS * 4096),), 4096).count == wire.MAX_CHUNKS


def test_digest_is_sha256_of_index_and_crc_in_order() -> None:
    crcs = [0xDEADBEEF, 0, 1]
    want = hashlib.sha256(b"".join(i.to_bytes(8, "little") + c.to_bytes(4, "little") for i, c in enumerate(crcs)))
    assert wire.digest(crcs) == want.hexdigest()
    assert wire.digest(crcs) != wire.digest(list(reversed(crcs)))


class _Decompressor:
    """A real decompressor that counts how often it was used."""

    def __init__(self) -> None:
        self.real = zstandard.ZstdDecompressor()
        self.used = 0

    def decompress(self, data: bytes | memoryview, max_output_size: int = 0) -> bytes:
        self.used += 1
        return self.real.decompress(data, max_output_size=max_output_size)


def _frame(chunk: bytes, copies: int, stated: bool = True) -> bytes:
    """One zstd frame of ``copies`` times ``chunk``, stating its size or not."""
    c = zstandard.ZstdCompressor(write_content_size=stated).compressobj(size=len(chunk) * copies if stated else -1)
    return b"".join(c.compress(chunk) for _ in range(copies)) + c.flush()


def test_a_zstd_chunk_is_decompressed_only_to_its_own_size() -> None:
    """A peer's frame of a few KiB stating 256 MiB was decompressed whole (max_output_size does
    not hold a frame that states its size): it is refused unopened, as one stating nothing
    and holding more, or less, than the chunk is."""
    size = 1 << 20
    good = os.urandom(size)
    d = _Decompressor()
    dctx = cast(zstandard.ZstdDecompressor, d)
    assert wire.inflate(dctx, _frame(good, 1), size) == good
    assert wire.inflate(dctx, memoryview(_frame(good, 1, stated=False)), size) == good
    assert d.used == 2
    bomb = _frame(bytes(size), 256)
    assert len(bomb) < size // 16 and zstandard.frame_content_size(bomb) == 256 * size
    assert wire.inflate(dctx, bomb, size) is None and d.used == 2
    assert wire.inflate(dctx, _frame(bytes(size), 4, stated=False), size) is None
    assert wire.inflate(dctx, _frame(good[:100], 1), size) is None
    assert wire.inflate(dctx, b"not zstd at all", size) is None
