"""The rank runtime as a training process meets it: its directory on PYTHONPATH, an ordinary
script.  Inert without TPAGENT_RANK_SOCKET; with it, process groups are the delegating kind, a
step still trains, an environment's own sitecustomize still runs, and no agent is no error."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest

from support.runtime import runtime_env

pytest.importorskip("torch")

SCRIPT = textwrap.dedent(
    """
    import json, os, sys, tempfile
    import torch, torch.distributed as dist
    init = dist.init_process_group
    store = dist.FileStore(tempfile.mktemp(), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    torch.manual_seed(0)
    model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(4, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    loss = model(torch.randn(8, 4)).pow(2).mean()
    loss.backward()
    opt.step()
    sub = dist.new_group([0])
    t = torch.ones(1)
    dist.all_reduce(t, group=sub)
    print(json.dumps({
        "patched": getattr(init, "__tpagent__", False),
        "group": type(dist.group.WORLD).__name__,
        "sub": type(sub).__name__,
        "loss": loss.item().hex(),
        "site": os.environ.get("USER_SITE_RAN", ""),
        "mods": sorted(m for m in sys.modules if m.startswith("tpagent_rank")),
    }))
    dist.destroy_process_group()
    """
)


def _run(tmp_path: Path, **env: str) -> tuple[dict[str, object], str]:
    user = tmp_path / "user"
    user.mkdir(exist_ok=True)
    (user / "sitecustomize.py").write_text("import os\nos.environ['USER_SITE_RAN'] = 'yes'\n")
    (tmp_path / "job.py").write_text(SCRIPT)
    done = subprocess.run(
        [sys.executable, "-X", "faulthandler", str(tmp_path / "job.py")],  # (an abort says where each thread stood)
        env=runtime_env(tmp_path, user, **env),
        capture_output=True,
        text=True,
        timeout=120,
        cwd=tmp_path,
    )
    assert done.returncode == 0 or _torchs_exit_race(env, done.returncode, done.stderr), done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1]), done.stderr


def _torchs_exit_race(env: dict[str, str], returncode: int | None, stderr: str) -> bool:
    """Whether a run *without the runtime* (a baseline: only what it printed is used) aborted as
    the interpreter finalized, by torch's own race at exit: a gloo worker thread, its backend
    never destroyed (torch keeps the default group's after destroy_process_group), takes the GIL
    then (pytorch/pytorch#179291, #38228).  Seen once in CI in a plain run of SCRIPT.  Never
    accepted of a run under the runtime, which lets go of its backends at exit for this reason."""
    aborted = returncode == -signal.SIGABRT and "terminate called without an active exception" in stderr
    return aborted and "TPAGENT_RANK_SOCKET" not in env


def test_inert_without_the_agents_socket(tmp_path: Path) -> None:
    seen, _ = _run(tmp_path)
    assert seen["patched"] is False
    assert seen["group"] == "ProcessGroup", "a process group was changed although the runtime was off"
    assert seen["mods"] == [], "the runtime was loaded although TPAGENT_RANK_SOCKET is unset"
    assert seen["site"] == "yes", "the environment's own sitecustomize did not run"


def test_on_a_rank_groups_delegate_and_the_step_is_the_same(tmp_path: Path) -> None:
    plain, _ = _run(tmp_path)
    seen, err = _run(tmp_path, TPAGENT_RANK_SOCKET=f"tpagent-test-{os.getpid()}-none", TPAGENT_JOB="j")
    assert seen["patched"] is True
    assert seen["group"] == "DelegatingGroup" and seen["sub"] == "DelegatingGroup"
    assert seen["loss"] == plain["loss"], "the delegating backend changed the result"
    assert seen["site"] == "yes", "the environment's own sitecustomize did not run after ours"
    assert "no agent answers" in err, "a rank without an agent should say it cannot be moved"


AT_EXIT = textwrap.dedent(
    """
    import atexit, json, tempfile, threading
    import torch, torch.distributed as dist
    # (registered first, so run last: after every exit handler of the runtime)
    atexit.register(lambda: print(json.dumps(sorted(
        t.name for t in threading.enumerate() if t is not threading.main_thread())), flush=True))
    dist.init_process_group("gloo", store=dist.FileStore(tempfile.mktemp(), 1), rank=0, world_size=1)
    t = torch.ones(1)
    dist.all_reduce(t)
    print(t.item(), flush=True)
    import os, time
    heard = os.environ.get("HEARD")  # (the silent agent has its hello: the thread now waits to read)
    deadline = time.monotonic() + 60
    while heard and not os.path.exists(heard) and time.monotonic() < deadline:
        time.sleep(0.01)
    """
)


@pytest.mark.parametrize("agent", ["none", "silent"])
def test_no_thread_of_the_runtime_outlives_the_exit_handlers(tmp_path: Path, agent: str) -> None:
    """A daemon thread still running when the interpreter finalizes is ended wherever it stands;
    in torch's C++ code (a store call) that aborts the process, and a job that trained to its end
    exits with SIGABRT.  So the runtime ends its threads at exit, whether no agent answers (it
    waits to ask again) or an agent holds its connection and says nothing (it waits to read)."""
    name = f"tpagent-test-{os.getpid()}-{agent}"
    (tmp_path / "job.py").write_text(AT_EXIT)
    heard = tmp_path / "heard"
    env = {**runtime_env(tmp_path), "TPAGENT_RANK_SOCKET": name, "TPAGENT_JOB": "j", "HEARD": str(heard)}
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as listener:
        if agent == "silent":
            listener.bind("\0" + name)
            listener.listen()
            listener.settimeout(120)
        else:
            heard.touch()
        job = subprocess.Popen(
            [sys.executable, "-X", "faulthandler", str(tmp_path / "job.py")],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            cwd=tmp_path,
        )
        try:
            if agent == "silent":  # (the job ends only once its hello is read, and no word ever comes)
                conn, _ = listener.accept()
                with conn:
                    assert b"hello" in conn.makefile("rb").readline(), "the rank's thread said no hello"
                    heard.touch()
                    stdout, stderr = job.communicate(timeout=120)
            else:
                stdout, stderr = job.communicate(timeout=120)
        finally:
            job.kill()
    done = subprocess.CompletedProcess(job.args, job.returncode, stdout, stderr)
    assert done.returncode == 0, done.stderr[-3000:]
    out = done.stdout.strip().splitlines()
    assert out[0] == "1.0", out
    assert "tpagent-rank" not in json.loads(out[-1]), "the runtime's connection thread outlived the exit handlers"


COLLECTIVES = Path(__file__).resolve().parent.parent / "workloads" / "collectives_job.py"


def _launch(tmp_path: Path, argvs: list[list[str]], **env: str) -> tuple[list[dict[str, Any]], str]:
    """Each of ``argvs`` as a rank (the runtime's directory on its PYTHONPATH, ``env`` added):
    the JSON line each printed last, and all they wrote to stderr."""
    full = runtime_env(tmp_path, OMP_NUM_THREADS="1", **env)
    ranks = [
        subprocess.Popen(
            [sys.executable, *argv], env=full, cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
        )
        for argv in argvs
    ]
    outs = [p.communicate(timeout=200) for p in ranks]
    for p, (_, err) in zip(ranks, outs, strict=True):
        assert p.returncode == 0 or _torchs_exit_race(env, p.returncode, err), err[-3000:]
    return [json.loads(out.strip().splitlines()[-1]) for out, _ in outs], "".join(err for _, err in outs)


def _ranks(tmp_path: Path, tag: str, **env: str) -> tuple[list[dict[str, Any]], str]:
    """tests/workloads/collectives_job.py as 3 ranks (a FileStore: no launcher needed)."""
    store = tmp_path / f"store-{tag}"
    return _launch(tmp_path, [[str(COLLECTIVES), str(store), str(r), "3"] for r in range(3)], **env)


@pytest.mark.timeout(300)
def test_every_kind_of_collective_gives_what_it_gives_without_the_runtime(tmp_path: Path) -> None:
    """Whatever torch calls on a group (its newer names too: all_gather_into_tensor, as FSDP2
    does, reaches a group as all_gather_single in torch 2.13; coalesced ops; object collectives,
    which pick their device by the group's devices; monitored_barrier, which asks the backend's
    name), a delegating group gives the same, bit for bit."""
    plain, _ = _ranks(tmp_path, "plain")
    seen, err = _ranks(tmp_path, "runtime", TPAGENT_RANK_SOCKET=f"tpagent-test-{os.getpid()}-none", TPAGENT_JOB="j")
    assert err.count("no agent answers") == 3, "the runtime was not loaded on every rank"
    assert [s["backend"] for s in seen] == ["gloo"] * 3, "get_backend names the user's backend"
    assert len(plain[0]) >= 15 and plain[0]["fsdp_losses"], plain[0]
    assert seen == plain


FORKED = textwrap.dedent(
    """
    import json, os, sys
    import torch, torch.distributed as dist
    from torch.utils.data import DataLoader, TensorDataset
    port, rank = int(sys.argv[1]), int(sys.argv[2])
    store = dist.TCPStore("127.0.0.1", port, 2, is_master=rank == 0)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=2)
    t = torch.ones(1)
    dist.all_reduce(t)
    loader = DataLoader(TensorDataset(torch.arange(8.0)), batch_size=2, num_workers=1, persistent_workers=True)
    batches = iter(loader)
    first = next(batches)[0].tolist()

    def sockets(pid):
        out = set()
        for fd in os.listdir(f"/proc/{pid}/fd"):
            try:
                link = os.readlink(f"/proc/{pid}/fd/{fd}")
            except OSError:  # (the listing's own descriptor)
                continue
            if link.startswith("socket:["):
                out.add(link)
        return out

    mine = sockets(os.getpid())
    inherited = mine & sockets(batches._workers[0].pid)
    print(json.dumps({"sum": t.item(), "first": first, "mine": len(mine), "inherited": sorted(inherited)}))
    dist.barrier()
    dist.destroy_process_group()
    """
)


def _forked(tmp_path: Path, **env: str) -> list[dict[str, Any]]:
    (tmp_path / "forked.py").write_text(FORKED)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    return _launch(tmp_path, [[str(tmp_path / "forked.py"), str(port), str(r)] for r in range(2)], **env)[0]


def test_a_forked_dataloader_worker_keeps_no_socket_of_the_communicators(tmp_path: Path) -> None:
    """A DataLoader worker, forked once the group exists, got a copy of every socket of the rank:
    the store's connection (and, on rank 0, the store itself), gloo's.  Under the runtime it lets
    go of them at once, so a teardown closes them for good and CRIU finds none in the rank's tree
    (without the runtime the same worker keeps them all: what this test would see otherwise)."""
    plain = _forked(tmp_path)
    assert all(r["inherited"] for r in plain), plain  # (the check can fail)
    seen = _forked(tmp_path, TPAGENT_RANK_SOCKET=f"tpagent-test-{os.getpid()}-none", TPAGENT_JOB="j")
    assert [r["sum"] for r in seen] == [2.0, 2.0] and [r["first"] for r in seen] == [[0.0, 1.0]] * 2
    assert all(r["mine"] >= 3 for r in seen), seen  # the store's connection, gloo's listener and its peer
    assert [r["inherited"] for r in seen] == [[], []], seen


SPLIT = textwrap.dedent(
    """
    import json, sys
    import torch, torch.distributed as dist
    from torch.distributed.distributed_c10d import split_group
    store_file, rank = sys.argv[1], int(sys.argv[2])
    dist.init_process_group("gloo", store=dist.FileStore(store_file, 4), rank=rank, world_size=4)

    def total(group, value):
        t = torch.tensor([float(value)])
        dist.all_reduce(t, group=group)
        return t.item()

    pairs = split_group(split_ranks=[[0, 2], [3, 1]])
    alone = split_group(parent_pg=pairs, split_ranks=[[1]])  # (of a subgroup: ranks 2 and 3 alone)
    three = split_group(split_ranks=[[0, 1, 2]])  # (rank 3 in none)
    after = dist.new_group([1, 2, 3])  # (a group made after them: every rank names it alike)
    print(json.dumps({
        "kinds": sorted({type(g).__name__ for g in (pairs, alone, three) if g is not None}),
        "pairs": [dist.get_process_group_ranks(pairs), total(pairs, rank + 1)],
        "alone": alone and [dist.get_process_group_ranks(alone), total(alone, rank * 10)],
        "three": three and [dist.get_process_group_ranks(three), total(three, rank + 1)],
        "after": total(after, rank) if rank else None,
        "world": total(None, 1),
    }))
    dist.destroy_process_group()
    """
)


def test_split_group_of_a_delegating_group_gives_delegating_groups_of_the_same_ranks(tmp_path: Path) -> None:
    """split_group (a DeviceMesh's way to make its groups once the default group is bound to a
    GPU: torch splits only an NCCL communicator, so here it refuses) gives, under the runtime,
    groups of its own whose communicators a rewire can rebuild: the splits' ranks, every rank
    in one or in none, of the world or of a subgroup, and groups made after them still agree."""
    (tmp_path / "split.py").write_text(SPLIT)
    seen, _ = _launch(
        tmp_path,
        [[str(tmp_path / "split.py"), str(tmp_path / "store"), str(r)] for r in range(4)],
        TPAGENT_RANK_SOCKET=f"tpagent-test-{os.getpid()}-none",
        TPAGENT_JOB="j",
    )
    assert [s["kinds"] for s in seen] == [["DelegatingGroup"]] * 4
    assert [s["pairs"] for s in seen] == [[[0, 2], 4.0], [[1, 3], 6.0], [[0, 2], 4.0], [[1, 3], 6.0]]
    assert [s["alone"] for s in seen] == [None, None, [[2], 20.0], [[3], 30.0]]
    assert [s["three"] for s in seen] == [[[0, 1, 2], 6.0]] * 3 + [None]
    assert [s["after"] for s in seen] == [None, 6.0, 6.0, 6.0]
    assert [s["world"] for s in seen] == [4.0] * 4


def test_an_op_whose_backend_gives_no_work_is_passed_through(tmp_path: Path) -> None:
    """NCCL's ops with async_op=False run on the current stream and give torch no Work (torch
    then waits on nothing): such an op goes through a delegating group as it came, and the group
    still tears down and rebuilds.  gloo always gives one, so a gloo backend that waits for its
    own Work and gives none stands in for NCCL (no GPU here; tests/agent/test_rewire_gpu.py runs
    the real one)."""
    import datetime

    import torch
    import torch.distributed as dist

    from tpagent_rank import backend

    class SyncOnly:
        def __init__(self, inner: Any) -> None:
            self.inner = inner

        def allreduce(self, tensors: Any, opts: Any) -> None:
            self.inner.allreduce(tensors, opts).wait()

    store = dist.FileStore(str(tmp_path / "store"), 1)
    group = backend.DelegatingGroup(store, 0, 1, datetime.timedelta(seconds=30), {"cpu": "gloo"})
    gloo = group._only
    group._inner = {"cpu": SyncOnly(gloo)}
    group._only = SyncOnly(gloo)
    t = torch.full((3,), 2.0)
    assert group.allreduce([t], dist.AllreduceOptions()) is None
    assert t.tolist() == [2.0, 2.0, 2.0] and not list(group._works)
    group.teardown()
    group.rebuild(1)
    work = group.allreduce([t], dist.AllreduceOptions())
    work.wait()  # (gloo again, a Work of its own, tracked until it is gone)
    assert t.tolist() == [2.0, 2.0, 2.0] and type(group._only).__name__ == "ProcessGroupGloo"


@pytest.mark.parametrize(
    ("value", "on"),
    [(None, True), ("1", True), ("0", False), (" 0 ", False), ("0x0", False), ("2", True), ("yes", True), ("", True)],
)
def test_whether_nccl_runs_its_ras_thread_is_read_as_nccl_reads_it(
    monkeypatch: pytest.MonkeyPatch, value: str | None, on: bool
) -> None:
    from tpagent_rank import backend

    if value is None:
        monkeypatch.delenv("NCCL_RAS_ENABLE", raising=False)
    else:
        monkeypatch.setenv("NCCL_RAS_ENABLE", value)
    monkeypatch.setattr(backend, "NCCL_HOST", None)
    assert backend.nccl_ras() is False  # (no NCCL communicator made in this process: no RAS thread)
    monkeypatch.setattr(backend, "NCCL_HOST", "host|boot")
    assert backend.nccl_ras() is on
