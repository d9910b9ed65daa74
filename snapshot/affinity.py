"""The CPUs each thread was bound to, which CRIU neither dumps nor restores (its pull requests
1298, 1969 and 2014 for it were never merged): without this a restored copy's threads run on
whatever CPUs CRIU's restorer had, every binding lost (Slurm's ``--cpu-bind``, ``taskset``,
``numactl``, a launcher's NUMA binding, a DataLoader worker pinned to its cores).

The post-dump hook notes, while the tree is frozen, each thread bound to fewer CPUs than its
control group lets it use (:func:`bound`): a thread that may use them all is not bound, and on
another node gets that node's.  After ``criu restore`` each is bound again (:func:`rebind`) to
those of its CPUs the node has; one whose CPUs it has none of runs unbound, which the log says.
"""

from __future__ import annotations

import logging
import os
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from host import proc

log = logging.getLogger(__name__)

#: The kernel's CPU list format (``0-3,8``), as /proc and /sys write it.
_LIST = re.compile(r"[0-9]{1,5}(-[0-9]{1,5})?(,[0-9]{1,5}(-[0-9]{1,5})?)*")
_MAX_CPU = 1 << 16


@dataclass(frozen=True)
class Binding:
    """A thread bound to some CPUs: its process (as dumped), its ID as its own PID namespace
    names it (CRIU gives it back under that ID) and the CPUs, in the kernel's list format."""

    pid: int
    tid: int
    cpus: str


def parse(cpus: str) -> set[int]:
    """The CPUs of a list such as ``0-3,8``; ValueError for anything else."""
    if not _LIST.fullmatch(cpus.strip()):
        raise ValueError(f"not a list of CPUs: {cpus!r}")
    spans = []
    for part in cpus.strip().split(","):
        low, _, high = part.partition("-")
        first = int(low)
        last = int(high or low)
        if not first <= last < _MAX_CPU:
            raise ValueError(f"not a list of CPUs: {cpus!r}")
        spans.append((first, last))
    out: set[int] = set()
    end = -1  # (each CPU added once: a list naming 0-65535 thousands of times took an hour)
    for first, last in sorted(spans):
        out.update(range(max(first, end + 1), last + 1))
        end = max(end, last)
    return out


def _node_cpus() -> set[int]:
    return parse(Path("/sys/devices/system/cpu/online").read_text())


def _allowed(pid: int) -> set[int]:
    """The CPUs ``pid``'s control group lets it use (its cpuset), else the node's online ones."""
    for _, path in proc.cgroup_files(pid, "cpuset.cpus.effective", "cpuset", "cpuset.effective_cpus"):
        try:
            return parse(path.read_text())
        except (OSError, ValueError):
            continue
    return _node_cpus()


def bound(pids: Sequence[int]) -> list[Binding]:
    """Each thread of these processes bound to fewer CPUs than its control group allows."""
    found = []
    for pid in pids:
        try:
            allowed = _allowed(pid)
            for tid in (pid, *proc.thread_ids(pid)):
                status = Path(f"/proc/{pid}/task/{tid}/status").read_text(errors="surrogateescape").splitlines()
                cpus = next(ln.split(":", 1)[1].strip() for ln in status if ln.startswith("Cpus_allowed_list:"))
                if parse(cpus) < allowed:
                    found.append(Binding(pid, proc.own_tid(pid, tid), cpus))
        except (OSError, ValueError, StopIteration, IndexError):  # (a thread that ended as it was looked at)
            continue
    return found


def _threads(pid: int) -> dict[int, int]:
    """Each thread of ``pid``: its ID in its own PID namespace -> its ID here."""
    return {proc.own_tid(pid, int(name)): int(name) for name in os.listdir(f"/proc/{pid}/task")}


def rebind(bindings: Sequence[Binding], mapping: Mapping[int, int]) -> None:
    """Bind each restored thread again (``mapping``: PID as dumped -> the copy's PID here) to
    those of its CPUs this node has; the log says where there were none, or the kernel refused."""
    node = _node_cpus()
    threads: dict[int, dict[int, int]] = {}
    for b in bindings:
        pid = mapping.get(b.pid)
        try:
            here = threads.setdefault(pid, _threads(pid)) if pid is not None else {}
            tid = here[b.tid]
            cpus = parse(b.cpus) & node
            if not cpus:
                log.warning(
                    "thread %d of PID %d was bound to CPUs %s, none of which this node has: unbound", tid, pid, b.cpus
                )
                continue
            os.sched_setaffinity(tid, cpus)
        except (OSError, KeyError, ValueError) as e:
            log.warning("thread %d of PID %s could not be bound to CPUs %s again: %s", b.tid, pid, b.cpus, e)
