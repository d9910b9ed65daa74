"""``tpagent rank -- CMD``: a rank's stand-in, the process a job's launcher (torchrun's
per-node agent, srun, a pod) starts and watches in the rank's place.

It starts CMD as a ``tpagent launch`` workload (own PID and mount namespace) with the rank
runtime (:mod:`tpagent_rank`) on its ``PYTHONPATH``, registers it with this node's agent as
rank ``RANK`` of job ``TPAGENT_JOB`` (else ``TORCHELASTIC_RUN_ID``, ``SLURM_JOB_ID``), then
stays here whatever happens to the rank: when the rank is migrated away the stand-in follows
it from agent to agent, passes SIGTERM/SIGINT/SIGHUP on to it wherever it runs, and exits
with the rank's own status.  The launcher never sees the rank leave (torchrun would restart
the whole worker group if a child exited).

A stand-in that is not root (Slurm starts tasks as the job's user) cannot start the namespace
or read the cluster secret: it asks its node's agent over the local channel of
:mod:`tpagent.jobs.local` to start the rank as its own user, and follows it through that agent.

Where no launcher hosts the job's store (srun and ``env://``: rank 0 would serve it), the stand-in
of rank 0 serves it on this node, outside the rank, with the rank's own Python and no privilege
(:func:`host_store`, :mod:`tpagent.jobs.storeserver`): a rank that served it could not move, as its
peers reach it at this node's address.  The store lives as long as the stand-in, as it would have
lived as long as rank 0.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import shutil
import signal
import socket
import stat
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO, Protocol, TypeVar

import tpagent_rank
from host import paths, proc, signals
from host.api import UsageError, is_whole, shown
from tpagent.jobs.local import LocalAgent, Start, runtime_readable
from tpagent.jobs.storeserver import python_of, serve, stop_store, store_user
from tpagent.migration.api import AgentError, PeerUnreachable
from tpagent.workload import launch
from tpagent_rank import protocol as P
from tpagent_rank.store import HOSTED

A = TypeVar("A", bound=P.Answer)


class RankAgent(Protocol):
    """What a stand-in asks of an agent: an agent over gRPC (root's), or through the local channel."""

    address: str

    def rank(self, job: str, rank: int, request: P.Request[A], timeout: float, key: str = "") -> A: ...


#: Where the runtime directory is written (root's, readable by the ranks): one per version.
RUNTIME_ROOT = paths.RANK_RUNTIME
FORWARDED = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)
#: How long the stand-in keeps asking an agent that does not answer before it gives the rank up.
LOST_AFTER = 600.0
#: A signal the rank's node cannot take yet (the rank moving) is passed on again this long.
SIGNAL_KEPT = 600.0
#: An agent silent this long is said to be (and again, if it answered meanwhile).
SILENT_SAID = 30.0


def rank_of(env: dict[str, str]) -> int:
    for key in ("RANK", "SLURM_PROCID", "OMPI_COMM_WORLD_RANK"):
        if is_whole(env.get(key, "")):
            if int(env[key]) >= P.RANK_MAX:
                raise UsageError(f"{key}={env[key][:30]} is not a rank tpagent can move: give 0 to {P.RANK_MAX - 1}.")
            return int(env[key])
    raise UsageError("the rank is not known: the launcher sets RANK (torchrun) or SLURM_PROCID (srun).")


def job_of(env: dict[str, str]) -> str:
    """The rank's job id (:func:`tpagent_rank.protocol.job_id`), one the agents take."""
    job = P.job_id(env)
    if not P.valid_job(job):
        named = " or ".join(P.JOB_VARIABLES)
        raise UsageError(
            f"the job id '{shown(job[:60])}' ({named}) is not one tpagent can move: give up to {P.JOB_MAX} "
            "printable characters."
        )
    return job


def runtime_dir(root: Path = RUNTIME_ROOT) -> Path:
    """The directory put on a rank's PYTHONPATH: only :mod:`tpagent_rank` and its start-up file."""
    from tpagent_rank import layout  # type: ignore[attr-defined,unused-ignore]

    package = Path(tpagent_rank.__file__).parent
    digest = hashlib.sha256(b"".join(f.read_bytes() for f in sorted(package.glob("*.py")))).hexdigest()[:16]
    dest = root / f"{tpagent_rank.__version__}-{digest}"  # (an upgrade gets a directory of its own)
    if (dest / "sitecustomize.py").is_file():
        runtime_readable(root)
        return dest
    root.mkdir(parents=True, exist_ok=True, mode=0o755)
    os.chmod(root, 0o755)
    runtime_readable(root)  # (ranks run as users too)
    tmp = Path(tempfile.mkdtemp(dir=root, prefix=".new-"))
    os.chmod(tmp, 0o755)
    layout.write_runtime_dir(tmp)
    try:
        tmp.rename(dest)  # (another stand-in may have been first: then its copy is used)
    except OSError:
        shutil.rmtree(tmp, ignore_errors=True)
    return dest


