"""What an agent knows of one rank on its node (:class:`RankEntry`, :mod:`tpagent.jobs.ranks` keeps
them), and how the registrations are kept across the agent's restarts (a restart must not orphan
running ranks): as rows of JSON, read back only for a namespace that still runs (the same init:
PID and start), one that moved away, or one that ended with a status to report."""

from __future__ import annotations

import contextlib
import json
import logging
import os
import stat
from collections.abc import Collection, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NamedTuple

from host import proc
from tpagent.jobs.connection import Connection
from tpagent.migration.api import Refused, Why
from tpagent_rank import lines
from tpagent_rank import protocol as P

log = logging.getLogger(__name__)

#: Ranks that moved away or ended, remembered (for their stand-ins) at most.
KEEP_ENDED = 1024
#: How long the name of a rank that ended here stays its user's (its stand-in asks how it ended,
#: or waits out its hold): another user's rank of that name is refused until then.
ENDED_CLAIM = 60.0
#: The statuses of a process killed outright (a crash, the OOM killer), not ended by its script or
#: its launcher: a rank of a job of several that ends so has its end held from its stand-in
#: (:meth:`tpagent.jobs.ranks.Ranks.locate`: moving) for its job to rebuild it elsewhere, where
#: the agent reports to an orchestrator (:mod:`tpagent.orchestrator.lost`).
DIED = frozenset({-9, -11, -7, -6, -4, -8})  # SIGKILL, SIGSEGV, SIGBUS, SIGABRT, SIGILL, SIGFPE


def identity_of(uid: int, hello: lines.Hello) -> str:
    """A rank's job across nodes: the user its runtime runs as (the kernel's word) and the job's
    key it said hello with."""
    return f"{uid}:{hello.key}"


def died(code: int, world: int) -> bool:
    """Whether a rank that ended with ``code`` (a signal's: negative) died, in a job of ``world``
    ranks its job may rebuild it from (:data:`DIED`)."""
    return code in DIED and world > 1


class Owned(NamedTuple):
    """Whose a rank known here is (:meth:`tpagent.jobs.ranks.Ranks.owner_of`)."""

    owner: int  # the user whose stand-in had it started here (-1: root's)
    moved_to: str  # the agent it moved to ("": none)
    here: bool  # it runs here still
    claimed: bool  # its name is still that user's: it runs here or moved, or ended lately or held
    identity: str = ""  # its job's identity as it last said hello here (:meth:`RankEntry.identity`; "": never)


@dataclass
class RankEntry:
    job: str
    rank: int
    init: int  # the PID (here) of its launched namespace's init
    init_start: int  # and its start, in clock ticks since boot
    world: int = 0
    conn: Connection | None = None
    exit_code: int | None = None
    moved_to: str = ""  # the agent it migrated to
    seen: lines.Hello | None = None  # its last hello
    uid: int = -1  # the user its runtime runs as (the kernel's word, as it last connected)
    owner: int = -1  # the user whose stand-in had it started here (tpagent.jobs.local; -1: root's stand-in)
    outputs: dict[int, int] = field(default_factory=dict)  # 1, 2 -> our descriptor of its stdout, stderr file
    held_until: float = 0.0  # (monotonic) its end (DIED) is held from its stand-in until then
    ended_at: float = 0.0  # (monotonic) when its end was reported here (0: not in this run)
    anew: bool = False  # moved_to runs a new process of it (rebuilt after it died here)
    broke: str = ""  # why a collective of it failed, as it said unasked on its connection (lines.Broke)
    step: int = 0  # its optimizer steps, as it last said (its hello, then lines.Stepped)
    identity: str = ""  # its job's identity (its user and job's key) as it last said hello, kept across restarts

    def claimed(self, now: float) -> bool:
        """Whether its name is still its user's though it runs here no more (``now``: monotonic):
        it moved on, or ended less than :data:`ENDED_CLAIM` ago, or its end is held."""
        ended = self.exit_code is not None and (now < self.held_until or now < self.ended_at + ENDED_CLAIM)
        return bool(self.moved_to) or ended

    def of_job(self, key: str) -> bool:
        """Whether it is of the job whose identity is ``key``: as it said hello, or (a copy not yet
        connected) by the user its workload runs as: another user's rank is never taken for it."""
        if self.identity:
            return self.identity == key
        uid, _ = user_of(self.init)
        return uid >= 0 and key.partition(":")[0] == str(uid)  # (the user part of :func:`identity_of`'s)

    def alive(self) -> bool:
        try:
            return proc.start_ticks(self.init) == self.init_start
        except (OSError, IndexError, ValueError):
            return False


