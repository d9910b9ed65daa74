"""A job's store served outside its ranks, with a rank's own Python (torch's ``TCPStore``), as
a user with no privilege: it needs none.

* Rank 0's stand-in serves it on ``MASTER_ADDR:MASTER_PORT`` where no launcher does (srun,
  ``env://``): a rank that served it could not move (:func:`tpagent.jobs.standin.host_store`).
* The agent that rebuilds a job whose store was lost with its node serves it anew on its own node
  (:func:`serve_anew`, unplanned recovery): at a free port, holding the value the job's identity
  was agreed on (so that every rank, old or new, has the identity it had), until no rank of the
  job runs on this node or left from it.  Its ranks are told where it is
  (:data:`tpagent_rank.protocol.STORE_VARIABLE`).

The stand-in's ends when its standard input does (the stand-in exited or was killed): it lives as
rank 0 would have.  One served anew outlives the agent that started it, as the job's ranks do:
it is written down (``WORK_DIR/stores.json``), and the agent's next run keeps it
(:func:`adopt`) until no rank of its job is left here, then ends it.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import pwd
import re
import select
import shutil
import stat
import subprocess
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, BinaryIO

import psutil

from host import proc
from host.api import is_whole
from host.sockets import endpoint
from tpagent.migration.journal import write_durably
from tpagent_rank import protocol as P

log = logging.getLogger(__name__)

#: How long the store server may take to listen (its Python imports torch first).
STORE_READY_TIMEOUT = 120.0
#: nobody's UID and GID where the system has no such user in its password file.
NOBODY = 65534
#: How often a store served anew looks whether a rank of its job is still on this node.
KEEP_CHECK = 5.0
#: The store server.  argv: host, port (0: a free one), until ("stdin": its standard input ends;
#: "killed"), then keys and values it starts with; it says "ready PORT" once it listens.
STORE_SERVER = """\
import sys, threading
from torch.distributed import TCPStore
store = TCPStore(sys.argv[1], int(sys.argv[2]), None, True, wait_for_workers=False)
for key, value in zip(sys.argv[4::2], sys.argv[5::2]):
    store.set(key, value)
print("ready", store.port, flush=True)
sys.stdin.read() if sys.argv[3] == "stdin" else threading.Event().wait()
"""


def python_of(cmd: list[str], env: dict[str, str]) -> str | None:
    """The Python interpreter that runs ``cmd``: the command itself, or what its ``#!`` names."""
    path = env.get("PATH", os.defpath)
    exe = cmd[0] if "/" in cmd[0] else shutil.which(cmd[0], path=path)
    for _ in range(2):
        if exe is None:
            return None
        if re.fullmatch(r"python[0-9.]*", Path(exe).name):
            return exe
        line = _first_line(exe)
        words = line[2:].decode(errors="replace").split() if line.startswith(b"#!") else []
        if len(words) > 1 and Path(words[0]).name == "env":  # #!/usr/bin/env python3
            words = words[1:]
        exe = (words[0] if "/" in words[0] else shutil.which(words[0], path=path)) if words else None
    return None


def _first_line(path: str) -> bytes:
    """The first line of ``path`` if it is a regular file (else, or unreadable, nothing).  The
    path is the user's: it is opened first with no access (O_PATH: a FIFO does not block, a
    device is not opened), and read only once that names a regular file."""
    try:
        handle = os.open(path, os.O_PATH | os.O_CLOEXEC)
    except OSError:
        return b""
    try:
        if not stat.S_ISREG(os.fstat(handle).st_mode):
            return b""
        with open(f"/proc/self/fd/{handle}", "rb") as f:  # (the very file looked at)
            return f.readline(256)
    except OSError:
        return b""
    finally:
        os.close(handle)


def store_user(env: dict[str, str]) -> tuple[int, int] | None:
    """Whom the store server runs as (UID, GID; None: this process's user): it needs no
    privilege, so a stand-in of root's runs it as the user who started it through sudo
    (``SUDO_UID``, ``SUDO_GID``), else as nobody, with no supplementary group."""
    if os.geteuid() != 0:
        return None
    uid = env.get("SUDO_UID", "")
    gid = env.get("SUDO_GID", "")
    if is_whole(uid) and is_whole(gid) and int(uid) != 0:
        return int(uid), int(gid)
    try:
        nobody = pwd.getpwnam("nobody")
    except KeyError:
        return NOBODY, NOBODY
    return nobody.pw_uid, nobody.pw_gid


