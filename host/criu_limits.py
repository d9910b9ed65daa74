"""What CRIU cannot checkpoint in a live tree, or cannot bring back as it was, found in its
processes' descriptors and mappings before anything is frozen (CRIU finds the first only once
the tree is frozen, in a page of its errors)."""

from __future__ import annotations

import ctypes
import fcntl
import os
import re
import resource
import stat
import struct
from collections.abc import Sequence
from contextlib import suppress

import psutil

from host import files, forked
from host.api import shown
from host.proc import CAP_SYS_RESOURCE, fd_links, fdinfo_int, has_capability, other_groups, other_users


def uncheckpointable(pids: Sequence[int]) -> list[str]:
    """One sentence for each process of the tree that holds what CRIU cannot checkpoint, found
    before anything is frozen (CRIU would find it only after): a descriptor of a kind of
    anonymous inode CRIU has no dumper for (io_uring, perf events, ...), or SysV shared memory,
    semaphores or message queues in the node's own IPC namespace (CRIU saves SysV objects only
    with an IPC namespace of the workload's, which `tpagent launch` gives it), or a POSIX
    message queue (``mq_open``: CRIU has no dumper for its filesystem), or a file on a mount
    none of the tree's mount namespaces has (opened before its process entered its namespace,
    or passed to it from another: CRIU cannot find that mount), or a memfd mapped shared and
    sealed against writes (CRIU dumps it and cannot restore it), or a pidfd of a process outside
    the tree, or a user namespace other than the node's (CRIU dumps it, and its restore fails),
    or a directory since removed as its working directory or an open one (:func:`_removed_dirs`)."""
    out = [why for why in (limits_unreadable(pids), descriptors_too_high(pids)) if why]
    node_ipc = os.readlink("/proc/self/ns/ipc")
    node_user = os.readlink("/proc/self/ns/user")
    sysv: dict[str, set[int]] | None = None  # (read once, if a process is in the node's namespace)
    mounts = _Mounts(pids)
    tree = set(pids)
    epolls: list[tuple[int, str]] = []  # (PID, fd) of each epoll instance judged, in the tree's order
    for pid in pids:
        with suppress(OSError):
            held, elsewhere = _descriptors(pid, mounts, epolls)
            for kind, fds in held.items():
                out.append(
                    f"PID {pid} uses {_ANON_NAMES.get(kind, kind)} (fd {', '.join(fds)}), which CRIU cannot checkpoint."
                )
            out += _sealed_shared(pid) + _pidfds_outside(pid, tree) + _removed_dirs(pid)
            if os.readlink(f"/proc/{pid}/ns/user") != node_user:
                out.append(
                    f"PID {pid} runs in a user namespace of its own (`unshare -U`, a rootless container), "
                    "which CRIU cannot restore; run it in the node's."
                )
            if elsewhere:
                fd, link = elsewhere[0]
                listed = ", ".join(fd for fd, _ in elsewhere)
                out.append(
                    f"PID {pid} holds {shown(link)} (fd {listed}) from a mount outside its "
                    "mount namespace (opened before it entered the namespace, or passed to it from another: "
                    "`unshare -m`, a container's runtime; or a filesystem unmounted since, `umount -l`), which "
                    "CRIU cannot find; have it open the file inside its namespace (`tpagent launch` gives it one), "
                    "or close one whose filesystem is gone."
                )
            if os.readlink(f"/proc/{pid}/ns/ipc") != node_ipc:
                continue
            sysv = _sysv_users() if sysv is None else sysv
            used = ["SysV shared memory"] if _maps_sysv(pid) else []
            used += [what for what, pids in sysv.items() if pid in pids]
            if used:
                out.append(
                    f"PID {pid} uses {' and '.join(used)} in the node's IPC namespace, which CRIU cannot "
                    "checkpoint; start the workload with `tpagent launch` (an IPC namespace of its own)."
                )
    return out


_F_GET_SEALS = 1034
#: Seals under which a memfd's shared mapping cannot be made again: CRIU's restore fails (EBUSY).
_WRITE_SEALS = 0x8 | 0x10  # F_SEAL_WRITE, F_SEAL_FUTURE_WRITE


def _removed_dirs(pid: int) -> list[str]:
    """One sentence where ``pid``'s working directory, or a directory it holds open, was removed:
    CRIU makes it again to restore it, and the restore's check (:mod:`host.reopened`) cannot tell
    that directory from one planted by its name."""
    for via in (f"/proc/{pid}/cwd", *(f"/proc/{pid}/fd/{fd}" for fd, _ in fd_links(pid))):
        with suppress(OSError):
            name = os.readlink(via)
            if stat.S_ISDIR(os.stat(via).st_mode) and files.removed(pid, via, name):
                what = "working directory" if via.endswith("/cwd") else f"open directory (fd {via.rsplit('/', 1)[1]})"
                return [
                    f"PID {pid}'s {what} was removed ({shown(name)}), which CRIU would make again by its name "
                    "to restore it; have it leave that directory (chdir), or close it."
                ]
    return []


