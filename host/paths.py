"""Every path on disk the agent and the CLI use, in one place (what a snapshot holds inside is its
format's: :mod:`snapshot.manifest`, :mod:`transfer.wire`).

::

    /etc/tpagent/agent.toml               the agent's configuration (tpagent.common.config)
    /etc/tpagent/tls/                     ca.crt, tls.crt, tls.key: mutual TLS (root's, key 0600)
    /opt/tpagent/criu/bin/criu            the CRIU scripts/install-criu.sh installs
    /run/tpagent/launched/PID.json        a `tpagent launch` workload's record (root's)
    /run/tpagent/restored/ID.json         the copies restored here from snapshot ID (root's)
    /run/tpagent/dumping/PID-TICKS        a dump's claim on a process it freezes (root's, flock'd)
    /run/tpagent/rank-go/NAME             "come back" to a rank that let go of its agent (0711)
    /run/tpagent/rank-runtime/VERSION/    the rank runtime put on ranks' PYTHONPATH (0755)
    /var/lib/tpagent/left-behind/         carried files a committed migration left on this node
    WORK_DIR/                             the agent's (work_dir; root's, 0700): see WorkDir

Everything under /run is gone at a reboot, as what it notes is; the work directory must outlive
one (its journal says what each migration in flight means then).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

ETC = Path("/etc/tpagent")
CONFIG_FILE = ETC / "agent.toml"
TLS_DIR = ETC / "tls"
INSTALLED_CRIU = Path("/opt/tpagent/criu/bin/criu")
RUN = Path("/run/tpagent")
#: Root's records of the workloads `tpagent launch` started, one per PID.
LAUNCHED = RUN / "launched"
#: Root's notes of the copies restored on this node, one per snapshot (by its id): a snapshot
#: restored twice would run twice.
RESTORED = RUN / "restored"
#: Root's claims on the processes dumps freeze, one per process (snapshot.claims).
DUMPING = RUN / "dumping"
#: Where the rank runtime is written for the ranks' PYTHONPATH (root's, readable by the ranks).
RANK_RUNTIME = RUN / "rank-runtime"
#: The default work directory.
WORK_DIR = Path("/var/lib/tpagent")
#: The carried files a committed migration left behind on this node (a node's, whatever its
#: agent's work directory).
LEFT_BEHIND = WORK_DIR / "left-behind"


@dataclass(frozen=True)
class WorkDir:
    """The agent's work directory (``work_dir``)::

    WORK_DIR/migrations/ID.json          the journal: one record per migration
    WORK_DIR/rewires/ID.json             where each rewire of a job's ranks stands
    WORK_DIR/ranks.json                  the ranks of this node (kept across restarts)
    WORK_DIR/stores.json                 the jobs' stores this node serves anew (unplanned recovery)
    WORK_DIR/outgoing/ID/                a snapshot this node sends (source)
    WORK_DIR/incoming/ID/                a snapshot this node receives (target), and beside it
    WORK_DIR/incoming/ID.created           what its restore made on this node (for a drop)
    WORK_DIR/incoming/ID.restore/          CRIU's work directory for its restore
    WORK_DIR/incoming/.ID.partial-*/       a snapshot still arriving (transfer.receiver)
    """

    root: Path
    #: What the agent makes in it (a filesystem's lost+found aside, what else it holds is not its).
    NAMES = ("migrations", "rewires", "ranks.json", "stores.json", "outgoing", "incoming")

    @property
    def migrations(self) -> Path:
        return self.root / "migrations"

    @property
    def rewires(self) -> Path:
        return self.root / "rewires"

    @property
    def ranks(self) -> Path:
        return self.root / "ranks.json"

    @property
    def stores(self) -> Path:
        return self.root / "stores.json"

    def outgoing(self, migration_id: str) -> Path:
        return self.root / "outgoing" / migration_id

    def incoming(self, migration_id: str) -> Path:
        return self.root / "incoming" / migration_id


def __getattr__(name: str) -> Path:
    """``RANK_GO``: where a rank that let go of its agent to be frozen looks for the word to come
    back (a file named by :func:`tpagent_rank.protocol.go_name`): the rank protocol's own constant,
    both sides read it there.  Imported only when asked for: CRIU's post-dump hook reads this
    module while a tree is frozen, and the protocol's classes take milliseconds to build."""
    if name == "RANK_GO":
        from tpagent_rank import protocol

        return Path(protocol.GO_DIR)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def created_note(snapshot: Path) -> Path:
    """Where the restore of a received snapshot notes what it made on this node (for a drop)."""
    return snapshot.parent / f"{snapshot.name}.created"


def restore_work(snapshot: Path) -> Path:
    """Where CRIU's restore of a received snapshot keeps its pidfile (known to a restarted agent)."""
    return snapshot.parent / f"{snapshot.name}.restore"
