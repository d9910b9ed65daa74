"""A rank's side of the line protocol with its node's agent (the agent's side, and the wire,
are written down in ``tpagent/jobs/ranks.py``), and what the agent asks of the rank: stop at a step,
tear the communicators down, let go of the store, rebuild, go on.

The training thread is only ever touched in the optimizer step post-hook (:func:`_after_step`)
and, for a job with no optimizer, as it enters a collective of the default group
(:func:`_before_collective`): each counts, and parks there when asked.  The agent picks the unit
(see ``tpagent/jobs/rewire.py``): optimizer steps once any rank has taken one, else the default
group's collectives, which every rank of an SPMD job issues in the same order.  Everything
else runs in this module's threads.
"""

from __future__ import annotations

import contextlib
import functools
import gc
import hashlib
import json
import os
import socket
import sys
import threading
import time
from collections import deque
from typing import Any

#: What the rank says when it cannot keep a rule of the protocol (stderr, one line).
PREFIX = "tpagent_rank: "
LINE_MAX = 64 * 1024
#: Where an agent says "come back" to a rank that let go of it to be frozen (a file: while it may
#: be frozen, the rank must hold no socket to the agent, so it looks for the file instead).
GO_DIR = "/run/tpagent/rank-go"


def go_name(job: str, rank: int) -> str:
    return hashlib.sha256(f"{job}\0{rank}".encode()).hexdigest()[:32]


def say(text: str) -> None:
    print(PREFIX + text, file=sys.stderr, flush=True)


