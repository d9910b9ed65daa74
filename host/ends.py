"""What ties a process tree to processes outside it that no checkpoint can take along, found
before anything is frozen (CRIU finds it only with the tree frozen, in a page of its errors, or
not at all):

- a tracer (gdb, ``strace -p``, py-spy) holding one of its threads: CRIU cannot seize it;
- a pipe whose other end only a process outside the tree holds (``python train.py | tee log``
  run without ``tpagent launch``), or a named pipe (FIFO) only it reads or writes: CRIU gives
  the copy a pipe with nobody at that end, so its writes fail (EPIPE) or its reads end (EOF)
  as soon as it runs;
- a unix stream connection to a process outside the tree (a local daemon, journald as a
  service's stdout): CRIU cannot dump half of one.  (A rank runtime's to its agent it lets go
  of before its job's move, and is no tie there.)

The other end is found by its inode: a pipe's (a FIFO's by its device too) from each process's
``/proc/PID/fd`` (and which way each descriptor goes from its ``fdinfo`` flags), a unix
socket's peer from the kernel's sock_diag (:mod:`host.unix_diag`).

Said, not refused (:func:`shared_offsets`): an open file (not opened to append) the tree shares
with a process outside it, one offset for both (a shell's ``>`` redirect both inherited).
"""

from __future__ import annotations

import logging
import os
import re
import signal
import stat
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import suppress
from pathlib import Path

from host import claims, criu_limits, files, forked, proc, ptrace, unix_diag
from host.api import shown
from host.proc import fd_links

log = logging.getLogger(__name__)

#: Seconds the processes of the node are read for the other ends of the tree's pipes, sockets,
#: terminals and shared memory, each time (a node of a few thousand processes takes well under one).
HOLDERS_WITHIN = 30.0
#: (In :func:`_holders`' wanted: a socket, held either way.)
_SOCKET = -2
#: How /proc names an eventfd (one name for them all: which one is asked of kcmp).
_EVENTFD = "anon_inode:[eventfd]"


def unmovable(pids: Sequence[int], agent_let_go: bool = False, ghost_limit: int | None = None) -> list[str]:
    """One sentence for each thing of the tree a checkpoint would refuse, all found before
    anything is frozen: what CRIU cannot dump (:func:`host.criu_limits.uncheckpointable`), a tie
    to a process outside the tree (:func:`refusals`), a file CRIU would name again where users
    can change its directory (:func:`host.files.relink_refusals`), and with ``ghost_limit``, a
    deleted file it would have to copy over that limit (:func:`host.criu_limits.large_ghosts`)."""
    return [
        *criu_limits.uncheckpointable(pids),
        *refusals(pids, agent_let_go),
        *files.relink_refusals(pids),
        *(criu_limits.large_ghosts(pids, ghost_limit) if ghost_limit is not None else ()),
    ]


class Unread(Exception):
    """The node's processes could not all be read in time (:data:`HOLDERS_WITHIN`): a tie to one
    of those left unread may be there, so the tree is refused, not taken as tied to nobody."""

    def __init__(self, root: int, looked_for: str) -> None:
        super().__init__(
            f"PID {root}'s tree could not be checked for {looked_for} outside it: not all of this node's "
            f"processes were read within {HOLDERS_WITHIN:.0f} s (the node is too busy, or runs too many), and a "
            "tie to one left unseen would break its copy; try again."
        )


def refusals(pids: Sequence[int], agent_let_go: bool = False) -> list[str]:
    """One sentence for each tie of the tree's processes to a process outside it.
    ``agent_let_go``: a rank's runtime lets go of its connection to its agent before the freeze
    (its job's move, and its dry run): that one is no tie.  Where the node's processes could not
    all be read in time, that sentence alone."""
    try:
        return _refusals(pids, agent_let_go)
    except Unread as e:
        return [str(e)]