def _sealed_shared(pid: int) -> list[str]:
    """A sentence if ``pid`` maps a memfd shared that is sealed against writes: CRIU dumps it,
    and its restore fails every time (it cannot seal it again with the mapping made)."""
    # (a memfd's name is "/memfd:NAME (deleted)"; a user's file shown so is taken by _sealed for no memfd)
    shared = [(m[0], m[5]) for m in files.mappings(pid) if m[5].startswith("/memfd:") and m[1][3] == "s"]
    for span, name in shared:
        with suppress(OSError):  # (map_files needs CAP_SYS_ADMIN: unread, no refusal)
            if _sealed(f"/proc/{pid}/map_files/{span}") & _WRITE_SEALS:
                return [
                    f"PID {pid} maps {shown(name.removesuffix(' (deleted)'))} (memfd_create) shared and sealed "
                    "against writes, which CRIU checkpoints but cannot restore; map it private, or seal it after "
                    "unmapping."
                ]
    return []


def _sealed(mapped: str) -> int:
    """The seals of the file mapped at ``mapped`` (a /proc/PID/map_files entry), if it is a plain
    file with no name left, as a memfd is: taken first without opening it (O_PATH), then, that
    very file checked, opened again through that descriptor (never a device a user mapped under
    a memfd's name, nor another file mapped there meanwhile); 0 for any other."""
    path = os.open(mapped, os.O_PATH | os.O_CLOEXEC)
    try:
        st = os.fstat(path)
        if not stat.S_ISREG(st.st_mode) or st.st_nlink:
            return 0
        fd = os.open(f"/proc/self/fd/{path}", os.O_RDONLY | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC)
    finally:
        os.close(path)
    try:
        return int(fcntl.fcntl(fd, _F_GET_SEALS))
    finally:
        os.close(fd)


def _pidfds_outside(pid: int, tree: set[int]) -> list[str]:
    """A sentence if ``pid`` holds a pidfd of a live process outside ``tree`` (CRIU refuses it,
    with the tree frozen)."""
    for fd, link in fd_links(pid):
        if link != "anon_inode:[pidfd]":
            continue
        if (fdinfo_int(pid, fd, "flags", 8) or 0) & os.O_EXCL:  # (PIDFD_THREAD: one thread's)
            return [f"PID {pid} holds a pidfd of a thread (fd {fd}, PIDFD_THREAD), which CRIU cannot checkpoint."]
        if (of := fdinfo_int(pid, fd, "Pid")) is not None and of > 0 and of not in tree:
            return [
                f"PID {pid} holds a pidfd (fd {fd}) of PID {of}, a process outside its tree, which CRIU cannot "
                "checkpoint; close it, or start that process inside the tree."
            ]
    return []


def limits_unreadable(pids: Sequence[int], who: str = "tpagent here") -> str:
    """Why CRIU could not read the resource limits of a process of ``pids`` (one of another
    user's, ``who`` lacking CAP_SYS_RESOURCE); "" where it could."""
    if has_capability(CAP_SYS_RESOURCE):
        return ""
    for pid in pids:  # (the kernel lets only a process of the very same UIDs and GIDs read them without)
        users = other_users([pid])
        groups = set() if users else other_groups([pid])
        if users or groups:
            runs = f"UID {min(users)}" if users else f"group {min(groups)}"
            return (
                f"PID {pid} runs as {runs}, and {who} lacks CAP_SYS_RESOURCE, without which CRIU cannot read the "
                "resource limits of a process of another user or group: give it that capability (a container: "
                "add SYS_RESOURCE)."
            )
    return ""


#: The descriptors CRIU needs above a process's highest as it restores it, below its limit on
#: open files rounded down to 128 (servicefd.c, choose_service_fd_base: its 17 service
#: descriptors and a pad of 16; a few more kept spare).
CRIU_FDS = 40


