"""What NCCL keeps of its host for the life of a process: its address, rewritten after the rank
has moved to another node (:func:`follow`), and its host identity (:func:`host_identity`).

NCCL picks the interface its bootstrap listens on once per process, at its first communicator,
and keeps the address in a static variable (``bootstrapNetIfAddr``; the socket transport keeps
its devices' addresses likewise): a communicator built after a move then binds to the source
node's address and fails ("Call to bind failed: Cannot assign requested address", as seen on an
H100).  NCCL has no call to choose again.  So, before the communicators are rebuilt on a new
node, the addresses this node no longer has are rewritten in place, in the library's own data:
each ``sockaddr_in``/``sockaddr_in6`` there that holds one (family, any port, the address, the
rest as the kernel fills it) gets the address this node has on the interface of that name, or
where it has none, on the first interface NCCL_SOCKET_IFNAME names, or else the address it
reaches the job's store from.  NCCL then binds, and tells its peers, the new address (it reads
the address back from the bound socket).

Where: the writable segments of every loaded library that defines ``ncclGetVersion`` (libnccl,
or a library NCCL is built into), as their ELF program headers give them (``dl_iterate_phdr``),
less their read-only-after-relocation part.  Not covered: an external network plugin's own
addresses (``libnccl-net*.so``), InfiniBand devices and their GIDs, IPv6 link-local addresses
(their scope is the source's interface index), and communicators made outside torch's process
groups (their threads would read the address while it is rewritten).

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
from collections.abc import Iterator

#: An interface's addresses, per family: {interface name: packed addresses}
Addresses = dict[str, list[bytes]]

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


def _usable(addr: bytes) -> bool:
    a = ipaddress.ip_address(addr)
    return not (a.is_loopback or a.is_link_local)


def nccl_interfaces(names: list[str], spec: str | None) -> list[str]:
    """The interfaces of ``names`` that NCCL_SOCKET_IFNAME (``spec``) lets NCCL use, in order:
    prefixes separated by commas, ``^`` first to exclude them, ``=`` for exact names."""
    if not spec:
        return []
    exclude = spec.startswith("^")
    spec = spec[1:] if exclude else spec
    exact = spec.startswith("=")
    wanted = [p for p in (spec[1:] if exact else spec).split(",") if p]
    return [n for n in names if any(n == p if exact else n.startswith(p) for p in wanted) != exclude]


def moves(before: Addresses, now: Addresses, store_host: str, spec: str | None = None) -> dict[bytes, bytes]:
    """Old address -> new, for each address of ``before`` (loopback and link-local aside) that this
    node does not have: the address of the same family on the interface of the same name here,
    else on the first interface NCCL_SOCKET_IFNAME (``spec``) names, else the one the store is
    reached from.  (An address every node carries, a Kubernetes service's, stays as it is.)"""
    here = {a for addrs in now.values() for a in addrs}
    named = nccl_interfaces(list(now), spec)
    out: dict[bytes, bytes] = {}
    for name, addrs in before.items():
        for old in addrs:
            if old in here or old in out or not _usable(old):
                continue
            family = socket.AF_INET if len(old) == 4 else socket.AF_INET6
            candidates = [name, *named]
            found = [a for n in candidates for a in now.get(n, []) if len(a) == len(old) and _usable(a)]
            new = found[0] if found else route_address(store_host, family)
            if new is not None and _usable(new):
                out[old] = new
    return out


def _pattern(old: bytes) -> re.Pattern[bytes]:
    """A sockaddr holding ``old`` (at every position, overlapping): family (host order), port,
    address, the rest zero (IPv4); family, port, flow info, address (IPv6)."""
    if len(old) == 4:
        body = re.escape(struct.pack("=H", socket.AF_INET)) + b".." + re.escape(old) + b"\0{8}"
    else:
        body = re.escape(struct.pack("=H", socket.AF_INET6)) + b"......" + re.escape(old)
    return re.compile(b"(?=" + body + b")", re.DOTALL)


def rewrite(regions: list[tuple[int, int]], table: dict[bytes, bytes]) -> int:
    """Rewrite each sockaddr (4-byte aligned) in ``regions`` of this process's memory that holds
    an old address of ``table`` to the new one; how many were rewritten."""
    done = 0
    for start, end in regions:
        data = ctypes.string_at(start, end - start)
        for old, new in table.items():
            for m in _pattern(old).finditer(data):
                if (start + m.start()) % 4 == 0:
                    ctypes.memmove(start + m.start() + (4 if len(old) == 4 else 8), new, len(new))
                    done += 1
    return done


# ---- where a library's writable data is: its ELF program headers -----------------------------

_PT_LOAD = 1
_PT_GNU_RELRO = 0x6474E552
_PF_W = 2


class _Phdr(ctypes.Structure):  # Elf64_Phdr
    _fields_ = [
        ("p_type", ctypes.c_uint32),
        ("p_flags", ctypes.c_uint32),
        ("p_offset", ctypes.c_uint64),
        ("p_vaddr", ctypes.c_uint64),
        ("p_paddr", ctypes.c_uint64),
        ("p_filesz", ctypes.c_uint64),
        ("p_memsz", ctypes.c_uint64),
        ("p_align", ctypes.c_uint64),
    ]


class _Info(ctypes.Structure):  # struct dl_phdr_info (its first fields)
    _fields_ = [
        ("dlpi_addr", ctypes.c_uint64),
        ("dlpi_name", ctypes.c_char_p),
        ("dlpi_phdr", ctypes.POINTER(_Phdr)),
        ("dlpi_phnum", ctypes.c_uint16),
    ]


#: A loaded object: its path, and its segments as (type, flags, start, end) in this process
Loaded = tuple[str, list[tuple[int, int, int, int]]]


def loaded() -> list[Loaded]:
    """Every shared object loaded in this process (``dl_iterate_phdr``); none on a 32-bit one."""
    if ctypes.sizeof(ctypes.c_void_p) != 8:
        return []
    out: list[Loaded] = []

    def one(info: ctypes._Pointer[_Info], size: int, data: ctypes.c_void_p) -> int:
        i = info.contents
        segs = [
            (h.p_type, h.p_flags, i.dlpi_addr + h.p_vaddr, i.dlpi_addr + h.p_vaddr + h.p_memsz)
            for h in (i.dlpi_phdr[k] for k in range(i.dlpi_phnum))
        ]
        out.append((os.fsdecode(i.dlpi_name or b""), segs))
        return 0

    callback = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.POINTER(_Info), ctypes.c_size_t, ctypes.c_void_p)(one)
    ctypes.CDLL(None).dl_iterate_phdr(callback, None)
    return out