def shared_offsets(pids: Sequence[int]) -> list[str]:
    """One warning for each open file of the tree's (a node's file, not opened to append) that a
    process outside it holds too, the very open file (fork shares it: a shell's ``>``): one offset
    for both, which its copy no longer shares.  None where the node's processes could not all be read."""
    opened: dict[str, list[tuple[int, str]]] = {}  # its path -> (PID, fd) of each such open file of the tree
    for pid in pids:
        for fd, link in fd_links(pid):
            if _offset_kept(pid, fd, link):
                opened.setdefault(link, []).append((pid, fd))
    out: dict[str, str] = {}
    with suppress(Unread):
        for other in _others(set(pids), "the holders of its open files") if opened else ():
            for ofd, link in fd_links(other):
                held = next((h for h in opened.get(link, ()) if forked.same_file(*h, other, ofd)), None)
                if held and link not in out:
                    out[link] = (
                        f"PID {held[0]} shares its open file {shown(link)} (fd {held[1]}) with PID {other} "
                        f"({_comm(other)}) outside its tree, at one offset (a shell's `>` both inherited): its copy "
                        "writes on from the offset it had, not theirs, so what both write after a restore overwrites "
                        "the other's (and CRIU refuses the restore if they wrote while it was frozen); open it to "
                        "append (`>>`) to keep both."
                    )
        return list(out.values())
    return []


def _refusals(pids: Sequence[int], agent_let_go: bool) -> list[str]:
    out = [
        claims.busy(pid)
        if claims.held(pid)
        else f"PID {pid} is traced by PID {tracer} ({_comm(tracer)}): a debugger or tracer (gdb, strace, py-spy) "
        "holds it, and CRIU cannot freeze a traced process; detach it and try again."
        for pid in pids
        if (tracer := _tracer(pid))
    ]
    pipes: dict[str, tuple[int, str, int]] = {}  # pipe:[INODE] -> (PID, fd, access mode), the first in the tree
    modes: dict[str, set[int]] = {}  # pipe:[INODE] -> the ways the tree holds it
    sockets: dict[str, tuple[int, str]] = {}  # socket:[INODE] -> (PID, fd), the first in the tree
    names: dict[str, str] = {}  # a named pipe's key (:func:`_fifo`) -> its path, as the tree names it
    events: dict[str, tuple[int, str]] = {}  # anon_inode:[eventfd]PID:FD -> (PID, fd), each of the tree's eventfds
    for pid in pids:
        for fd, link in fd_links(pid):
            key = _fifo(pid, fd) if link.startswith("/") else link  # (a named pipe: by its inode, not its name)
            if key and key.startswith(("pipe:", "fifo:")):
                mode = _access(pid, fd)
                pipes.setdefault(key, (pid, fd, mode))
                modes.setdefault(key, set()).add(mode)
                names.setdefault(key, link)
            elif link.startswith("socket:"):
                sockets.setdefault(link, (pid, fd))
            elif link == _EVENTFD:
                events[f"{_EVENTFD}{pid}:{fd}"] = (pid, fd)
    # A pipe the tree holds only one way of (it only writes it, or only reads it).
    wanted = {link: pipes[link][2] for link, m in modes.items() if m in ({os.O_RDONLY}, {os.O_WRONLY})}
    peers = _outside_peers(pids, sockets)
    wanted.update(dict.fromkeys((peer for peer, _ in peers.values()), _SOCKET))
    wanted.update(dict.fromkeys([*sockets, *events], _SOCKET))  # (the very socket or eventfd held outside too)
    outside = _holders(set(pids), wanted, events)
    for link, (pid, fd) in [*sockets.items(), *events.items()]:
        if (other := outside.get(link)) is not None:
            what = "an eventfd" if link in events else "a socket"
            out.append(
                f"PID {pid} holds {what} (fd {fd}) that PID {other[0]} ({_comm(other[0])}) outside its tree holds too "
                "(inherited, or passed to it): its copy would have one of its own, apart from theirs (an eventfd's "
                "counts never meeting; a socket's port or connection still theirs); checkpoint the tree that holds "
                "both, or close it in one of them."
            )
    for link, (pid, fd, mode) in pipes.items():
        if (other := outside.get(link)) is not None:
            verb, their = ("writes to", "reads") if mode == os.O_WRONLY else ("reads", "writes")
            what = "a pipe" if link.startswith("pipe:") else f"the named pipe {shown(names[link])}"
            out.append(
                f"PID {pid} {verb} {what} (fd {fd}) that PID {other[0]} ({_comm(other[0])}) outside its tree "
                f"{their}: the copy's pipe would have nobody at that end; give it a file instead (for its output, "
                "`tpagent launch --stdout FILE`), or start the other end inside the tree."
            )
    for link, (peer, name) in peers.items():
        pid, fd = sockets[link]
        if name == _agent(pid):
            if not agent_let_go:
                out.append(
                    f"PID {pid} is a rank whose runtime is connected to its agent (fd {fd}), which CRIU cannot dump: "
                    "it lets go of it only for its job's move; move it with `tpagent migrate --job JOB --rank R`."
                )
            continue
        who = f"PID {outside[peer][0]} ({_comm(outside[peer][0])})" if peer in outside else "a process"
        out.append(
            f"PID {pid} holds a unix socket (fd {fd}) connected to {who} outside its tree, and CRIU cannot "
            "checkpoint one end of a connection; close it, or start that process inside the tree (a service's "
            "output to the journal: `tpagent launch --stdout FILE`)."
        )
    return [*out, *_terminals(pids), *_shared_memory(pids, not agent_let_go), *_parent_death(pids)]


