"""The agents' side of a model-aware move (issue 27, item 2): a fresh process of a rank's command,
started on the target as the rank was started on its source, takes the rank's registered
training state in place of its process image (the ranks' side: :mod:`tpagent_rank.join`).

* The source agent reads how the rank runs (:func:`spec_of`): its command line and environment,
  its user, groups and umask, its namespace init's working directory and output files, all from
  /proc (a copy restored by a transparent move is read the same way as a rank first launched).
  The rank runtime's own variables are left out: each agent sets its own.
* The target agent starts it (:func:`start`, the ``join`` request) as a ``tpagent launch``
  namespace, as that user, with :data:`~tpagent_rank.protocol.JOIN_VARIABLE` set, and registers
  it as the rank's; the move (:mod:`tpagent.jobs.awaremove`) then hands it the state.

Who may ask: another node's agent (mTLS and a signed call, as every agent-to-agent call), which
may already restore any process image here.  What it names is checked as a stand-in's start is
(:mod:`tpagent.jobs.local`), and the output files are opened as the user, never as root.
"""

from __future__ import annotations

import os
import stat
import time
from pathlib import Path

import psutil

from host import proc, signals
from host.api import UsageError
from tpagent.common.threads import Threads
from tpagent.jobs.local import ARGS_MAX, ENV_MAX
from tpagent.jobs.ranks import Ranks
from tpagent.jobs.standin import RUNTIME_ROOT, runtime_dir
from tpagent.migration.api import Refused, Why
from tpagent.workload import launch
from tpagent.workload.launch import RunAs
from tpagent_rank import protocol as P

#: The rank runtime's own variables: the agent where a process runs sets them.
RUNTIME_VARIABLES = ("TPAGENT_RANK_SOCKET", P.JOIN_VARIABLE, P.STATE_VARIABLE)
#: The most supplementary groups a process has (NGROUPS_MAX) that a join may name.
GROUPS_MAX = 65536
#: How long a joiner's namespace may take to start.
START_TIMEOUT = 30.0


def _workload(init: int) -> psutil.Process:
    """The command a launched namespace's init started: its first child still running."""
    children = [c for c in psutil.Process(init).children() if c.status() != psutil.STATUS_ZOMBIE]
    if not children:
        raise Refused("its namespace runs no command any more", Why.NOT_FOUND)
    return min(children, key=lambda c: (proc.start_ticks(c.pid), c.pid))


def _output(init: int, which: int) -> str:
    link = f"/proc/{init}/fd/{which}"
    path = os.readlink(link)
    if not os.path.isabs(path) or path.endswith(" (deleted)") or not stat.S_ISREG(os.stat(link).st_mode):
        raise Refused(
            f"its {'stdout' if which == 1 else 'stderr'} is not a file a new process can write to", Why.INVALID
        )
    return path


def _status(pid: int, key: str) -> list[str]:
    """The values of one field of /proc/PID/status."""
    for line in Path(f"/proc/{pid}/status").read_text(errors="surrogateescape").splitlines():
        if line.startswith(key + ":"):
            return line.split()[1:]
    return []


def _without_runtime(env: dict[str, str]) -> tuple[str, ...]:
    """``env`` as NAME=value, less the runtime's variables and its directory on PYTHONPATH."""
    out = {k: v for k, v in env.items() if k not in RUNTIME_VARIABLES}
    kept = [p for p in out.get("PYTHONPATH", "").split(os.pathsep) if p and not p.startswith(f"{RUNTIME_ROOT}/")]
    if kept:
        out["PYTHONPATH"] = os.pathsep.join(kept)
    else:
        out.pop("PYTHONPATH", None)
    return tuple(f"{k}={v}" for k, v in sorted(out.items()))


def spec_of(init: int, init_ticks: int, owner: int) -> P.Join:
    """How the rank whose namespace's init is ``init`` (started at ``init_ticks``) runs, as a
    ``join`` request; :class:`Refused` in one sentence if it cannot be told."""
    try:
        work = _workload(init)
        before = proc.start_ticks(work.pid)
        groups = tuple(int(g) for g in _status(work.pid, "Groups"))
        umask = _status(init, "Umask")
        spec = P.Join(
            cmd=tuple(work.cmdline()),
            env=_without_runtime(work.environ()),
            cwd=psutil.Process(init).cwd(),
            umask=int(umask[0], 8) if umask else 0o022,
            uid=work.uids().real,
            gid=work.gids().real,
            groups=groups,
            stdout=_output(init, 1),
            stderr=_output(init, 2),
            owner=owner,
        )
        if proc.start_ticks(work.pid) != before or proc.start_ticks(init) != init_ticks:
            raise Refused("it ended while it was read", Why.NOT_FOUND)
    except (psutil.Error, OSError, ValueError) as e:
        raise Refused(f"how it runs cannot be read ({e})", Why.NOT_FOUND) from e
    if not spec.cmd:
        raise Refused("its command line cannot be read", Why.NOT_FOUND)
    return spec


