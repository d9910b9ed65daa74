"""What the orchestrator does next: a pure function of its taints, moves and ranks away from
home, and the nodes as their agents last reported them.

* On a taint, the ranks on the tainted node (a GPU's taint: those using that GPU) move, each
  job's together (one boundary), to one spare that fits them: dedicated spares first, in the
  configuration's order, then floating capacity.  A node that is tainted, silent, a move's
  target already, or the home some moved ranks will return to is no spare.
* A move that failed (the ranks run where they were) is planned again on another spare where
  there is one (else on the same), up to ``retries`` times; then the taint says why its ranks stay.
* Once the taint that moved ranks away is removed, ranks whose job returns home go back there,
  if it is reachable, untainted and free.
* A planned move whose taint was removed before it started is cancelled.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field, replace

from tpagent.orchestrator.api import (
    Away,
    Gpu,
    Move,
    MoveKind,
    MoveState,
    NodeSeen,
    RankSeen,
    Taint,
    View,
    job_identity,
    job_name,
)
from tpagent.orchestrator.config import OrchestratorConfig
from tpagent.orchestrator.scheduler import Pool

#: The failed moves of (job, source node, taint).
Failed = Callable[[str, str, "int | None"], list[Move]]


@dataclass(frozen=True)
class NewMove:
    job: str
    ranks: tuple[int, ...]
    source: str
    target: str
    kind: MoveKind
    taint: int | None
    attempt: int


@dataclass(frozen=True)
class Spare:
    node: str
    free: tuple[Gpu, ...]  # its GPUs no rank uses and no taint covers
    dedicated: bool
    empty: bool  # no rank, nor any other workload's process on a GPU, runs there


@dataclass
class Plan:
    moves: list[NewMove] = field(default_factory=list)
    cancels: list[tuple[int, str]] = field(default_factory=list)
    waiting: dict[int, str] = field(default_factory=dict)  # taint id -> why its ranks stay ("": they do not)
    spares: list[Spare] = field(default_factory=list)  # free before this plan


def spares(
    view: View,
    taints: list[Taint],
    active: list[Move],
    away: list[Away],
    cfg: OrchestratorConfig,
    dedicated: dict[str, frozenset[str]],
) -> list[Spare]:
    """The capacity free now, ``dedicated`` spares (node -> its GPUs reserved, empty: all) first."""
    blocked = {t.node for t in taints if not t.gpu} | {m.target for m in active} | {m.source for m in active}
    running = {r.job for n in view.nodes.values() for r in n.ranks}
    # (kept for their return: while their job runs, or may, its nodes not all heard from yet)
    blocked |= {a.home for a in away if cfg.returns_home(a.job) and (a.job in running or not view.heard)}
    blocked |= view.held
    out = []
    for name, n in view.nodes.items():
        if name in blocked or not view.current(name):
            continue
        spare = _spare_of(n, taints)
        free = tuple(g for g in spare.free if g.uuid in dedicated[name]) if dedicated.get(name) else spare.free
        if free or spare.empty:
            out.append(replace(spare, free=free, dedicated=name in dedicated))
    order = list(dedicated)
    return sorted(out, key=lambda s: (not s.dedicated, order.index(s.node) if s.dedicated else 0, s.node))


def misfit(source: NodeSeen, job: str, ranks: tuple[int, ...], spare: Spare, node: NodeSeen) -> str:
    """Why ``spare`` cannot take ``ranks`` of ``job`` on ``source`` ("": it can)."""
    wanted = gpus_used(source.ranks, job, ranks)
    if not wanted:
        return "" if spare.empty else "runs ranks already"
    models = [g for g in source.gpus if g.uuid in wanted]
    if source.driver != node.driver:
        return f"driver {node.driver or 'none'}, not {source.driver}"
    fit = _fitting(source, wanted, spare)
    if len(fit) < len(wanted):
        return f"{len(fit)} free GPU(s) like {models[0].name if models else 'the source'}'s, needs {len(wanted)}"
    return ""


def choose(
    view: View, source: NodeSeen, job: str, ranks: tuple[int, ...], free: list[Spare], tried: set[str], pool: Pool
) -> tuple[Spare | None, str]:
    """The first spare of ``free`` the scheduler's ``pool`` allows that fits: one not ``tried``
    before if there is one, one taken from lower-priority work only if no other fits; never
    ``source`` itself (its ranks would be moved onto their own node, then "home" from it to it)."""
    if pool.why:
        return None, pool.why
    why = []
    fits = []
    for s in free:
        if s.node == source.name:
            continue
        if not (s.dedicated or pool.floating is None or s.node in pool.floating or s.node in pool.taken):
            continue
        reason = misfit(source, job, ranks, s, view.nodes[s.node])
        if reason:
            why.append(f"{s.node} {reason}")
        else:
            fits.append(s)
    if fits:  # (a stable sort: dedicated ones first still)
        return sorted(fits, key=lambda s: (s.node in pool.taken, s.node in tried))[0], ""
    return None, "no spare fits" + (f" ({'; '.join(why)})" if why else ": none is free")


def plan(
    view: View,
    taints: list[Taint],
    moves: list[Move],
    away: list[Away],
    failed: Failed,
    cfg: OrchestratorConfig,
    pools: Callable[[str], Pool],
) -> Plan:
    """``pools(job)``: where the scheduler lets ``job``'s ranks go (its dedicated spares are every job's)."""
    active = [m for m in moves if m.state in (MoveState.PLANNED, MoveState.RUNNING)]
    dedicated = pools("").dedicated
    out = Plan(spares=spares(view, taints, active, away, cfg, dedicated))
    free = list(out.spares)
    moving = {m.job for m in active}
    live = {t.id for t in taints}
    node_taints = {t.node for t in taints if not t.gpu}
    for m in active:
        if m.state is not MoveState.PLANNED:
            continue
        if m.kind is MoveKind.AWAY and m.taint not in live:
            out.cancels.append((m.id, "its taint was removed before it started"))
        elif m.target in node_taints:
            out.cancels.append((m.id, f"{m.target} was tainted before it started"))
        elif view.rebuilt(m.job):
            out.cancels.append((m.id, "its job's lost ranks are being rebuilt"))
        elif m.target in view.held:
            out.cancels.append((m.id, f"{m.target} was given to a rebuild of lost ranks before it started"))
        elif gone := [n for n in (m.target, m.source) if view.gone(n)] or view.lost_with(m.job):
            out.cancels.append((m.id, f"{gone[0]} stopped reporting before it started"))
        elif why := _unfit(view, taints, dedicated, m):
            out.cancels.append((m.id, f"{m.target} no longer fits before it started ({why})"))
    reasons: dict[int, list[str]] = defaultdict(list)
    for t in taints:
        node = view.nodes.get(t.node)
        if node is None or not view.reachable(t.node):
            reasons[t.id].append(f"{t.node} has not reported (lately): its ranks are not moved while it is silent")
            continue
        if not view.current(t.node):
            continue
        groups: dict[str, list[int]] = defaultdict(list)
        for r in node.ranks:
            if t.covers(node.name, r.gpus):
                groups[r.job].append(r.rank)
        for job, ranks in sorted(groups.items()):
            if job in moving:
                if other := [m.id for m in active if m.job == job and m.taint != t.id]:
                    reasons[t.id].append(f"job {job_name(job)} is being moved (move {other[0]}); one move at a time")
                continue
            if job in view.busy():
                reasons[t.id].append(f"job {job_name(job)} is being moved by someone else")
                continue
            if view.rebuilt(job):
                reasons[t.id].append(f"job {job_name(job)}'s lost ranks are being rebuilt")
                continue
            if lost := view.lost_with(job):
                reasons[t.id].append(f"job {job_name(job)} has ranks on {lost[0]}, which stopped reporting")
                continue
            done = failed(job, node.name, t.id)
            if len(done) > cfg.retries:
                reasons[t.id].append(
                    f"moving job {job_name(job)}'s ranks failed {len(done)} times (last: {done[-1].message})"
                )
                continue
            avoid = {
                m.target for m in done if m.state is MoveState.FAILED
            }  # (an interrupted try: not the spare's doing)
            spare, why = choose(view, node, job, tuple(ranks), free, avoid, pools(job))
            if spare is None:
                reasons[t.id].append(f"job {job_name(job)} rank(s) {', '.join(map(str, ranks))}: {why}")
                continue
            free.remove(spare)
            moving.add(job)
            out.moves.append(NewMove(job, tuple(ranks), node.name, spare.node, MoveKind.AWAY, t.id, len(done) + 1))
    out.waiting = {t.id: "; ".join(reasons[t.id]) for t in taints}
    _home(view, taints, away, failed, cfg, moving, out)
    return out


def followed(view: View, moves: list[Move], away: list[Away]) -> list[tuple[Away, str]]:
    """Each rank away whose agents report it on another node than the record's, and that node:
    moved outside the orchestrator (`tpagent migrate`), or rebuilt elsewhere.  Only where every
    report can be trusted (none stale, every node heard, no move of its job under way here or
    on any agent, no rebuild on the node), its identity is known, and exactly one node runs it."""
    if view.stale or not view.heard:
        return []
    moving = {m.job for m in moves} | view.busy()
    out = []
    for a in away:
        if a.job in moving or not job_identity(a.job):  # (a key of no identity may be any user's job)
            continue
        on = [
            name
            for name, n in view.nodes.items()
            if not view.gone(name) and any(r.job == a.job and r.rank == a.rank for r in n.ranks)
        ]
        if len(on) == 1 and on[0] != a.on and on[0] not in view.held:  # (held: a rebuild under way there)
            out.append((a, on[0]))
    return out


def _home(
    view: View,
    taints: list[Taint],
    away: list[Away],
    failed: Failed,
    cfg: OrchestratorConfig,
    moving: set[str],
    out: Plan,
) -> None:
    live = {t.id for t in taints}
    tainted = {t.node for t in taints if not t.gpu}
    groups: dict[tuple[str, str, str, int], list[int]] = defaultdict(list)
    for a in away:
        if a.taint not in live and cfg.returns_home(a.job):
            groups[a.job, a.on, a.home, a.taint].append(a.rank)
    for (job, on, home, taint), ranks in sorted(groups.items()):
        node = view.nodes.get(on)
        if job in moving or node is None or on == home or not view.current(on) or not view.current(home):
            continue
        if home in tainted or not {r.rank for r in node.ranks if r.job == job} >= set(ranks):
            continue
        if job in view.busy() or view.rebuilt(job) or view.lost_with(job):
            continue
        done = failed(job, on, taint)
        target = view.nodes[home]
        if len(done) > cfg.retries or misfit(node, job, tuple(ranks), _spare_of(target, taints), target):
            continue
        moving.add(job)
        out.moves.append(NewMove(job, tuple(ranks), on, home, MoveKind.HOME, taint, len(done) + 1))


def _spare_of(node: NodeSeen, taints: list[Taint]) -> Spare:
    """``node`` as a spare: its GPUs no rank uses, no taint covers, no finding of its health names
    (its next report taints it: an operator's untaint of it does not make it well), and no other
    workload's process uses; empty where neither ranks nor such processes run."""
    used = {g for r in node.ranks for g in r.gpus} | {t.gpu for t in taints if t.node == node.name}
    used |= {f.gpu for f in node.findings} | node.foreign
    return Spare(
        node.name, tuple(g for g in node.gpus if g.uuid not in used), False, not node.ranks and not node.foreign
    )


def gpus_used(ranks: Iterable[RankSeen], job: str, which: tuple[int, ...]) -> set[str]:
    """The GPUs the ranks ``which`` of ``job`` among ``ranks`` use."""
    return {g for r in ranks if r.job == job and r.rank in which for g in r.gpus}


def _fitting(source: NodeSeen, wanted: set[str], spare: Spare) -> list[Gpu]:
    """The free GPUs of ``spare`` like the ``wanted`` GPUs of ``source`` (their model, as much memory)."""
    models = [g for g in source.gpus if g.uuid in wanted]
    return [g for g in spare.free if all(g.name == m.name and g.memory_total >= m.memory_total for m in models)]


def _target_of(view: View, taints: list[Taint], dedicated: dict[str, frozenset[str]], m: Move) -> Spare:
    """``m``'s target as a spare for it now: moving away onto a dedicated spare, only its GPUs reserved."""
    spare = _spare_of(view.nodes[m.target], taints)
    if m.kind is MoveKind.AWAY and dedicated.get(m.target):
        return replace(spare, free=tuple(g for g in spare.free if g.uuid in dedicated[m.target]))
    return spare


def target_gpus(
    view: View, taints: list[Taint], dedicated: dict[str, frozenset[str]], m: Move
) -> tuple[str, ...] | None:
    """The GPUs of ``m``'s target its ranks may be placed on (its agent picks among them): those
    like theirs that no rank uses, no taint covers and, moving away onto a dedicated spare, that
    are reserved; () for ranks that use no GPU; None: too few are left, or a report is missing."""
    source = view.nodes.get(m.source)
    if source is None or m.target not in view.nodes:
        return None
    wanted = gpus_used(source.ranks, m.job, m.ranks)
    fit = _fitting(source, wanted, _target_of(view, taints, dedicated, m)) if wanted else []
    return tuple(g.uuid for g in fit) if len(fit) >= len(wanted) else None


def _unfit(view: View, taints: list[Taint], dedicated: dict[str, frozenset[str]], m: Move) -> str:
    """Why the target of planned move ``m`` no longer takes its ranks, as reported now (a GPU of
    it tainted since, taken by a rank): "" if it does, or if either node's report is not current."""
    source = view.nodes.get(m.source)
    target = view.nodes.get(m.target)
    if source is None or target is None or not (view.current(m.source) and view.current(m.target)):
        return ""
    return misfit(source, m.job, m.ranks, _target_of(view, taints, dedicated, m), target)


def kept_gpus(seen: NodeSeen, before: NodeSeen | None) -> NodeSeen:
    """``seen``; a rank whose GPU no longer answers NVML (its processes are no longer listed)
    keeps the GPUs it used before, so that a taint of that GPU still covers it, and so does a
    rank that died (its processes are gone), so that its rebuild's spare has GPUs like them."""
    old = {(r.job, r.rank): r.gpus for r in (*before.ranks, *before.died)} if before is not None else {}

    def kept(ranks: tuple[RankSeen, ...]) -> tuple[RankSeen, ...]:
        return tuple(r if r.gpus else replace(r, gpus=old.get((r.job, r.rank), ())) for r in ranks)

    return replace(seen, ranks=kept(seen.ranks), died=kept(seen.died))