def descriptors_too_high(pids: Sequence[int], who: str = "tpagent here") -> str:
    """Why CRIU could not restore a process of ``pids`` here: it holds a descriptor too near the
    hard limit on open files for CRIU's own above it, and ``who`` lacks CAP_SYS_RESOURCE, without
    which CRIU cannot raise that limit (with it, CRIU raises it to fs.nr_open); "" where it could.
    (Its soft limit CRIU is run with at the hard one: :func:`snapshot.criu.Criu`.)"""
    if has_capability(CAP_SYS_RESOURCE):
        return ""
    hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
    for pid in pids:
        with suppress(OSError, ValueError):
            top = max(map(int, os.listdir(f"/proc/{pid}/fd")), default=-1)
            if top + CRIU_FDS > hard // 128 * 128:
                return (
                    f"PID {pid} holds descriptor {top}, too near this node's limit on open files (hard "
                    f"RLIMIT_NOFILE {hard}) for the {CRIU_FDS} CRIU needs above a process's highest as it restores "
                    f"it, and {who} lacks CAP_SYS_RESOURCE, without which CRIU cannot raise that limit: give it that "
                    "capability (a container: add SYS_RESOURCE), or raise its hard limit (systemd: LimitNOFILE)."
                )
    return ""


def _sysv_users() -> dict[str, set[int]]:
    """The processes the node's IPC namespace names as the last to operate on one of its SysV
    semaphores (semctl GETPID) or message queues (the last to send and to receive): such objects
    belong to the namespace, which CRIU saves only as a whole, so a tree in the node's own comes
    back without them (on this node it finds them again; on another, an ID that names nothing,
    or another's).  A PID named is kept only if its process now started before that operation
    (the kernel names an ended process's PID on, which another may have taken since)."""
    out: dict[str, set[int]] = {"SysV semaphores": set(), "SysV message queues": set()}
    for semid, nsems, when in _table("/proc/sysvipc/sem", "semid", "nsems", "otime"):
        for num in range(min(nsems, 32_000)):  # (SEMMSL: a set holds at most 32 000)
            last = _libc.semctl(semid, num, _GETPID)
            if last < 0:
                break  # (the set is gone meanwhile)
            if _started_by(last, when):
                out["SysV semaphores"].add(last)
    for sent, received, sent_at, received_at in _table("/proc/sysvipc/msg", "lspid", "lrpid", "stime", "rtime"):
        out["SysV message queues"] |= {
            p for p, when in ((sent, sent_at), (received, received_at)) if _started_by(p, when)
        }
    return out


def _started_by(pid: int, when: int) -> bool:
    """Whether process ``pid`` started by ``when`` (seconds since the epoch, as /proc/sysvipc says)."""
    try:
        return pid > 0 and psutil.Process(pid).create_time() <= when + 1  # (a second for the clocks' rounding)
    except psutil.Error:
        return False


def _table(path: str, *columns: str) -> list[tuple[int, ...]]:
    """``columns`` of each row of a /proc/sysvipc table (read by the names of its header)."""
    with suppress(OSError), open(path) as f:
        head = f.readline().split()
        at = [head.index(c) for c in columns]
        return [tuple(int(row[i]) for i in at) for row in map(str.split, f) if len(row) == len(head)]
    return []


#: Descriptors whose path is on a mount of the kernel's own, in no mount namespace, which CRIU
#: dumps by their kind (a memfd, a terminal) and not as files on a mount.
_OWN_MOUNTS = ("/memfd:", "/dev/pts/", "/dev/ptmx", "/dev/tty", "/dev/console")


def _descriptors(
    pid: int, mounts: _Mounts, epolls: list[tuple[int, str]]
) -> tuple[dict[str, list[str]], list[tuple[str, str]]]:
    """``pid``'s descriptors CRIU cannot dump: by kind (an anonymous inode's, "mqueue"), and
    (fd, path) of those on a mount none of the tree's mount namespaces has."""
    held: dict[str, list[str]] = {}
    elsewhere: list[tuple[str, str]] = []
    for fd, link in fd_links(pid):
        kind = link.removeprefix("anon_inode:")
        # An epoll instance several processes share (forked) is judged, as CRIU dumps it, in the
        # first of the tree that holds it (``epolls``): a worker that inherited it lacks what its
        # parent opened since.
        if kind == "[eventpoll]" and not any(forked.same_file(p, f, pid, fd) for p, f in epolls):
            epolls.append((pid, fd))
            if _watches_closed(pid, fd):
                held.setdefault(_STALE_EPOLL, []).append(fd)
        if kind != link:
            if kind not in CRIU_ANON_INODES:
                held.setdefault(kind, []).append(fd)
            continue
        if link.startswith("pipe:") and (fdinfo_int(pid, fd, "flags", 8) or 0) & os.O_DIRECT:
            held.setdefault(_PACKET_PIPE, []).append(fd)
        if _MQUEUE_NAME.fullmatch(link) and _filesystem(f"/proc/{pid}/fd/{fd}") == _MQUEUE_MAGIC:
            held.setdefault("mqueue", []).append(fd)  # (opened with mq_open: the namespace's own mount)
        elif link.startswith("/") and not link.startswith(_OWN_MOUNTS):
            mnt = fdinfo_int(pid, fd, "mnt_id")
            if mnt is None:
                continue  # (a descriptor closed since)
            fs = mounts.type_of(mnt)
            if fs == "mqueue":  # (opened under a mount of the queues' filesystem, /dev/mqueue)
                held.setdefault("mqueue", []).append(fd)
            elif fs is None and mounts.types:  # (none known: unread, no refusal)
                elsewhere.append((fd, link))
    return held, elsewhere


