"""Which GPUs of a target a moved process may land on, and that two copies received at once land
on different ones: the target's admission (tpagent.migration.admission), the orchestrator's
choice (tpagent.orchestrator.policy.target_gpus) and the checks of GPU names from the network.

This machine has no GPU: the target's inventory is written out here (a stand-in for NVML, which
cannot list GPUs that are not there), and ``criu check`` is taken as passed (the unit tier starts
no process).  Real agents pass the names on: tests/agent/test_migrate.py and test_rewire.py."""

from __future__ import annotations

from pathlib import Path

import pytest

from host.gpus import GpuInfo
from support.protocol_fakes import FakeTarget, unit_context
from tpagent.jobs.api import RewireRecord
from tpagent.migration import admission
from tpagent.migration.admission import Admission
from tpagent.migration.api import MOST_GPUS, Offer, Refused, Why, gpu_uuids
from tpagent.orchestrator import policy
from tpagent.orchestrator.api import Gpu, Move, MoveKind, MoveState, NodeSeen, RankSeen, Taint, TaintKind, View

H100 = 80 << 30


def gpu(uuid: str, bus: str = "", used_gib: int = 0, pids: tuple[int, ...] = ()) -> GpuInfo:
    return GpuInfo(0, uuid, "H100", H100, used_gib << 30, 40, 0, pids, bus)


#: The target node: four idle GPUs, the first the emptiest.
TARGET = [gpu("GPU-t0", "0000:18:00.0"), gpu("GPU-t1", "0000:3B:00.0", 1), gpu("GPU-t2", "", 2), gpu("GPU-t3", "", 3)]


