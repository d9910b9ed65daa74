"""The peers of this network namespace's connected unix sockets, from the kernel's sock_diag
(netlink)::

    REQUEST ::= NLMSGHDR(SOCK_DIAG_BY_FAMILY, REQUEST|DUMP) UNIX_DIAG_REQ(AF_UNIX, ESTABLISHED, NAME|PEER)
    ANSWER  ::= { NLMSGHDR UNIX_DIAG_MSG(family type state pad ino cookie[2]) { RTATTR } } NLMSGHDR(DONE)
    RTATTR  ::= len:u16 type:u16 value (padded to 4)     UNIX_DIAG_PEER: the peer's inode, u32;
                                                         UNIX_DIAG_NAME: its sun_path (a listener's,
                                                         for a connection it accepted)
"""

from __future__ import annotations

import socket
import struct
from collections.abc import Iterable

_NETLINK_SOCK_DIAG = 4
_SOCK_DIAG_BY_FAMILY = 20
_NLM_F_REQUEST = 0x1
_NLM_F_DUMP = 0x300
_NLMSG_ERROR = 2
_NLMSG_DONE = 3
_UDIAG_SHOW_NAME = 0x1
_UDIAG_SHOW_PEER = 0x4
_UNIX_DIAG_NAME = 0
_UNIX_DIAG_PEER = 2
_ESTABLISHED = 1
_STREAMS = frozenset({socket.SOCK_STREAM, socket.SOCK_SEQPACKET})


def peers() -> tuple[dict[int, int], dict[int, bytes]]:
    """INODE -> its peer's INODE, for each connected unix stream or seqpacket socket of this
    network namespace; and INODE -> the name of each connected socket that has one (the
    module's grammar)."""
    show = _UDIAG_SHOW_NAME | _UDIAG_SHOW_PEER
    states = 1 << _ESTABLISHED  # (a connection a listener accepted has its name)
    request = struct.pack("=BBHIIIII", socket.AF_UNIX, 0, 0, states, 0, show, 0xFFFFFFFF, 0xFFFFFFFF)
    header = struct.pack("=IHHII", 16 + len(request), _SOCK_DIAG_BY_FAMILY, _NLM_F_REQUEST | _NLM_F_DUMP, 1, 0)
    peers: dict[int, int] = {}
    names: dict[int, bytes] = {}
    with socket.socket(socket.AF_NETLINK, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC, _NETLINK_SOCK_DIAG) as s:
        s.settimeout(5)
        s.sendto(header + request, (0, 0))
        while True:
            data = s.recv(1 << 20)
            for kind, body in _messages(data):
                if kind == _NLMSG_DONE:
                    return peers, names
                if kind == _NLMSG_ERROR or len(body) < 16:
                    raise OSError("sock_diag did not answer the request")
                _family, kind_, state, _pad, inode = struct.unpack_from("=BBBBI", body)
                for atype, value in _attributes(body[16:]):
                    if atype == _UNIX_DIAG_NAME:  # (a path ends at its NUL; an abstract name has none)
                        names[inode] = value if value.startswith(b"\0") else value.split(b"\0")[0]
                    elif atype == _UNIX_DIAG_PEER and len(value) >= 4 and kind_ in _STREAMS and state == _ESTABLISHED:
                        peers[inode] = struct.unpack_from("=I", value)[0]
            if not data:
                return peers, names


def _messages(data: bytes) -> Iterable[tuple[int, bytes]]:
    off = 0
    while off + 16 <= len(data):
        length, kind = struct.unpack_from("=IH", data, off)
        if length < 16 or off + length > len(data):  # (not one the kernel wrote: read no further)
            return
        yield kind, data[off + 16 : off + length]
        off += (length + 3) & ~3


def _attributes(data: bytes) -> Iterable[tuple[int, bytes]]:
    off = 0
    while off + 4 <= len(data):
        length, kind = struct.unpack_from("=HH", data, off)
        if length < 4 or off + length > len(data):
            return
        yield kind, data[off + 4 : off + length]
        off += (length + 3) & ~3
