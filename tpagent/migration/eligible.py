"""What this node may migrate: GPU processes (as NVML sees them), workloads started by
``tpagent launch`` (by its root-only records), and processes running a program named in
``allow_executables`` (by ``/proc/PID/exe``); never what a command line says (anyone can forge one)."""

from __future__ import annotations

import os
from pathlib import Path

import psutil

from host import criu_limits, ends, files, forked, gpus, proc, sockets
from tpagent.common.config import AgentConfig
from tpagent.migration.api import ProcessInfo, Refused, Why
from tpagent.workload import launch


def migratable(cfg: AgentConfig) -> list[ProcessInfo]:
    out = []
    gpu_pids = {pid for g in gpus.inventory() for pid in g.pids}
    allowed = {os.path.realpath(a) for a in cfg.allow_executables}
    for p in psutil.process_iter(["pid", "cmdline", "memory_info", "exe", "uids"]):
        record = launch.launched(p.pid)
        why = ""
        if p.pid in gpu_pids:
            why = "gpu"
        elif record is not None:
            why = "launched"
        elif (p.info["exe"] or "") in allowed:  # (a full path: a user's own copy named python3 is not it)
            why = "operator"
        if why and p.pid != 1:
            rss = p.info["memory_info"].rss if p.info["memory_info"] else 0
            uid = p.info["uids"].real if p.info["uids"] else 0
            cmdline = tuple(p.info["cmdline"] or ())
            owner = record.owner if record else -1
            out.append(ProcessInfo(p.pid, cmdline, rss, p.pid in gpu_pids, why, uid, owner))
    return out


def check_migratable(cfg: AgentConfig, pid: int) -> None:
    """Refused in one sentence unless ``pid`` is a process this node may migrate."""
    if pid <= 1:
        raise Refused(f"PID {pid} cannot be migrated.", Why.INVALID)
    init = proc.namespace_init(pid)  # (a process inside a launched namespace, or a thread of one)
    if init is not None:
        raise Refused(proc.inside_namespace(pid, init, "migrate"), Why.INVALID)
    if not psutil.pid_exists(pid):
        raise Refused(f"there is no process with PID {pid} on {cfg.node}.", Why.NOT_FOUND)
    if pid not in {p.pid for p in migratable(cfg)}:
        raise Refused(
            f"PID {pid} is not a migratable process on {cfg.node}: it does not use a GPU, was not started with "
            "`tpagent launch`, and runs no program named in allow_executables.",
            Why.DENIED,
        )
    why = criu_limits.limits_unreadable(proc.tree_pids(pid), f"the agent on {cfg.node}")
    if why:
        raise Refused(why, Why.PRECONDITION)


_LOCKS = {"FLOCK": "flock", "POSIX": "POSIX (fcntl)", "OFDLCK": "open-file (fcntl)"}


def stays(
    cfg: AgentConfig,
    pids: list[int],
    tcp: list[sockets.TcpSocket],
    carry: list[Path],
    cuda_pids: list[int],
    communicators_rebuilt: bool,
) -> list[str]:
    """What no target can take of the tree, one sentence each: what CRIU cannot checkpoint, a
    loopback peer outside the tree, a node-local file (``carry``) shared with one, a lock on a file
    the target sees.  ``communicators_rebuilt`` (a rank's): its TCP connections are not judged."""
    return [
        *ends.unmovable(pids, communicators_rebuilt, cfg.ghost_limit_mib << 20),
        *ends.shared_maps(pids, carry),
        *forked.refusals(forked.find(pids, cuda_pids), cuda_pids),
        *sockets.left_behind(tcp),
        *(
            f"PID {pid} holds a {_LOCKS.get(kind, kind)} lock on {path}, which the target sees as well (a shared "
            "path): its copy would wait for ever behind the frozen original's lock; release it before migrating"
            for pid, kind, path in proc.file_locks(pids)
            if files.under(path, cfg.shared_paths)
        ),
    ]


def warnings(pids: list[int]) -> list[str]:
    """What a move of the tree would not bring back as it was, one sentence each (said, not
    refused: the move still works): :func:`host.criu_limits.restore_warnings`, and an open file
    shared at one offset with a process outside it (:func:`host.ends.shared_offsets`)."""
    return [*criu_limits.restore_warnings(pids), *ends.shared_offsets(pids)]