def _parent_death(pids: Sequence[int]) -> list[str]:
    """One sentence for each root of the tree (a process whose parent is outside it) that asked
    to be killed when its parent dies (PR_SET_PDEATHSIG, as vLLM's and torchelastic's workers
    do): its copy is restored as another process's child (CRIU's, which leaves), so the signal
    would kill it as it starts.  Read inside it, through ptrace (nothing outside shows it)."""
    out = []
    tree = set(pids)
    for pid in pids:
        try:
            parent = proc.parent_pid(pid)
            if parent in tree or parent == 0 or not ptrace.supported():
                continue
            sig = ptrace.parent_death_signal(pid)
        except (OSError, ValueError, IndexError):  # (gone, or not to be seized: its own refusal says why)
            continue
        if sig:
            out.append(
                f"PID {pid} asks to be killed when its parent dies ({_signal_name(sig)}, PR_SET_PDEATHSIG) and its "
                f"parent, PID {parent} ({_comm(parent)}), is outside its tree: its copy, restored as another "
                f"process's child, would be killed as it starts; "
                f"{f'checkpoint the tree from PID {parent}, or ' if parent != 1 else ''}start the workload with "
                "`tpagent launch`."
            )
    return out


def _signal_name(sig: int) -> str:
    try:
        return signal.Signals(sig).name
    except ValueError:
        return f"signal {sig}"


def _terminals(pids: Sequence[int]) -> list[str]:
    """One sentence for each pseudo-terminal the tree holds the slave of (``/dev/pts/N``, or
    ``/dev/tty`` for its controlling one) while no process of it holds the master: a terminal
    window, tmux, screen or sshd outside the tree does (CRIU: 'Found slave peer index N without
    correspond master peer', once the tree is frozen)."""
    slaves: dict[int, tuple[int, list[str]]] = {}  # index -> (PID, its fds), the first in the tree
    masters: set[int] = set()
    for pid in pids:
        for fd, link in fd_links(pid):
            slave = _pts_index(pid, link)
            if slave is not None:
                first = slaves.setdefault(slave, (pid, []))
                if first[0] == pid:
                    first[1].append(fd)
            elif link in _PTMX:
                masters.add(_tty_index(pid, fd))
    lone = {index: held for index, held in slaves.items() if index not in masters}
    holders: dict[int, int] = {}
    for other in _others(set(pids), "the holders of the terminals") if lone else ():
        for fd, link in fd_links(other):
            if link in _PTMX and (index := _tty_index(other, fd)) in lone:
                holders.setdefault(index, other)
        if len(holders) == len(lone):
            break
    return [
        f"PID {pid}'s terminal (/dev/pts/{index}, fd {', '.join(fds)}) is held at its other end by "
        f"{f'PID {holders[index]} ({_comm(holders[index])})' if index in holders else 'a process'} outside its "
        "tree (a terminal window, tmux, screen, ssh), and CRIU cannot take one end of a terminal; start it with "
        "`tpagent launch --stdout FILE`, or with its output and input redirected (nohup CMD > FILE 2>&1 < /dev/null)."
        for index, (pid, fds) in sorted(lone.items())
    ]


