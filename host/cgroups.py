"""The control groups of a process, as files a root process can join: a user's rank started by
the agent joins its stand-in's groups, so that the scheduler's limits (memory, devices) and its
end of a job (``proctrack/cgroup`` kills what is in the job's groups) reach the rank too."""

from __future__ import annotations

from pathlib import Path

from host import files

#: Mount options of a cgroup v1 hierarchy that are not controllers.
_NOT_CONTROLLERS = frozenset({"rw", "ro", "nosuid", "nodev", "noexec", "relatime", "noatime", "clone_children"})


def _mounts(mountinfo: str) -> tuple[dict[frozenset[str], tuple[str, str]], tuple[str, str] | None]:
    """v1 hierarchies (controllers -> mount point, its root) and the v2 one (mount point, root)."""
    v1: dict[frozenset[str], tuple[str, str]] = {}
    v2 = None
    for line in mountinfo.splitlines():
        fields, _, rest = line.partition(" - ")
        parts = fields.split()
        after = rest.split()
        if len(parts) < 5 or len(after) < 3:
            continue
        root = parts[3]
        point = parts[4]
        if after[0] == "cgroup2" and v2 is None:
            v2 = (point, root)
        elif after[0] == "cgroup":
            v1.setdefault(frozenset(after[2].split(",")) - _NOT_CONTROLLERS, (point, root))
    return v1, v2


def procs_files(cgroup: str, mountinfo: str) -> tuple[str, ...]:
    """The ``cgroup.procs`` files of the groups ``cgroup`` (a /proc/PID/cgroup) lists, through the
    hierarchies ``mountinfo`` (/proc/self/mountinfo) mounts; the root groups and hierarchies not
    mounted here are left out."""
    v1, v2 = _mounts(mountinfo)
    out = []
    for line in cgroup.splitlines():
        _, controllers, path = (line.split(":", 2) + ["", ""])[:3]
        mount = v2 if controllers == "" else v1.get(frozenset(controllers.split(",")))
        if mount is None or path in ("", "/"):
            continue
        point, root = mount
        if root != "/" and not files.under(path, (root,)):
            continue
        rel = path[len(root) :] if root != "/" else path
        if ".." in rel.split("/"):
            continue
        out.append(str(Path(point) / rel.lstrip("/") / "cgroup.procs"))
    return tuple(out)


def of_process(pid: int) -> tuple[str, ...]:
    """:func:`procs_files` of process ``pid``, as this process sees the hierarchies.  A group's
    name is any bytes but a newline (its owner chose it): read as the file system's names are,
    bytes of no encoding kept as they are (``surrogateescape``)."""
    cgroup = Path(f"/proc/{pid}/cgroup").read_text(errors="surrogateescape")
    return procs_files(cgroup, Path("/proc/self/mountinfo").read_text(errors="surrogateescape"))
