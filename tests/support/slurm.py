"""A real Slurm (Debian's slurm-wlm) over a test cluster's namespace nodes: a private ``munged``,
``slurmctld`` on the host's end of the bridge, and one ``slurmd`` in each node's network
namespace with a UTS namespace of its own whose hostname is the node's name (as its agent's
``node``).  The daemons are entered with ``nsenter --net`` rather than ``ip netns exec``, which
remounts /sys and so hides the cgroup file systems slurmd needs.  Every file is under the test's
directory; ``SLURM_CONF`` points the commands (and the orchestrator) at it."""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import tempfile
from pathlib import Path
from typing import Any

from support.agents import free_port
from support.cluster import Cluster
from support.helpers import wait_until
from support.users import as_user

DAEMONS = ("munged", "slurmctld", "slurmd")


def have_slurm() -> bool:
    return all(shutil.which(d) or Path(f"/usr/sbin/{d}").exists() for d in DAEMONS)


class Slurm:
    def __init__(self, c: Cluster, partitions: dict[str, list[str]]) -> None:
        """``partitions``: name -> the cluster's nodes (by their short names) in it; the first is the default."""
        self.c = c
        self.members = [c.nodes[m] for m in dict.fromkeys(m for ms in partitions.values() for m in ms)]
        # (in /tmp: users' sbatch and srun read slurm.conf and reach munge's socket)
        self.dir = Path(tempfile.mkdtemp(prefix="tpagent-slurm-", dir="/tmp"))
        self.dir.chmod(0o755)
        self.conf = self.dir / "slurm.conf"
        self.procs: list[subprocess.Popen[bytes]] = []
        self.ctld: subprocess.Popen[bytes] | None = None
        key = self.dir / "munge.key"
        key.write_bytes(os.urandom(1024))
        key.chmod(0o600)
        self.socket = self.dir / "munge.sock"
        self._start(
            "munged",
            "/usr/sbin/munged",
            "-F",
            "-f",
            f"--socket={self.socket}",
            f"--key-file={key}",
            f"--log-file={self.dir / 'munged.log'}",
            f"--pid-file={self.dir / 'munged.pid'}",
            f"--seed-file={self.dir / 'munged.seed'}",
        )
        wait_until(self.socket.exists, "munged to listen", 30)
        self.ctld_port = free_port()
        self._write_conf(partitions)
        self.start_ctld()
        for node in self.members:
            (self.dir / f"spool-{node.name}").mkdir()
            boot = f"hostname {node.name} && exec /usr/sbin/slurmd -D -f {self.conf}"
            self._start(
                f"slurmd-{node.name}", "nsenter", f"--net=/run/netns/{node.name}", "unshare", "--uts", "sh", "-c", boot
            )
        wait_until(lambda: all(n["state"] == "idle" for n in self.nodes().values()), "every slurmd to register", 60)

    def _write_conf(self, partitions: dict[str, list[str]]) -> None:
        d = self.dir
        lines = [
            "ClusterName=tptest",
            f"SlurmctldHost={socket.gethostname()}({self.c.bridge_addr})",
            f"SlurmctldPort={self.ctld_port}",
            f"SlurmdPort={free_port()}",
            "AuthType=auth/munge",
            "CryptoType=crypto/munge",
            # (a credential lives 30 s, not 120: a requeued job may start again that much sooner)
            f"AuthInfo=socket={self.socket},cred_expire=30",
            "SlurmUser=root",
            "SlurmdUser=root",
            f"StateSaveLocation={d / 'state'}",
            f"SlurmdSpoolDir={d / 'spool-%n'}",
            f"SlurmctldPidFile={d / 'slurmctld.pid'}",
            f"SlurmdPidFile={d / 'slurmd-%n.pid'}",
            f"SlurmctldLogFile={d / 'slurmctld.log'}",
            f"SlurmdLogFile={d / 'slurmd-%n.log'}",
            "ProctrackType=proctrack/linuxproc",
            "TaskPlugin=task/none",
            "JobAcctGatherType=jobacct_gather/none",
            "AccountingStorageType=accounting_storage/none",
            "SchedulerType=sched/backfill",
            "SelectType=select/cons_tres",
            "SelectTypeParameters=CR_Core",
            "PriorityType=priority/basic",
            "MpiDefault=none",
            "ReturnToService=2",
            "SlurmdTimeout=300",
            "InactiveLimit=0",
            "KillWait=5",
            "MessageTimeout=5",
        ]
        for node in self.members:
            lines.append(f"NodeName={node.name} NodeAddr={node.addr} CPUs=2 RealMemory=1000 State=UNKNOWN")
        for i, (name, members) in enumerate(partitions.items()):
            nodes = ",".join(self.c.nodes[m].name for m in members)
            lines.append(f"PartitionName={name} Nodes={nodes} Default={'YES' if i == 0 else 'NO'} MaxTime=INFINITE")
        (d / "state").mkdir(exist_ok=True, mode=0o700)
        self.conf.write_text("\n".join(lines) + "\n")
        self.conf.chmod(0o644)

    def _start(self, log: str, *cmd: str) -> None:
        with open(self.dir / f"{log}.out", "ab") as out:
            self.procs.append(
                subprocess.Popen(cmd, stdout=out, stderr=out, stdin=subprocess.DEVNULL, env=self.env(os.environ))
            )

    def env(self, base: Any = None) -> dict[str, str]:
        return {**(base if base is not None else os.environ), "SLURM_CONF": str(self.conf)}

    def start_ctld(self) -> None:
        with open(self.dir / "slurmctld.out", "ab") as out:
            cmd = ["/usr/sbin/slurmctld", "-D", "-f", str(self.conf)]
            self.ctld = subprocess.Popen(cmd, stdout=out, stderr=out, stdin=subprocess.DEVNULL, env=self.env())
        wait_until(lambda: self.cmd("sinfo", check=False).returncode == 0, "slurmctld to answer", 60, 0.2)

    def stop_ctld(self) -> None:
        """slurmctld stopped as an administrator stops it: it saves its state first (one killed lost
        what it had not saved yet, such as an AdminComment written a moment before)."""
        if self.ctld is not None and self.ctld.poll() is None:
            self.ctld.terminate()
            try:
                self.ctld.wait(30)
            except subprocess.TimeoutExpired:
                self.ctld.kill()
                self.ctld.wait(30)

    def cmd(
        self, *args: str, check: bool = True, env: dict[str, str] | None = None, user: tuple[int, int] | None = None
    ) -> subprocess.CompletedProcess[str]:
        """A Slurm command (as ``user``, else root)."""
        argv = [*(as_user(user) if user else []), *args]
        out = subprocess.run(argv, env=self.env(env), capture_output=True, text=True, timeout=60)
        assert out.returncode == 0 or not check, f"{' '.join(args)}: {out.stderr}"
        return out

    def sbatch(self, *args: str, env: dict[str, str] | None = None, user: tuple[int, int] | None = None) -> str:
        return self.cmd("sbatch", "--parsable", *args, env=env, user=user).stdout.strip().split(";")[0]

    def job(self, jobid: str) -> dict[str, Any]:
        jobs = json.loads(self.cmd("squeue", "--all", "--json").stdout)["jobs"]
        found = [j for j in jobs if str(j["job_id"]) == jobid]
        return dict(found[0]) if found else {}

    def jobs(self, name: str = "") -> list[dict[str, Any]]:
        jobs = json.loads(self.cmd("squeue", "--all", "--json").stdout)["jobs"]
        return [j for j in jobs if not name or j["name"] == name]

    def nodes(self) -> dict[str, dict[str, Any]]:
        return {n["name"]: n for n in json.loads(self.cmd("sinfo", "--json").stdout)["nodes"]}

    def log(self) -> str:
        return (self.dir / "slurmctld.log").read_text(errors="replace")[-3000:]

    def where(self, job: str) -> str:
        """Where ``job`` stands, for a failure's message: its state and reason, the nodes'."""
        j = self.job(job)
        nodes = {n: f"{v['state']} {v.get('reason', '')}".strip() for n, v in self.nodes().items()}
        return f"Slurm job {job}: {j.get('job_state')} ({j.get('state_reason')}) on {j.get('nodes')}; nodes: {nodes}"

    def close(self) -> None:
        """Every daemon killed at once (what their jobs left in the nodes goes with the cluster);
        their logs kept in the cluster's directory."""
        for p in [*self.procs, *([self.ctld] if self.ctld else [])]:
            if p.poll() is None:
                p.kill()
            p.wait()
        kept = self.c.tmp / "slurm-logs"
        kept.mkdir(exist_ok=True)
        for f in [*self.dir.glob("*.log"), *self.dir.glob("*.out")]:
            shutil.copy(f, kept / f.name)
        shutil.rmtree(self.dir, ignore_errors=True)
