"""The job's store served by rank 0's stand-in (tpagent/jobs/standin.py), a real server joined by
a real rank through the runtime: rank 0's ``env://`` rendezvous becomes a client of it, where
without the runtime it would try to serve the port itself.  (Which ranks it applies to:
tests/unit/test_store_hosting.py.)"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import textwrap
from datetime import timedelta
from pathlib import Path

import pytest

from tpagent.jobs import standin
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
    print(json.dumps({"serves": store.hosted_here(default)}))
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
