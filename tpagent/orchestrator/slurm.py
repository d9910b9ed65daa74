"""The Slurm adapter of the scheduler port (:mod:`.scheduler`), through Slurm's own commands:
``sinfo --json`` and ``squeue --json`` (Slurm 22.05 and later) to read, ``sbatch``, ``scancel``
and ``scontrol`` to act.  Chosen over slurmrestd: every Slurm cluster has the commands and the
orchestrator's node is a Slurm client already (its ``slurm.conf`` or ``SLURM_CONF``, munge), while
slurmrestd is a daemon more, with JWT keys to hand out.  Commands run with an argument list (never
a shell string) and a timeout.  The orchestrator must run as root or as SlurmUser (it drains
nodes, holds them for other users' jobs and writes jobs' admin comments).

* Spares: the idle nodes of ``slurm_spare_partition`` (dedicated, after ``dedicated_spares``
  that Slurm shows idle); floating: idle nodes of the job's own partition, and nodes of it with
  GPUs free (GRES); with no spare free, nodes whose jobs all have a priority below
  ``slurm_preempt_below`` and the moving job's own are taken, their jobs requeued first.
* A hold is a placeholder batch job named ``tpagent-hold`` on the spare, submitted as the
  orchestrator's user (root: a spare partition users cannot submit to takes it), exclusive (or
  the GPUs the ranks use), its comment and admin comment ``tpagent hold job=K node=N`` (K: the
  job's key, its name and identity, :mod:`~tpagent.orchestrator.api`).  The move starts only
  once Slurm has allocated it.
* A taint drains its node with the reason ``tpagent: ...``; only a node drained so is resumed.
* The job's admin comment says where its moved ranks run: ``tpagent: rank 1 on N (hold 42)``,
  after what an administrator wrote there (``budget 7 | tpagent: ...``), which is kept.

Node names are the agents' (``node`` in their configuration): give each agent its Slurm
NodeName.  The tpagent job of ``srun ... tpagent rank`` is its Slurm job ID (else a running
job of that name).
"""

from __future__ import annotations

import json
import logging
import re
import subprocess
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from host.api import UsageError
from tpagent.orchestrator.api import Move, MoveKind, job_name, printable
from tpagent.orchestrator.config import OrchestratorConfig
from tpagent.orchestrator.scheduler import Held, Pool, SchedulerError, Wanted

log = logging.getLogger(__name__)

HOLD_NAME = "tpagent-hold"
PREFIX = "tpagent: "  # of a drain's reason and a job's admin comment: tpagent's own
RECORD_AFTER = " | "  # (an administrator's own admin comment, then tpagent's record)
#: One Slurm command, at most this long.
TIMEOUT = 30.0
#: What the adapter read last is used by :meth:`Slurm.pool` for at most this long.
FRESH_FOR = 10.0
ACTIVE = frozenset({"PENDING", "CONFIGURING", "RUNNING", "COMPLETING", "SUSPENDED", "RESIZING", "REQUEUED"})
_HOLD = re.compile(r"tpagent hold job=(.+) node=(\S+)")  # (a job's name may hold spaces; a node's none)
_GPUS = re.compile(r"gpu(?::[^:(,]+)?:(\d+)")
_DOWN = ("unable to contact slurm controller", "connection refused", "socket timed out", "timed out")


@dataclass(frozen=True)
class SNode:
    name: str
    state: str  # idle, mixed, allocated, down, ...
    flags: frozenset[str]  # DRAIN, ...
    partitions: tuple[str, ...]
    reason: str
    gpus: int
    gpus_used: int
    cpus_used: int

    @property
    def drained(self) -> bool:
        return "DRAIN" in self.flags or self.state.startswith("drain")

    @property
    def usable(self) -> bool:
        return not self.drained and self.state in ("idle", "mixed", "allocated")


def recorded_in(comment: str, record: str) -> str:
    """A job's admin comment ``comment`` with tpagent's record in it made ``record`` ("": none).
    The record is the comment's last part (``PREFIX`` on); an administrator's own words before it
    are kept, the two parts apart by ``RECORD_AFTER``."""
    at = comment.rfind(RECORD_AFTER + PREFIX)
    own = comment[:at] if at >= 0 else "" if comment.startswith(PREFIX) else comment
    return RECORD_AFTER.join(part for part in (own, record) if part)


