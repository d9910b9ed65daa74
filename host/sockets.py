"""The sockets of a process tree (TCP; unix ones' names), and which cannot be restored on another node.

Read from the tree's own network namespace (``/proc/PID/net/tcp{,6}``, not the reader's) and
matched to the tree by socket inode (``/proc/PID/fd/*`` -> ``socket:[INODE]``)::

    TABLE ::= HEADER "\\n" { LINE "\\n" }
    LINE  ::= SL ":" LOCAL REMOTE STATE QUEUES TIMER RETRANSMIT UID TIMEOUT INODE ...
    LOCAL, REMOTE ::= ADDR_HEX ":" PORT_HEX    ADDR_HEX: 8 (v4) or 32 (v6) hex digits, each
                                               32-bit word in host byte order
    STATE ::= 2 HEX                            01 ESTABLISHED, 0A LISTEN, ...

CRIU restores a TCP connection on another node by binding it to its old local address and
putting its sequence numbers back (TCP repair): the address must exist there, and the peer
must still be reachable.  Both ends of a connection inside the tree move together; a peer on
the source's loopback outside the tree stays behind (the copy's connection is then reset).
A listening socket needs its port free on the target.
"""

from __future__ import annotations

import errno
import ipaddress
import os
import socket
import struct
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import psutil

from host.api import port_number, unbracketed
from host.proc import fd_links

_LISTEN = "0A"
_TIME_WAIT = "06"
#: States in which the peer has already closed its end (its FIN came): nothing of it is left to
#: reset, whether or not a socket of it still exists (an orphan in FIN-WAIT-2 belongs to no one).
_PEER_CLOSED = {"08", "09", "0B"}  # CLOSE_WAIT, LAST_ACK, CLOSING


@dataclass(frozen=True)
class TcpSocket:
    """One TCP socket of the tree: ``remote`` is ("", 0) for a listening one."""

    local: tuple[str, int]
    remote: tuple[str, int]
    listening: bool
    pid: int
    peer_closed: bool = False  # its peer has closed its end

    @property
    def name(self) -> str:
        """How a message names it: ``LOCAL -> REMOTE``, or ``LOCAL (listening)``."""
        if self.listening:
            return f"{endpoint(*self.local)} (listening)"
        return f"{endpoint(*self.local)} -> {endpoint(*self.remote)}"


def endpoint(host: str, port: int | str) -> str:
    """HOST:PORT, [V6]:PORT (``host`` bare, or bracketed as the settings write it)."""
    bare = unbracketed(host)
    return f"[{bare}]:{port}" if ":" in bare else f"{bare}:{port}"


def parse_endpoint(text: str) -> tuple[str, int]:
    """The (host, port) of HOST:PORT or [V6]:PORT; ValueError if it is neither."""
    host, sep, port = text.rpartition(":")
    host = host.removeprefix("[").removesuffix("]")
    ipaddress.ip_address(host)  # (ValueError: not an address)
    number = port_number(port)
    if not sep or number is None:
        raise ValueError(f"{text!r} is not HOST:PORT")
    return host, number


def _address(hex_addr: str) -> str:
    words = [int(hex_addr[i : i + 8], 16) for i in range(0, len(hex_addr), 8)]
    raw = b"".join(struct.pack("=I", w) for w in words)
    ip = ipaddress.ip_address(raw)
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        return str(ip.ipv4_mapped)  # (a v6 socket's view of a v4 peer: compared as v4)
    return str(ip)


def _table(pid: int | str) -> list[tuple[tuple[str, int], tuple[str, int], str, int]]:
    """(local, remote, state, inode) of every TCP socket in the network namespace of ``pid``."""
    out = []
    for name in ("tcp", "tcp6"):
        try:
            lines = Path(f"/proc/{pid}/net/{name}").read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            f = line.split()
            if len(f) < 10:
                continue
            la, lp = f[1].split(":")
            ra, rp = f[2].split(":")
            out.append(((_address(la), int(lp, 16)), (_address(ra), int(rp, 16)), f[3], int(f[9])))
    return out


def _socket_inodes(pid: int) -> set[int]:
    return {int(link[8:-1]) for _, link in fd_links(pid) if link.startswith("socket:[")}


