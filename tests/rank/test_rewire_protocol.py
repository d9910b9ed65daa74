"""The rewire coordinator (tpagent/jobs/rewire.py) against ranks kept in memory: each answers the
runtime's requests as tpagent_rank does (a training thread advancing its step, parking at the
agreed boundary).  Only the ranks and the migration are stand-ins; the coordinator is real."""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import pytest

from tpagent.jobs.api import Moving, RewireRecord
from tpagent.jobs.journal import Unwritten
from tpagent.jobs.rewire import Rewire
from tpagent.migration.api import Event, MigrationResult, Outcome, Refused, Why
from tpagent_rank import protocol as P
from tpagent_rank import rewire

HERE = "10.0.0.1:7400"
THERE = "10.0.0.9:7400"


@dataclass
class FakeRank:
    rank: int
    step: int = 0
    gen: int = 0
    stop_at: int | None = None
    parked: bool = False
    torn: bool = False
    dead: bool = False
    dies_after: str = ""  # the op it dies right after answering (a peer killed mid-rewire)
    refuse_rebuild_at: str = ""  # it cannot build its communicators on this node (its agent's address)
    at: str = ""  # where it was asked last
    nccl_host: str | None = None  # the host identity its NCCL holds (None: no NCCL)
    nccl_ras: bool = False  # its NCCL runs the RAS thread
    hosts: dict[str, str] = field(default_factory=dict)  # its agent's address -> that node's host identity
    optimizer: bool = True  # it takes optimizer steps (else only its collectives are counted)
    log: list[str] = field(default_factory=list)
    units: list[str] = field(default_factory=list)
    stops: list[int] = field(default_factory=list)  # the steps it parked at (once resumed, it steps on)
    stopped_by: str = ""  # the move that stopped it (the runtime's own check holds it to that move)
    lock: threading.Lock = field(default_factory=threading.Lock)

    @property
    def cond(self) -> threading.Lock:
        return self.lock

    def tick(self) -> None:
        """One step of its training thread (unless parked)."""
        with self.lock:
            if self.dead or self.parked:
                return
            self.step += 1
            if self.stop_at is not None and self.step >= self.stop_at:
                self.parked = True
                self.stops.append(self.step)

    def answer(self, request: P.Request[Any]) -> P.Answer:
        if self.dead:
            raise Refused(f"rank {self.rank} is no longer running", Why.NOT_FOUND)
        self.log.append(request.OP.value)
        self.dead = request.OP.value == self.dies_after
        if isinstance(request, P.End):
            return P.Answer()
        if refused := rewire.by_another(self, request):
            return refused
        with self.lock:
            if isinstance(request, P.Where):
                # (the fake counts one collective per step: either unit stops it at the same place)
                return P.Standing(
                    step=self.step if self.optimizer else 0,
                    collectives=self.step,
                    gen=self.gen,
                    rate=100.0,
                    collective_rate=100.0,
                    nccl_host=self.nccl_host or "",
                    nccl_ras=self.nccl_ras,
                    host=self.hosts.get(self.at, "here|boot1"),
                )
            if isinstance(request, P.Pause):
                self.units.append(request.unit)
                if self.step >= request.at:
                    return P.Paused(ok=False, late=True, error="past it")
                self.stop_at = request.at
                self.stopped_by = request.by
                self.parked = self.step >= self.stop_at
                if self.parked:
                    self.stops.append(self.step)
                return P.Paused()
            if isinstance(request, P.Cancel):
                self.stop_at, self.stopped_by = None, ""
                self.parked = False
                return P.Answer()
            if isinstance(request, P.Teardown):
                self.torn = True
                return P.TornDown()
            if isinstance(request, P.Rebuild):
                if self.at == self.refuse_rebuild_at:
                    return P.failed("the store cannot be reached from here")
                self.torn = False
                self.gen = request.gen
                return P.Answer()
            if isinstance(request, P.Resume):
                self.stop_at, self.stopped_by = None, ""
                self.parked = False
                return P.Answer()
        if isinstance(request, P.Boundary):
            deadline = time.monotonic() + request.timeout
            while not self.parked:
                if self.dead or time.monotonic() > deadline:
                    return P.AtBoundary(ok=False, error="it did not reach the step in time")
                time.sleep(0.01)
            return P.AtBoundary(step=self.step)
        raise AssertionError(request)


