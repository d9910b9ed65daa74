"""tpagent_rank.nccladdr's parts, without NCCL: which old address maps to which new one, the
rewrite of sockaddrs in memory (and of nothing else), and the finding of a loaded library's
writable data by a symbol it defines.  The whole, against a library that keeps its address as
NCCL does, is tests/agent/test_nccl_address.py (root: a network namespace of its own)."""

from __future__ import annotations

import ctypes
import ipaddress
import socket
import struct
from pathlib import Path

from tpagent_rank import nccladdr


def ip(text: str) -> bytes:
    return ipaddress.ip_address(text).packed


def sin(addr: str, port: int) -> bytes:
    return struct.pack("=H", socket.AF_INET) + struct.pack("!H", port) + ip(addr) + bytes(8)


def sin6(addr: str, port: int, scope: int = 0) -> bytes:
    return struct.pack("=H", socket.AF_INET6) + struct.pack("!HI", port, 0) + ip(addr) + struct.pack("=I", scope)


def test_an_address_maps_to_the_same_interface_here_else_to_the_way_to_the_store() -> None:
    before = {"ib0": [ip("10.1.0.5"), ip("fd00::5")], "eth9": [ip("10.2.0.5")], "eth0": [ip("127.0.0.1")]}
    now = {"ib0": [ip("10.1.0.7"), ip("fd00::7")], "eth0": [ip("127.0.0.1")]}
    # (eth9 has no namesake here: the address that reaches the store, 127.0.0.1 here, is
    # loopback, which no peer could reach: left as it was)
    assert nccladdr.moves(before, now, "127.0.0.1") == {ip("10.1.0.5"): ip("10.1.0.7"), ip("fd00::5"): ip("fd00::7")}
    assert nccladdr.moves(now, now, "127.0.0.1") == {}


def test_without_a_namesake_the_interfaces_nccl_socket_ifname_names_come_first() -> None:
    before = {"enp65s0": [ip("10.3.0.5")]}
    now = {"docker0": [ip("172.17.0.1")], "enp66s0": [ip("10.3.0.6")], "ens1": [ip("10.4.0.6")]}
    assert nccladdr.moves(before, now, "127.0.0.1", "enp") == {ip("10.3.0.5"): ip("10.3.0.6")}
    assert nccladdr.moves(before, now, "127.0.0.1", "=ens1") == {ip("10.3.0.5"): ip("10.4.0.6")}
    assert nccladdr.moves(before, now, "127.0.0.1", "^docker,enp") == {ip("10.3.0.5"): ip("10.4.0.6")}
    assert nccladdr.nccl_interfaces(["eth0", "eth1", "ib0"], "^=eth0") == ["eth1", "ib0"]
    assert nccladdr.nccl_interfaces(["eth0", "ib0"], None) == []


def test_link_local_addresses_are_not_followed() -> None:
    """A link-local sockaddr holds its interface's index on the source as its scope: not one
    this node can bind to, whatever its address."""
    before = {"eth0": [ip("fe80::1"), ip("10.0.0.1")]}
    now = {"eth0": [ip("fe80::2"), ip("10.0.0.2")]}
    assert nccladdr.moves(before, now, "127.0.0.1") == {ip("10.0.0.1"): ip("10.0.0.2")}


def test_the_way_to_the_store_is_the_local_address_a_connection_would_use() -> None:
    here = {a for addrs in nccladdr.local_addresses().values() for a in addrs}
    routed = nccladdr.route_address("192.0.2.77", socket.AF_INET)  # (nothing is sent)
    assert routed is None or routed in here


def test_only_whole_aligned_sockaddrs_of_an_old_address_are_rewritten() -> None:
    table = {ip("10.0.0.1"): ip("10.0.0.2"), ip("fd00::1"): ip("fd00::2")}
    parts = [
        sin("10.0.0.1", 0),  # NCCL's kept interface address: rewritten
        sin("10.0.0.1", 4242),  # one with a port: rewritten, its port kept
        sin("10.0.0.3", 0),  # another address: left
        ip("10.0.0.1") + bytes(12),  # the address alone, not a sockaddr: left
        b"\x01\x02" + sin("10.0.0.1", 0) + b"\x03\x04",  # not 4-byte aligned: left
        sin6("fd00::1", 0, 3),  # IPv6: rewritten, scope kept
    ]
    raw = b"".join(parts)
    buf = ctypes.create_string_buffer(raw, len(raw))
    start = ctypes.addressof(buf)
    assert nccladdr.rewrite([(start, start + len(raw))], table) == 3
    want = b"".join([sin("10.0.0.2", 0), sin("10.0.0.2", 4242), *parts[2:5], sin6("fd00::2", 0, 3)])
    assert buf.raw == want


def test_the_data_of_the_library_that_defines_a_symbol_is_found() -> None:
    """libc's writable segments (getpid is libc's), less what is read-only once relocated: each
    lies in a writable mapping of libc's file or the anonymous one the loader made for its .bss."""
    libc = ctypes.CDLL(None)
    at = ctypes.cast(libc.getpid, ctypes.c_void_p).value
    assert at is not None
    maps = []
    for line in Path("/proc/self/maps").read_text().splitlines():
        parts = line.split()
        start, end = (int(x, 16) for x in parts[0].split("-"))
        maps.append((start, end, parts[1], parts[5] if len(parts) > 5 else ""))
    owner = next(p for s, e, _, p in maps if s <= at < e)
    regions = nccladdr.nccl_data(symbol="getpid")
    assert regions
    for s, e in regions:
        inside = [m for m in maps if m[0] < e and s < m[1]]
        assert inside and all(m[2].startswith("rw") and m[3] in (owner, "") for m in inside), (hex(s), inside)
    assert any(m[3] == owner for s, e in regions for m in maps if m[0] <= s < m[1])
    assert nccladdr.nccl_data(symbol="tpagentNoSuchSymbol") == []


def test_a_node_with_every_address_it_had_rewrites_nothing() -> None:
    assert nccladdr.follow(nccladdr.local_addresses(), "127.0.0.1") is None