@dataclass(frozen=True)
class SJob:
    id: str
    name: str
    state: str
    nodes: tuple[str, ...]
    partition: str
    priority: int
    user_id: int
    comment: str
    admin_comment: str

    @property
    def active(self) -> bool:
        return self.state in ACTIVE

    def hold_of(self) -> tuple[str, str] | None:
        """(job, node) if this is a placeholder of ours: marked in its admin comment, which only
        Slurm's administrators can write (a user's job may take the name and comment)."""
        found = _HOLD.fullmatch(self.admin_comment) if self.name == HOLD_NAME else None
        return (found[1], found[2]) if found else None


def _gpus(gres: str) -> int:
    return sum(int(n) for n in _GPUS.findall(gres or ""))


def _number(value: Any) -> int:
    """An integer as Slurm prints it: a number, or (23.02 and later) {"set", "number"}."""
    if isinstance(value, dict):
        value = value.get("number", 0) if value.get("set", True) else 0
    return int(value or 0)


def _states(value: Any) -> list[str]:
    """A state as Slurm prints it: a string (22.05), or a list of the state and its flags (later)."""
    return [str(v) for v in value] if isinstance(value, list) else [str(value or "")]


def expand(hostlist: str, most: int = 1 << 16) -> tuple[str, ...]:
    """The node names of a Slurm host list: ``gpu[01-03,7],cpu1`` -> gpu01, gpu02, gpu03, gpu7,
    cpu1; text after a range and several ranges in a name are kept (``n[1-2]-ib[0-1]``: n1-ib0,
    n1-ib1, n2-ib0, n2-ib1).  At most ``most`` names (a longer list is cut there)."""
    out: list[str] = []
    for item in re.findall(r"(?:[^,\[]|\[[^\]]*\])+", hostlist):
        names = [""]
        for text, ranges in re.findall(r"([^\[]*)(?:\[([^\]]*)\])?", item):
            names = [n + text for n in names]
            if ranges:
                names = [n + i for n in names for i in _numbers(ranges, most)][:most]
        out += names[: most - len(out)]
    return tuple(out)


def _numbers(ranges: str, most: int) -> list[str]:
    """``01-03,7`` -> 01, 02, 03, 7 (each as wide as the range's first number)."""
    out: list[str] = []
    for part in ranges.split(","):
        lo, _, hi = part.partition("-")
        out += [f"{i:0{len(lo)}d}" for i in range(int(lo), min(int(hi or lo), int(lo) + most) + 1)]
    return out[:most]


def _node(d: dict[str, Any]) -> SNode:
    state = _states(d.get("state"))
    return SNode(
        str(d["name"]),
        state[0].lower(),
        frozenset(str(f).upper() for f in [*(d.get("state_flags") or ()), *state[1:]]),
        tuple(str(p) for p in d.get("partitions") or ()),
        str(d.get("reason") or ""),
        _gpus(str(d.get("gres") or "")),
        _gpus(str(d.get("gres_used") or "")),
        int(d.get("alloc_cpus") or 0),
    )


def _job(d: dict[str, Any]) -> SJob:
    allocated = (d.get("job_resources") or {}).get("allocated_nodes") or ()
    nodes = tuple(str(n["nodename"]) for n in allocated if isinstance(n, dict) and "nodename" in n)
    if not nodes and isinstance(d.get("nodes"), str):  # (Slurm 23.02 and later: the host list)
        nodes = expand(d["nodes"])
    return SJob(
        str(d["job_id"]),
        str(d.get("name") or ""),
        _states(d.get("job_state"))[0].upper(),
        nodes,
        str(d.get("partition") or ""),
        _number(d.get("priority")),
        int(d.get("user_id") or 0),
        str(d.get("comment") or ""),
        str(d.get("admin_comment") or ""),
    )


def run(*args: str, timeout: float = TIMEOUT) -> str:
    """A Slurm command's output; :class:`SchedulerError` with Slurm's own words if it fails."""
    return _run(args, timeout).stdout


def read(*args: str, key: str) -> list[dict[str, Any]]:
    """The ``key`` list of what a ``--json`` command printed (sinfo, squeue: they exit 0 and list
    errors when slurmctld does not answer)."""
    done = _run(args, TIMEOUT)
    try:
        out = json.loads(done.stdout)
        errors = out.get("errors") or []
        items = list(out[key])
    except (ValueError, KeyError, TypeError, AttributeError) as e:
        raise SchedulerError(f"Slurm's {args[0]} printed what this adapter cannot read ({e!r}).") from e
    if errors:
        said = errors[0].get("error") if isinstance(errors[0], dict) else errors[0]
        raise SchedulerError(f"Slurm does not answer ({args[0]}: {said}).", down=True)
    return items


