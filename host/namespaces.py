"""A process tree's namespaces, as a checkpoint must take them: a PID namespace of its own (a
`tpagent launch` workload's), a mount namespace other than the node's (CRIU rebuilds it), and
namespaces a process of the tree has apart from its root's, which CRIU cannot restore."""

from __future__ import annotations

import os
from collections.abc import Sequence

import psutil

from host.api import UsageError
from host.proc import ns_pids, pid_namespace


def own_pid_namespace(target: psutil.Process) -> bool:
    """True if ``target`` is the init of a PID namespace of its own (a `tpagent launch` workload's);
    UsageError if it lives inside one, or a process of its tree has started one (give its init)."""
    mine = pid_namespace(os.getpid())
    if pid_namespace(target.pid) == mine:
        for child in target.children(recursive=True):
            if pid_namespace(child.pid) != mine:
                raise UsageError(
                    f"PID {target.pid} has started a PID namespace whose init is PID {child.pid}; "
                    f"checkpoint the namespace by giving PID {child.pid}."
                )
        return False
    if ns_pids(target.pid)[-1] != 1:
        init = next((p.pid for p in target.parents() if ns_pids(p.pid)[-1] == 1), None)
        raise UsageError(
            f"PID {target.pid} lives inside a PID namespace; checkpoint the whole namespace "
            f"by giving the PID of its init{f' ({init})' if init else ''}."
        )
    return True


#: The namespaces a process of a tree may not have apart from its root's: CRIU refuses a nested
#: UTS, IPC or cgroup namespace, and restores no child into a network namespace of its own (nor into
#: a mount namespace of its own, but inside a PID namespace of the tree's: a `tpagent launch` workload's).
_NESTED = {"net": "network", "uts": "UTS", "ipc": "IPC", "cgroup": "cgroup"}


def own_mounts(pids: Sequence[int], launched: bool) -> bool:
    """Whether the tree ``pids`` (its root first; ``launched``: the init of a PID namespace of its
    own) has a mount namespace other than this process's (`unshare -m`, a container's, `tpagent
    launch`'s): CRIU then rebuilds it, its mounts bound back from the node's same paths.
    UsageError where a process of it has a namespace apart from the root's (:data:`_NESTED`)."""
    nested = _NESTED if launched else {**_NESTED, "mnt": "mount"}
    root = {kind: os.readlink(f"/proc/{pids[0]}/ns/{kind}") for kind in nested}
    for pid in pids[1:]:
        if kind := next((k for k in nested if os.readlink(f"/proc/{pid}/ns/{k}") != root[k]), None):
            raise UsageError(
                f"PID {pid} has a {nested[kind]} namespace of its own, apart from its tree's root's (PID {pids[0]}), "
                "which CRIU cannot checkpoint and restore; checkpoint that process alone (or start it with "
                "`tpagent launch`); nothing was done."
            )
    return launched or root["mnt"] != os.readlink("/proc/self/ns/mnt")
