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
from collections.abc import Iterable
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

    def alive(self) -> bool:
        try:
            return proc.start_ticks(self.init) == self.init_start
        except (OSError, IndexError, ValueError):
            return False


def open_output(init: int, which: int) -> int:
    """Our own descriptor of the file the init of a rank's namespace has as stdout (1) or stderr
    (2), where the rank writes: opened through the init's descriptor, never a path (what a path
    names can be changed; what the init has open cannot), and only if it is a regular file."""
    link = f"/proc/{init}/fd/{which}"
    try:
        st = os.stat(link)
        if not stat.S_ISREG(st.st_mode):
            raise Refused(f"the rank's {_STREAMS[which]} is not a file, so it is not relayed.", Why.INVALID)
        fd = os.open(link, os.O_RDONLY | os.O_NOCTTY | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as e:
        raise Refused(f"the rank's {_STREAMS[which]} cannot be read ({e.strerror}).", Why.NOT_FOUND) from e
    now = os.fstat(fd)
    if (now.st_dev, now.st_ino) != (st.st_dev, st.st_ino):
        os.close(fd)
        raise Refused(f"the rank's {_STREAMS[which]} changed while it was opened.", Why.CONFLICT)
    return fd


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
        }
        for e in entries
    ]