#: What of a rank's environment its store server gets: where its Python and torch are found, no
#: more (a rank's tokens and keys stay with the rank; the server may run as another user).
STORE_ENVIRONMENT = frozenset(
    {"PATH", "PYTHONPATH", "PYTHONHOME", "LD_LIBRARY_PATH", "VIRTUAL_ENV", "CONDA_PREFIX", "LANG", "LC_ALL", "TMPDIR"}
)


def _serve(
    argv: list[str], env: dict[str, str], errors: BinaryIO, user: tuple[int, int] | None
) -> subprocess.Popen[bytes]:
    uid, gid = user if user is not None else (None, None)
    return subprocess.Popen(
        argv,
        stdin=subprocess.PIPE if argv[5] == "stdin" else subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=errors,
        env={**{k: v for k, v in env.items() if k in STORE_ENVIRONMENT}, "HOME": "/"},
        cwd="/",
        start_new_session=True,
        user=uid,
        group=gid,
        extra_groups=[] if user is not None else None,
    )


def _started(
    argv: list[str], env: dict[str, str], user: tuple[int, int] | None
) -> tuple[subprocess.Popen[bytes] | None, str]:
    """The store server, listening, and its port; or None and the last line it said."""
    with tempfile.TemporaryFile() as errors:
        try:
            server = _serve(argv, env, errors, user)
        except OSError as e:
            return None, f"{argv[0]}: {e.strerror}"
        except subprocess.SubprocessError as e:  # (its child died before it said why: "Bad exception data")
            return None, f"{argv[0]}: {e}"
        assert server.stdout is not None
        ready, _, _ = select.select([server.stdout], [], [], STORE_READY_TIMEOUT)
        said = server.stdout.readline().split() if ready else []
        if len(said) == 2 and said[0] == b"ready" and said[1].isdigit():
            return server, said[1].decode()
        stop_store(server)
        errors.seek(0)
        return None, (errors.read().decode(errors="replace").strip().splitlines() or ["it did not start in time"])[-1]


def stop_store(server: subprocess.Popen[bytes]) -> None:
    server.kill()
    server.wait()
    for pipe in (server.stdin, server.stdout):
        if pipe is not None:
            pipe.close()


def serve(
    python: str,
    host: str,
    port: int,
    env: dict[str, str],
    user: tuple[int, int] | None,
    seed: dict[str, str],
    until: str = "stdin",
    roots: bool = True,
) -> tuple[subprocess.Popen[bytes] | None, str, str]:
    """The store served at ``host``:``port`` by ``python`` as ``user`` (None: this process's),
    holding ``seed`` until its standard input ends (or ``until`` "killed"): the server, its port
    and what is to be said of it ("": nothing); or None, "" and why not.  Where ``user`` cannot
    run that Python (or its torch), root serves it, said, if ``python`` and ``env`` are root's
    own (``roots``): never a user's, which would run the user's code as root."""
    argv = [python, "-c", STORE_SERVER, host, str(port), until, *(x for kv in sorted(seed.items()) for x in kv)]
    server, said = _started(argv, env, user)
    if server is not None:
        return server, said, ""
    if user is None or not roots:
        return None, "", f"serving it on port {port} failed: {said}"
    server, last = _started(argv, env, None)
    if server is None:
        return None, "", f"serving it on port {port} failed: {last}"
    return (
        server,
        last,
        (
            f"the job's store is served as root: as UID {user[0]} it did not start ({said}); "
            "a Python (and torch) that any user can run keeps root out of it"
        ),
    )