class Rank:
    def __init__(self, job: str, rank: int, world: int, store: Any, spec: str | None, socket_name: str) -> None:
        self.job, self.rank, self.world, self.store, self.spec = job, rank, world, store, spec
        self.socket_name = socket_name
        self.cond = threading.Condition()
        self.step = 0
        self.collectives = 0  # of the default group, issued
        self.gen = 0
        self.stop_at: int | None = None
        self.unit = "step"  # what stop_at counts: "step" or "collective"
        self.parked = False
        self.ended = ""  # why the job cannot go on (the agent said so): a parked rank raises it
        self.torn = False
        self.leaving = False
        self.times: deque[float] = deque(maxlen=20)
        self.ctimes: deque[float] = deque(maxlen=20)
        self.group: Any = None  # the default group (its collectives are counted)
        self.sock: socket.socket | None = None
        self.write_lock = threading.Lock()
        self.detached: list[tuple[int, str, int]] = []  # (fd, host, port) of store connections let go
        self.kept: list[Any] = []  # the store clients whose sockets took their place
        self.addresses: dict[str, list[bytes]] = {}  # the node's it was told to leave, as it tore down
        self.park_timeout = float(os.environ.get("TPAGENT_RANK_PARK_TIMEOUT", "600"))
        self.pid = os.getpid()

    # ---- the training thread ---------------------------------------------------------------

    def after_step(self) -> None:
        with self.cond:
            self.step += 1
            self.times.append(time.monotonic())
            if self.stop_at is not None and self.unit == "step" and self.step >= self.stop_at:
                self._park(f"step {self.step}")

    def before_collective(self) -> None:
        if self.stop_at is None:  # (the common case, without the lock: only the training thread counts;
            self.collectives += 1  # a pause set meanwhile is seen at the next collective)
            self.ctimes.append(time.monotonic())
            return
        with self.cond:
            if self.stop_at is not None and self.unit == "collective" and self.collectives >= self.stop_at:
                self._park(f"collective {self.collectives}")
            self.collectives += 1
            self.ctimes.append(time.monotonic())

    def _park(self, where: str) -> None:
        """Wait here (``cond`` held) until the agent says go on, or its deadline passes."""
        _synchronize()
        self.parked = True
        self.cond.notify_all()
        deadline = time.monotonic() + self.park_timeout
        while self.parked:
            self.cond.wait(0.5)
            if self.ended:
                self.parked = False
                raise RuntimeError(f"{PREFIX}rank {self.rank} of job {self.job} stopped after {where}: {self.ended}")
            if self.parked and time.monotonic() > deadline:
                if self.torn:
                    raise RuntimeError(
                        f"{PREFIX}rank {self.rank} of job {self.job} waited {self.park_timeout:.0f} s after {where} "
                        "for its communicators to be rebuilt; its agent never said"
                    )
                say(f"no word from the agent for {self.park_timeout:.0f} s after {where}: going on")
                self.parked, self.stop_at = False, None

    # ---- the connection --------------------------------------------------------------------

    def start(self) -> None:
        threading.Thread(target=self._connection, name="tpagent-rank", daemon=True).start()

    def _connect(self) -> socket.socket | None:
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
        try:
            s.connect("\0" + self.socket_name)
            return s
        except OSError:
            s.close()
            return None

    def _connection(self) -> None:
        warned = False
        while os.getpid() == self.pid:
            if self.leaving and not os.path.exists(os.path.join(GO_DIR, go_name(self.job, self.rank))):
                time.sleep(0.1)  # (no socket until an agent says so: it may be freezing us)
                continue
            s = self._connect()
            if s is None:
                if not warned and not self.torn:
                    say(f"no agent answers on @{self.socket_name}; this rank cannot be moved until one does")
                    warned = True
                time.sleep(0.1 if self.torn else 1.0)
                continue
            warned = False
            self._serve(s)
            time.sleep(0.1)

    def _serve(self, s: socket.socket) -> None:
        f = s.makefile("rb")
        try:
            with self.cond:
                state = self._state()
            s.sendall(
                self._line(
                    {
                        "op": "hello",
                        "v": 1,
                        "job": self.job,
                        "rank": self.rank,
                        "world": self.world,
                        "pid": os.getpid(),
                        "gen": self.gen,
                        "step": self.step,
                        "state": state,
                        "backend": str(self.spec),
                    }
                )
            )
            welcome = json.loads(f.readline(LINE_MAX) or b"{}")
            if welcome.get("op") != "welcome":
                time.sleep(0.5)  # (not registered yet: the agent says so; ask again)
                return
            self.node = str(welcome.get("node", ""))
            if not self.torn:
                self._tell_store()
            with self.write_lock:
                self.sock = s
            while line := f.readline(LINE_MAX + 1):
                body = json.loads(line)
                if body.get("op") == "teardown" and body.get("leaving"):
                    # Answered here, then this thread closes the connection itself (nothing blocked
                    # on it): the agent freezes the rank only once it has seen it closed.
                    self._answer(body)
                    if self.leaving:
                        break
                    continue
                threading.Thread(target=self._answer, args=(body,), daemon=True).start()
        except (OSError, ValueError):
            pass
        finally:
            with self.write_lock:
                if self.sock is s:
                    self.sock = None
            with contextlib.suppress(OSError):
                f.close()
            with contextlib.suppress(OSError):
                s.close()

    @staticmethod
    def _line(body: dict[str, Any]) -> bytes:
        return json.dumps(body).encode() + b"\n"

    def _reply(self, body: dict[str, Any]) -> None:
        with self.write_lock:
            if self.sock is not None:
                with contextlib.suppress(OSError):
                    self.sock.sendall(self._line(body))

    def _answer(self, body: dict[str, Any]) -> None:
        rid = body.get("id")
        try:
            answer = self._do(str(body.get("op")), body)
        except Exception as e:  # every request gets its answer
            answer = {"ok": False, "error": f"{type(e).__name__}: {e}"}
        self._reply({"id": rid, **answer})

    @functools.cached_property
    def store_facts(self) -> dict[str, str | None]:
        """Where this rank stands with the job's store, which do not change while it runs: whether
        it serves the store itself, and whether it reaches it at a loopback address."""
        from tpagent_rank import store

        return {"hosts_store": store.hosted_here(self.store), "store_loopback": store.loopback(self.store)}

    def _state(self) -> str:
        return "torn_down" if self.torn else "paused" if self.parked else "running"

    def _tell_store(self) -> None:
        with contextlib.suppress(Exception):
            self.store.set(f"tpagent/agent/{self.rank}", self.node)

    # ---- what the agent asks -----------------------------------------------------------------

    def _do(self, op: str, body: dict[str, Any]) -> dict[str, Any]:
        from tpagent_rank import backend

        if op == "where":
            with self.cond:
                return {
                    "ok": True,
                    "step": self.step,
                    "collectives": self.collectives,
                    "gen": self.gen,
                    "state": self._state(),
                    "rate": _rate(self.times),
                    "collective_rate": _rate(self.ctimes),
                    "groups": len(backend.GROUPS.live()),
                    "nccl_host": backend.NCCL_HOST,
                    "nccl_ras": backend.nccl_ras(),
                    "host": backend.host_identity(),
                    **self.store_facts,
                }
        if op == "peers":
            agents = []
            for r in range(self.world):
                key = f"tpagent/agent/{r}"
                agents.append(self.store.get(key).decode() if self.store.check([key]) else None)
            return {"ok": True, "agents": agents}
        if op == "pause":
            at, unit = int(body["at"]), str(body.get("unit", "step"))
            if unit not in ("step", "collective"):
                return {"ok": False, "error": f"{unit!r} is not a unit a rank stops at"}
            with self.cond:
                if (self.step if unit == "step" else self.collectives) >= at:
                    return {"ok": False, "late": True, "error": f"it is past {unit} {at}"}
                self.stop_at, self.unit = at, unit
            return {"ok": True}
        if op == "boundary":
            deadline = time.monotonic() + float(body.get("timeout", 60))
            with self.cond:
                while not self.parked:
                    if not self.cond.wait(max(0.0, deadline - time.monotonic())) and time.monotonic() >= deadline:
                        at = self.step if self.unit == "step" else self.collectives
                        return {"ok": False, "error": f"it did not reach {self.unit} {self.stop_at} in time (at {at})"}
                return {"ok": True, "step": self.step, "collectives": self.collectives}
        if op == "cancel":
            with self.cond:
                if self.torn:
                    return {"ok": False, "error": "its communicators are torn down: rebuild them first"}
                self.stop_at, self.parked = None, False
                self.cond.notify_all()
            return {"ok": True}
        if op == "teardown":
            with self.cond:
                if not self.parked:
                    return {"ok": False, "error": "it is not stopped at a boundary"}
            for g in backend.GROUPS.live():
                g.teardown()
            gc.collect()
            closed = 0
            if body.get("leaving"):
                from tpagent_rank import nccladdr, store

                try:  # (where NCCL's address came from: see the rebuild)
                    self.addresses = nccladdr.local_addresses()
                except OSError as e:
                    self.addresses = {}
                    say(f"this node's addresses could not be read ({e}): NCCL's will not follow the move")

                self.detached = store.detach(self.store)
                closed = len(self.detached)
                if not closed:
                    return {
                        "ok": False,
                        "error": f"no connection to the job's store ({store.address(self.store)}) "
                        f"was found among {store.connections()}",
                    }
            with self.cond:
                self.torn, self.leaving = True, bool(body.get("leaving"))
            return {"ok": True, "closed": closed}
        if op == "rebuild":
            gen = int(body["gen"])
            if self.detached:
                from tpagent_rank import owned, store

                with owned.noting():  # (a forked child lets go of them)
                    self.kept.extend(store.reattach(self.detached, min(60.0, float(body.get("timeout", 60)))))
                self.detached = []
            self._tell_store()
            if self.leaving and backend.NCCL_HOST is not None and self.addresses:  # (NCCL keeps its node's address)
                from tpagent_rank import nccladdr, store

                try:
                    said = nccladdr.follow(self.addresses, store.host(self.store))
                except (OSError, ValueError) as e:
                    return {"ok": False, "error": f"NCCL's address of the node it left could not be rewritten: {e}"}
                if said:
                    say(said)
            backend.GROUPS.gen = gen
            with self.cond:
                torn = self.torn
            for g in backend.GROUPS.live():
                if not torn:  # (a rewire finished after its agent restarted: this rank had not got so far)
                    g.teardown()
                g.rebuild(gen)
            with self.cond:
                if backend.GROUPS.gen != gen:  # (a later one was asked for meanwhile: it says)
                    return {"ok": False, "error": f"generation {gen} was given up while it was being built"}
                self.gen, self.torn, self.leaving = gen, False, False
            return {"ok": True}
        if op == "end":  # (the job cannot go on: a rank is gone for good; better now than at a deadline)
            with self.cond:
                self.ended = str(body.get("why", "")) or "its agent ended the job"
                self.cond.notify_all()
            return {"ok": True}
        if op == "resume":
            with self.cond:
                if self.torn:
                    return {"ok": False, "error": "its communicators are torn down: rebuild them first"}
                self.stop_at, self.parked = None, False
                self.cond.notify_all()
            return {"ok": True}
        return {"ok": False, "error": f"{op!r} is not a request a rank answers"}


