"""A rank's side of the rank protocol (:mod:`tpagent_rank.protocol`, which says the wire; the
agent's side is ``tpagent/jobs/ranks.py``), and what the agent asks of the rank: stop at a step,
tear the communicators down, let go of the store, rebuild, go on.

The training thread is touched only in the optimizer step post-hook (:func:`_after_step`) and, for a job with no
optimizer, as it enters a collective of the default group (:func:`_before_collective`): each counts, and parks there
when asked.  The agent picks the unit (``tpagent/jobs/rewire.py``): optimizer steps once a rank has taken one, else
the default group's collectives, which each rank of an SPMD job issues in one order.  The rest runs in our threads."""

from __future__ import annotations

import contextlib
import functools
import os
import socket
import struct
import sys
import threading
import time
from collections import deque
from collections.abc import Callable
from typing import Any, BinaryIO

from tpagent_rank import codec, ending, env, join, lines, recover, rewire
from tpagent_rank import protocol as P
from tpagent_rank.notice import PREFIX, say

#: How long the job's store is given to accept a connection before it is taken as gone.
STORE_PROBE = 2.0


class Rank:
    def __init__(self, job: str, rank: int, world: int, store: Any, spec: str | None, socket_name: str) -> None:
        self.job = job
        self.rank = rank
        self.world = world
        self.store = store
        self.spec = spec
        self.socket_name = socket_name
        self.cond = threading.Condition()
        self.step = 0
        self.collectives = 0  # of the default group, issued
        self.gen = 0
        self.stop_at: int | None = None
        self.unit = P.Unit.STEP.value  # what stop_at counts
        self.stopped_by = ""  # the move that stopped it (P.Pause's by), till it lets it go on ("": none)
        self.parked = False
        self.ended = ""  # why the job cannot go on (the agent said so): a parked rank raises it
        self.ending = ""  # why it is to end (told first: End's hold), raised at the next End or the deadline
        self.torn = False
        self.leaving = False
        self.came_back = False  # leaving, it was told to come back and did (a broken line reconnects at once)
        self.join = join.Joining() if env.JOIN else None  # a fresh process taking a rank's place
        self.quiet = self.join is not None  # its output goes nowhere until its first collective in the job
        self.retired = False  # its joiner has its place: it ends at its next collective or step
        self.retire_answered = threading.Event()
        self.held: recover.Held | None = None  # the state of its last step boundary (a registered rank's)
        self.in_step = False  # the training thread is inside an optimizer step
        self.restarting = False  # its held state is being taken: it enters no optimizer step
        self.chore: Callable[[], object] | None = None  # to run on the parked training thread
        self.chore_error: str | None = None
        self.times: deque[float] = deque(maxlen=20)
        self.ctimes: deque[float] = deque(maxlen=20)
        self.stepped_said = 0.0  # when its step was last said to its agent (lines.Stepped)
        self.saying: threading.Thread | None = None  # (saying it: one at a time, never a pile)
        self.progress = 0.0  # when a collective of any of its groups was last issued (monotonic)
        self.group: Any = None  # the default group (its collectives are counted)
        self.sock: socket.socket | None = None
        self.write_lock = threading.Lock()
        self.detached: list[tuple[int, str, int]] = []  # (fd, host, port) of store connections let go
        self.kept: list[Any] = []  # the store clients whose sockets took their place
        self.addresses: dict[str, list[bytes]] = {}  # the node's it was told to leave, as it tore down
        self.park_timeout = float(os.environ.get("TPAGENT_RANK_PARK_TIMEOUT", "600"))
        self.pid = os.getpid()
        self.impostor_said = False
        self.closing = threading.Event()  # set at exit: the connection's thread ends (see stop)
        self.thread: threading.Thread | None = None
        self.conn: socket.socket | None = None  # the connection being served (welcomed or not)
        self.key_said = False
        self.key: str | None = None  # the job's identity, agreed in its store (JOB_KEY) before the first hello
        #: What the agent asks of this rank (the rank protocol's runtime ops), by op.
        self.handlers: dict[P.Op, Callable[[Any], P.Answer]] = {
            P.Op.WHERE: self._where,
            P.Op.PEERS: self._peers,
            P.Op.PAUSE: self._pause,
            P.Op.BOUNDARY: lambda r: rewire.boundary(self, r),
            P.Op.CANCEL: lambda _r: self._go_on(),
            P.Op.TEARDOWN: lambda r: rewire.teardown(self, r),
            P.Op.REBUILD: lambda r: rewire.rebuild(self, r),
            P.Op.RESUME: lambda _r: self._go_on(),
            P.Op.END: lambda r: ending.end(self, r),
            P.Op.RETIRE: lambda _r: join.retire(self),
            P.Op.RESTART: self._restart,
            P.Op.SETTLE: lambda r: recover.settle(self, r),
        }

    # ---- the training thread ---------------------------------------------------------------

    def after_step(self) -> None:
        if self.join is not None:
            self.join.stepped(self)
            return
        if self.retired:
            join.leave(self)
        with self.cond:
            self.step += 1
            now = time.monotonic()
            self.times.append(now)
        if now - self.stepped_said >= lines.STEPPED_EVERY and self.sock is not None:
            self.stepped_said = now  # (said by a thread of its own: a write never holds up training)
            if self.saying is None or not self.saying.is_alive():  # (an agent that stops reading)
                args = (lines.Stepped(self.step),)
                self.saying = threading.Thread(target=self.say, args=args, name="tpagent-stepped", daemon=True)
                self.saying.start()
        recover.capture(self, _live_groups)
        with self.cond:
            if self.stop_at is not None and self.unit == P.Unit.STEP and self.step >= self.stop_at:
                self.park(f"step {self.step}")

    def before_collective(self) -> None:
        if self.ended:  # (its communicators were broken off: no collective can complete)
            raise RuntimeError(f"{PREFIX}rank {self.rank} of job {self.job} cannot go on: {self.ended}")
        if self.stop_at is None:  # (the common case, without the lock: only the training thread counts;
            self.collectives += 1  # a pause set meanwhile is seen at the next collective)
            self.ctimes.append(time.monotonic())
            return
        with self.cond:
            if self.stop_at is not None and self.unit == P.Unit.COLLECTIVE and self.collectives >= self.stop_at:
                self.park(f"collective {self.collectives}")
            self.collectives += 1
            self.ctimes.append(time.monotonic())

    def park(self, where: str) -> None:
        """Wait here (``cond`` held) until the agent says go on, or its deadline passes; run
        what is asked of the training thread meanwhile (:meth:`on_training_thread`)."""
        _synchronize()
        self.parked = True
        self.cond.notify_all()
        deadline = time.monotonic() + self.park_timeout
        while self.parked:
            self.cond.wait(0.5)
            if self.chore is not None:
                chore = self.chore
                self.chore = None
                try:
                    chore()
                    self.chore_error = ""
                except Exception as e:  # (the user's code: said to the agent)
                    self.chore_error = f"{type(e).__name__}: {e}"
                self.cond.notify_all()
            if self.ended or (self.ending and time.monotonic() > deadline):  # (ending: told, not yet ended)
                self.parked = False
                why = self.ended or self.ending
                raise RuntimeError(f"{PREFIX}rank {self.rank} of job {self.job} stopped after {where}: {why}")
            if self.parked and time.monotonic() > deadline:
                if self.torn:
                    raise RuntimeError(
                        f"{PREFIX}rank {self.rank} of job {self.job} waited {self.park_timeout:.0f} s after {where} "
                        "for its communicators to be rebuilt; its agent never said"
                    )
                say(f"no word from the agent for {self.park_timeout:.0f} s after {where}: going on")
                self.parked = False
                self.stop_at = None
                self.stopped_by = ""

    def on_training_thread(self, chore: Callable[[], object]) -> str:
        """Run ``chore`` on the parked training thread (the user's code, on its CUDA device); why it failed, or ""."""
        with self.cond:
            if not self.parked or self.chore is not None:
                return "it is not stopped at a boundary"
            self.chore = chore
            self.chore_error = None
            self.cond.notify_all()
            while self.chore_error is None:
                if not self.parked:
                    self.chore = None  # (never run at a later stop)
                    return "it went on before it was done"
                self.cond.wait(0.5)
            return str(self.chore_error)

    # ---- the connection --------------------------------------------------------------------

    def start(self) -> None:
        self.thread = threading.Thread(target=self._connection, name="tpagent-rank", daemon=True)
        self.thread.start()

    def stop(self) -> None:
        """At exit, while the interpreter is whole: the connection's thread is ended and waited
        for (a little).  A daemon thread still running as the interpreter finalizes is ended by
        it wherever it stands, and one standing in torch's C++ code (a store call) then aborts
        the process ("terminate called without an active exception", pytorch/pytorch#38228):
        the job would end with SIGABRT after its last step."""
        if os.getpid() != self.pid or self.thread is None:
            return
        self.closing.set()
        if self.write_lock.acquire(timeout=1.0):  # (a reply stuck sending holds it: then the thread stays)
            try:
                if self.conn is not None:
                    with contextlib.suppress(OSError):
                        self.conn.shutdown(socket.SHUT_RDWR)  # (its readline returns)
            finally:
                self.write_lock.release()
        self.thread.join(timeout=2.0)

    def _connect(self) -> socket.socket | None:
        """A connection to the agent, or None.  Whoever listens on the name is believed only if
        it is root (the agent) or this rank's own user (who could do all it asks anyway): an
        abstract name may be taken by anyone while no agent holds it."""
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
        try:
            s.connect("\0" + self.socket_name)
            pid, uid, _gid = struct.unpack("3i", s.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, 12))
        except OSError:
            s.close()
            return None
        if uid not in (0, os.geteuid()):
            s.close()
            if not self.impostor_said:
                say(f"@{self.socket_name} is held by PID {pid} of UID {uid}, not by the agent: not talked to")
                self.impostor_said = True
            return None
        return s

    def _connection(self) -> None:
        warned = False
        while os.getpid() == self.pid and not self.closing.is_set():
            go = os.path.join(P.GO_DIR, P.go_name(self.job, self.rank))
            if self.leaving and not self.came_back and not os.path.exists(go):
                self.closing.wait(0.1)  # (no socket until an agent says so: it may be freezing us)
                continue
            s = self._connect()
            if s is None:
                if not warned and not self.torn:
                    say(f"no agent answers on @{self.socket_name}; this rank cannot be moved until one does")
                    warned = True
                self.closing.wait(0.1 if self.torn else 1.0)
                continue
            warned = False
            if self.key is None:
                self.key = self._job_key()
            self._serve(s)
            self.closing.wait(0.1)

    def _serve(self, s: socket.socket) -> None:
        f = s.makefile("rb")
        with self.write_lock:
            self.conn = s  # (stop sets closing, then shuts what it finds here: one of them sees the other)
            closing = self.closing.is_set()
        try:
            if closing:
                return
            with self.cond:
                hello = lines.Hello(
                    self.job,
                    self.rank,
                    self.world,
                    pid=os.getpid(),
                    gen=self.gen,
                    step=self.step,
                    state=self._state(),
                    backend=str(self.spec),
                    key=self.key or "",
                )
            s.sendall(codec.said(hello))
            first = codec.parse_line(f.readline(P.LINE_MAX + 1) or b"{}\n")
            if not codec.is_said(first, lines.LineOp.WELCOME):
                self.closing.wait(0.5)  # (not registered yet: the agent says so; ask again)
                return
            self.node = codec.decode(lines.Welcome, first).node
            self.came_back = self.leaving  # (welcomed back: a break reconnects at once, whatever becomes of the word)
            if not self.torn and self.join is None:  # (a joiner says so once it is in: rebuild)
                self.tell_store()
            with self.write_lock:
                self.sock = s
            while data := f.readline(P.LINE_MAX + 1):
                body = codec.parse_line(data)
                rid = body.get("id")
                try:
                    request = codec.decode_request(body)
                except P.ProtocolError as e:
                    self._reply(rid, P.failed(str(e)), on=s)
                    if body.get("op") == P.Op.LOAD.value:  # (what follows it cannot be told from lines)
                        break
                    continue
                if isinstance(request, P.Load):  # (its state follows the line, or is fetched)
                    payload = None if request.source else join.exactly(f, request.size)
                    threading.Thread(target=self._load, args=(rid, request, payload, s), daemon=True).start()
                    continue
                if isinstance(request, P.Teardown) and request.leaving:
                    # Answered here, then this thread closes the connection itself (nothing blocked
                    # on it): the agent freezes the rank only once it has seen it closed.
                    self._answer(rid, request, s)
                    if self.leaving:
                        break
                    continue
                threading.Thread(target=self._answer, args=(rid, request, s), daemon=True).start()
        except (OSError, ValueError, MemoryError):  # (MemoryError: a state announced too large to hold)
            pass
        finally:
            with self.write_lock:
                if self.sock is s:
                    self.sock = None
                self.conn = None
            with contextlib.suppress(OSError):
                f.close()
            with contextlib.suppress(OSError):
                s.close()

    def _reply(self, rid: object, answer: P.Answer, tail: bytes = b"", on: socket.socket | None = None) -> None:
        """``answer``'s line, then ``tail`` (a saved state), on the connection that asked (``on``), never a later."""
        try:
            data = codec.line(answer, id=rid)
        except P.ProtocolError as e:  # (every request gets its answer: this one says why it has none)
            data = codec.line(P.failed(f"its answer is not one of the rank protocol ({e})"), id=rid)
            tail = b""
        with self.write_lock:
            if self.sock is not None and self.sock is on:
                with contextlib.suppress(OSError):
                    self.sock.sendall(data)
                    self.sock.sendall(tail)

    def say(self, message: lines.Broke | lines.Stepped) -> None:
        """Tell the agent, unasked: a collective failed, or how far the rank stepped."""
        with self.write_lock:
            if self.sock is not None:
                with contextlib.suppress(OSError):
                    self.sock.sendall(codec.said(message))

    def _answer(self, rid: object, request: P.Request[Any], on: socket.socket) -> None:
        tail = b""
        answer: P.Answer
        try:
            if self.join is not None and request.OP not in join.ASKED_OF_A_JOINER:
                answer = P.failed("it is a process started to take a rank's place, not yet in the job")
            elif isinstance(request, P.Save):
                answer, tail = join.save(self, request)
            else:
                answer = self._do(request)
        except Exception as e:  # every request gets its answer
            answer = P.failed(f"{type(e).__name__}: {e}")
        self._reply(rid, answer, tail, on)
        if isinstance(request, P.Retire):
            self.retire_answered.set()  # (it ends only once its agent has this)
        if isinstance(request, P.Restart) and answer.ok:
            recover.restart(self, request.store, request.fresh)

    def _load(self, rid: object, request: P.Load, given: BinaryIO | None, on: socket.socket) -> None:
        joining = self.join
        if joining is None:
            if given is not None:
                given.close()
            return self._reply(rid, P.failed("it is not a joiner"), on=on)
        try:
            payload = join.fetched(request) if given is None else given
        except (OSError, ValueError) as e:
            return self._reply(rid, P.failed(f"its state could not be fetched from {request.source}: {e}"), on=on)
        self._reply(rid, joining.load(self, request, payload), on=on)
        joining.answered.set()

    @functools.cached_property
    def store_facts(self) -> tuple[str, str, str]:
        """Where this rank stands with the job's store, which do not change while it runs: the
        store's address if it serves the store itself, if it reaches it at a loopback address
        ("": no), and where it reaches it ("": not over TCP)."""
        from tpagent_rank import store

        return store.hosted_here(self.store) or "", store.loopback(self.store) or "", store.tcp_address(self.store)

    def _state(self) -> str:
        state = P.RankState.TORN_DOWN if self.torn else P.RankState.PAUSED if self.parked else P.RankState.RUNNING
        if self.join is not None:
            state = P.RankState.WAITING if self.join.waiting else P.RankState.JOINING
        return state.value

    def _job_key(self) -> str | None:
        """The job's identity (:func:`tpagent_rank.store.job_key`), or None while it cannot be agreed."""
        from tpagent_rank import store

        try:
            return store.job_key(self.store)
        except Exception as e:  # (a store without compare_set, or gone: asked again at the next connection)
            if not self.key_said:
                why = f"{type(e).__name__}: {e}"
                say(f"the job's identity cannot be agreed in its store ({why}): it cannot be moved until it is")
                self.key_said = True
            return None

    def tell_store(self) -> None:
        with contextlib.suppress(Exception):
            self.store.set(f"{P.AGENT_KEY}{self.rank}", self.node)

    # ---- what the agent asks -----------------------------------------------------------------

    def _do(self, request: P.Request[Any]) -> P.Answer:
        """The answer to one request (a dispatch over the runtime's ops)."""
        handler = self.handlers.get(request.OP)
        if handler is None:
            return P.failed(f"{request.OP.value!r} is not a request a rank answers")
        return rewire.by_another(self, request) or handler(request)

    def _where(self, _: P.Where) -> P.Standing:
        from tpagent_rank import aware, backend, nccladdr, store

        replicas = aware.replica_ranks()  # (resolved once, outside the lock: it may scan the heap)
        with self.cond:
            return P.Standing(
                step=self.step,
                collectives=self.collectives,
                gen=self.gen,
                state=self._state(),
                rate=_rate(self.times),
                collective_rate=_rate(self.ctimes),
                groups=len(backend.GROUPS.live()),
                nccl_host=backend.NCCL_HOST or "",
                nccl_ras=backend.nccl_ras(),
                host=nccladdr.host_identity(),
                hosts_store=self.store_facts[0],
                store_loopback=self.store_facts[1],
                aware=aware.usable(),
                replicas=replicas or (),
                no_replicas=aware.why_no_replicas() if replicas is None else "",
                held=self.held.step if self.held is not None else -1,
                broken=recover.BROKEN.why,
                store=self.store_facts[2],
                agreed=store.NAMED.get("agreed", ""),
            )

    def _peers(self, _: P.Peers) -> P.Agents:
        """Where each rank's agent is, as the job's store says; nothing where the store does not
        answer (lost with its node: a client would wait for its whole timeout)."""
        from tpagent_rank import store

        address = self.store_facts[2]
        if address and not store.reachable(address, STORE_PROBE):
            return P.Agents(agents=("",) * self.world)
        agents = []
        for r in range(self.world):
            key = f"{P.AGENT_KEY}{r}"
            agents.append(self.store.get(key).decode() if self.store.check([key]) else "")
        return P.Agents(agents=tuple(agents))

    def _pause(self, request: P.Pause) -> P.Paused:
        if request.unit not in (P.Unit.STEP.value, P.Unit.COLLECTIVE.value):
            return P.Paused(ok=False, error=f"{request.unit!r} is not a unit a rank stops at")
        with self.cond:  # (by_another's check, again under the lock that takes it: two pauses may come at once)
            if self.stopped_by not in ("", request.by):
                return P.Paused(ok=False, error=f"it is stopped by another move of its job ({self.stopped_by})")
            if (self.step if request.unit == P.Unit.STEP.value else self.collectives) >= request.at:
                return P.Paused(ok=False, late=True, error=f"it is past {request.unit} {request.at}")
            self.stop_at = request.at
            self.unit = request.unit
            self.stopped_by = request.by
        return P.Paused()

    def _restart(self, request: P.Restart) -> P.Answer:
        host, _, port = request.store.rpartition(":")
        if request.store and not (host and port.isdigit() and 0 < int(port) < 65536):
            return P.failed(f"{request.store!r} is not a store's HOST:PORT")
        taken = None if request.fresh else recover.held_file(self)  # (fresh: what it holds is dropped)
        if isinstance(taken, str):
            return P.failed(taken)
        busy = recover.quiet(recover.QUIET)  # (before the answer: after it comes the exec)
        busy = busy or ("it was told to end meanwhile" if self.ended else "")
        return P.failed(busy) if busy else P.Answer()

    def _go_on(self) -> P.Answer:
        with self.cond:
            if self.torn:
                return P.failed("its communicators are torn down: rebuild them first")
            self.stop_at = None
            self.stopped_by = ""
            self.parked = False
            self.cond.notify_all()
        return P.Answer()


def _live_groups() -> int:
    from tpagent_rank import backend

    return len(backend.GROUPS.live())


def _rate(times: deque[float]) -> float:
    return (len(times) - 1) / (times[-1] - times[0]) if len(times) > 1 and times[-1] > times[0] else 0.0


def _synchronize() -> None:
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()