#: How /proc names the master side of a pseudo-terminal (its slave is /dev/pts/N).
_PTMX = frozenset({"/dev/ptmx", "/dev/pts/ptmx"})
_PTS = re.compile(r"/dev/pts/([0-9]+)")
_PTS_MAJORS = range(136, 144)  # (Unix98 pty slaves: index = (major - 136) * 256 + minor)


def _pts_index(pid: int, link: str) -> int | None:
    """The index of the pty slave ``link`` names (``/dev/tty``: ``pid``'s controlling terminal), or None."""
    if (m := _PTS.fullmatch(link)) is not None:
        return int(m.group(1))
    if link != "/dev/tty":
        return None
    try:
        tty = proc.controlling_tty(pid)
    except (OSError, ValueError, IndexError):
        return None
    major = (tty >> 8) & 0xFFF
    minor = (tty & 0xFF) | ((tty >> 12) & 0xFFF00)
    return (major - 136) * 256 + minor if major in _PTS_MAJORS else None


def _tty_index(pid: int, fd: str) -> int:
    """The index of the terminal a master descriptor (``/dev/ptmx``) drives (its fdinfo); -1: unreadable."""
    index = proc.fdinfo_int(pid, fd, "tty-index")
    return -1 if index is None else index


def shared_maps(pids: Sequence[int], carried: Sequence[Path]) -> list[str]:
    """One sentence for each node-local file a migration would take along (``carried``) that
    the tree maps shared and a process outside it maps shared too, either side writing (a
    segment in /dev/shm, a POSIX semaphore, a memory-mapped file): the copy on the target would
    map a copy of it, its writes and theirs no longer meeting (a semaphore they post never
    reaching it).  Only a move refuses it: a restore on the node maps the same file again."""
    names = {str(p) for p in carried}
    try:
        mapped = _mapped_outside(pids, names.__contains__, "the processes mapping the files")
    except Unread as e:
        return [str(e)]
    return [
        f"PID {pid} maps {path} shared with PID {other} ({_comm(other)}) outside its tree, and one of them "
        "writes it: its copy on the target would map a copy of this node-local file, their writes no longer "
        "meeting; end that process, or start it inside the tree."
        for pid, path, other in mapped
    ]


#: How /proc/PID/maps names anonymous memory a mapping shares (mmap MAP_SHARED | MAP_ANONYMOUS,
#: in huge pages too: a parent's, shared with the children it forked) and a memfd (passed to
#: another process over a unix socket).
_SHARED_ANONYMOUS = ("/dev/zero (deleted)", "/anon_hugepage (deleted)")


def _anonymous(path: str) -> bool:
    """Memory no other can map by name: anonymous, a memfd's, which CRIU gives the copy a copy of."""
    return path in _SHARED_ANONYMOUS or path.startswith("/memfd:")


def _removed(path: str) -> bool:
    """:func:`_anonymous`, or a removed file's (``multiprocessing.Value``: a file of /dev/shm removed
    once mapped), which CRIU gives the copy a copy of too (SysV's are refused on their own)."""
    return _anonymous(path) or (path.endswith(" (deleted)") and not path.startswith("/SYSV"))