def _rate(times: deque[float]) -> float:
    return (len(times) - 1) / (times[-1] - times[0]) if len(times) > 1 and times[-1] > times[0] else 0.0


def _synchronize() -> None:
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()


RANK: Rank | None = None


def group_created(group: Any, store: Any, rank: int, size: int, spec: str | None) -> None:
    """Called for every delegating group; the first (the default group) starts the rank."""
    global RANK
    if RANK is not None:
        return
    from torch.optim.optimizer import register_optimizer_step_post_hook

    from tpagent_rank import backend, owned
    from tpagent_rank import store as stores

    owned.note(stores.held(store))  # (a forked child lets go of them)
    name = os.environ.get("TPAGENT_RANK_SOCKET", "")
    job = os.environ.get("TPAGENT_JOB") or os.environ.get("TORCHELASTIC_RUN_ID") or "job"
    RANK = Rank(job, rank, size, store, spec, name)
    RANK.group = group
    register_optimizer_step_post_hook(lambda opt, args, kwargs: _after_step())
    backend.BEFORE.append(_before_collective)
    os.register_at_fork(after_in_child=_forget)
    RANK.start()


def _after_step() -> None:
    if RANK is not None and RANK.pid == os.getpid():
        RANK.after_step()


def _before_collective(group: Any) -> None:
    if RANK is not None and group is RANK.group:  # (a forked child has no RANK: _forget)
        RANK.before_collective()


def _forget() -> None:
    """In a forked child (a DataLoader worker): none of this is its own."""
    global RANK
    if RANK is not None and RANK.sock is not None:
        with contextlib.suppress(OSError):
            os.close(RANK.sock.detach())
    RANK = None
