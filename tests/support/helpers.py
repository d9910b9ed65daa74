"""Shared test machinery: real workloads, the real CLI, and checks on the workload's state."""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import psutil

from host.proc import alive, is_kernel_thread

ROOT = Path(__file__).resolve().parents[2]
STATEFUL = ROOT / "tests" / "workloads" / "stateful.py"
_TICK = re.compile(r"^tick (\d+) counter (\d+) piped (\d+)$")
#: Put before a command to run it as user nobody, as an attacker with no privilege (no groups).
NOBODY = ["setpriv", "--reuid=nobody", "--regid=nogroup", "--clear-groups", "--"]


def wait_until(pred, what: str, timeout: float = 60.0, interval: float = 0.05, where=None):  # type: ignore[no-untyped-def]
    """``pred()`` once it is true; past ``timeout`` an AssertionError naming ``what`` (and, with
    ``where``, a callable, what it says of where things stood)."""
    deadline = time.monotonic() + timeout
    while True:
        value = pred()
        if value:
            return value
        if time.monotonic() > deadline:
            said = f"\n{where()}" if where is not None else ""
            raise AssertionError(f"timed out after {timeout} s waiting for {what}{said}")
        time.sleep(interval)


def tpagent(*args: str, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "cli.main", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=ROOT,
        stdin=subprocess.DEVNULL,
    )


def assert_one_sentence_error(proc: subprocess.CompletedProcess[str], *needles: str) -> None:
    """Non-zero exit, no traceback, one ``tpagent: ...`` line saying what is wrong."""
    assert proc.returncode not in (0, None), proc
    assert "Traceback" not in proc.stderr, proc.stderr
    lines = [ln for ln in proc.stderr.splitlines() if ln.startswith("tpagent:")]
    assert len(lines) == 1, proc.stderr
    for needle in needles:
        assert needle in lines[0], lines[0]


def kernel_thread() -> int | None:
    """A kernel thread's PID (kthreadd is 2 on a host), or None where none is seen (a PID namespace
    of its own: there PID 2 is anyone's)."""
    for pid in psutil.pids():
        with contextlib.suppress(OSError):
            if is_kernel_thread(pid):
                return pid
    return None


def process_with_pid(pid: int) -> subprocess.Popen[bytes]:
    """A `sleep` that has exactly ``pid``, once it is free (the kernel's next PID is steered
    through ns_last_pid, as root; a user gets there by cycling PIDs)."""
    for _ in range(100):
        Path("/proc/sys/kernel/ns_last_pid").write_text(str(pid - 1))
        holder = subprocess.Popen(["sleep", "600"], stdin=subprocess.DEVNULL)
        if holder.pid == pid:
            return holder
        holder.kill()
        holder.wait()
    raise AssertionError(f"could not start a process with PID {pid} (other processes took it first)")


def slow_restore_criu(tmp: Path, seconds: float) -> tuple[Path, Path]:
    """A CRIU (the real one behind a wrapper) whose restores wait ``seconds`` first: the wrapper,
    and the file it touches as a restore begins."""
    from snapshot.criu import Criu

    wrapper = tmp / "criu-slow-restore"
    started = tmp / "restore-started"
    real = Criu().path
    wrapper.write_text(
        f'#!/bin/sh\nif [ "$1" = restore ]; then touch {started}; sleep {seconds:g}; fi\nexec {real} "$@"\n'
    )
    wrapper.chmod(0o755)
    return wrapper, started


def kill_and_wait(pid: int, timeout: float = 10.0) -> None:
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        return
    wait_until(lambda: not alive(pid), f"PID {pid} to die", timeout)


_SHELL = """\
import subprocess, sys
child = subprocess.Popen(sys.argv[2:])
open(sys.argv[1], "w").write(f"{child.pid}\\n")
child.wait()
"""