def _writable(segs: list[tuple[int, int, int, int]]) -> Iterator[tuple[int, int]]:
    """The writable load segments, less what is read-only once relocated (``PT_GNU_RELRO``)."""
    relro = [(s, e) for t, _, s, e in segs if t == _PT_GNU_RELRO]
    for t, flags, s, e in segs:
        if t != _PT_LOAD or not flags & _PF_W:
            continue
        for rs, re_ in relro:
            if rs <= s < re_:
                s = re_
            elif s < rs < e:
                yield (s, rs)
                s = max(s, re_)
        if s < e:
            yield (s, e)


def nccl_data(symbol: str = "ncclGetVersion") -> list[tuple[int, int]]:
    """The writable data (.data, .bss) of each loaded library that defines ``symbol`` (NCCL's:
    libnccl.so, or a library NCCL is built into); empty where none does."""
    objects = sorted(loaded(), key=lambda o: "nccl" not in os.path.basename(o[0]))
    owners: list[int] = []
    out: list[tuple[int, int]] = []
    for path, _ in objects:
        if not path:  # (the program itself)
            continue
        try:
            lib = ctypes.CDLL(path, mode=os.RTLD_NOLOAD | os.RTLD_LAZY)
            at = ctypes.cast(getattr(lib, symbol), ctypes.c_void_p).value
        except (OSError, AttributeError):
            continue
        for k, (_, segs) in enumerate(objects):  # (the object defining it: may be a dependency)
            if k not in owners and any(t == _PT_LOAD and at is not None and s <= at < e for t, _, s, e in segs):
                owners.append(k)
                out.extend(_writable(segs))
    return out


def follow(before: Addresses, store_host: str) -> str | None:
    """After a move: NCCL's addresses of the node it left, rewritten to this node's; what was
    done, in words (None: this node has every address the rank's node had)."""
    table = moves(before, local_addresses(), store_host, os.environ.get("NCCL_SOCKET_IFNAME"))
    if not table:
        return None
    pairs = ", ".join(f"{ipaddress.ip_address(o)} -> {ipaddress.ip_address(n)}" for o, n in table.items())
    regions = nccl_data()
    if not regions:
        return f"no loaded library defines NCCL's symbols: its addresses of the node it left ({pairs}) stay"
    n = rewrite(regions, table)
    return f"NCCL's addresses of the node it left rewritten to this node's ({pairs}), {n} in all"


def host_identity(as_nccl: bool = False) -> str:
    """This host as NCCL tells hosts apart: its host name and boot id (``as_nccl``: the
    NCCL_HOSTID of this process's environment instead, where it sets one)."""
    if as_nccl and os.environ.get("NCCL_HOSTID"):
        return "NCCL_HOSTID=" + os.environ["NCCL_HOSTID"]
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
    except OSError:
        boot = ""
    return f"{socket.gethostname()}|{boot}"