def tree_tcp(pids: Iterable[int]) -> list[TcpSocket]:
    """Every TCP socket the processes hold (by descriptor), each once."""
    owner: dict[int, int] = {}
    tables: dict[int, list[tuple[tuple[str, int], tuple[str, int], str, int]]] = {}
    for pid in pids:
        for inode in _socket_inodes(pid):
            owner.setdefault(inode, pid)
        try:
            netns = os.stat(f"/proc/{pid}/ns/net").st_ino
        except OSError:
            continue
        if netns not in tables:
            tables[netns] = _table(pid)
    out = []
    for table in tables.values():
        for local, remote, state, inode in table:
            if inode in owner and state != _TIME_WAIT:
                listening = state == _LISTEN
                found = TcpSocket(
                    local, ("", 0) if listening else remote, listening, owner.pop(inode), state in _PEER_CLOSED
                )
                out.append(found)
    return out


def is_loopback(host: str) -> bool:
    return ipaddress.ip_address(host).is_loopback


def _unspecified(host: str) -> bool:
    return ipaddress.ip_address(host).is_unspecified


def left_behind(sockets: list[TcpSocket]) -> list[str]:
    """What cannot survive the move whatever the target: connections to a peer on this node's
    loopback that is not in the tree and has not closed its end (one sentence each)."""
    ours = {(s.local, s.remote) for s in sockets if not s.listening}
    return [
        f"the TCP connection {s.name} (PID {s.pid}) goes to a peer on this node's loopback outside the process tree, "
        "which would stay behind here and reset the copy's connection: start both ends in one tree (one "
        "`tpagent launch`) so that they move together, or close the connection before migrating"
        for s in sockets
        if not s.listening and not s.peer_closed and is_loopback(s.remote[0]) and (s.remote, s.local) not in ours
    ]


def must_check_on_target(sockets: list[TcpSocket]) -> list[TcpSocket]:
    """The sockets only the target can judge: those bound to an address that is not loopback
    (it must exist there), and listening ones (their port must be free there)."""
    return [s for s in sockets if s.listening or not (is_loopback(s.local[0]) or _unspecified(s.local[0]))]


def offered(sockets: list[TcpSocket]) -> tuple[tuple[str, str], ...]:
    """:func:`must_check_on_target`'s, as a migration offers them: (LOCAL, REMOTE) HOST:PORT each,
    REMOTE "" for a listening one."""
    return tuple(
        (endpoint(*s.local), endpoint(*s.remote) if not s.listening else "") for s in must_check_on_target(sockets)
    )


def address_exists(host: str) -> bool:
    """Whether this node has ``host``: loopback, or an address of one of its interfaces (in
    this process's network namespace, where the agent restores)."""
    ip = ipaddress.ip_address(host)
    if ip.is_loopback or ip.is_unspecified:
        return True
    ours = (a.address.partition("%")[0] for addrs in psutil.net_if_addrs().values() for a in addrs)
    return any(_same(ip, a) for a in ours)


def _same(ip: ipaddress.IPv4Address | ipaddress.IPv6Address, text: str) -> bool:
    try:
        return ipaddress.ip_address(text) == ip
    except ValueError:  # (a MAC address: AF_PACKET)
        return False


#: What :func:`bind_problem` says of a port another socket listens on.
TAKEN = "its port is taken"