def serve_anew(
    job: str, spec: P.Join, host: str, agreed: str, running: Callable[[], bool], kept: Path | None = None
) -> tuple[str, Callable[[], None]]:
    """Serve the store of ``job``, lost with its node, on this node at ``host`` (see the module),
    with the Python and as the user of the rank ``spec`` (root's rank: as nobody, or as root where
    nobody cannot run its Python; a user's rank never as root); ``agreed``: the value its identity
    was agreed on; written down in ``kept``.  ``HOST:PORT`` and what ends it; RuntimeError: why not."""
    env = dict(e.split("=", 1) for e in spec.env if "=" in e)
    python = python_of(list(spec.cmd), env)
    if python is None:
        raise RuntimeError(f"{spec.cmd[0]} is not a Python interpreter (nor a script one runs) to serve it with")
    user = None if os.geteuid() != 0 else (spec.uid, spec.gid) if spec.uid != 0 else store_user({})
    seed = {P.JOB_KEY: agreed} if agreed else {}
    server, port, said = serve(python, host, 0, env, user, seed, until="killed", roots=spec.uid == 0)
    if server is None:
        raise RuntimeError(said)
    if said:
        log.warning("job %s: %s", job, said)
    address = endpoint(host, port)
    store = Kept(job, address, psutil.Process(server.pid), kept, server)
    store.note()
    threading.Thread(target=store.keep, args=(running,), name=f"store-{job}", daemon=True).start()
    return address, store.end


def adopt(kept: Path, running: Callable[[str], bool]) -> None:
    """The stores a previous run of this agent served anew (written down in ``kept``), kept again
    until no rank of their jobs is left here; those that ended meanwhile forgotten."""
    try:
        rows = _read(kept)
    except (OSError, ValueError, KeyError, TypeError) as e:
        log.error("the stores served anew, written down in %s, cannot be read (%s): none is kept", kept, e)
        return
    for row in rows:
        try:
            p = psutil.Process(int(row["pid"]))
            ours = proc.is_started(p.pid, row["started"]) and STORE_SERVER in p.cmdline()
        except (psutil.Error, KeyError, TypeError, ValueError):
            ours = False
        store = Kept(str(row.get("job", "")), str(row.get("address", "")), p if ours else None, kept)
        if not ours:
            store.forget()
            continue
        log.info("job %s: its store served anew at %s is kept again", store.job, store.address)
        threading.Thread(target=store.keep, args=(lambda j=store.job: running(j),), daemon=True).start()


def _read(kept: Path) -> list[dict[str, Any]]:
    """The records in ``kept`` (none if it is not there); ValueError if it holds no list of them."""
    rows = json.loads(kept.read_text())["stores"] if kept.exists() else []
    if not isinstance(rows, list):
        raise ValueError("its stores are not a list")
    return [r for r in rows if isinstance(r, dict)]


class Kept:
    """A store served anew (see the module): its server, and where it is written down."""

    lock = threading.Lock()  # (one file for every job's)

    def __init__(
        self,
        job: str,
        address: str,
        server: psutil.Process | None,
        kept: Path | None,
        child: subprocess.Popen[bytes] | None = None,
    ) -> None:
        self.job = job
        self.address = address
        self.server = server  # (None: it is not running, or not the one written down)
        self.kept = kept
        self.child = child  # (its Popen, where this run of the agent started it: it reaps it)

    def _rows(self) -> list[dict[str, object]]:
        """The other jobs' records."""
        assert self.kept is not None
        try:
            rows = _read(self.kept)
        except (OSError, ValueError, KeyError, TypeError):
            rows = []
        return [r for r in rows if r.get("job") != self.job]

    def _write(self, rows: list[dict[str, object]]) -> None:
        assert self.kept is not None
        try:
            write_durably(self.kept, {"format": 1, "stores": rows})
        except OSError as e:
            log.error("the stores served anew cannot be written down in %s: %s", self.kept, e.strerror)

    def note(self) -> None:
        if self.kept is None or self.server is None:
            return
        row = {
            "job": self.job,
            "address": self.address,
            "pid": self.server.pid,
            "started": proc.started(self.server.pid),
        }
        with self.lock:
            self._write([*self._rows(), row])

    def forget(self) -> None:
        if self.kept is None:
            return
        with self.lock:
            self._write(self._rows())

    def keep(self, running: Callable[[], bool]) -> None:
        """Until the server ends, or no rank of the job is left here (then it is ended)."""
        while self.server is not None and self._alive() and running():
            time.sleep(KEEP_CHECK)
        self.end()

    def _alive(self) -> bool:
        if self.child is not None:
            return self.child.poll() is None
        try:
            return self.server is not None and self.server.is_running() and self.server.status() != psutil.STATUS_ZOMBIE
        except psutil.Error:
            return False

    def end(self) -> None:
        if self.child is not None:
            stop_store(self.child)
        elif self.server is not None:  # (a previous run's: its parent now reaps it)
            with contextlib.suppress(psutil.Error):
                self.server.kill()
                self.server.wait(10)
        self.forget()
