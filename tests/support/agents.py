"""Agents served in the test's own process, on loopback (no network namespaces)."""

from __future__ import annotations

import os
import random
import socket
import threading
import uuid
from pathlib import Path

from support.certs import node_certs
from tpagent.common.config import AgentConfig
from tpagent.daemon.node import Node
from tpagent.daemon.serve import context, serve


def free_port() -> int:
    """A port free now on 127.0.0.1, below the kernel's ephemeral range: one from that range, once
    let go, may become any connection's own port before the server it is for binds it (CI saw a
    metrics server refused so)."""
    low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    for _ in range(200):
        port = random.randrange(10000, low)
        if 29000 <= port < 30000:  # (torchrun's and the jobs' stores, at their fixed ports)
            continue
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise AssertionError(f"no free port between 10000 and {low} on 127.0.0.1")


def agent_config(tmp: Path, name: str, **kw: object) -> AgentConfig:
    """A node's configuration: the cluster secret in ``tmp/secret``, its certificate from ``tmp/ca``."""
    secret = tmp / "secret"
    if not secret.exists():
        secret.write_text(os.urandom(24).hex())
        secret.chmod(0o600)
    settings: dict[str, object] = {
        "metrics_listen": "",
        "health_listen": "",
        "listen": f"127.0.0.1:{free_port()}",
        "rank_socket": f"tpagent-test-{uuid.uuid4().hex[:12]}",  # (agents in one network namespace)
        **kw,
    }
    return AgentConfig(secret_file=secret, node=name, work_dir=tmp / name, tls_dir=node_certs(tmp, name), **settings)  # type: ignore[arg-type]


def serving(cfg: AgentConfig) -> threading.Event:
    """Serve ``cfg`` in a thread until the returned event is set."""
    ready = threading.Event()
    stop = threading.Event()
    threading.Thread(target=serve, args=(cfg, ready, stop), daemon=True).start()
    assert ready.wait(30)
    return stop


def node_of(cfg: AgentConfig) -> Node:
    """The agent of ``cfg`` without its gRPC server (its journal, its protocol, real peers)."""
    return Node(context(cfg))