class FakeMove:
    """A migration's surface as the coordinator uses it: one that gets as far as a running copy
    (``outcome`` DONE) holds it for the coordinator's verdict, kept or dropped."""

    def __init__(self, pid: int, outcome: Outcome, hold: float, verdict: Callable[[], bool | None] | None) -> None:
        self.pid = pid
        self.outcome = outcome
        self.migration_id = f"m{pid}"
        self.events: queue.Queue[Event | None] = queue.Queue()
        self.result: MigrationResult | None = None
        self.hold = hold
        self.verdict = verdict
        self.problems: list[str] = []
        self.copy_runs = threading.Event()
        self.new_pid = 0
        self.on_copy: Callable[[bool], None] = lambda _runs: None  # the copy runs (True), or no longer (False)

    def run(self) -> MigrationResult:
        self.events.put(Event(self.migration_id, "freezing"))
        outcome = self.outcome
        if outcome is Outcome.DONE:
            assert self.hold > 0 and self.verdict is not None, "a rank's copy must wait for the coordinator's word"
            self.new_pid = 4242
            self.on_copy(True)
            self.copy_runs.set()
            deadline = time.monotonic() + 10
            while (keep := self.verdict()) is None:
                assert time.monotonic() < deadline, "no verdict on the held copy"
                time.sleep(0.01)
            if not keep:
                self.on_copy(False)
                outcome = Outcome.ROLLED_BACK
        self.events.put(Event(self.migration_id, "done" if outcome is Outcome.DONE else "rolled_back"))
        self.result = MigrationResult(self.migration_id, outcome, "", 4242 if outcome is Outcome.DONE else 0)
        self.events.put(None)
        return self.result

    def cancel(self, reason: str) -> bool:
        return False


#: The job's identity, as the moving rank's agent vouches for it (every rank of the job has it).
KEY = "0:5eed"


class Job:
    def __init__(self, world: int = 3, outcome: Outcome = Outcome.DONE, stepping: bool = True) -> None:
        self.ranks = [FakeRank(r) for r in range(world)]
        self.where = [HERE] + [f"10.0.0.{r + 1}:7400" for r in range(1, world)]
        self.outcome = outcome
        self.asked: list[tuple[str, int, str]] = []
        self.ends: list[tuple[int, bool]] = []  # (rank, hold) of each End, in the order asked
        self.released: list[tuple[int, str]] = []
        self.placed: list[tuple[bool, tuple[str, ...]]] = []  # (dry run, the target's GPUs named) per move asked
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._train, daemon=True)
        if stepping:
            self.thread.start()

    def _train(self) -> None:
        while not self.stop.is_set():
            for r in self.ranks:
                r.tick()
            time.sleep(0.002)

    def ask(self, address: str, job: str, rank: int, request: P.Request[Any], timeout: float, key: str = "") -> Any:
        op = request.OP.value
        self.asked.append((address, rank, op))
        if isinstance(request, P.End):
            self.ends.append((rank, request.hold))
        if request.OP in (P.RUNTIME_OPS | {P.Op.RELEASE}) - P.ASKED_FREELY:
            assert key == KEY, f"{op} of rank {rank} asked without the job's identity ({key!r})"
        if isinstance(request, P.Peers):
            return P.Agents(agents=tuple(self.where), key=KEY)
        if isinstance(request, (P.Expect, P.Moved, P.Release)):
            # (a rank is expected and released where it runs, its move noted where it was)
            assert address == (HERE if op == "moved" else self.where[rank]), (request, address, self.where)
            if isinstance(request, P.Release):
                assert (rank, address) not in self.released, f"rank {rank} released twice at {address}"
                self.released.append((rank, address))
            return P.Answer()
        assert address == self.where[rank], f"rank {rank} asked at {address}, it runs at {self.where[rank]}"
        self.ranks[rank].at = address
        return self.ranks[rank].answer(request)

    def start_move(
        self,
        pid: int,
        target: str,
        *,
        dry_run: bool = False,
        hold: float = 0.0,
        verdict: Callable[[], bool | None] | None = None,
        target_gpus: tuple[str, ...] = (),
    ) -> Moving:
        self.placed.append((dry_run, target_gpus))
        move = FakeMove(pid, Outcome.DRY_RUN if dry_run else self.outcome, hold, verdict)
        move.on_copy = lambda runs: self.where.__setitem__(0, target if runs else HERE)
        return move

    def rewire(self, timeout: float = 5.0, gpus: tuple[str, ...] = ()) -> tuple[Rewire, MigrationResult]:
        record = RewireRecord.new("j", HERE, {0: (777, THERE)})
        record.gpus = list(gpus)
        rw = Rewire(record, self.ask, self.start_move, timeout, Unwritten())
        try:
            return rw, rw.run()
        finally:
            self.stop.set()