def _checked(job: str, rank: int, j: P.Join) -> dict[str, str]:
    """The joiner's environment (less this agent's variables), once ``j`` is checked."""
    if not P.valid_job(job) or not 0 <= rank < P.RANK_MAX or not j.cmd or len(j.cmd) > ARGS_MAX:
        raise Refused("a join names a job, a rank from 0 and a command", Why.INVALID)
    texts = [*j.cmd, *j.env, j.cwd, j.stdout, j.stderr]
    if len(j.env) > ENV_MAX or any("\0" in t for t in texts) or any("=" not in e[1:] for e in j.env):
        raise Refused("a join's command, environment (NAME=value) and paths are text without NUL", Why.INVALID)
    if not all(os.path.isabs(p) for p in (j.cwd, j.stdout, j.stderr)):
        raise Refused("a join's working directory and output files are absolute paths", Why.INVALID)
    if not 0 <= j.umask <= 0o777:
        raise Refused(f"a join's umask is 0 to 0o777, not {j.umask:#o}", Why.INVALID)
    ids = (j.uid, j.gid, *j.groups)
    if len(j.groups) > GROUPS_MAX or not all(0 <= i < (1 << 32) - 1 for i in ids) or j.owner < -1:
        raise Refused("a join names a user, a group and supplementary groups by number", Why.INVALID)
    env = dict(e.split("=", 1) for e in j.env)
    for name in RUNTIME_VARIABLES:
        env.pop(name, None)
    return env


def start(ranks: Ranks, threads: Threads, rank_socket: str, job: str, rank: int, j: P.Join) -> int:
    """Start the joiner ``j`` describes as rank ``rank`` of ``job`` here, registered as that rank's
    (its owner's, if a user's stand-in had the rank started); its namespace init's PID."""
    env = _checked(job, rank, j)
    known = ranks.owner_of(job, rank)
    if known is not None and known.here:
        raise Refused(f"rank {rank} of job {job} runs here already", Why.CONFLICT)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(runtime_dir()), env.get("PYTHONPATH", "")) if p)
    env["TPAGENT_RANK_SOCKET"] = rank_socket
    env[P.JOIN_VARIABLE] = "1"
    who = RunAs(j.uid, j.gid, j.groups, j.cwd, env)
    try:
        init, holder = launch.start(
            list(j.cmd), Path(j.stdout), Path(j.stderr), START_TIMEOUT, umask=j.umask, run_as=who
        )
    except UsageError as e:
        raise Refused(f"rank {rank} of job {job} could not be started here: {e}", Why.PRECONDITION) from e
    threads.spawn("stand-ins", f"holder-{init}", holder.wait)  # (reaped: its status is the init's)
    try:
        ranks.expect(job, rank, init, owner=j.owner)
    except Refused:
        signals.kill_tree(init)
        raise
    return init


def wait_gone(init: int, init_ticks: int, timeout: float) -> bool:
    """Wait until the namespace of ``init`` has ended (True), up to ``timeout``; past it, it is
    killed (False)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if proc.start_ticks(init) != init_ticks:
                return True
        except (OSError, IndexError, ValueError):
            return True
        time.sleep(0.05)
    signals.kill_tree(init)
    return False


class Leaving:
    """The ranks of this node, as a model-aware move leaving them sees them (:class:`~tpagent.jobs.api.Leaving`)."""

    def __init__(self, ranks: Ranks) -> None:
        self.ranks = ranks

    def spec(self, job: str, rank: int) -> P.Join:
        e = self.ranks.entry(job, rank)
        return spec_of(e.init, e.init_start, e.owner)

    def gone(self, job: str, rank: int, timeout: float) -> bool:
        e = self.ranks.entry(job, rank)
        return wait_gone(e.init, e.init_start, timeout)

    def here(self, job: str) -> bool:
        return any(row.job == job for row in self.ranks.jobs())