def launcher_env(env: dict[str, str]) -> dict[str, str]:
    """``env`` with what ``env://`` reads (RANK, WORLD_SIZE, LOCAL_RANK) taken from srun's
    variables where the launcher did not set them."""
    out = dict(env)
    for key, slurm in (("RANK", "SLURM_PROCID"), ("WORLD_SIZE", "SLURM_NTASKS"), ("LOCAL_RANK", "SLURM_LOCALID")):
        if key not in out and is_whole(out.get(slurm, "")):
            out[key] = out[slurm]
    return out


def rank_env(env: dict[str, str], socket_name: str, job: str, runtime: bool = True) -> dict[str, str]:
    """The rank's environment; with the runtime on its PYTHONPATH (``runtime``: else the agent puts it there)."""
    out = launcher_env(env)
    if runtime:
        out["PYTHONPATH"] = os.pathsep.join(p for p in (str(runtime_dir()), env.get("PYTHONPATH", "")) if p)
    out["TPAGENT_RANK_SOCKET"] = socket_name
    out["TPAGENT_JOB"] = job
    out.setdefault("USE_LIBUV", "0")  # a store a rank hosts must be dumpable (libuv's uses io_uring)
    # NCCL's RAS (2.24+) starts a thread per process at its first communicator, listening on the
    # node's address, and never stops it.  On an H100 a rank whose communicators were all
    # destroyed still held such a socket and could not move.  Off unless the user turned it on.
    out.setdefault("NCCL_RAS_ENABLE", "0")
    return out


def _local(host: str) -> bool:
    """Whether ``host`` names an address of this node."""
    try:
        found = socket.getaddrinfo(host, None, type=socket.SOCK_DGRAM)
    except OSError:
        return False
    for family, _, _, _, addr in found:
        with socket.socket(family, socket.SOCK_DGRAM) as s:
            try:
                s.bind((addr[0], 0))
                return True
            except OSError:
                continue
    return False


def host_store(cmd: list[str], env: dict[str, str]) -> tuple[subprocess.Popen[bytes] | None, str]:
    """Serve the job's store here, outside the rank, if rank ``env`` would serve it (rank 0 of
    an ``env://`` job that no launcher hosts a store for), as :func:`store_user`: the server (and
    what its stand-in says of it, if anything), or None and why not ("" if the rank serves none)."""
    host = env.get("MASTER_ADDR", "")
    port = env.get("MASTER_PORT", "")
    if env.get("RANK") != "0" or not host or not is_whole(port) or env.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
        return None, ""
    if not _local(host):
        return None, f"MASTER_ADDR {host} is not an address of this node"
    python = python_of(cmd, env)
    if python is None:
        return None, f"{cmd[0]} is not a Python interpreter (nor a script one runs) to serve it with"
    server, _port, said = serve(python, host, int(port), env, store_user(env), {})
    return server, said


#: Bytes of a line held back at most, waiting for its end (output that is not lines goes on past it).
LINE_HELD_MAX = 64 << 10


@dataclass
class _Relay:
    """How far the rank's stdout or stderr file has been relayed, and where to.  Only whole
    lines are written: its launcher's output is shared with the node's other ranks, whose lines
    a piece of one (read as the rank was writing it) would cut in two."""

    offset: int
    out: BinaryIO
    #: The start of a line whose end the rank has not written yet.
    held: bytes = b""

    def write(self, data: bytes, final: bool = False) -> None:
        """Relay ``data``, read at ``offset``, up to its last whole line (all of it if ``final``)."""
        self.offset += len(data)
        text = self.held + data
        cut = len(text) if final or len(text) > LINE_HELD_MAX else text.rfind(b"\n") + 1
        self.held = text[cut:]
        if cut:
            with contextlib.suppress(OSError):
                self.out.write(text[:cut])
                self.out.flush()


