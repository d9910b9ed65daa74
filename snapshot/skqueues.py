"""Messages queued on the tree's unix sockets that carry descriptors (SCM_RIGHTS), read from
CRIU's ``sk-queues.img``.  CRIU 4.2 dumps them, but where the message was sent by another
process of the tree (a worker to its parent, as torch.multiprocessing passes tensors) its
restore loses it (a memfd's: the receiver never gets it) or fails ("Failed to send packet: Bad
file descriptor": a regular file's).  The post-dump hook refuses a dump holding any (CRIU rolls
back: the tree runs on where it stood); they are in flight only for a moment, so the same dump
works once they are read.  The image (after CRIU's two magic numbers), little-endian::

    IMAGE  ::= { SIZE:u32 ENTRY(SIZE bytes) DATA(ENTRY.length bytes) }
    ENTRY  ::= protobuf sk_packet_entry: id_for = 1 (varint), length = 2 (varint),
               addr = 3 (bytes), scm = 4 (repeated: one per control message), ucred = 128
"""

from __future__ import annotations

from pathlib import Path

NAME = "sk-queues.img"
#: The most of the image a streamed dump keeps to read (its queued data included); one over it is refused.
MOST = 64 << 20
_MAGICS = 8
_LENGTH = 2
_SCM = 4


def carrying_descriptors(image: bytes) -> int:
    """How many of the queued messages in ``image`` (a whole sk-queues.img) carry control
    messages (descriptors: the only kind CRIU dumps); ValueError if it is no such image."""
    at = _MAGICS
    found = 0
    while at < len(image):
        if at + 4 > len(image):
            raise ValueError("an sk-queues image cut inside an entry's size")
        size = int.from_bytes(image[at : at + 4], "little")
        fields = _fields(image[at + 4 : at + 4 + size])
        found += _SCM in fields
        at += 4 + size + fields.get(_LENGTH, 0)
    if at != len(image):
        raise ValueError("an sk-queues image cut inside an entry")
    return found


def refusal(count: int) -> str:
    """The sentence of a dump refused for ``count`` such messages (the hook's error)."""
    return (
        f"{count} message(s) queued on a unix socket of the tree carry descriptors (SCM_RIGHTS, as "
        "torch.multiprocessing passes tensors), which CRIU does not bring back whole (the copy would lose "
        "those another of its processes sent); they are in flight for a moment only, so try again"
    )


def check(path: Path) -> None:
    """Raise RuntimeError (:func:`refusal`) if the image at ``path`` (if any) holds such messages."""
    try:
        image = path.read_bytes()
    except FileNotFoundError:
        return
    if count := carrying_descriptors(image):
        raise RuntimeError(refusal(count))


def _fields(entry: bytes) -> dict[int, int]:
    """Each field number of a protobuf message -> its value (a varint's) or its length (bytes')."""
    out: dict[int, int] = {}
    at = 0
    while at < len(entry):
        key, at = _varint(entry, at)
        number = key >> 3
        wire = key & 7
        if wire == 0:
            out[number], at = _varint(entry, at)
        elif wire == 2:
            length, at = _varint(entry, at)
            out[number] = length
            at += length
        elif wire in (1, 5):
            at += 8 if wire == 1 else 4
        else:
            raise ValueError(f"an sk-queues entry with a field of wire type {wire}")
    if at != len(entry):
        raise ValueError("an sk-queues entry cut inside a field")
    return out


def _varint(data: bytes, at: int) -> tuple[int, int]:
    value = 0
    for shift in range(0, 64, 7):
        if at >= len(data):
            raise ValueError("an sk-queues entry cut inside a number")
        byte = data[at]
        at += 1
        value |= (byte & 0x7F) << shift
        if not byte & 0x80:
            return value, at
    raise ValueError("an sk-queues entry with a number over 64 bits")