def _shared_memory(pids: Sequence[int], removed: bool) -> list[str]:
    """One sentence for each piece of shared anonymous memory (or memfd; with ``removed``, a removed
    file's) the tree shares with a process outside it, either side writing (a child checkpointed
    without the parent it was forked from): the copy would have memory of its own, theirs no longer
    meeting.  (A rank's move, ``removed`` False, tears its communicators down before the freeze:
    NCCL's shared memory with the node's other ranks, /dev/shm files removed once mapped, goes.)"""
    wanted = _removed if removed else _anonymous
    return [
        f"PID {pid} shares memory ({_kind_of(path)}) "
        f"with PID {other} ({_comm(other)}) outside its tree, and one of them writes it: its copy would have "
        "memory of its own, no longer shared; checkpoint the tree that holds both."
        for pid, path, other in _mapped_outside(pids, wanted, "the processes sharing its memory")
    ]


def _kind_of(path: str) -> str:
    if path.startswith("/memfd:"):
        return "a memfd"
    return "a shared anonymous mapping" if path in _SHARED_ANONYMOUS else f"the removed file {shown(path[:-10])}"


def _mapped_outside(pids: Sequence[int], wanted: Callable[[str], bool], looked_for: str) -> list[tuple[int, str, int]]:
    """(PID, path, other PID) for each mapping of the tree, shared, of a path ``wanted`` takes,
    that a process outside it maps shared too (the same device and inode), either side writing;
    the first such process found, each mapping once."""
    mine: dict[tuple[str, str], tuple[int, str, bool]] = {}  # (device, inode) -> (PID, path, written)
    for pid in pids:
        for fields in files.mappings(pid):
            if fields[1][3] == "s" and wanted(fields[5]):
                first = mine.setdefault((fields[3], fields[4]), (pid, fields[5], False))
                mine[(fields[3], fields[4])] = (*first[:2], first[2] or fields[1][1] == "w")
    out = []
    for other in _others(set(pids), looked_for) if mine else ():
        for fields in files.mappings(other):
            held = mine.get((fields[3], fields[4]))
            if held is not None and fields[1][3] == "s" and (held[2] or fields[1][1] == "w"):
                del mine[(fields[3], fields[4])]
                out.append((held[0], held[1], other))
        if not mine:
            break
    return out


def _tracer(pid: int) -> int:
    """The PID (as this node sees it) of whatever ptraces a thread of ``pid``; 0: none."""
    with suppress(OSError):
        for tid in os.listdir(f"/proc/{pid}/task"):
            with suppress(OSError, ValueError):
                for line in Path(f"/proc/{pid}/task/{tid}/status").read_text(errors="surrogateescape").splitlines():
                    if line.startswith("TracerPid:") and int(line.split()[1]):
                        return int(line.split()[1])
    return 0


def _comm(pid: int) -> str:
    try:
        return shown(Path(f"/proc/{pid}/comm").read_text(errors="surrogateescape").strip())  # (its own choice)
    except OSError:
        return "gone since"


def _fifo(pid: int, fd: str) -> str:
    """``fifo:DEVICE:INODE`` if the descriptor is a named pipe (its other ends: whoever holds that
    inode, by whatever name: a hard link, another namespace's path); else ""."""
    try:
        st = os.stat(f"/proc/{pid}/fd/{fd}")
    except OSError:
        return ""
    return f"fifo:{st.st_dev}:{st.st_ino}" if stat.S_ISFIFO(st.st_mode) else ""


def _regular(pid: int, fd: str) -> bool:
    try:
        return stat.S_ISREG(os.stat(f"/proc/{pid}/fd/{fd}").st_mode)
    except OSError:
        return False


def _access(pid: int, fd: str) -> int:
    """Which way the descriptor goes: os.O_RDONLY, os.O_WRONLY or os.O_RDWR (-1: unreadable)."""
    flags = proc.fdinfo_int(pid, fd, "flags", 8)
    return -1 if flags is None else flags & os.O_ACCMODE


def _offset_kept(pid: int, fd: str, link: str) -> bool:
    """Whether the descriptor is a node's regular file (not the kernel's, not a memfd) opened
    without O_APPEND: where a process outside the tree holds that very open file, their offset is one."""
    flags = proc.fdinfo_int(pid, fd, "flags", 8)
    plain = link.startswith("/") and not files.kernels(link) and not link.startswith("/memfd:")
    return plain and flags is not None and not flags & os.O_APPEND and _regular(pid, fd)