@pytest.fixture
def node(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Admission:
    monkeypatch.setattr(admission.gpus, "inventory", lambda: list(TARGET))
    monkeypatch.setattr(admission.Criu, "check", lambda self, timeout=60: "ok")
    live: set[str] = set()
    a = Admission(unit_context(tmp_path, FakeTarget(tmp_path)), lambda mid: mid in live, lambda mid: False)
    a.live = live  # type: ignore[attr-defined]  # (the migrations whose copies are not restored yet)
    return a


def offer(
    mid: str, uuids: tuple[str, ...], buses: tuple[str, ...] = (), to: tuple[str, ...] = (), dry: bool = False
) -> Offer:
    return Offer(mid * 32, "A", "a:1", 1 << 20, uuids, gpu_bus_ids=buses, target_gpus=to, dry_run=dry)


def take(node: Admission, o: Offer) -> dict[str, str]:
    """``o`` taken by ``node``: where its GPUs go (its copy not restored yet)."""
    got = node.offer(o, lambda gpu_map: ("127.0.0.1:1", node.ctx.cfg.work_dir / o.migration_id))
    assert not got.problems, got.problems
    node.live.add(o.migration_id)  # type: ignore[attr-defined]
    return dict(got.gpu_map)


def test_two_copies_received_at_once_land_on_different_gpus(node: Admission) -> None:
    """Two ranks moved together: the first copy is not yet restored (no process on its GPU) when
    the second is offered.  Both went to the emptiest GPU, and NCCL refuses two ranks on one."""
    first = take(node, offer("a", ("GPU-s0",)))
    second = take(node, offer("b", ("GPU-s1",)))
    assert first == {"GPU-s0": "GPU-t0"} and second == {"GPU-s1": "GPU-t1"}
    # (a GPU at the rank's own bus id is not taken either while a copy is placed on it)
    assert take(node, offer("c", ("GPU-s2",), ("0000:18:00.0",))) == {"GPU-s2": "GPU-t2"}
    node.live.clear()  # type: ignore[attr-defined]  # (restored: NVML lists their processes from now on)
    assert take(node, offer("d", ("GPU-s3",))) == {"GPU-s3": "GPU-t0"}


def test_a_copy_lands_only_on_the_gpus_its_move_names(node: Admission) -> None:
    """The orchestrator names the target's free GPUs no taint covers: neither the emptiest GPU
    nor the one at the rank's own bus id is taken if the move does not name it."""
    got = take(node, offer("a", ("GPU-s0", "GPU-s1"), ("0000:18:00.0", ""), to=("GPU-t3", "GPU-t2")))
    assert got == {"GPU-s0": "GPU-t2", "GPU-s1": "GPU-t3"}


@pytest.mark.parametrize(
    ("to", "said"),
    [
        (("GPU-t9",), "GPU-t9, named for the copy, is not a GPU of source"),
        (("GPU-t1",), "the move names 1 GPU(s) of source; the process uses 2"),
    ],
    ids=["not-there", "too-few"],
)
def test_gpus_named_that_cannot_take_the_copy_are_refused_before_anything_moves(
    node: Admission, to: tuple[str, ...], said: str
) -> None:
    for dry in (True, False):
        got = node.offer(offer("a", ("GPU-s0", "GPU-s1"), to=to, dry=dry), lambda gpu_map: pytest.fail("taken"))
        assert any(p.startswith(said) for p in got.problems), got.problems
        assert not got.gpu_map and not node.reservations.in_flight()


def test_a_gpu_named_that_a_copy_received_meanwhile_takes_is_not_given_twice(node: Admission) -> None:
    """Two ranks moved with one GPU named for both (`--to-gpu X`, each rank's move alone fits):
    the second is refused before anything of it freezes, not placed on X beside the first."""
    assert take(node, offer("a", ("GPU-s0",), to=("GPU-t3",))) == {"GPU-s0": "GPU-t3"}
    got = node.offer(offer("b", ("GPU-s1",), to=("GPU-t3",)), lambda gpu_map: pytest.fail("taken"))
    said = "the move names 1 GPU(s) of source, 1 of them taken by the copies it is receiving; the process uses 1"
    assert got.problems[0] == said, got.problems
    assert take(node, offer("c", ("GPU-s1",), to=("GPU-t3", "GPU-t1"))) == {"GPU-s1": "GPU-t1"}


def test_a_gpu_named_on_a_node_for_a_process_of_no_gpu_must_still_be_there(node: Admission) -> None:
    """(Someone's --to-gpu with a mistyped UUID is told so, whatever the process.)"""
    got = node.offer(offer("a", (), to=("GPU-nope",), dry=True), lambda gpu_map: pytest.fail("taken"))
    assert got.problems == ("GPU-nope, named for the copy, is not a GPU of source (nvidia-smi -L lists them)",)


@pytest.mark.parametrize(
    "names",
    [
        ["GPU-1; rm -rf /"],
        ["gpu0"],
        [""],
        ["GPU-" + "a" * 200],
        ["GPU-\udcff"],
        ["MIG-GPU-8c4a/1/0"],  # (NVML lists whole GPUs: a MIG device could never be found)
        [f"GPU-{i}" for i in range(MOST_GPUS + 1)],
        ["GPU-a"] * MOST_GPUS + ["GPU-b"],  # (not cut to the first 64, GPU-b dropped without a word)
    ],
    ids=["shell", "no-prefix", "empty", "long", "not-utf8", "mig", "too-many", "too-many-repeated"],
)
def test_gpu_names_from_the_network_are_checked(node: Admission, names: list[str]) -> None:
    with pytest.raises(Refused) as e:
        gpu_uuids(names)
    assert e.value.why is Why.INVALID
    with pytest.raises(Refused):
        node.offer(offer("a", ("GPU-s0",), to=tuple(names)), lambda gpu_map: pytest.fail("taken"))
    assert gpu_uuids(["GPU-8c4a3b2e-1f", "GPU-0d1e", "GPU-8c4a3b2e-1f"]) == ("GPU-8c4a3b2e-1f", "GPU-0d1e")


def test_a_rewire_keeps_the_gpus_its_ranks_may_use_in_its_journal() -> None:
    record = RewireRecord.new("job", "a:1", {0: (42, "b:1")})
    record.agents = ["a:1"]
    record.gpus = ["GPU-t2", "GPU-t3"]
    assert RewireRecord.from_json(record.to_json()).gpus == ["GPU-t2", "GPU-t3"]
    old = record.to_json()
    del old["gpus"]  # (a record an older agent wrote: any GPU)
    assert RewireRecord.from_json(old).gpus == []


# ---- the orchestrator's choice ------------------------------------------------------------


def g(uuid: str, name: str = "H100", memory: int = H100) -> Gpu:
    return Gpu(uuid, name, memory)


def seen(name: str, gpus: tuple[Gpu, ...], ranks: tuple[RankSeen, ...] = ()) -> NodeSeen:
    return NodeSeen(name, f"{name}:7400", 0.0, gpus=gpus, ranks=ranks, driver="580")


def rank(job: str, r: int, *gpus: str) -> RankSeen:
    return RankSeen(job, r, gpus=gpus)


SOURCE = seen("a", (g("GPU-a0"), g("GPU-a1")), (rank("j", 0, "GPU-a0"), rank("j", 1, "GPU-a1")))
SPARE = seen(
    "d",
    (g("GPU-d0"), g("GPU-d1"), g("GPU-d2"), g("GPU-d3", "A100"), g("GPU-d4", memory=40 << 30), g("GPU-d5")),
    (rank("other", 0, "GPU-d5"),),
)
VIEW = View({"a": SOURCE, "d": SPARE})


def taint(tid: int, gpu: str) -> Taint:
    return Taint(tid, "d", gpu, TaintKind.PREEMPTIVE, "ECC errors", "health:ecc", 0.0)


def move(kind: MoveKind = MoveKind.AWAY, ranks: tuple[int, ...] = (0, 1)) -> Move:
    return Move(1, "j", ranks, "a", "d", kind, MoveState.PLANNED, 1)


def test_the_orchestrator_names_the_free_untainted_gpus_like_the_ranks() -> None:
    """Not the one another job's rank uses, not another model's, not one of less memory, not a tainted one."""
    taints = [taint(1, "GPU-d1")]
    assert policy.target_gpus(VIEW, taints, {}, move()) == ("GPU-d0", "GPU-d2")


def test_onto_a_dedicated_spare_only_its_reserved_gpus_are_named() -> None:
    dedicated = {"d": frozenset({"GPU-d1", "GPU-d2"})}
    assert policy.target_gpus(VIEW, [], dedicated, move()) == ("GPU-d1", "GPU-d2")
    # (a move home is no move onto a spare: any of its free GPUs)
    assert policy.target_gpus(VIEW, [], dedicated, move(MoveKind.HOME)) == ("GPU-d0", "GPU-d1", "GPU-d2")


def test_too_few_gpus_left_holds_the_move_and_cpu_ranks_name_none() -> None:
    taints = [taint(1, "GPU-d0"), taint(2, "GPU-d1")]
    assert policy.target_gpus(VIEW, taints, {}, move()) is None
    assert policy.target_gpus(VIEW, taints, {}, move(ranks=(0,))) == ("GPU-d2",)
    cpu = View({"a": seen("a", (), (rank("j", 0),)), "d": SPARE})
    assert policy.target_gpus(cpu, taints, {}, move(ranks=(0,))) == ()