def _run(args: tuple[str, ...], timeout: float) -> subprocess.CompletedProcess[str]:
    try:
        done = subprocess.run(list(args), capture_output=True, text=True, timeout=timeout, stdin=subprocess.DEVNULL)
    except FileNotFoundError as e:
        raise SchedulerError(f"Slurm's {args[0]} is not installed on the orchestrator's node.") from e
    except subprocess.TimeoutExpired as e:
        raise SchedulerError(f"Slurm does not answer: {args[0]} took more than {timeout:g} s.", down=True) from e
    if done.returncode != 0:
        said = (done.stderr.strip().splitlines() or [f"exit status {done.returncode}"])[-1]
        down = any(d in said.lower() for d in _DOWN)
        raise SchedulerError(f"Slurm's {args[0]} {args[1] if len(args) > 1 else ''} failed: {said}", down=down)
    return done


class Slurm:
    name = "Slurm"

    def __init__(self, cfg: OrchestratorConfig) -> None:
        self.cfg = cfg
        self.lock = threading.Lock()
        self.read: tuple[float, dict[str, SNode], list[SJob]] | None = None
        self.unknown: set[str] = set()  # tainted nodes Slurm knows not (said once)
        self.unheld: set[tuple[str, str]] = set()  # (job, node): ranks there Slurm would not hold (said once)

    # ---- reading -------------------------------------------------------------------------

    def refresh(self) -> tuple[dict[str, SNode], list[SJob]]:
        try:
            nodes = {n.name: n for n in map(_node, read("sinfo", "--json", key="nodes"))}
            jobs = [_job(j) for j in read("squeue", "--all", "--json", key="jobs")]
        except (ValueError, KeyError, TypeError) as e:
            raise SchedulerError(f"Slurm's sinfo or squeue said what this adapter cannot read ({e!r}).") from e
        with self.lock:
            self.read = (time.monotonic(), nodes, jobs)
        return nodes, jobs

    def _last(self) -> tuple[dict[str, SNode], list[SJob]] | None:
        with self.lock:
            if self.read is None or time.monotonic() - self.read[0] > FRESH_FOR:
                return None
            return self.read[1], self.read[2]

    @staticmethod
    def job_of(job: str, jobs: list[SJob], users: frozenset[int]) -> SJob | None:
        """The Slurm job of a tpagent job: the one whose ID it is (``srun ... tpagent rank``'s
        default) if its ranks run as that job's user (``users``, root's aside); never found by
        name, which any user can give their own jobs, nor for another user's ranks (a job name
        is theirs to choose: TPAGENT_JOB)."""
        found = next((j for j in jobs if j.id == job_name(job) and j.hold_of() is None), None)
        return found if found is not None and all(u == found.user_id for u in users) else None

    def check(self) -> None:
        part = self.cfg.slurm_spare_partition
        try:
            text = run("scontrol", "show", "partition", "--oneliner")
        except SchedulerError as e:
            if e.down:  # (it may come back: the orchestrator starts, and waits for it to move anything)
                log.warning("%s", e)
                return
            raise UsageError(str(e)) from e
        have = re.findall(r"PartitionName=(\S+)", text)
        if part and part not in have:
            raise UsageError(f"Slurm has no partition {part!r} (slurm_spare_partition; it has: {', '.join(have)}).")

    # ---- the port ------------------------------------------------------------------------

    def pool(self, job: str, users: frozenset[int]) -> Pool:
        last = self._last()
        if last is None:
            return Pool(floating=frozenset(), why="Slurm has not answered lately: no spare is taken")
        nodes, jobs = last
        mine = self.job_of(job, jobs, users)
        held = {h[1] for j in jobs if j.active and (h := j.hold_of())}
        spare = self.cfg.slurm_spare_partition
        idle = {n.name for n in nodes.values() if n.usable and n.cpus_used == 0 and n.name not in held}
        cfg_gpus = self.cfg.dedicated()
        order = [*cfg_gpus, *sorted(n for n in idle if spare and spare in nodes[n].partitions)]
        dedicated = {n: cfg_gpus.get(n, frozenset()) for n in dict.fromkeys(order) if n in idle}
        floating: set[str] = set()
        taken: set[str] = set()
        if mine is not None:
            own = [n for n in nodes.values() if mine.partition in n.partitions and n.usable and n.name not in held]
            floating = {n.name for n in own if n.name in idle or n.gpus > n.gpus_used}
            below = min(self.cfg.slurm_preempt_below, mine.priority)
            for n in own:
                there = [j for j in jobs if j.state == "RUNNING" and n.name in j.nodes]
                if (
                    self.cfg.slurm_preempt_below
                    and there
                    and all(j.priority < below and j.id != mine.id for j in there)
                ):
                    taken.add(n.name)
        return Pool(dedicated, frozenset(floating), frozenset(taken))

    def hold(self, move: Move, gpus: int, users: frozenset[int]) -> Held:
        if move.kind is MoveKind.HOME:
            return Held()  # (back where the job ran: its own allocation, or a node it held before)
        nodes, jobs = self.refresh()
        mine = self.job_of(move.job, jobs, users)
        if mine is not None and move.target in mine.nodes:
            return Held()  # (its own allocation: Slurm counts it as the job's already)
        node = nodes.get(move.target)
        if node is None:
            raise SchedulerError(f"Slurm knows no node {move.target}: a rank moved there would run unaccounted.")
        found = [j for j in jobs if j.active and j.hold_of() == (move.job, move.target)]
        said: list[str] = []
        if found:
            handle = found[0].id
        else:
            giving = self._giving_way(move, node, jobs, mine, gpus)
            handle = self._submit(move.job, node, gpus, mine)  # (first: one sbatch refuses requeues nothing)
            for j in giving:
                run("scontrol", "requeue", j.id)
                said.append(
                    f"Slurm job {j.id} ({j.name}, priority {j.priority}) requeued to free {node.name} "
                    f"for job {job_name(move.job)} rank(s) {', '.join(map(str, move.ranks))}"
                )
        deadline = time.monotonic() + self.cfg.spare_hold_timeout
        while True:
            state = next((j for j in self.refresh()[1] if j.id == handle), None)
            if state is not None and state.state == "RUNNING":
                return Held(handle, tuple(said))
            if state is None or not state.active or time.monotonic() > deadline:
                self._cancel(handle)
                how = state.state.lower() if state is not None else "gone"
                raise SchedulerError(
                    f"Slurm did not allocate {move.target} to placeholder job {handle} "
                    f"in {self.cfg.spare_hold_timeout:g} s (it is {how})" + "".join(f"; {x}" for x in said) + "."
                )
            time.sleep(0.5)

    def _giving_way(self, move: Move, node: SNode, jobs: list[SJob], mine: SJob | None, gpus: int) -> list[SJob]:
        """The jobs on ``node`` to requeue for ``move``: none where it is free enough; SchedulerError
        where one of them does not give way."""
        there = [j for j in jobs if j.state == "RUNNING" and node.name in j.nodes and j.hold_of() is None]
        if not there or node.cpus_used == 0 or gpus and node.gpus - node.gpus_used >= gpus:
            return []  # (free, or GPUs enough free beside what runs there: the placeholder asks for those)
        below = min(self.cfg.slurm_preempt_below, mine.priority if mine is not None else 0)
        for j in there:
            if not self.cfg.slurm_preempt_below or j.priority >= below:
                raise SchedulerError(
                    f"{node.name} runs Slurm job {j.id} (priority {j.priority}), which does not give way "
                    f"to job {job_name(move.job)} (slurm_preempt_below = {self.cfg.slurm_preempt_below})."
                )
        return there

    def _submit(self, job: str, node: SNode, gpus: int, mine: SJob | None) -> str:
        spare = self.cfg.slurm_spare_partition
        if spare and spare in node.partitions:
            partition = spare
        elif mine is not None and mine.partition in node.partitions:
            partition = mine.partition
        else:
            partition = node.partitions[0] if node.partitions else ""
        marker = f"tpagent hold job={job} node={node.name}"
        args = ["sbatch", "--parsable", "--hold", "--job-name", HOLD_NAME, "--nodes", "1", "--nodelist", node.name]
        args += ["--comment", marker, "--output", "/dev/null", "--no-requeue"]
        args += ["--partition", partition] if partition else []
        args += ["--gres", f"gpu:{gpus}"] if gpus and node.gpus else ["--exclusive"]
        handle = run(*args, "--wrap", "exec sleep infinity").strip().split(";")[0]
        if not handle.isdigit():
            raise SchedulerError(f"Slurm's sbatch gave no job ID for the placeholder ({handle!r}).")
        try:  # (held until marked: an orchestrator killed in between leaves a held job that holds nothing)
            run("scontrol", "update", f"JobId={handle}", f"AdminComment={marker}")
            run("scontrol", "release", handle)
        except SchedulerError:
            self._cancel(handle)
            raise
        return handle

    def _cancel(self, handle: str) -> None:
        try:
            run("scancel", handle)
        except SchedulerError as e:
            log.warning("placeholder job %s not cancelled: %s", handle, e)

    def reconcile(self, wanted: Callable[[], Wanted]) -> list[str]:
        nodes, jobs = self.refresh()
        want = wanted()
        said = self._drains(want, nodes)
        for j in jobs:
            key = j.hold_of()
            if key is None or not j.active or key in want.moving:
                continue
            owner = self.job_of(key[0], jobs, want.users.get(key[0], frozenset()))
            alive = key[0] in want.running or (owner is not None and owner.active)
            if (key in want.away or key in want.runs) and alive:
                continue
            run("scancel", j.id)
            why = f"no rank of job {job_name(key[0])} runs there" if alive else f"job {job_name(key[0])} ended"
            said.append(f"placeholder job {j.id} on {key[1]} cancelled: {why}")
        said += self._remade(want, nodes, jobs)
        holds = {h: j.id for j in jobs if j.active and (h := j.hold_of())}
        recorded = set()
        for job, ranks in want.where.items():
            mine = self.job_of(job, jobs, want.users.get(job, frozenset()))
            if mine is None or not mine.active:
                continue
            recorded.add(mine.id)
            where = [
                f"rank {r} on {n}" + (f" (hold {holds[job, n]})" if (job, n) in holds else "") for r, n in ranks.items()
            ]
            text = recorded_in(mine.admin_comment, printable(PREFIX + "; ".join(sorted(where)), 1000))
            if mine.admin_comment != text:
                run("scontrol", "update", f"JobId={mine.id}", f"AdminComment={text}")
        for j in jobs:  # (not a placeholder: its marker holds a job's name, which a user may make look like a record)
            text = recorded_in(j.admin_comment, "")
            if j.active and j.id not in recorded and j.hold_of() is None and text != j.admin_comment:
                run("scontrol", "update", f"JobId={j.id}", f"AdminComment={text}")
        return said

    def _remade(self, want: Wanted, nodes: dict[str, SNode], jobs: list[SJob]) -> list[str]:
        """Placeholders made again where ranks of a running job are away with none (someone else
        cancelled it), or made where ranks of a job of Slurm's run outside its nodes with none (moved
        there by hand, or by an orchestrator that lost its database): held as a whole node, not waited for."""
        holds = {h for j in jobs if j.active and (h := j.hold_of())}
        said = []
        for job, name in sorted((want.away | want.runs) - holds - want.moving):
            mine = self.job_of(job, jobs, want.users.get(job, frozenset()))
            alive = job in want.running or mine is not None and mine.active
            if not alive or name not in nodes or mine is not None and name in mine.nodes:
                continue
            away = (job, name) in want.away
            if not away and (mine is None or not mine.active or not mine.nodes):  # (not Slurm's, or not placed)
                continue
            try:
                handle = self._submit(job, nodes[name], 0, mine)
            except SchedulerError as e:
                if e.down:
                    raise  # (one refused, a QOS's, stops neither the other jobs' placeholders nor their records)
                if (job, name) not in self.unheld:  # (said once, not at every reconcile)
                    self.unheld.add((job, name))
                    said.append(f"{name} not held for job {job_name(job)}, whose ranks run there: {e}")
                continue
            how = "again: job {}'s ranks run there" if away else "for job {}: its ranks run there, outside its nodes"
            said.append(f"placeholder job {handle} submitted to hold {name} " + how.format(job_name(job)))
        return said

    def _drains(self, want: Wanted, nodes: dict[str, SNode]) -> list[str]:
        said = []
        for name, why in sorted(want.drains.items()):
            node = nodes.get(name)
            if node is None:
                if name not in self.unknown:
                    said.append(f"Slurm knows no node {name}: its taint does not drain it there")
                self.unknown.add(name)
            elif not node.drained:
                reason = printable(PREFIX + why, 200)
                run("scontrol", "update", f"NodeName={name}", "State=DRAIN", f"Reason={reason}")
                said.append(f"{name} drained in Slurm ({reason})")
        self.unknown &= set(want.drains)
        for name, node in sorted(nodes.items()):
            if node.drained and node.reason.startswith(PREFIX) and name not in want.drains:
                run("scontrol", "update", f"NodeName={name}", "State=RESUME")
                said.append(f"{name} resumed in Slurm (tpagent had drained it)")
        return said