def _holders(
    tree: set[int], wanted: dict[str, int], events: dict[str, tuple[int, str]] | None = None
) -> dict[str, tuple[int, str]]:
    """For each of ``wanted`` (pipe:[INODE] or fifo:DEVICE:INODE -> the way the tree holds it;
    socket:[INODE] -> :data:`_SOCKET`; a key of ``events``, the tree's eventfds -> :data:`_SOCKET`), the
    first process outside ``tree`` found holding it the other way (any way, a socket; an eventfd: that very
    one, :func:`host.forked.same_file`): (PID, fd).  Every process of the node may have to be read: the
    tree's own session first (a shell pipeline's other end)."""
    found: dict[str, tuple[int, str]] = {}
    fifos = any(k.startswith("fifo:") for k in wanted)  # (then each path held is looked at: its inode)
    for pid in _others(tree, "the holders of the pipes and sockets") if wanted else ():
        if len(found) == len(wanted):
            break
        for fd, held in fd_links(pid):
            if held == _EVENTFD:
                for key, (mine, my_fd) in (events or {}).items():
                    if key not in found and forked.same_file(mine, my_fd, pid, fd):
                        found[key] = (pid, fd)
                continue
            link = (_fifo(pid, fd) or held) if fifos and held.startswith("/") else held
            way = wanted.get(link)
            if way is not None and link not in found and (way == _SOCKET or _access(pid, fd) not in (way, -1)):
                found[link] = (pid, fd)
    return found


def _others(tree: set[int], looked_for: str) -> Iterator[int]:
    """The node's processes outside ``tree``, those of its session first, for
    :data:`HOLDERS_WITHIN` seconds at most: then :class:`Unread`, for ``looked_for``."""
    session = _session(min(tree))
    others = sorted(
        (int(e.name) for e in os.scandir("/proc") if e.name.isdigit() and int(e.name) not in tree),
        key=lambda pid: _session(pid) != session,
    )
    deadline = time.monotonic() + HOLDERS_WITHIN
    for pid in others:
        if time.monotonic() > deadline:
            raise Unread(min(tree), looked_for)
        yield pid


def _session(pid: int) -> int:
    try:
        return os.getsid(pid)
    except OSError:
        return -1


def _agent(pid: int) -> bytes | None:
    """The abstract name of the agent's rank socket, as the rank runtime in ``pid`` connects to
    it (``TPAGENT_RANK_SOCKET``; None: no runtime).  That connection the runtime lets go of
    before any freeze: it is no tie."""
    name = proc.environ_value(pid, "TPAGENT_RANK_SOCKET")
    return b"\0" + name if name else None


def _outside_peers(pids: Sequence[int], sockets: dict[str, tuple[int, str]]) -> dict[str, tuple[str, bytes]]:
    """socket:[INODE] of the tree's connected unix stream sockets whose peer is not the tree's ->
    the peer's socket:[INODE] and the name it has (a listener's, for a connection it accepted).
    Only the tree's processes in this process's network namespace (sock_diag answers for its own)."""
    here = os.readlink("/proc/self/ns/net")
    mine = {link: at for link, at in sockets.items() if _netns(at[0]) == here}
    if not mine:
        return {}
    try:
        peers, names = unix_diag.peers()
    except OSError as e:
        log.warning("the kernel's table of unix sockets cannot be read (%s): their peers are not checked", e)
        return {}
    out = {}
    for link in mine:
        peer = peers.get(int(link[len("socket:[") : -1]))
        if peer and f"socket:[{peer}]" not in sockets:  # (0: the other end closed, which CRIU dumps)
            out[link] = (f"socket:[{peer}]", names.get(peer, b""))
    return out


def _netns(pid: int) -> str:
    try:
        return os.readlink(f"/proc/{pid}/ns/net")
    except OSError:
        return ""