def _messages(rw: Rewire) -> list[str]:
    out = []
    while (e := rw.events.get_nowait()) is not None:
        out.append(e.message)
    return out


def test_every_rank_stops_at_one_step_and_rebuilds_where_it_now_runs() -> None:
    job = Job()
    rw, result = job.rewire(gpus=("GPU-t2", "GPU-t3"))
    assert result.outcome is Outcome.DONE, _messages(rw)
    assert job.placed == [(False, ("GPU-t2", "GPU-t3"))]  # (the target's GPUs named for the move, passed on)
    steps = {r.stops[-1] for r in job.ranks}
    assert len(steps) == 1, f"the ranks stopped at different steps: {steps}"
    assert all(r.gen == 1 and not r.torn and not r.parked for r in job.ranks)
    rebuilds = [(a, r) for a, r, op in job.asked if op == "rebuild"]
    assert (THERE, 0) in rebuilds and (HERE, 0) not in rebuilds, "rank 0 must rebuild on the node it moved to"
    for r in job.ranks:  # the order each rank saw
        ops = [op for op in r.log if op != "where"]
        assert ops == ["pause", "boundary", "teardown", "rebuild", "resume"], ops
    assert {"boundary", "teardown", "migrate", "rebuild"} <= set(result.timings)


@pytest.mark.parametrize("optimizer", [True, False], ids=["optimizer-steps", "no-optimizer"])
def test_the_boundary_counts_optimizer_steps_or_else_the_default_groups_collectives(optimizer: bool) -> None:
    job = Job(stepping=False)
    for r in job.ranks:
        r.optimizer = optimizer
    job.thread.start()
    rw, result = job.rewire()
    assert result.outcome is Outcome.DONE, _messages(rw)
    unit = "step" if optimizer else "collective"
    assert all(r.units == [unit] for r in job.ranks), [r.units for r in job.ranks]
    assert len({r.stops[-1] for r in job.ranks}) == 1
    assert f"resumed at {unit} " in _messages(rw)[-1]
    assert rw.record.unit == unit


def test_a_rolled_back_move_rebuilds_the_rank_where_it_was() -> None:
    job = Job(outcome=Outcome.ROLLED_BACK)
    rw, result = job.rewire()
    assert result.outcome is Outcome.ROLLED_BACK
    assert all(r.gen == 1 and not r.parked for r in job.ranks)
    assert (HERE, 0, "rebuild") in job.asked


def test_a_copy_that_cannot_join_the_new_communicators_is_dropped_and_all_rebuild_where_they_were() -> None:
    """Nothing is lost until the communicators are up on every rank: the moved rank's copy fails
    to build them on its target, so it is dropped (its original runs on here) and every rank
    builds them again, under the next generation, with rank 0 back where it was."""
    job = Job()
    job.ranks[0].refuse_rebuild_at = THERE
    rw, result = job.rewire()
    said = _messages(rw)
    assert result.outcome is Outcome.ROLLED_BACK, said
    assert job.where[0] == HERE and all(r.gen == 2 and not r.torn and not r.parked for r in job.ranks)
    assert [op for op in job.ranks[0].log if op != "where"] == [
        "pause",
        "boundary",
        "teardown",
        "rebuild",
        "rebuild",
        "resume",
    ]
    for r in job.ranks[1:]:
        assert [op for op in r.log if op != "where"] == [
            "pause",
            "boundary",
            "teardown",
            "rebuild",
            "teardown",
            "rebuild",
            "resume",
        ]
    assert any("rank 0 stays on this node" in m and "store cannot be reached" in m for m in said), said
    assert rw.record.gen == 2
    assert job.released == [(0, THERE), (0, HERE)], "the copy is told to come back there, the original here"


