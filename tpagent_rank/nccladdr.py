"""NCCL's own address, after the rank has moved to another node.

NCCL picks the interface its bootstrap listens on once per process, at its first communicator,
and keeps the address in a static variable (``bootstrapNetIfAddr``; the socket transport keeps
its devices' addresses likewise): a communicator built after a move then binds to the source
node's address and fails ("Call to bind failed: Cannot assign requested address", as seen on an
H100).  NCCL has no call to choose again.  So, before the communicators are rebuilt on a new
node, the addresses this node no longer has are rewritten in place, in the library's own data:
each ``sockaddr_in``/``sockaddr_in6`` there that holds one (family, any port, the address, the
rest as the kernel fills it) gets the address this node has on the interface of that name, or,
where it has no such interface, the address it reaches the job's store from.  NCCL then binds,
and tells its peers, the new address (it reads the address back from the bound socket).

Only the standard library (``ctypes``): this runs in the user's process.
"""

from __future__ import annotations

import contextlib
import ctypes
import fcntl
import ipaddress
import os
import re
import socket
import struct

#: An interface's addresses, per family: {interface name: packed addresses}
Addresses = dict[str, list[bytes]]
#: This process's mappings: (start, end, permissions, path or '')
Maps = list[tuple[int, int, str, str]]

_SIOCGIFADDR = 0x8915


def local_addresses() -> Addresses:
    """This network namespace's addresses by interface: IPv4 (the primary one, as ``ip`` lists
    first) and IPv6 (from /proc/net/if_inet6); loopback left out."""
    out: Addresses = {}
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        for _, name in socket.if_nameindex():
            with contextlib.suppress(OSError):
                req = struct.pack("256s", name.encode()[:15])
                out.setdefault(name, []).append(fcntl.ioctl(s.fileno(), _SIOCGIFADDR, req)[20:24])
    with contextlib.suppress(OSError), open("/proc/net/if_inet6") as f:
        for line in f:
            parts = line.split()
            if len(parts) == 6:
                out.setdefault(parts[5], []).append(bytes.fromhex(parts[0]))
    kept = {n: [a for a in addrs if not ipaddress.ip_address(a).is_loopback] for n, addrs in out.items() if n != "lo"}
    return {n: addrs for n, addrs in kept.items() if addrs}


def route_address(host: str, family: int) -> bytes | None:
    """The address this node reaches ``host`` from (a UDP connect sends nothing)."""
    with contextlib.suppress(OSError), socket.socket(family, socket.SOCK_DGRAM) as s:
        s.connect((host, 9))
        return socket.inet_pton(family, s.getsockname()[0])
    return None


def moves(before: Addresses, now: Addresses, store_host: str) -> dict[bytes, bytes]:
    """Old address -> new for each address of ``before`` that this node does not have: the
    address of the interface of the same name and family here, else the one the store is
    reached from."""
    here = {a for addrs in now.values() for a in addrs}
    out: dict[bytes, bytes] = {}
    for name, addrs in before.items():
        for old in addrs:
            if old in here or old in out:
                continue
            same = [a for a in now.get(name, []) if len(a) == len(old)]
            new = same[0] if same else route_address(store_host, socket.AF_INET if len(old) == 4 else socket.AF_INET6)
            if new is not None and not ipaddress.ip_address(new).is_loopback:
                out[old] = new
    return out


def _pattern(old: bytes) -> re.Pattern[bytes]:
    """A sockaddr holding ``old``: family (host order), port, address, the rest zero (IPv4) or
    flow info and scope (IPv6)."""
    if len(old) == 4:
        return re.compile(re.escape(struct.pack("=H", socket.AF_INET)) + b".." + re.escape(old) + b"\0{8}", re.DOTALL)
    return re.compile(re.escape(struct.pack("=H", socket.AF_INET6)) + b"......" + re.escape(old), re.DOTALL)


def rewrite(regions: list[tuple[int, int]], table: dict[bytes, bytes]) -> int:
    """Rewrite each sockaddr (4-byte aligned) in ``regions`` of this process's memory that holds
    an old address of ``table`` to the new one; how many were rewritten."""
    done = 0
    for start, end in regions:
        data = ctypes.string_at(start, end - start)
        for old, new in table.items():
            for m in _pattern(old).finditer(data):
                if m.start() % 4 == 0:
                    at = start + m.start() + (4 if len(old) == 4 else 8)
                    ctypes.memmove(at, new, len(new))
                    done += 1
    return done


def _maps() -> Maps:
    out = []
    with open("/proc/self/maps") as f:
        for line in f:
            parts = line.split(maxsplit=5)
            start, end = (int(x, 16) for x in parts[0].split("-"))
            out.append((start, end, parts[1], parts[5].strip() if len(parts) > 5 else ""))
    return out


def nccl_data(maps: Maps | None = None, symbol: str = "ncclGetVersion") -> list[tuple[int, int]]:
    """The writable data of the library that defines NCCL (``libnccl.so``, or a library NCCL is
    built into) in this process: its ``rw-p`` mappings and the anonymous one right after them
    (its .bss past the file).  Empty where no loaded library defines ``symbol``."""
    maps = _maps() if maps is None else maps
    files = sorted({p for _, _, perm, p in maps if "x" in perm and p.startswith("/")}, key=lambda p: "nccl" not in p)
    for path in files:
        try:
            lib = ctypes.CDLL(path, mode=os.RTLD_NOLOAD | os.RTLD_LAZY)
            at = ctypes.cast(getattr(lib, symbol), ctypes.c_void_p).value
        except (OSError, AttributeError):
            continue
        owner = next((p for s, e, _, p in maps if at is not None and s <= at < e), None)
        if owner is None:
            continue
        out: list[tuple[int, int]] = []
        for i, (s, e, perm, p) in enumerate(maps):
            if p == owner and perm.startswith("rw"):
                out.append((s, e))
                after = maps[i + 1] if i + 1 < len(maps) else None
                if after is not None and after[3] == "" and after[0] == e and after[2].startswith("rw"):
                    out.append((after[0], after[1]))
        return out
    return []


def follow(before: Addresses, store_host: str) -> str | None:
    """After a move: NCCL's addresses of the node it left, rewritten to this node's; what was
    done, in words (None: the node is the same, or NCCL is not loaded)."""
    table = moves(before, local_addresses(), store_host)
    if not table:
        return None
    regions = nccl_data()
    if not regions:
        return None
    n = rewrite(regions, table)
    pairs = ", ".join(f"{ipaddress.ip_address(o)} -> {ipaddress.ip_address(n_)}" for o, n_ in table.items())
    return f"NCCL's addresses of the node it left rewritten to this node's ({pairs}), {n} in all"
