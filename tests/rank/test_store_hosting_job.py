"""The job's store served by rank 0's stand-in (tpagent/jobs/standin.py), a real server joined by
a real rank through the runtime: rank 0's ``env://`` rendezvous becomes a client of it, where
without the runtime it would try to serve the port itself.  (Which ranks it applies to:
tests/unit/test_store_hosting.py.)  And the store served anew once it was lost with its node
(tpagent/jobs/storeserver.py, unplanned recovery): a rank told where joins it, whatever address
its script names, and its job's identity is the one it had."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import textwrap
from datetime import timedelta
from pathlib import Path

import pytest

from tpagent.jobs import standin, storeserver
from tpagent_rank import protocol as P
from tpagent_rank.layout import write_runtime_dir

torch_distributed = pytest.importorskip("torch.distributed")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


RANK0 = textwrap.dedent(
    """
    import json, torch.distributed as dist
    dist.init_process_group("gloo")
    from tpagent_rank import store
    default = dist.distributed_c10d._get_default_store()
    store._underlying(default).set("from-rank-0", "hello")
    key = store.job_key(default)
    print(json.dumps({"serves": store.hosted_here(default), "key": key, "agreed": store.NAMED["agreed"]}))
    dist.destroy_process_group()
    """
)


def _rank0(tmp_path: Path, port: int, **env: str) -> subprocess.CompletedProcess[str]:
    runtime = tmp_path / "runtime"
    if not runtime.exists():
        runtime.mkdir()
        write_runtime_dir(runtime)
    base = {k: v for k, v in os.environ.items() if not k.startswith("TPAGENT_")}
    return subprocess.run(
        [sys.executable, "-c", RANK0],
        env={
            **base,
            "PYTHONPATH": os.pathsep.join(filter(None, [str(runtime), base.get("PYTHONPATH")])),
            "RANK": "0",
            "WORLD_SIZE": "1",
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port),
            "USE_LIBUV": "0",
            "TPAGENT_RANK_SOCKET": f"tpagent-test-{os.getpid()}-none",
            **env,
        },
        capture_output=True,
        text=True,
        timeout=120,
        cwd=tmp_path,
    )


def test_rank_0_joins_the_store_its_stand_in_serves(tmp_path: Path) -> None:
    port = _free_port()
    env = {**os.environ, "RANK": "0", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
    server, why = standin.host_store([sys.executable, "train.py"], env)
    assert server is not None, why
    try:
        # Without the word from its stand-in, rank 0 would serve the port itself: it is taken.
        alone = _rank0(tmp_path, port)
        assert alone.returncode != 0 and "address already in use" in alone.stderr.lower(), alone.stderr[-2000:]
        joined = _rank0(tmp_path, port, TPAGENT_STORE_HOSTED=str(port))
        assert joined.returncode == 0, joined.stderr[-3000:]
        assert '"serves": null' in joined.stdout, "rank 0 serves the store although its stand-in does"
        client = torch_distributed.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=10))
        assert client.get("from-rank-0") == b"hello"  # (the rank wrote into the stand-in's store)
    finally:
        standin.stop_store(server)


def test_a_store_served_anew_is_joined_whatever_address_the_script_names_and_the_jobs_identity_stays(
    tmp_path: Path,
) -> None:
    port = _free_port()
    env = {**os.environ, "RANK": "0", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
    server, why = standin.host_store([sys.executable, "train.py"], env)
    assert server is not None, why
    try:
        before = _rank0(tmp_path, port, TPAGENT_STORE_HOSTED=str(port))
        assert before.returncode == 0, before.stderr[-3000:]
    finally:
        standin.stop_store(server)  # (lost with its node)
    said = json.loads(before.stdout.splitlines()[-1])
    spec = P.Join(
        cmd=(sys.executable, "train.py"),
        env=tuple(f"{k}={v}" for k, v in os.environ.items()),
        cwd=str(tmp_path),
        umask=0o022,
        uid=os.getuid(),
        gid=os.getgid(),
        groups=(),
        stdout="",
        stderr="",
    )
    address, end = storeserver.serve_anew("j", spec, "127.0.0.1", said["agreed"], lambda: True)
    try:
        assert address != f"127.0.0.1:{port}"
        lost = _rank0(tmp_path, port)  # (as the script names it: it would serve the port itself, a new store)
        assert lost.returncode == 0, lost.stderr[-3000:]
        assert json.loads(lost.stdout.splitlines()[-1])["key"] != said["key"]
        after = _rank0(tmp_path, port, **{P.STORE_VARIABLE: address})
        assert after.returncode == 0, after.stderr[-3000:]
        now = json.loads(after.stdout.splitlines()[-1])
        assert now["key"] == said["key"] and now["agreed"] == said["agreed"], (now, said)
        host, _, served = address.rpartition(":")
        client = torch_distributed.TCPStore(host, int(served), is_master=False, timeout=timedelta(seconds=10))
        assert client.get("from-rank-0") == b"hello"  # (it wrote into the store served anew)
    finally:
        end()