@pytest.mark.parametrize("there", ["here|boot1", "there|boot2"], ids=["same-host", "other-host"])
def test_a_copy_whose_nccl_would_take_ranks_on_another_host_for_neighbours_is_dropped(there: str) -> None:
    """NCCL reads its host identity once per process (NVIDIA/nccl#2348): rank 0's copy still
    holds that of its first host, as ranks 1 and 2 do, which stay there.  On another host it must
    not be built with them (NCCL would join them through shared memory): the copy is dropped before
    any communicator is built, rank 0 stays, and the job goes on.  On the same host (two agents
    on one machine) nothing is wrong, and it moves."""
    job = Job()
    for r in job.ranks:
        r.nccl_host = "here|boot1"
        r.hosts = {THERE: there}
    rw, result = job.rewire()
    said = _messages(rw)
    if there == "here|boot1":
        assert result.outcome is Outcome.DONE and job.where[0] == THERE, said
        return
    assert result.outcome is Outcome.ROLLED_BACK and job.where[0] == HERE, said
    assert (THERE, 0, "rebuild") not in job.asked, "a communicator was built with the copy on the other host"
    why = next(m for m in said if "rank 0 stays on this node" in m)
    assert "rank(s) 0 on host there" in why and "rank(s) 1, 2 on host here" in why and "nccl issue 2348" in why, why
    assert all(r.gen == 2 and not r.parked for r in job.ranks)


def test_a_rank_past_the_step_makes_all_cancel_and_agree_on_a_later_one() -> None:
    job = Job(stepping=False)
    job.ranks[2].step = 500  # (its "where" said less: it raced ahead)
    real = job.ranks[2].answer
    calls = {"where": 0}

    def answer(request: P.Request[Any]) -> P.Answer:
        if isinstance(request, P.Where) and calls["where"] == 0:
            calls["where"] += 1
            return P.Standing(step=10, gen=0, rate=0.0)
        return real(request)

    job.ranks[2].answer = answer  # type: ignore[method-assign]
    job.thread.start()
    rw, result = job.rewire()
    assert result.outcome is Outcome.DONE, _messages(rw)
    assert len({r.stops[-1] for r in job.ranks}) == 1
    assert job.ranks[0].log.count("cancel") == 1


def test_a_rank_that_dies_at_the_boundary_is_named_and_the_others_go_on() -> None:
    job = Job(stepping=False)
    job.ranks[1].dead = True
    job.thread.start()
    rw, result = job.rewire(timeout=1.0)
    assert result.outcome is Outcome.FAILED
    said = " ".join(_messages(rw))
    assert "rank 1" in said and "no longer running" in said, said
    assert not any(r.parked or r.torn for r in job.ranks if not r.dead), "a live rank was left stopped"
    assert all(op != "teardown" for _a, _r, op in job.asked)


@pytest.mark.parametrize("dies_after", ["pause", "where"])
def test_a_job_ended_while_its_ranks_are_stopped_is_not_said_to_go_on(dies_after: str) -> None:
    """Every rank dies as it is asked to pause (or once it was): the move said "the other ranks go
    on" (or "the job goes on as it was") of a job that was no more."""
    job = Job(stepping=False)
    for r in job.ranks:
        r.dies_after = dies_after
    job.thread.start()
    _rw, result = job.rewire(timeout=1.0)
    assert result.outcome is Outcome.FAILED and "no rank of the job answered" in result.message, result.message
    assert "go on" not in result.message and all(r.dead for r in job.ranks)


def test_ranks_that_all_answer_they_missed_the_step_are_said_to_go_on() -> None:
    """Every rank answers, none reached the step in time (their training stalled): they run on,
    and are not said to be gone."""
    job = Job(stepping=False)  # (its ranks never step: none reaches the step proposed)
    _rw, result = job.rewire(timeout=1.0)
    assert result.outcome is Outcome.FAILED and "did not reach the step in time" in result.message, result.message
    assert result.message.endswith("the other ranks go on") and not any(r.dead for r in job.ranks)