class StandIn:
    def __init__(
        self,
        cmd: list[str],
        agent: RankAgent,
        connect: Callable[[str], RankAgent],
        stdout: Path,
        stderr: Path,
        socket_name: str,
        umask: int,
        relay: bool = True,
    ) -> None:
        self.cmd = cmd
        self.agent = agent
        self.connect = connect
        self.stdout = stdout
        self.stderr = stderr
        self.socket_name = socket_name
        self.umask = umask
        self.signals: list[int] = []
        self.kept: list[tuple[int, float]] = []  # (the signals not yet passed on, since when)
        self.told = False  # (that the first of them waits)
        self.init_ticks = 0  # (its init's start, once launched)
        self.wake = threading.Event()
        #: What is relayed: the rank's stdout (and stderr, if a file of its own).
        self.relays: dict[int, _Relay] = {}
        #: Our own descriptors of the files the rank writes (1, 2): what its agent could not relay
        #: (restarting as the rank ended) is read from them at the end.
        self.files: dict[int, int] = {}
        #: The agent refused to know the rank (another's of that name runs there): it is run and
        #: followed here alone, never asked of the agent, which would answer of the other's.
        self.alone = False
        if relay:
            self.relays[1] = _Relay(_size(stdout), sys.stdout.buffer)
            if stderr.absolute() != stdout.absolute():
                self.relays[2] = _Relay(_size(stderr), sys.stderr.buffer)

    def say(self, text: str) -> None:
        print(f"tpagent rank: {text}", file=sys.stderr, flush=True)

    def run(self) -> int:
        env = dict(os.environ)
        job = job_of(env)
        rank = rank_of(env)
        renv = rank_env(env, self.socket_name, job, runtime=not isinstance(self.agent, LocalAgent))
        store, why = host_store(self.cmd, launcher_env(env))  # (not the runtime's environment)
        if store is not None:
            renv[HOSTED] = renv["MASTER_PORT"]
            if why:
                self.say(why)
        elif why:
            self.say(f"rank {rank} of job {job} serves the job's store itself, so it cannot be moved: {why}")
        try:
            return self._run(job, rank, renv)
        finally:
            if store is not None:
                stop_store(store)

    def _launch(self, job: str, rank: int, renv: dict[str, str]) -> tuple[int, subprocess.Popen[bytes] | None]:
        """The rank's init, and the process holding its namespace (None: the agent holds it)."""
        if isinstance(self.agent, LocalAgent):
            out, err = (str(f.absolute()) for f in (self.stdout, self.stderr))
            start = Start(job, rank, tuple(self.cmd), renv, os.getcwd(), self.umask, out, err)
            init = self.agent.start(start)
            self._hold_files({1: out, 2: err})  # (the caller's own files, opened as the caller)
            return init, None
        init, holder = launch.start(self.cmd, self.stdout, self.stderr, umask=self.umask, env=renv)
        self.init_ticks = proc.start_ticks(init)  # (signals reach that very process, never its PID's next)
        self._hold_files({w: f"/proc/{init}/fd/{w}" for w in (1, 2)})  # (what its init holds: never a path)
        try:
            self.agent.rank(job, rank, P.Expect(pid=init), 30)
        except AgentError as e:
            self.say(f"the agent does not know rank {rank} of job {job}, so it cannot be moved ({e})")
            self.alone = True
        return init, holder

    def _run(self, job: str, rank: int, renv: dict[str, str]) -> int:
        for sig in FORWARDED:  # (first: one that comes while the rank starts is passed on once it runs)
            signal.signal(sig, self._on_signal)
        try:
            init, holder = self._launch(job, rank, renv)
        except AgentError as e:
            self.say(f"rank {rank} of job {job} could not be started: {e}")
            return 1
        where: RankAgent = self.agent
        last_heard = time.monotonic()
        said = False  # (that its agent has not answered for a while)
        while True:
            self._forward(where, job, rank, init, holder)
            self._relay(where, job, rank)
            if where is self.agent and holder is not None and holder.poll() is None:
                self.wake.wait(0.5)
                self.wake.clear()
                continue
            if self.alone and holder is not None:
                return self._ended(where, job, rank, _status(holder.wait()))
            try:
                loc = where.rank(job, rank, P.Locate(), 10)
                last_heard = time.monotonic()
            except PeerUnreachable as e:
                silent = time.monotonic() - last_heard
                if silent > LOST_AFTER:
                    self.say(
                        f"the agent at {where.address} has not answered for {LOST_AFTER:.0f} s ({e}); "
                        f"rank {rank} of job {job} is given up"
                    )
                    return 1
                if silent > SILENT_SAID and not said:
                    self.say(f"the agent at {where.address} has not answered for {silent:.0f} s ({e}); asked on")
                said = silent > SILENT_SAID
                time.sleep(1)
                continue
            except AgentError as e:
                if where is self.agent and holder is not None:  # (the agent never knew it: it ran and ended here)
                    return self._ended(where, job, rank, _status(holder.wait()))
                self.say(f"the agent at {where.address} lost track of rank {rank} of job {job} ({e})")
                return 1
            if loc.state == P.Whereabouts.EXITED.value:
                return self._ended(where, job, rank, _status(loc.code))
            if loc.state == P.Whereabouts.MOVED.value:
                self.say(f"rank {rank} of job {job} now runs on {loc.node}" + (" (rebuilt)" if loc.anew else ""))
                where = self._peer(loc.node)
                for relay in self.relays.values() if loc.anew else ():  # (a new process: files of its own)
                    relay.write(b"", final=True)
                    relay.offset = 0
                continue
            if loc.state in (P.Whereabouts.HERE.value, P.Whereabouts.MOVING.value):
                self.wake.wait(0.5)
                self.wake.clear()
                continue
            if where is self.agent and holder is not None:
                return self._ended(where, job, rank, _status(holder.wait()))
            self.say(f"rank {rank} of job {job} is gone from {where.address} without an exit status")
            return 1

    def _hold_files(self, names: dict[int, str]) -> None:
        for which in self.relays:
            with contextlib.suppress(OSError):
                fd = os.open(names[which], os.O_RDONLY | os.O_CLOEXEC | os.O_NONBLOCK | os.O_NOCTTY)
                if stat.S_ISREG(os.fstat(fd).st_mode):
                    self.files[which] = fd
                else:
                    os.close(fd)

    def _ended(self, where: RankAgent, job: str, rank: int, code: int) -> int:
        self._relay(where, job, rank)  # (the last of what it wrote)
        if where is self.agent:  # (it ended on this node: what its agent did not relay is in its files)
            self._relay_files()
        for relay in self.relays.values():
            relay.write(b"", final=True)  # (a last line without its end)
        return code

    def _relay(self, where: RankAgent, job: str, rank: int) -> None:
        """Write what the rank wrote since the last time to this process's own stdout (stderr),
        which its launcher shows: read through the agent of the node it runs on (or from its
        files, where the agent does not know it)."""
        if self.alone:
            self._relay_files()
            return
        for which, relay in self.relays.items():
            for _ in range(16):  # (at most 16 MiB a round: signals are passed on meanwhile)
                try:
                    data = where.rank(job, rank, P.Output(fd=which, offset=relay.offset), 10).data
                except AgentError:
                    break  # (asked again next round; a rank the agent cannot read is not relayed)
                if not data:
                    break
                relay.write(data)

    def _relay_files(self) -> None:
        for which, relay in self.relays.items():
            fd = self.files.get(which)
            while fd is not None and (data := os.pread(fd, 1 << 20, relay.offset)):
                relay.write(data)

    def _peer(self, address: str) -> RankAgent:
        return self.connect(address)

    def _on_signal(self, signum: int, _frame: object) -> None:  # (only flags)
        self.signals.append(signum)
        self.wake.set()

    def _forward(self, where: RankAgent, job: str, rank: int, init: int, holder: object) -> None:
        """Pass the signals this process got on to the rank, in order.  One its node cannot take
        now (the rank being moved, or moved on and this process not yet told) is kept, with those
        after it, and passed on again each round (where the rank is then), for up to
        :data:`SIGNAL_KEPT` seconds."""
        now = time.monotonic()
        while self.signals:
            self.kept.append((self.signals.pop(0), now))
        while self.kept:
            sig, since = self.kept[0]
            why = self._pass_on(where, job, rank, init, holder, sig)
            if why and now - since < SIGNAL_KEPT:
                if not self.told:
                    self.say(f"signal {sig} waits to be passed on to rank {rank} of job {job}: {why}")
                self.told = True
                return
            if why:
                self.say(f"signal {sig} was not passed on to rank {rank} of job {job} in {SIGNAL_KEPT:.0f} s: {why}")
            self.kept.pop(0)
            self.told = False

    def _pass_on(self, where: RankAgent, job: str, rank: int, init: int, holder: object, sig: int) -> str:
        """Why ``sig`` could not be passed on to the rank now ("": it was).  Through the agent of
        the node it runs on, which holds it while it moves the rank; a rank launched here goes
        without its agent (not answering, or not knowing it): its init passes it on."""
        local = where is self.agent and holder is not None
        if not (local and self.alone):
            try:
                answer = where.rank(job, rank, P.Signal(signum=int(sig)), 10)
                return "" if answer.ok else answer.error
            except AgentError as e:
                if not local:
                    return f"the agent at {where.address}: {e}"
        ok = signals.signal_exact(init, self.init_ticks, sig)
        return "" if ok else f"it no longer runs as PID {init} here"


def _size(path: Path) -> int:
    """How much of ``path`` was there before the rank started (an existing log is appended to)."""
    try:
        return os.stat(path).st_size
    except OSError:
        return 0


def _status(code: int | None) -> int:
    """An exit status as a shell gives it (a signal: 128 + its number)."""
    if code is None:
        return 1
    return code if code >= 0 else 128 - code