@dataclass
class Workload:
    """tests/workloads/stateful.py, started plainly or under `tpagent launch`."""

    log: Path
    mib: int
    launched: bool = False
    session_leader: bool = True
    extra: tuple[str, ...] = ()
    wrap: tuple[str, ...] = ()  # (a session leader) a command it is started under: `unshare -m`...
    pid: int = 0  # the PID to dump: the process itself, or its namespace's init
    popen: subprocess.Popen[bytes] | None = field(default=None, repr=False)

    def start(self) -> Workload:
        cmd = [sys.executable, str(STATEFUL), str(self.log), str(self.mib), *self.extra]
        out = self.log.with_suffix(".out")
        if self.launched:
            proc = tpagent("launch", "--stdout", str(out), "--", *cmd)
            assert proc.returncode == 0, proc.stderr
            self.pid = int(proc.stdout.strip())
        elif self.session_leader:
            with open(out, "ab") as f:
                self.popen = subprocess.Popen(
                    [*self.wrap, *cmd], stdin=subprocess.DEVNULL, stdout=f, stderr=f, start_new_session=True
                )
            self.pid = self.popen.pid
        else:
            # A shell job: the workload's session leader is its parent, a shell-like process in our
            # PID namespace (a leader outside it, as a CI runner's may be, CRIU cannot dump at all).
            pidfile = self.log.with_suffix(".pid")
            with open(out, "ab") as f:
                self.popen = subprocess.Popen(
                    [sys.executable, "-c", _SHELL, str(pidfile), *cmd],
                    stdin=subprocess.DEVNULL,
                    stdout=f,
                    stderr=f,
                    start_new_session=True,
                )
            wait_until(lambda: pidfile.exists() and pidfile.read_text().endswith("\n"), "the shell job to start")
            self.pid = int(pidfile.read_text())
        wait_until(lambda: len(self.ticks()) >= 5, "the workload to start ticking")
        return self

    @property
    def worker_pid(self) -> int:
        """The stateful process itself (in a launched namespace: the init's child)."""
        if not self.launched:
            return self.pid
        return psutil.Process(self.pid).children()[0].pid

    def lines(self) -> list[str]:
        return self.log.read_text().splitlines() if self.log.exists() else []

    def ticks(self) -> list[tuple[int, int, int]]:
        return [tuple(map(int, m.groups())) for ln in self.lines() if (m := _TICK.match(ln))]  # type: ignore[misc]

    def digest(self) -> str:
        return next(ln.split()[1] for ln in self.lines() if ln.startswith("digest "))

    def verify_state(self) -> None:
        """Ask the workload to re-hash its memory; it must equal the digest it started with."""
        before = sum(ln.startswith("verify ") for ln in self.lines())
        os.kill(self.worker_pid, signal.SIGUSR1)
        wait_until(lambda: sum(ln.startswith("verify ") for ln in self.lines()) > before, "a verify line")
        last = [ln for ln in self.lines() if ln.startswith("verify ")][-1]
        assert last.split()[1] == self.digest(), "the workload's memory changed across checkpoint/restore"

    def reap(self) -> None:
        """Collect the exit of the original (our child) once CRIU killed it, freeing its PID."""
        if self.popen is not None:
            self.popen.wait(timeout=30)
            self.popen = None

    def stop(self) -> None:
        if self.pid:
            kill_and_wait(self.pid)
        self.reap()


def assert_continuous(ticks: list[tuple[int, int, int]]) -> None:
    """Ticks count up by exactly one with no restart; thread and pipe values never go back."""
    assert ticks, "no ticks"
    for (n0, c0, p0), (n1, c1, p1) in zip(ticks, ticks[1:], strict=False):
        assert n1 == n0 + 1, f"tick {n0} followed by tick {n1}"
        assert c1 >= c0 and p1 >= p0, f"thread state went back at tick {n1}"


@dataclass
class TcpEcho:
    """tests/workloads/tcp_echo.py: a process using an established TCP connection to itself."""

    log: Path
    popen: subprocess.Popen[bytes] | None = field(default=None, repr=False)

    def start(self) -> TcpEcho:
        script = STATEFUL.parent / "tcp_echo.py"
        self.popen = subprocess.Popen(
            [sys.executable, str(script), str(self.log)], stdin=subprocess.DEVNULL, start_new_session=True
        )
        wait_until(lambda: self.log.exists() and len(self.pairs()) > 5, "the TCP workload to start")
        return self

    @property
    def pid(self) -> int:
        assert self.popen is not None
        return self.popen.pid

    def pairs(self) -> list[tuple[int, int]]:
        """(N, M) per ``tick N echo M`` line: M == N while the connection carries bytes intact."""
        return [(int(a), int(b)) for _, a, _, b in (ln.split() for ln in self.log.read_text().splitlines())]

    def stop(self) -> None:
        kill_and_wait(self.pid)
        assert self.popen is not None
        self.popen.wait(timeout=10)