def _watches_closed(pid: int, fd: str) -> bool:
    """Whether the epoll instance ``fd`` of ``pid`` watches a descriptor it no longer has, or has
    as another file than the one watched (by its inode, where the kernel shows it: 5.14 on): the
    file another process still holds, so the kernel keeps the watch, and CRIU finds no file to
    dump it with."""
    try:
        with open(f"/proc/{pid}/fdinfo/{fd}") as f:
            watched = [(m[1], int(m[2], 16)) for m in map(_TFD.match, f) if m]
    except OSError:
        return False
    for target, ino in watched:
        if not os.path.lexists(f"/proc/{pid}/fd/{target}"):
            return True
        now = fdinfo_int(pid, target, "ino")
        if now is not None and now != ino:
            return True
    return False


class _Mounts:
    """The mounts of every mount namespace of a tree (what CRIU collects), their filesystem
    types by ID; read again once on a miss (a mount made since they were read)."""

    def __init__(self, pids: Sequence[int]) -> None:
        self.pids = list(pids)
        self.types = self._read()
        self.read_again = True

    def type_of(self, mnt_id: int) -> str | None:
        if mnt_id not in self.types and self.read_again:
            self.read_again = False
            self.types = self._read()
        return self.types.get(mnt_id)

    def _read(self) -> dict[int, str]:
        seen: set[str] = set()
        types: dict[int, str] = {}
        for pid in self.pids:
            with suppress(OSError, ValueError, IndexError):
                ns = os.readlink(f"/proc/{pid}/ns/mnt")
                if ns not in seen:
                    seen.add(ns)
                    # (ID ... - FSTYPE SOURCE OPTIONS; a mount point is any bytes)
                    with open(f"/proc/{pid}/mountinfo", errors="surrogateescape") as f:
                        types.update((int(ln.split(maxsplit=1)[0]), ln.split(" - ", 1)[1].split()[0]) for ln in f)
        return types


def large_ghosts(pids: Sequence[int], limit: int) -> list[str]:
    """One sentence for each file the tree holds open or mapped that was deleted, no other
    name of it left, with more than ``limit`` bytes of data: CRIU would have to copy it into
    the snapshot (a ghost file), and refuses one over its ghost limit once the tree is frozen.
    A library replaced under a running job (pip upgrading torch) is one.  Its data is its
    blocks (CRIU copies a sparse file's holes as holes); memfds and shared anonymous memory,
    which CRIU dumps as memory, are not ghosts."""
    seen: set[tuple[int, int]] = set()
    out = []
    for pid in pids:
        for path, name in files.held(pid):
            if not name.endswith(" (deleted)") or name.startswith(_NOT_GHOSTS):
                continue
            try:
                st = os.stat(path)
            except OSError:
                continue
            if stat.S_ISREG(st.st_mode) and st.st_nlink == 0 and (st.st_dev, st.st_ino) not in seen:
                seen.add((st.st_dev, st.st_ino))
                if st.st_blocks * 512 > limit:
                    out.append(
                        f"PID {pid} holds {name.removesuffix(' (deleted)')}, deleted while in use, with "
                        f"{st.st_blocks * 512 / 2**20:.0f} MiB of data: more than the ghost limit ({limit / 2**20:.0f} "
                        "MiB), which CRIU would have to copy into the snapshot; raise it with --ghost-limit-mib "
                        "(TPAGENT_GHOST_LIMIT_MIB, the agent's ghost_limit_mib)."
                    )
    return out


#: Deleted names in /proc that are no ghost files: a memfd's, anonymous memory's (shared, or
#: in huge pages: MAP_HUGETLB), SysV shared memory's.
_NOT_GHOSTS = ("/memfd:", "/dev/zero ", "/anon_hugepage ", "/SYSV")