def bind_problem(host: str, port: int) -> str | None:
    """Why a TCP server (SO_REUSEADDR, as gRPC's) could not listen on ``host``:``port`` here,
    as a phrase (:data:`TAKEN`, or that the host does not resolve or is none of this node's
    addresses), or None where it can bind one of the addresses ``host`` names."""
    try:
        found = socket.getaddrinfo(unbracketed(host) or None, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except (socket.gaierror, UnicodeError) as e:
        return f"{host} does not resolve here ({e.strerror if isinstance(e, socket.gaierror) else e})"
    errors: list[int] = []
    for family, kind, proto, _, address in found:
        with socket.socket(family, kind, proto) as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                s.bind(address)
            except OSError as e:
                errors.append(e.errno or 0)
                continue
        return None
    if errno.EADDRINUSE in errors:
        return TAKEN
    refused = next((e for e in reversed(errors) if e), errno.EADDRNOTAVAIL)  # (the last address's)
    if refused == errno.EADDRNOTAVAIL:
        return f"{host} is no address of this node's"
    return os.strerror(refused).lower()


def listener_on(host: str, port: int) -> str | None:
    """The address of a socket listening here that takes ``host``:``port`` (the same port on
    the same address, or either one the wildcard), or None."""
    ip = ipaddress.ip_address(host)
    for local, _, state, _ in _table("self"):
        if state != _LISTEN or local[1] != port:
            continue
        other = ipaddress.ip_address(local[0])
        if other == ip or other.is_unspecified or ip.is_unspecified:
            return endpoint(*local)
    return None


def unusable_here(node: str, connections: Iterable[tuple[str, str]]) -> list[str]:
    """What keeps ``node`` (this one) from taking each (LOCAL, REMOTE) socket; REMOTE is ""
    for a listening socket.  One sentence each; malformed entries are named as such."""
    problems = []
    for local_text, remote_text in connections:
        try:
            host, port = parse_endpoint(local_text)
            if remote_text:
                parse_endpoint(remote_text)
        except ValueError:
            problems.append(f"the source sent a TCP endpoint this agent cannot read ({local_text!r}, {remote_text!r})")
            continue
        if not address_exists(host):
            what = (
                f"TCP connection {local_text} -> {remote_text}" if remote_text else f"TCP listening socket {local_text}"
            )
            problems.append(
                f"the {what} is bound to {host}, an address {node} does not have, so it cannot be restored there: "
                "close it before migrating or pick a node that has the address (the connections of a distributed "
                "job are not moved but rebuilt, by rewiring its communicators)"
            )
            continue
        taken = listener_on(host, port) if not remote_text else None
        if taken is not None:
            problems.append(
                f"the TCP listening socket {local_text} needs port {port}, which is taken on {node} (a socket listens "
                f"on {taken} there): free the port there or pick another node"
            )
    return problems


def _unix_table(path: str) -> list[tuple[str, str]]:
    """(INODE, NAME) of each bound socket of a ``net/unix`` table::

        LINE ::= NUM REFCOUNT PROTOCOL FLAGS TYPE STATE INODE [PATH]   (PATH "@..." when abstract)

    A name is any bytes its binder chose: what is not UTF-8 is kept as backslash escapes (the
    same on every node: names compare as they are read), and one with a newline breaks into
    lines that do not parse, or are some other socket's line (no more than binding that
    socket's name would do).  OSError if unreadable."""
    lines = Path(path).read_bytes().decode(errors="backslashreplace").splitlines()[1:]
    return [(f[6], f[7]) for f in (line.split(maxsplit=7) for line in lines) if len(f) == 8]


def _unix_names(pids: Iterable[int]) -> set[str]:
    """The names the tree's bound unix sockets print in its own ``/proc/PID/net/unix``."""
    out: set[str] = set()
    for pid in pids:
        inodes = _socket_inodes(pid)
        try:
            table = _unix_table(f"/proc/{pid}/net/unix")
        except OSError:
            continue
        out.update(name for inode, name in table if inode.isdigit() and int(inode) in inodes)
    return out


def unix_bound(pids: Iterable[int]) -> list[str]:
    """The absolute paths the tree's unix sockets are bound to (a listener's file, such as each
    DataLoader worker's ``pymp-XXXX/listener-XXXX``)."""
    return sorted({os.path.normpath(n) for n in _unix_names(pids) if n.startswith("/")})


def abstract_bound(pids: Iterable[int]) -> list[str]:
    """The abstract names (``@NAME``, a NUL inside printed as "@") the tree's unix sockets are
    bound to.  They belong to a network namespace, not to a file: CRIU binds each again, and
    cannot where a process of the target's namespace holds it.  (A CUDA process holds one named
    after its PID namespace and PID, @cuda-uvmfd-NSINO-PID@: ranks of two nodes, moved to one,
    may hold the same name.)"""
    return sorted(n for n in _unix_names(pids) if n.startswith("@"))


def abstract_taken(names: Iterable[str]) -> list[str]:
    """Those of ``names`` a unix socket of this process's network namespace is bound to."""
    wanted = set(names)
    if not wanted:
        return []
    try:
        bound = {name for _, name in _unix_table("/proc/self/net/unix")}
    except OSError:
        return []
    return sorted(wanted & bound)
