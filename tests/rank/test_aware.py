"""Model-aware mode's registration (tpagent_rank.register, issue 27 item 1) in real torch jobs:
the replicas the runtime derives from DDP and FSDP2 meshes, and a registered state that
rebuilds a rank in a fresh process, from its own save or a replica's, bit for bit."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from support.helpers import wait_until
from support.runtime import PlayedAgent, runtime_env
from tpagent_rank import protocol as P

pytest.importorskip("torch")

JOB = Path(__file__).resolve().parent.parent / "workloads" / "aware_job.py"


def _ranks(tmp_path: Path, tag: str, mode: str | list[str], world: int, steps: int = 6) -> list[dict[str, Any]]:
    """aware_job.py as ``world`` ranks under the runtime (no agent answers: it is not needed)."""
    env = runtime_env(
        tmp_path, OMP_NUM_THREADS="1", TPAGENT_RANK_SOCKET=f"tpagent-test-{os.getpid()}-none", TPAGENT_JOB="j"
    )
    modes = mode if isinstance(mode, list) else [mode] * world
    store = tmp_path / f"store-{tag}"
    procs = [
        subprocess.Popen(
            [
                sys.executable,
                "-X",
                "faulthandler",
                str(JOB),
                str(store),
                str(r),
                str(world),
                m,
                str(steps),
                str(tmp_path),
            ],
            env=env,
            cwd=tmp_path,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for r, m in enumerate(modes)
    ]
    outs = [p.communicate(timeout=200) for p in procs]
    for p, (_, err) in zip(procs, outs, strict=True):
        assert p.returncode == 0, err[-3000:]
    return [json.loads(out.strip().splitlines()[-1]) for out, _ in outs]


def test_replicas_are_derived_from_ddp_and_from_an_hsdp_mesh_and_plain_fsdp_has_none(tmp_path: Path) -> None:
    ddp = _ranks(tmp_path, "ddp", "ddp", 2, steps=1)
    assert [r["replicas"] for r in ddp] == [[0, 1], [0, 1]]
    hsdp = _ranks(tmp_path, "hsdp", "hsdp", 4)
    # (mesh (2, 2), replicate x shard: rank r holds shard r % 2, replicated on the ranks of that shard)
    assert [r["replicas"] for r in hsdp] == [[0, 2], [1, 3], [0, 2], [1, 3]], hsdp
    given = _ranks(tmp_path, "given", "hsdp-mesh", 4)
    assert [r["replicas"] for r in given] == [r["replicas"] for r in hsdp]
    fsdp = _ranks(tmp_path, "fsdp", "fsdp", 2)
    assert [r["replicas"] for r in fsdp] == [None, None]
    assert all("no other rank holds its training state" in r["why"] for r in fsdp), fsdp


@pytest.mark.parametrize(
    ("kind", "sources"),
    [
        ("", [1, 1]),  # DDP of 2: rank 0 from rank 1's state, rank 1 from its own
        ("sharded-", [2, 1, 0, 3]),  # HSDP 2 x 2: ranks 0 and 2 from each other's (same shard)
    ],
    ids=["ddp", "hsdp"],
)
def test_a_fresh_process_loading_the_state_of_itself_or_of_a_replica_trains_on_bit_identical(
    tmp_path: Path, kind: str, sources: list[int]
) -> None:
    """Every rank of a job stops at step 3 and writes its registered state; fresh processes of the
    same script (seeded differently: nothing of them is left to chance) load it, some from a
    replica's state, the others from their own, and train on to step 6: every loss and the final
    parameters are those of the job run through without stopping.  Under HSDP the state holds
    DTensors (each rank's shard of the parameters and of Adam's moments)."""
    world = len(sources)
    whole = _ranks(tmp_path, "whole", kind + "ddp", world, steps=6)
    saved = _ranks(tmp_path, "saved", kind + "save", world, steps=3)
    assert all(r["bytes"] > 0 for r in saved)
    resumed = _ranks(tmp_path, "resumed", [f"{kind}resume-{s}" for s in sources], world, steps=6)
    for r in range(world):
        assert saved[r]["losses"] == {k: v for k, v in whole[r]["losses"].items() if int(k) <= 3}
        assert resumed[r]["losses"] == {k: v for k, v in whole[r]["losses"].items() if int(k) > 3}, r
        assert resumed[r]["params"] == whole[r]["params"]
    assert whole[0]["losses"] != whole[1]["losses"]  # (each rank its own data: the check can fail)


CHECK = """
import collections, sys, numpy, torch
sys.path[:0] = [sys.argv[1]]
from tpagent_rank import aware
big = torch.ones(1 << 26)  # (256 MiB: emptied, not copied, to be checked)
plain = {"w": big, "opt": {"state": {0: {"m": big}}}, "np": numpy.random.get_state(), "o": collections.OrderedDict(a=1)}
plain["order"] = numpy.arange(1 << 25).reshape(2, -1)  # (a data order, 256 MiB: emptied too)
print("plain", repr(aware.check(aware.Registration(dict, print), plain)))
reg = aware.Registration(dict, print)
print("counter", repr(aware.check(reg, {"w": big, "seen": collections.defaultdict(int)})))
print("again", repr(aware.check(reg, {})))
aware.register(save=dict, load=print)
aware.registration().unreadable = reg.unreadable
print("usable", aware.usable(), aware.replica_ranks(), repr(aware.why_no_replicas()))
"""


def test_a_state_another_process_could_not_read_back_is_said_once_and_the_rank_counts_as_unregistered(
    tmp_path: Path,
) -> None:
    """The first state a rank saves is written and read back as a fresh process would, its tensors
    and numpy arrays emptied: numpy's RNG state, arrays and plain containers pass; a defaultdict (not what torch's safe
    loader reads) is said once, on standard error, with what it is, and the rank is then neither
    movable as its state nor a replica to rebuild from."""
    runtime_env(tmp_path)
    out = subprocess.run(
        [sys.executable, "-c", CHECK, str(tmp_path / "runtime")], capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr
    said = dict(line.split(" ", 1) for line in out.stdout.splitlines())
    assert said["plain"] == "''", said
    why = "its training state cannot be read safely: it holds collections.defaultdict, which torch's safe loader"
    assert said["counter"].startswith(repr(why)[:-1]) and said["again"] == said["counter"], said
    assert said["usable"].startswith("False None " + repr(why)[:-1]), said
    warned = [line for line in out.stderr.splitlines() if line.startswith("tpagent_rank: ")]
    assert len(warned) == 1 and why in warned[0] and "only as its process image" in warned[0], out.stderr


def test_a_rank_whose_state_cannot_be_read_back_trains_on_and_tells_its_agent_it_moves_only_as_its_image(
    tmp_path: Path,
) -> None:
    """A rank whose registered state holds a defaultdict, under its agent (played here): it says
    so once, trains on as ever, holds no state to rebuild from, and its agent hears why."""
    name = f"tpagent-test-{os.getpid()}-unreadable"
    agent = PlayedAgent(name)
    env = runtime_env(tmp_path, TPAGENT_JOB="j", TPAGENT_RANK_SOCKET=name, AWARE_DEFAULTDICT="1", OMP_NUM_THREADS="1")
    argv = [sys.executable, str(JOB), str(tmp_path / "store"), "0", "1", "steps", "40", str(tmp_path)]
    proc = subprocess.Popen(argv, env=env, cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        agent.welcome()
        wait_until(lambda: agent.ask(P.Where()).step >= 2, "the rank to take two steps", 60, 0.1)
        standing = agent.ask(P.Where())
        out, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        agent.close()
    assert not standing.aware and standing.held == -1 and not standing.replicas, standing
    assert standing.no_replicas.startswith(P.UNREADABLE + ": it holds collections.defaultdict"), standing
    assert proc.returncode == 0 and len(json.loads(out.splitlines()[-1])["losses"]) == 40, err[-2000:]
    assert err.count(P.UNREADABLE) == 1, err[-2000:]


def test_a_states_cuda_devices_map_to_this_process_s_whether_named_or_given_as_devices() -> None:
    """A storage's location is looked up by name, a DTensor's device by its ``torch.device``:
    both map to this process's device (here the CPU, which has no GPU to take them)."""
    import torch

    from tpagent_rank import aware

    table = aware.device_table(torch)
    for key in ("cuda", "cuda:0", "cuda:7", torch.device("cuda", 7), torch.device("cuda")):
        assert table[key] == (f"cuda:{torch.cuda.current_device()}" if torch.cuda.is_available() else "cpu"), key
    assert torch.device("cpu") not in table and "cpu" not in table


EVIL = """
import os, sys, torch
sys.path[:0] = [sys.argv[1]]
from tpagent_rank import aware
class Evil:
    def __reduce__(self):
        return (os.system, ("touch " + sys.argv[2],))
with open(sys.argv[3], "wb") as f:
    torch.save({"step": 1, "x": Evil()}, f)
aware.register(save=dict, load=lambda s: print("loaded", s))
try:
    with open(sys.argv[3], "rb") as f:
        aware.read_state(f)
except ValueError as e:
    print("refused:", e)
"""


def test_a_state_that_would_run_code_as_it_is_read_is_refused(tmp_path: Path) -> None:
    """A state comes from another process (a replica, over the network): it is read by torch's
    safe loader, so one whose unpickling would run a command is refused, and nothing runs."""
    runtime_env(tmp_path)
    runtime = tmp_path / "runtime"
    marker = tmp_path / "ran"
    out = subprocess.run(
        [sys.executable, "-c", EVIL, str(runtime), str(marker), str(tmp_path / "state")],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    assert "refused: the training state cannot be read safely" in out.stdout, out.stdout
    assert "loaded" not in out.stdout and not marker.exists()
