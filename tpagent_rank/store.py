"""Letting go of the job's store before a freeze, and taking it back after.

The TCPStore client never reconnects by itself, and CRIU would carry its established
connection to a node where its local address does not exist.  So before a moving rank is
frozen, every descriptor of this process connected to the store gets an unconnected socket
put in its place (``dup2``: the client keeps its descriptor number); after the restore a fresh
client of the same store (which does the store's own handshake) lends its connection to the
old descriptor the same way (its own descriptor gets an unconnected socket), and is kept,
unused, so that nothing ever closes that descriptor number.

A rank that hosts the store itself (``env://`` rank 0, where no launcher hosts it) cannot move:
its peers reach the store at this node's address.  Its stand-in hosts the store instead, outside
the rank (:data:`HOSTED`, see ``tpagent/jobs/standin.py``), and :func:`patch_rendezvous` makes the
rank a client of it.  Where the node serving a job's store was lost, its recovery serves it anew
elsewhere (:data:`~tpagent_rank.protocol.STORE_VARIABLE`), and every rendezvous is made a client
of that one.
"""

from __future__ import annotations

import hashlib
import os
import secrets
import socket
import struct
import time
from datetime import timedelta
from typing import Any

from tpagent_rank import owned

#: Set in a rank's environment by its stand-in: the port of the store it hosts on this node.
HOSTED = "TPAGENT_STORE_HOSTED"
#: The address of the store the script named, once a rendezvous was made a client of the store
#: served in its place (:data:`~tpagent_rank.protocol.STORE_VARIABLE`), as :func:`address` says it;
#: and the value the job's identity was agreed on (:func:`job_key`).
NAMED: dict[str, str] = {}


def _underlying(store: Any) -> Any:
    while hasattr(store, "underlying_store"):
        store = store.underlying_store
    return store


def _inodes() -> dict[int, int]:
    """Socket inode -> descriptor of this process."""
    return {ino: fd for fd, ino in owned.sockets().items()}


def _addr(hexaddr: str) -> str:
    ip, port = hexaddr.split(":")
    if len(ip) == 8:
        return f"{socket.inet_ntop(socket.AF_INET, struct.pack('<I', int(ip, 16)))}:{int(port, 16)}"
    raw = b"".join(struct.pack("<I", int(ip[i : i + 8], 16)) for i in range(0, 32, 8))
    return f"[{socket.inet_ntop(socket.AF_INET6, raw)}]:{int(port, 16)}"


def _sockets(state: str) -> dict[int, tuple[str, str]]:
    """Descriptor -> (local, remote address) of this process's TCP sockets in ``state`` (the
    kernel's hex code: 01 established, 0A listening)."""
    fds = _inodes()
    out = {}
    for table in ("/proc/self/net/tcp", "/proc/self/net/tcp6"):
        try:
            with open(table) as t:
                lines = t.read().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            f = line.split()
            if f[3] == state and int(f[9]) in fds:
                out[fds[int(f[9])]] = (_addr(f[1]), _addr(f[2]))
    return out


def connections() -> dict[int, str]:
    """Descriptor -> remote address of this process's established TCP connections."""
    return {fd: remote for fd, (_local, remote) in _sockets("01").items()}


def held(store: Any) -> list[int]:
    """The descriptors of this process's sockets of ``store``: its connections to it and, if it
    serves it, its listening socket and the connections it accepted."""
    base = _underlying(store)
    port = getattr(base, "port", None)
    if not isinstance(port, int):
        return []
    ips = _ips(str(getattr(base, "host", "")))
    sockets = {**_sockets("01"), **_sockets("0A")}
    return [fd for fd, (local, remote) in sockets.items() if _reaches(remote, ips, port) or local.endswith(f":{port}")]


def _reaches(remote: str, ips: set[str], port: int) -> bool:
    """Whether the remote address ``remote`` (``IP:PORT``, ``[IPv6]:PORT``) is one of ``ips`` at ``port``."""
    ip, _, p = remote.rpartition(":")
    return int(p) == port and ip.strip("[]").removeprefix("::ffff:") in ips  # (an IPv4 peer of an IPv6 socket)


def hosted_here(store: Any) -> str | None:
    """``HOST:PORT`` of the job's store if this process serves it (listens on its port), else None."""
    base = _underlying(store)
    port = getattr(base, "port", None)
    if not isinstance(port, int):
        return None
    for local, _remote in _sockets("0A").values():
        if local.rpartition(":")[2] == str(port):
            return f"{base.host}:{port}"
    return None


def loopback(store: Any) -> str | None:
    """``HOST:PORT`` of the job's store if it is reached at a loopback address (not from another node)."""
    import ipaddress

    base = _underlying(store)
    ips = _ips(str(getattr(base, "host", "")))
    try:
        if ips and all(ipaddress.ip_address(ip.split("%")[0]).is_loopback for ip in ips):
            return f"{base.host}:{getattr(base, 'port', '?')}"
    except ValueError:
        return None
    return None


