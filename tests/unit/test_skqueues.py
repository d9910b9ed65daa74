"""CRIU's sk-queues.img read for messages that carry descriptors (:mod:`snapshot.skqueues`),
on images made here as CRIU writes them (the real ones: tests/snapshot/test_process_shapes.py)."""

from __future__ import annotations

import pytest

from snapshot import skqueues

MAGICS = bytes.fromhex("19435654 26402656")


def _varint(n: int) -> bytes:
    out = bytearray()
    while True:
        out.append(n & 0x7F | (0x80 if n > 0x7F else 0))
        n >>= 7
        if not n:
            return bytes(out)


def _entry(data: bytes, rights: int = 0, ucred: bool = False) -> bytes:
    """One queued message: its protobuf entry (id_for 0x15, its length, an SCM_RIGHTS entry of
    ``rights`` descriptors, a ucred), framed by its size, then its data."""
    pb = b"\x08\x15" + b"\x10" + _varint(len(data))
    if rights:
        scm = b"\x08\x01" + b"".join(b"\x10" + _varint(0x16 + i) for i in range(rights))
        pb += b"\x22" + _varint(len(scm)) + scm
    if ucred:  # (field 128, a message: a two-byte key)
        pb += b"\x82\x08" + _varint(4) + b"\x08\x01\x10\x02"
    return len(pb).to_bytes(4, "little") + pb + data


def test_messages_carrying_descriptors_are_counted_among_plain_ones() -> None:
    image = MAGICS + _entry(b"plain") + _entry(b"x" * 300, rights=2) + _entry(b"", ucred=True) + _entry(b"y", 1)
    assert skqueues.carrying_descriptors(image) == 2
    assert skqueues.carrying_descriptors(MAGICS + _entry(b"plain" * 100, ucred=True)) == 0
    assert skqueues.carrying_descriptors(MAGICS) == 0


@pytest.mark.parametrize(
    "image",
    [
        MAGICS + _entry(b"data")[:-1],  # (its data cut)
        MAGICS + _entry(b"data")[:3],  # (its size cut)
        MAGICS + (3).to_bytes(4, "little") + b"\x08\x95",  # (a number cut)
        MAGICS + (2).to_bytes(4, "little") + b"\x0b\x00",  # (wire type 3: a group, which CRIU never writes)
        MAGICS + (3).to_bytes(4, "little") + b"\x22\x05\x00",  # (a field longer than its entry)
    ],
)
def test_what_is_not_such_an_image_is_refused_not_read_as_no_message(image: bytes) -> None:
    with pytest.raises(ValueError):
        skqueues.carrying_descriptors(image)
