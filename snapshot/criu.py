"""Drive CRIU (>= 4.2) through its command line.

Each call runs ``criu`` with an argument list (never a shell string), a timeout and a log
file inside the images directory; when CRIU fails, its error lines and the log's tail are
carried in :class:`~snapshot.api.CriuError` so the user sees CRIU's own words.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import resource
import shutil
import subprocess
import sys
import threading
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path

import psutil

from host import paths, signals, sockets
from host import proc as host_proc
from host.api import UsageError, shown
from host.safefs import private_opener
from host.signals import deferred_sigint
from host.trusted import trusted_program
from snapshot.api import CriuError, DumpMode

log = logging.getLogger(__name__)

MIN_VERSION = (4, 2)
#: Where ``scripts/install-criu.sh`` puts its private CRIU.
INSTALLED_CRIU = paths.INSTALLED_CRIU
INSTALL_HINT = (
    "run scripts/install-criu.sh (it installs Debian's CRIU 4.2 into /opt/tpagent/criu) "
    "or point TPAGENT_CRIU at a criu >= 4.2"
)
#: In CRIU's work directory (-W): "PID START_TIME" of the CRIU working there, written as it
#: starts, so that a restarted agent knows that very process (never a command-line match).
PIDFILE = "criu.pid"
#: How long a dump past its time is given to roll back once told to (:meth:`Criu._run`), before CRIU is killed.
GIVE_UP_WITHIN = 300.0
_LOG_TAIL_LINES = 12
#: Error lines CRIU logs on every run on these nodes that mean nothing for the outcome.
_HARMLESS = ("Can't setup RLIMIT_NOFILE",)


def locate(explicit: Path | None = None) -> Path:
    """Find the criu binary: explicit path, $TPAGENT_CRIU, the installed prefix, then PATH; one
    only root can change (root runs it, on other users' processes)."""
    env = os.environ.get("TPAGENT_CRIU")
    for candidate in (explicit, Path(env) if env else None):
        if candidate is not None:
            if not (candidate.is_file() and os.access(candidate, os.X_OK)):
                raise UsageError(f"CRIU was not found at {candidate}; {INSTALL_HINT}.")
            return trusted_program(candidate, "CRIU")
    if INSTALLED_CRIU.is_file():
        return trusted_program(INSTALLED_CRIU, "CRIU")
    found = shutil.which("criu")
    if found is None:
        raise UsageError(f"CRIU is not installed; {INSTALL_HINT}.")
    return trusted_program(Path(found), "CRIU")


def parse_version(text: str) -> tuple[int, int, int] | None:
    match = re.search(r"Version:\s*(\d+)\.(\d+)(?:\.(\d+))?", text)
    return None if match is None else (int(match[1]), int(match[2]), int(match[3] or 0))


def log_errors(log_file: Path) -> str:
    """CRIU's error lines from a log, else its tail: what the user needs to see."""
    try:
        lines = log_file.read_text(errors="replace").splitlines()
    except OSError:
        return ""
    errors = [
        re.sub(r"^\(\s*[\d.]+\)\s*", "", ln.strip())
        for ln in lines
        if ("Error (" in ln or "BUG" in ln) and not any(h in ln for h in _HARMLESS)
    ]
    picked = errors[-_LOG_TAIL_LINES:] if errors else lines[-_LOG_TAIL_LINES:]
    return " | ".join(picked)


@dataclass(frozen=True)
class DumpOptions:
    #: What CRIU does with the tree once the dump is sealed.
    finish: DumpMode = DumpMode.KILL
    shell_job: bool = False
    tcp_established: bool = False
    #: The tree's mount namespace is not the node's (``tpagent launch``'s, `unshare -m`): its
    #: mounts are declared external, bound back from the node's same paths on restore.
    mounts: bool = False
    #: Run by CRIU at each action; a failing ``post-dump`` makes CRIU roll the dump back
    #: (resume the tree, unlock its network) instead of killing it.
    action_script: Path | None = None
    env: Mapping[str, str] = field(default_factory=dict)
    #: Largest deleted-but-open file CRIU keeps in the images (CRIU's own default: 1 MiB).
    ghost_limit: int = 1 << 20
    #: Hand the images over pipes to a :class:`snapshot.streamer.Capture` listening in the
    #: images directory instead of writing them there.
    stream: bool = False
    #: Mount points of the namespace left out of the dump (``--skip-mnt``): see :mod:`host.mounts`.
    skip_mounts: tuple[str, ...] = ()


@dataclass(frozen=True)
class RestoreOptions:
    shell_job: bool = False
    tcp_established: bool = False
    mounts: bool = False  # (as :attr:`DumpOptions.mounts`: the mount namespace rebuilt)
    #: Leave the restored tree stopped (SIGSTOP): it runs once sent SIGCONT.
    leave_stopped: bool = False
    #: Run by CRIU at each action; a failing ``post-restore`` makes CRIU kill the tree before
    #: any of it ran (:func:`snapshot.hook.restored`).
    action_script: Path | None = None
    env: Mapping[str, str] = field(default_factory=dict)


class Criu:
    """One CRIU binary, checked for version on construction."""

    def __init__(self, path: Path | None = None) -> None:
        self.path = locate(path)
        self.version = self._probe_version()
        if self.version[:2] < MIN_VERSION:
            have = ".".join(map(str, self.version))
            raise UsageError(
                f"CRIU {have} at {self.path} is too old: tpagent needs CRIU >= 4.2 "
                f"(older CRIU cannot dump TCP sockets or read this kernel's vDSO); {INSTALL_HINT}."
            )

    @property
    def version_str(self) -> str:
        return ".".join(map(str, self.version))

    def _run(
        self,
        args: list[str],
        timeout: float | None,
        env: Mapping[str, str] | None = None,
        work: Path | None = None,
        cwd: Path | None = None,
        give_up: Path | None = None,
    ) -> subprocess.CompletedProcess[str]:
        """Run criu to completion.  A Ctrl-C is held back until CRIU is done: a CRIU killed
        while its parasite code runs inside the workload would take the workload down, and
        one left running unsupervised could stop the tree after we resumed it.  With
        ``work``, CRIU's PID and start time go to its :data:`PIDFILE` there.  Past ``timeout``,
        CRIU is killed; with ``give_up`` (a dump's cancel file) it is first told there to roll
        back and given :data:`GIVE_UP_WITHIN` seconds: a CRIU killed mid-dump leaves the tree's
        TCP connections in repair mode and its network locked (the workload dies of it).  A CRIU
        killed is killed with its descendants (a restore's tree)."""
        cmd = [str(self.path), *args]
        log.debug("running %s", cmd)
        with deferred_sigint():
            try:
                # Its own session: a terminal's Ctrl-C goes to our process group, not to CRIU.
                # umask 077: its images are someone's whole memory, for root's eyes only.
                with _open_files_up_to_hard():
                    proc = subprocess.Popen(
                        cmd,
                        stdout=subprocess.PIPE,
                        stderr=subprocess.PIPE,
                        text=True,
                        errors="replace",  # (a program that is no CRIU may print anything)
                        stdin=subprocess.DEVNULL,
                        start_new_session=True,
                        env={**os.environ, **env} if env else None,
                        umask=0o077,
                        cwd=cwd,
                    )
            except OSError as e:
                raise CriuError(f"could not run {self.path}", detail=str(e), code=e.errno) from e
            if work is not None:
                _write_pidfile(work / PIDFILE, proc.pid)
            try:
                out, err = proc.communicate(timeout=timeout)
            except subprocess.TimeoutExpired as e:
                late = f"criu {args[0]} did not finish within {timeout:.0f} s"
                if give_up is not None:
                    give_up.write_text(f"{late}: rolled back")
                    with contextlib.suppress(subprocess.TimeoutExpired):  # (done, or rolled back: as it says)
                        out, err = proc.communicate(timeout=GIVE_UP_WITHIN)
                        return subprocess.CompletedProcess(cmd, proc.returncode, out, err)
                # With every process it started: a restore's tree, left by a CRIU killed, ran on beside
                # the original its caller went back to.
                signals.kill_tree(proc.pid)
                with contextlib.suppress(subprocess.TimeoutExpired):
                    proc.communicate(timeout=5)
                proc.wait()
                raise CriuError(late) from e
        return subprocess.CompletedProcess(cmd, proc.returncode, out, err)

    def _probe_version(self) -> tuple[int, int, int]:
        proc = self._run(["--version"], timeout=30)
        version = parse_version(proc.stdout + proc.stderr)
        if version is None:
            said = next(iter((proc.stdout + proc.stderr).strip().splitlines()), "nothing")
            raise UsageError(
                f"{self.path} does not look like CRIU (its --version printed {said[:80]!r}); {INSTALL_HINT}."
            )
        return version

    def check(self, timeout: float = 60) -> str:
        """``criu check``: returns its verdict, raises CriuError when CRIU says it cannot work."""
        proc = self._run(["check"], timeout)
        out = (proc.stdout + proc.stderr).strip()
        if proc.returncode != 0:
            raise CriuError("criu check failed", detail=out[-500:], code=proc.returncode)
        return out.splitlines()[-1] if out else "ok"

    def dump(
        self, pid: int, images: Path, work: Path, opts: DumpOptions, timeout: float | None, cancel: Path | None = None
    ) -> None:
        """Dump the tree of ``pid`` into ``images``; CRIU's log and stats go to ``work``.  Past
        ``timeout``, CRIU is told to roll back in ``cancel`` (read by the post-dump hook)."""
        # Streamed, CRIU connects to its images directory's socket by the -D path, which must fit
        # a socket's name (108 bytes): it runs there, told ".".
        cwd = images if opts.stream else None
        args = ["dump", "-t", str(pid), "-D", "." if opts.stream else str(images), "-W", str(work)]
        args += ["-o", "dump.log", "-v4"]
        args += [] if opts.finish is DumpMode.KILL else [f"--{opts.finish.value}"]  # --leave-running / --leave-stopped
        args += self._common(opts.shell_job, opts.tcp_established)
        # The namespace's mounts are the node's own: declare them all external.
        args += ["--external", "mnt[]"] if opts.mounts else []
        args += [arg for path in opts.skip_mounts for arg in ("--skip-mnt", path)]
        args += ["--action-script", str(opts.action_script)] if opts.action_script else []
        # A file open under a name removed while it has another (a POSIX semaphore of Python's
        # spawn multiprocessing) is named again beside where it was (host.files.Relinked).
        args += ["--ghost-limit", str(opts.ghost_limit), "--link-remap"]
        args += ["--stream"] if opts.stream else []
        proc = self._run(args, timeout, opts.env, work, cwd, cancel)
        if proc.returncode != 0:
            detail = log_errors(work / "dump.log") or proc.stderr.strip()
            if "Can't dump ghost file" in detail:
                raise CriuError(
                    f"PID {pid} holds a deleted-but-open file larger than the ghost limit "
                    f"({opts.ghost_limit / 2**20:.0f} MiB), which CRIU would have to copy into the snapshot; "
                    "raise it with --ghost-limit-mib (TPAGENT_GHOST_LIMIT_MIB, the agent's ghost_limit_mib)",
                    detail=detail,
                    code=proc.returncode,
                )
            if "In-flight connection" in detail or "write queue on an in-flight socket" in detail:
                raise CriuError(
                    f"PID {pid}'s tree has a listening socket with connections queued that it has not accepted "
                    "(in flight), which CRIU does not dump; once they are accepted (or given up), try again",
                    detail=detail,
                    code=proc.returncode,
                )
            raise CriuError(f"criu dump of PID {pid} failed", detail=detail, code=proc.returncode)

    def restore(self, images: Path, work: Path, opts: RestoreOptions, timeout: float) -> int:
        """Restore detached; returns the PID (in our namespace) of the restored tree's root.

        CRIU's log, stats and pidfile go to ``work``, never into the snapshot's directory."""
        pidfile = work / "restore.pid"
        args = ["restore", "-D", str(images), "-W", str(work), "-o", "restore.log", "-v4", "-d"]
        args += ["--pidfile", str(pidfile)]
        args += ["--leave-stopped"] if opts.leave_stopped else []
        args += self._common(opts.shell_job, opts.tcp_established)
        # Rebuilding a mount namespace needs its root given (without it CRIU 4.2 segfaults
        # at mount.c:48) and the external mounts bound back to the node's same paths.
        args += ["--root", "/", "--ext-mount-map", "auto"] if opts.mounts else []
        args += ["--action-script", str(opts.action_script)] if opts.action_script else []
        proc = self._run(args, timeout, opts.env, work=work)
        if proc.returncode != 0:
            raise CriuError(
                _port_taken(work / "restore.log")
                or _mount_missing(work / "restore.log")
                or _file_changed(work / "restore.log")
                or "criu restore failed",
                detail=log_errors(work / "restore.log") or proc.stderr.strip(),
                code=proc.returncode,
            )
        try:
            return int(pidfile.read_text().strip())
        except (OSError, ValueError) as e:
            raise CriuError("criu restore did not report the restored PID") from e

    @staticmethod
    def _common(shell_job: bool, tcp: bool) -> list[str]:
        args = ["--file-locks", "--ext-unix-sk", "--manage-cgroups=ignore"]
        args += ["--shell-job"] if shell_job else []
        # No iptables on these nodes: nftables for the network lock, none when no TCP is held.
        args += ["--tcp-established", "--network-lock", "nftables"] if tcp else ["--network-lock", "skip"]
        return args


#: CRIU's log of an inet socket it restores, and of its bind failing (the lines of one process:
#: ``(TIME) PID: inet: Restore: family F type T proto P port N state S src_addr A``).
_INET_RESTORE = re.compile(r"\(\s*[\d.]+\)\s+(\d+): inet:\s+Restore: .*\btype (\S+)\s.*\bport (\d+) .*\bsrc_addr (\S+)")
_BIND_TAKEN = re.compile(r"\(\s*[\d.]+\)\s+(\d+): Error \(criu/sk-inet\.c:\d+\): inet: Can't bind inet socket .*in use")


def _port_taken(log_file: Path) -> str | None:
    """Why a restore failed, in one sentence, where CRIU could not bind a socket of the tree's
    again because its port is taken here (the very node it was dumped on, or one where another
    process has it): None for any other failure."""
    try:
        lines = log_file.read_text(errors="replace").splitlines()
    except OSError:
        return None
    restoring: dict[str, tuple[str, str, int]] = {}  # each process's last socket restored
    for line in lines:
        if m := _INET_RESTORE.fullmatch(line):
            restoring[m[1]] = (m[2], m[4], int(m[3]))
        elif (m := _BIND_TAKEN.fullmatch(line)) and m[1] in restoring:
            kind, host, port = restoring[m[1]]
            where = sockets.endpoint(host, port)
            if kind != "SOCK_STREAM":
                return f"criu restore failed: port {where}, which the process had bound, is taken here; CRIU said"
            listener = sockets.listener_on(host, port)
            why = (
                f"a socket listens on {listener} here"
                if listener
                else "connections closed on that port wait out TIME_WAIT, a minute at most, and the process had "
                "not set SO_REUSEADDR"
            )
            return (
                f"criu restore failed: TCP port {where}, which the process had bound, is taken on this node ({why}); "
                "nothing was restored, and the snapshot can be restored once the port is free; CRIU said"
            )
    return None


#: CRIU's log of a mount point of the namespace it rebuilds that the node lacks (mount-v2.c:
#: its own path for the parent mount, then the rest), and of where each of its paths stands in
#: the namespace (``Will mount ID @ ITS_PATH PATH``).
_NO_MOUNTPOINT = re.compile(r".*Can't stat mountpoint (/\S*?/mnt-\d+)(/.*): No such file or directory")
_WILL_MOUNT = re.compile(r".*Will mount \d+ @ (/\S*/mnt-\d+) (/.*)")


def _mount_missing(log_file: Path) -> str | None:
    """Why a restore failed, in one sentence, where a mount point of the snapshot's namespace is
    missing on this node (a container's or a session's mount gone since the dump, or on the
    node it was dumped on only): None for any other failure."""
    try:
        lines = log_file.read_text(errors="replace").splitlines()
        found = next(filter(None, map(_NO_MOUNTPOINT.fullmatch, lines)))
    except (OSError, StopIteration):
        return None
    paths = {m[1]: m[2] for m in map(_WILL_MOUNT.fullmatch, lines) if m}
    path = paths.get(found[1], "").rstrip("/") + found[2]
    return (
        f"criu restore failed: the process's namespace had a mount at {path}, which is missing on this node "
        "(CRIU binds each mount back at its path); nothing was restored: make that directory (an empty one does "
        "if the process used nothing in it) and restore again; CRIU said"
    )


_LIMIT_LOCK = threading.Lock()


@contextlib.contextmanager
def _open_files_up_to_hard() -> Iterator[None]:
    """This process's soft limit on open files at its hard one while it starts CRIU, which keeps it (a
    shell's 1024 is a job's usual): CRIU puts its own descriptors above the tree's highest, under its
    soft limit, which it cannot raise itself without CAP_SYS_RESOURCE (its restore of a job holding
    more failed: "Can't chose service_fd_base"); raising a soft limit needs no privilege.  Put back
    at once: what the agent starts otherwise (a rebuilt rank) has the limit it had."""
    with _LIMIT_LOCK:
        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
        try:
            yield
        finally:
            resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


def _write_pidfile(path: Path, pid: int) -> None:
    try:
        started = host_proc.started(pid)
    except OSError:
        return  # (it is done already)
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w", opener=private_opener) as f:
        f.write(f"{pid} {started}")
    tmp.rename(path)


def pidfile(work: Path) -> tuple[int, str] | None:
    """The PID and start (:func:`host.proc.started`) of the CRIU started with ``work`` as its work
    directory, from its :data:`PIDFILE` there; None where there is none or it cannot be read."""
    try:
        pid_text, started = (work / PIDFILE).read_text().split()
        return int(pid_text), started
    except (OSError, ValueError):
        return None


_LOCK_TABLE = re.compile(r"inet (CRIU-[0-9A-Za-z-]+) ")


def drop_network_lock(work: Path) -> None:
    """Remove the nftables table with which the dump in ``work`` locked its TCP connections
    (named in its dump.log).  CRIU lifts it on a rollback, and a restore on this node does;
    after a restore elsewhere it stays here and keeps dropping those connections' packets."""
    try:
        found = _LOCK_TABLE.search((work / "dump.log").read_text(errors="replace"))
    except OSError:
        return
    if found is None:
        return  # (no TCP connection was locked)
    # (or the one scripts/setup.sh --bundle put beside this Python, on a node that had none)
    nft = shutil.which("nft") or shutil.which("nft", path=str(Path(sys.executable).parent))
    if nft is None:
        log.warning("cannot remove CRIU's network lock %s: nft (nftables) is not installed", found.group(1))
        return
    done = subprocess.run([nft, "delete", "table", "inet", found.group(1)], capture_output=True, text=True, timeout=30)
    if done.returncode != 0 and "No such file" not in done.stderr:
        log.warning("could not remove CRIU's network lock %s: %s", found.group(1), done.stderr.strip())


def started_in(work: Path) -> psutil.Process | None:
    """The CRIU that was started with ``work`` as its work directory, if it still runs: that
    very process (PID and start, from its :data:`PIDFILE`), not any process that mentions the
    path."""
    written = pidfile(work)
    if written is None or not host_proc.is_started(*written):
        return None
    try:
        return psutil.Process(written[0])
    except psutil.Error:
        return None


def stop_in(work: Path) -> bool:
    """Kill the CRIU that was started with ``work`` as its work directory, if it still runs,
    and what it had started (a tree half restored: stopped first, so it starts no more of it,
    then killed whole); whether it ran."""
    written = pidfile(work)
    if written is None or not host_proc.is_started(*written):
        return False
    ticks, _, _ = written[1].partition("@")
    return signals.kill_tree(written[0], int(ticks) if ticks.isdigit() else None)


def running_in(work: Path) -> bool:
    """Whether the CRIU that was started with ``work`` as its work directory still runs."""
    return started_in(work) is not None


#: CRIU's check of a file the process held, reopened by its name (files-reg.c): the size (but
#: of a file only appended to), the mode and, for an ELF file, the build-ID it had at the dump.
_FILE_CHANGED = re.compile(r".*Error \(criu/files-reg\.c:\d+\): File (.+) has bad (size|mode|build-ID)\b(.*)")
_EXPECTED = re.compile(r" (\d+) \(expect (\d+)\)")


def _file_changed(log_file: Path) -> str | None:
    """Why a restore failed, in one sentence, where a file the process held is not as it was at
    the dump (written to, or replaced, since: CRIU reopens each one only as it was): None for
    any other failure."""
    try:
        found = next(filter(None, map(_FILE_CHANGED.fullmatch, log_file.read_text(errors="replace").splitlines())))
    except (OSError, StopIteration):
        return None
    path = "/" + found[1].lstrip("/")  # (CRIU's path is its mount namespace root's, without the "/")
    what = {"size": "its size", "mode": "its mode", "build-ID": "its ELF build-ID (another build of it)"}[found[2]]
    if (values := _EXPECTED.match(found[3])) and found[2] == "size":
        what = f"its size ({int(values[1]):,} bytes here, {int(values[2]):,} when dumped)"
    elif values and found[2] == "mode":
        what = f"its mode ({values[1]} here, {values[2]} when dumped)"
    return (
        f"criu restore failed: {shown(path)}, which the process held, has changed since the dump: {what}; CRIU reopens "
        "a file only as it was, so nothing was restored: put that file back as it was (or restore on a node that "
        "has it so) and restore again; CRIU said"
    )
