"""`tpagent orchestrator` on the host's end of a test cluster's bridge (where every node reaches
it), with its own certificate of the cluster's CA, and the commands that ask it."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

from support.agents import free_port
from support.certs import node_certs
from support.cluster import Cluster
from support.helpers import ROOT, wait_until


class Orchestrator:
    def __init__(self, c: Cluster, tmp: Path, env: dict[str, str] | None = None, **settings: Any) -> None:
        """``env``: variables it runs with beside this process's (SLURM_CONF)."""
        self.c = c
        self.env = {**os.environ, **(env or {})}
        self.work = tmp / "orchestrator"
        self.work.mkdir()
        self.tls = node_certs(tmp, "orchestrator", c.bridge_addr)
        self.port = free_port()
        self.address = f"{c.bridge_addr}:{self.port}"
        self.settings = {
            "listen": self.address,
            "node": "orchestrator",
            "secret_file": str(c.secret),
            "tls_dir": str(self.tls),
            "state": str(self.work / "db" / "state.db"),
            "metrics_listen": "",
            "report_period": 0.5,
            "unreachable_after": 10.0,
            **settings,
        }
        self.proc: subprocess.Popen[bytes] | None = None

    def config(self) -> Path:
        lines = [f"{k} = {json.dumps(v)}" for k, v in self.settings.items()]  # (TOML takes these as JSON writes them)
        path = self.work / "orchestrator.toml"
        path.write_text("\n".join(lines) + "\n")
        return path

    def start(self) -> None:
        cmd = [sys.executable, "-m", "cli.main", "orchestrator", "--config", str(self.config())]
        with open(self.work / "orchestrator.log", "ab") as log:
            self.proc = subprocess.Popen(cmd, cwd=ROOT, stdout=log, stderr=log, stdin=subprocess.DEVNULL, env=self.env)
        wait_until(lambda: self._up(), "the orchestrator to serve", 60)

    def _up(self) -> bool:
        assert self.proc is not None
        if self.proc.poll() is not None:
            raise AssertionError(f"the orchestrator exited: {self.log()[-3000:]}")
        return self.cli("cluster", "--json").returncode == 0

    def log(self) -> str:
        return (self.work / "orchestrator.log").read_text(errors="replace")

    def kill(self, sig: signal.Signals = signal.SIGKILL) -> None:
        if self.proc is not None and self.proc.poll() is None:
            os.kill(self.proc.pid, sig)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()  # (never left running, nor its Popen to the garbage collector)
                self.proc.wait()
                raise AssertionError(f"the orchestrator did not stop on {sig.name}: {self.log()[-3000:]}") from None

    def cli(self, *args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
        env = {**self.c.cli_env(), "TPAGENT_ORCHESTRATOR": self.address}
        cmd = [sys.executable, "-m", "cli.main", *args]
        return subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)

    def ok(self, *args: str) -> str:
        out = self.cli(*args)
        assert out.returncode == 0, out.stdout + out.stderr
        return out.stdout

    def cluster(self) -> dict[str, Any]:
        return dict(json.loads(self.ok("cluster", "--json")))

    def rank_on(self, job: str, rank: int) -> str:
        """The node whose agent reports ``rank`` of ``job`` ("" if none does)."""
        found = [r["node"] for r in self.cluster()["ranks"] if r["job"] == job and r["rank"] == rank]
        return found[0] if len(found) == 1 else ""

    def wait_rank_on(self, job: str, rank: int, node: str, timeout: float = 180) -> None:
        def where() -> str:  # (what the orchestrator saw and did, to read why not)
            return f"moves: {self.cluster()['moves']}\nevents (last 40):\n" + "\n".join(
                self.ok("events").splitlines()[-40:]
            )

        wait_until(lambda: self.rank_on(job, rank) == node, f"rank {rank} to run on {node}", timeout, 0.5, where)

    def idle(self) -> bool:
        return not any(m["state"] in ("planned", "running") for m in self.cluster()["moves"])

    def close(self) -> None:
        self.kill(signal.SIGTERM)