#: The kinds of anonymous inode CRIU dumps (criu/files.c: each has its dump ops; any other is
#: refused once the tree is frozen).
CRIU_ANON_INODES = frozenset(
    {"[eventfd]", "[eventpoll]", "inotify", "[fanotify]", "[signalfd]", "[timerfd]", "[pidfd]", "bpf-map"}
)
_STALE_EPOLL = "an epoll instance watching a descriptor it has closed (another process still holding that file)"
_PACKET_PIPE = "a pipe in packet mode (pipe2 with O_DIRECT)"
_TFD = re.compile(r"tfd:\s*(\d+)\s.*\bino:([0-9a-f]+)\s")
_ANON_NAMES = {
    "[io_uring]": "io_uring",
    "[perf_event]": "a perf event",
    "[userfaultfd]": "userfaultfd",
    "mqueue": "a POSIX message queue",
}
#: How /proc shows a message queue's descriptor: its name, one slash first (" (deleted)" after
#: mq_unlink).  Only such links are asked their filesystem (a statfs): a file's at the root of
#: ``/`` is the only other of that shape, and no mount of a network filesystem is asked.
_MQUEUE_NAME = re.compile(r"/(?!memfd:)[^/]+")
_MQUEUE_MAGIC = 0x19800202  # (linux/magic.h)
_libc = ctypes.CDLL(None, use_errno=True)
_GETPID = 11  # (semctl's command: the last process to operate on a semaphore)


def _filesystem(path: str) -> int | None:
    """The type of the filesystem ``path`` is on (statfs's f_type), or None if it cannot be read."""
    buf = ctypes.create_string_buffer(256)  # (struct statfs: 120 bytes on x86-64 and arm64)
    if _libc.statfs(os.fsencode(path), buf) != 0:
        return None
    return int(struct.unpack_from("l", buf)[0])  # (f_type is its first field)


def _maps_sysv(pid: int) -> bool:
    with open(f"/proc/{pid}/maps", errors="surrogateescape") as f:
        return any(" /SYSV" in line for line in f)


#: Descriptors whose queued events a checkpoint may lose (what /proc shows their fd as -> the API).
_EVENT_QUEUES = {"anon_inode:inotify": "inotify", "anon_inode:[fanotify]": "fanotify"}


def restore_warnings(pids: Sequence[int]) -> list[str]:
    """One sentence for each process of the tree that holds state a restore may not bring back
    as it was: an inotify or fanotify instance, whose events queued at the freeze can be lost
    (CRIU brings back the watches, not the queue); a UDP socket with datagrams queued unread
    (CRIU saves no inet socket's queue); personality flags (``setarch -R``), which CRIU reads
    wrongly and never puts back.  For ``inspect``, a dump's output, a dry run."""
    out = []
    for pid in pids:
        if flags := _personality(pid):
            out.append(
                f"PID {pid} runs with personality flags {flags:#x} (setarch: ADDR_NO_RANDOMIZE is 0x40000), which "
                "CRIU does not restore: its copy runs without them."
            )
        held: dict[str, list[str]] = {}
        links = fd_links(pid)
        for fd, link in links:
            api = _EVENT_QUEUES.get(link)
            if api is not None:
                held.setdefault(api, []).append(fd)
        for api, fds in held.items():
            out.append(
                f"PID {pid} watches files with {api} (fd {', '.join(fds)}): events queued when it is frozen can be "
                "lost, so it should rescan what it watches after a restore."
            )
        queued = _udp_queued(pid) if any(link.startswith("socket:") for _, link in links) else {}
        out += [
            f"PID {pid} has datagrams queued unread on a UDP socket (fd {fd}): CRIU saves no inet socket's "
            "queue, so a restore loses them."
            for fd, link in links
            if link in queued
        ]
    return out


def _personality(pid: int) -> int:
    """``pid``'s execution domain and flags (/proc/PID/personality, in hex; root's to read): 0 is
    Linux's plain one (CRIU reads it, as decimal, and puts nothing back)."""
    try:
        with open(f"/proc/{pid}/personality") as f:
            return int(f.read(), 16)
    except (OSError, ValueError):
        return 0


def _udp_queued(pid: int) -> dict[str, int]:
    """``socket:[INODE]`` -> what is queued unread (the kernel's bytes of it), of each UDP socket of
    ``pid``'s network namespace that has any (/proc/PID/net/udp and udp6: rx_queue, in hex)."""
    out = {}
    for table in ("udp", "udp6"):
        with suppress(OSError, ValueError, IndexError), open(f"/proc/{pid}/net/{table}") as f:
            for row in map(str.split, list(f)[1:]):
                if queued := int(row[4].partition(":")[2], 16):
                    out[f"socket:[{row[9]}]"] = queued
    return out