def patch_rendezvous(module: Any) -> None:
    """Where the stand-in hosts the store (:data:`HOSTED`), the rank that would have served it
    on that port (``env://``, ``tcp://`` rank 0) is made a client of it, as torchrun's ranks are
    of its agent's store; where the store is served elsewhere since its node was lost
    (:data:`~tpagent_rank.protocol.STORE_VARIABLE`), every rank is made a client of that one.
    Nothing else changes."""
    from tpagent_rank.protocol import STORE_VARIABLE

    port = os.environ.get(HOSTED, "")
    moved = os.environ.get(STORE_VARIABLE, "").rpartition(":")
    create = getattr(module, "_create_c10d_store", None)
    if not (port.isdigit() or moved[2].isdigit()) or create is None or getattr(create, "__tpagent__", False):
        return

    def _create_c10d_store(
        hostname: str, port_: int, rank: int, world_size: int, timeout: Any, *args: Any, **kwargs: Any
    ) -> Any:
        if moved[2].isdigit():
            host = moved[0].strip("[]")
            NAMED["address"] = f"{hostname}:{port_} (TCPStore)"  # (as a client of the named store says it)
            NAMED["served"] = f"{host}:{moved[2]}"
            return module.TCPStore(
                host_name=host, port=int(moved[2]), world_size=world_size, is_master=False, timeout=timeout
            )
        if int(port_) != int(port):
            return create(hostname, port_, rank, world_size, timeout, *args, **kwargs)
        return module.TCPStore(host_name=hostname, port=port_, world_size=world_size, is_master=False, timeout=timeout)

    _create_c10d_store.__tpagent__ = True  # type: ignore[attr-defined]
    module._create_c10d_store = _create_c10d_store


def _ips(host: str) -> set[str]:
    try:
        return {str(a[4][0]) for a in socket.getaddrinfo(host, None)}
    except OSError:
        return {host}


def host(store: Any) -> str:
    """The host name or address the job's store is reached at."""
    return str(getattr(_underlying(store), "host", ""))


def job_key(store: Any) -> str:
    """The job's identity: the value at JOB_KEY, which the first rank to ask puts there (a fresh
    random one), with the address of the store it is kept in, as this rank reaches it (its own
    word, which a store's writer cannot change): every rank of the job has the same, and no other
    job, even one whose store was given this one's value, has it.  Whatever the store raises."""
    from tpagent_rank.protocol import JOB_KEY

    # (in the store itself, not under a prefix the script's group or a launcher put over it: a
    # store served anew holds the value there, :mod:`tpagent.jobs.storeserver`)
    agreed = bytes(_underlying(store).compare_set(JOB_KEY, "", secrets.token_hex(16))).decode()
    NAMED["agreed"] = agreed
    named = NAMED.get("address", "") if served_elsewhere(store) else ""
    return hashlib.sha256(f"{agreed}\0{named or address(store)}".encode()).hexdigest()[:32]


def served_elsewhere(store: Any) -> bool:
    """Whether ``store`` is the one served in place of the store the script named."""
    return bool(NAMED.get("served")) and tcp_address(store) == NAMED["served"]


def tcp_address(store: Any) -> str:
    """``HOST:PORT`` at which ``store`` is reached, if it is a TCP store ("" otherwise)."""
    base = _underlying(store)
    port = getattr(base, "port", None)
    return f"{base.host}:{port}" if isinstance(port, int) and type(base).__name__ == "TCPStore" else ""


def reachable(host_port: str, timeout: float) -> bool:
    """Whether a TCP connection to ``host_port`` is accepted within ``timeout`` seconds."""
    host, _, port = host_port.rpartition(":")
    try:
        socket.create_connection((host.strip("[]"), int(port)), timeout=timeout).close()
    except (OSError, ValueError):
        return False
    return True


def address(store: Any) -> str:
    base = _underlying(store)
    return f"{getattr(base, 'host', '?')}:{getattr(base, 'port', '?')} ({type(base).__name__})"


def detach(store: Any) -> list[tuple[int, str, int]]:
    """Put an unconnected socket in place of every connection to ``store``; what was detached."""
    base = _underlying(store)
    host = str(base.host)
    port = int(base.port)
    ips = _ips(host)
    out = []
    for fd, remote in connections().items():
        if _reaches(remote, ips, port):
            family = socket.AF_INET6 if remote.startswith("[") else socket.AF_INET
            with socket.socket(family, socket.SOCK_STREAM) as placeholder:
                os.dup2(placeholder.fileno(), fd)
            out.append((fd, host, port))
    return out


#: A store that refuses every connection this long has ended (its launcher did): said at once,
#: where a TCPStore client would try again for its whole timeout.
REFUSED_FOR = 3.0


def _refuses(host: str, port: int, timeout: float) -> bool:
    """Whether the store at ``host``:``port`` refuses connections for :data:`REFUSED_FOR`
    seconds on end (anything else, an answer or silence, is left to the client's own wait)."""
    deadline = time.monotonic() + min(REFUSED_FOR, timeout)
    while True:
        try:
            socket.create_connection((host, port), timeout=min(REFUSED_FOR, timeout)).close()
            return False
        except ConnectionRefusedError:
            if time.monotonic() > deadline:
                return True
            time.sleep(0.2)
        except OSError:
            return False


def reattach(detached: list[tuple[int, str, int]], timeout: float = 60.0) -> list[Any]:
    """Connect each detached descriptor to its store again; the clients to keep alive."""
    from torch._C import _distributed_c10d as c10d

    kept = []
    for fd, host, port in detached:
        if _refuses(host, port, timeout):
            raise RuntimeError(
                f"the job's store at {host}:{port} refuses connections: it has ended (with its launcher?)"
            )
        before = set(connections())
        client = c10d.TCPStore(host, port, is_master=False, timeout=timedelta(seconds=timeout), wait_for_workers=False)
        new = [f for f, remote in connections().items() if f not in before and remote.endswith(f":{port}")]
        if len(new) != 1:
            raise RuntimeError(f"the store at {host}:{port} was reached, but its connection could not be told apart")
        os.dup2(new[0], fd)
        # The new client's own descriptor lets go of the connection too (one holder of it: a
        # later detach finds it once); the client is kept, never used, so nothing closes that number.
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as placeholder:
            os.dup2(placeholder.fileno(), new[0])
        kept.append(client)
    return kept