def test_a_peer_dead_after_the_teardown_ends_every_rank_once_all_were_told_why() -> None:
    """Rank 2 dies once the communicators are down: the job cannot go on.  Every live rank is told
    why (End with hold) before any is ended: one ended first may take the others down with its
    launcher (the store's node) before they have heard it."""
    job = Job()
    job.ranks[2].dies_after = "teardown"
    rw, result = job.rewire(timeout=1.0)
    assert result.outcome is Outcome.FAILED and "the job cannot go on" in result.message, result.message
    assert "rank 2 could not build its communicators" in result.message, result.message
    told = [r for r, hold in job.ends if hold]
    ended = [r for r, hold in job.ends if not hold]
    assert sorted(told) == sorted(ended) == [0, 1, 2], job.ends  # (rank 2's agent was asked too: it said gone)
    assert job.ends.index((ended[0], False)) == len(told), f"a rank was ended before all were told: {job.ends}"


@pytest.mark.parametrize("missing", [1, 2])
def test_a_rank_that_never_said_where_its_agent_is_refuses_before_anything_stops(missing: int) -> None:
    job = Job()
    job.where[missing] = ""
    rw, result = job.rewire()
    assert result.outcome is Outcome.FAILED
    assert f"rank(s) {missing}" in " ".join(_messages(rw))
    assert not any(op in ("pause", "teardown") for _a, _r, op in job.asked)


@pytest.mark.parametrize("dry_run", [False, True])
def test_a_moving_rank_whose_nccl_runs_ras_is_refused_before_anything_stops(dry_run: bool) -> None:
    job = Job()
    job.ranks[0].nccl_host = "here|boot1"
    job.ranks[0].nccl_ras = True
    job.ranks[1].nccl_host = "here|boot1"
    job.ranks[1].nccl_ras = True  # (it stays: its RAS is no matter)
    record = RewireRecord.new("j", HERE, {0: (777, THERE)})
    rw = Rewire(record, job.ask, job.start_move, 5.0, Unwritten(), dry_run=dry_run)
    try:
        result = rw.run()
    finally:
        job.stop.set()
    said = []
    while (e := rw.events.get_nowait()) is not None:
        said += [e.message, *e.problems]
    assert result.outcome is (Outcome.DRY_RUN if dry_run else Outcome.FAILED), said
    assert rw.state == "failed"
    assert any("rank 0 runs NCCL's RAS thread" in s for s in said), said
    assert not any("rank 1 runs" in s for s in said), said
    assert not any(op in ("pause", "teardown") for _a, _r, op in job.asked)


def test_a_second_move_of_the_job_started_on_another_node_is_refused_and_the_first_goes_on() -> None:
    """While rank 0's copy is held on the target, a move of that copy back (started there, where
    its agent knows of no move of the job) asks the stopped ranks to stop too: each refuses it (it
    was another move that stopped them), and it fails having changed nothing; the first ends
    as if alone.  (Before: its pause let the stopped ranks run on under the held copy, and both
    moves tore down and rebuilt every rank, each at its own generation.)"""
    job = Job()
    second: list[MigrationResult] = []
    start_move = job.start_move

    def start(pid: int, target: str, **kw: Any) -> Moving:
        move = start_move(pid, target, **kw)
        verdict = kw["verdict"]

        def second_first() -> bool | None:  # (the copy runs on the target: the second move starts there)
            if not second:
                record = RewireRecord.new("j", THERE, {0: (4242, HERE)})
                second.append(Rewire(record, job.ask, job.start_move, 2.0, Unwritten()).run())
            return verdict()  # type: ignore[no-any-return]

        move.verdict = second_first  # type: ignore[attr-defined]
        return move

    job.start_move = start  # type: ignore[method-assign]
    rw = Rewire(RewireRecord.new("j", HERE, {0: (777, THERE)}), job.ask, job.start_move, 5.0, Unwritten())
    try:
        result = rw.run()
    finally:
        job.stop.set()
    assert result.outcome is Outcome.DONE, _messages(rw)
    assert second and second[0].outcome is Outcome.FAILED, second
    assert "stopped by another move of its job" in second[0].message, second[0].message
    assert job.where[0] == THERE and len(job.placed) == 1  # (the second moved nothing)
    assert all(r.gen == 1 and not r.torn and not r.parked and r.stop_at is None for r in job.ranks)
    for r in job.ranks:  # (the second's pause and cancel, refused, came as the first's copy was held)
        ops = [op for op in r.log if op != "where"]
        first = [op for i, op in enumerate(ops) if op != "cancel" and not (op == "pause" and i > 0)]
        assert first == ["pause", "boundary", "teardown", "rebuild", "resume"] and ops.count("pause") == 2, ops