def open_output(init: int, which: int) -> int:
    """Our own descriptor of the file the init of a rank's namespace has as stdout (1) or stderr
    (2), where the rank writes: opened through the init's descriptor, never a path (what a path
    names can be changed; what the init has open cannot), and only if it is a regular file that
    the rank's user may read itself (:func:`readable_by`, of :func:`user_of` the init): a file
    it may only write to (a root's log of mode 0622) is not read back to it."""
    link = f"/proc/{init}/fd/{which}"
    name = _STREAMS[which]
    try:
        st = os.stat(link)
        if not stat.S_ISREG(st.st_mode):
            raise Refused(f"the rank's {name} is not a file, so it is not relayed.", Why.INVALID)
        fd = os.open(link, os.O_RDONLY | os.O_NOCTTY | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as e:
        raise Refused(f"the rank's {name} cannot be read ({e.strerror}).", Why.NOT_FOUND) from e
    now = os.fstat(fd)
    if (now.st_dev, now.st_ino) != (st.st_dev, st.st_ino):
        os.close(fd)
        raise Refused(f"the rank's {name} changed while it was opened.", Why.CONFLICT)
    uid, groups = user_of(init)
    if uid < 0:
        os.close(fd)
        raise Refused(f"the rank's process is not there to say whose its {name} is.", Why.NOT_FOUND)
    if not readable_by(now, uid, groups) or uid not in (0, now.st_uid) and _has_acl(fd):
        os.close(fd)
        raise Refused(f"the rank's {name} is a file its user may not read, so it is not relayed.", Why.DENIED)
    return fd


def user_of(init: int) -> tuple[int, tuple[int, ...]]:
    """The user (real UID) and groups (real GID, then the supplementary ones) of the workload
    the init of a rank's namespace started: its child, as one read of the child's status says
    (-1 and none where it has no child now)."""
    try:
        children = Path(f"/proc/{init}/task/{init}/children").read_text().split()
        status = Path(f"/proc/{children[0]}/status").read_text(errors="surrogateescape") if children else ""
    except OSError:
        return -1, ()
    fields = dict(line.partition(":")[::2] for line in status.splitlines())
    try:
        if int(fields["PPid"]) != init:  # (the child ended and its PID is another's now)
            return -1, ()
        return int(fields["Uid"].split()[0]), (int(fields["Gid"].split()[0]), *map(int, fields["Groups"].split()))
    except (KeyError, IndexError, ValueError):
        return -1, ()


def _has_acl(fd: int) -> bool:
    """Whether the file has an access control list beyond its mode (which may deny what the mode
    allows: such a file of another's is not read for a user, whatever the list says)."""
    try:
        return bool(os.getxattr(fd, "system.posix_acl_access"))
    except OSError:  # (none, or a file system without them)
        return False


def readable_by(st: os.stat_result, uid: int, groups: Collection[int]) -> bool:
    """Whether user ``uid``, of ``groups`` (its group and supplementary ones), may read a file of
    ``st`` by its mode, as the kernel judges (a file with an access list is not judged here).
    Root may; so may the file's owner (who may make it readable anyway)."""
    if uid in (0, st.st_uid):
        return True
    if st.st_gid in groups:
        return bool(st.st_mode & stat.S_IRGRP)
    return bool(st.st_mode & stat.S_IROTH)


_STREAMS = {1: "stdout", 2: "stderr"}


def close_outputs(e: RankEntry) -> None:
    for fd in e.outputs.values():
        with contextlib.suppress(OSError):
            os.close(fd)
    e.outputs.clear()


def load(path: Path) -> list[RankEntry]:
    """The registrations a previous run of the agent saved in ``path`` (see the module)."""
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        return []
    except (OSError, ValueError) as e:
        log.error("the ranks saved in %s cannot be read (%s): ranks started before are not known", path, e)
        return []
    out = []
    for d in data.get("ranks", []) if isinstance(data, dict) else []:
        try:
            code = d["exit_code"] if isinstance(d["exit_code"], int) else None
            entry = RankEntry(
                str(d["job"]),
                int(d["rank"]),
                int(d["init"]),
                int(d["init_start"]),
                int(d["world"]),
                None,
                code,
                str(d["moved_to"]),
                owner=int(d.get("owner", -1)),
                anew=bool(d.get("anew", False)),
                identity=str(d.get("identity", "")),
            )
        except (KeyError, TypeError, ValueError):
            continue
        if P.valid_job(entry.job) and (entry.alive() or entry.moved_to or entry.exit_code is not None):
            out.append(entry)
    return out


def rows(entries: Iterable[RankEntry]) -> list[dict[str, Any]]:
    """``entries`` as :func:`load` reads them back."""
    return [
        {
            "job": e.job,
            "rank": e.rank,
            "init": e.init,
            "init_start": e.init_start,
            "world": e.world,
            "exit_code": e.exit_code,
            "moved_to": e.moved_to,
            "owner": e.owner,
            "anew": e.anew,
            "identity": e.identity,
        }
        for e in entries
    ]
