"""Ranks of ordinary users (issue 26): a stand-in that is not root asks its node's agent, over the
local stand-in channel, to start its rank as itself.  Attacks as a second user (daemon) against
the first's (nobody's) rank, by the wire itself: nothing reaches another user's rank, files or
directory, and nothing runs with more than the caller's own rights (an LD_PRELOAD is never loaded
by root's processes)."""

from __future__ import annotations

import base64
import json
import os
import shutil
import signal
import struct
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psutil
import pytest

from conftest import needs_criu
from host import proc
from support.cluster import Cluster
from support.helpers import ROOT, wait_until
from support.users import DAEMON, NOBODY, as_user, user_dir, user_python
from tpagent.jobs import joiners

pytestmark = needs_criu

CLIENT = ROOT / "tests" / "attackers" / "stand_in_client.py"
WHO = ROOT / "tests" / "workloads" / "who.py"
CHANNEL = "tpagent-ranks-standin"  # (the agents' default rank_socket, "-standin")
PRELOAD = r"""
#include <stdio.h>
#include <unistd.h>
__attribute__((constructor)) static void said(void) {
    FILE *f = fopen(LOG, "a");
    if (f) { fprintf(f, "%d\n", (int)geteuid()); fclose(f); }
}
"""


@pytest.fixture
def node_a(tmp_path: Path) -> Iterator[Cluster]:
    c = Cluster(tmp_path, ["A"])
    try:
        c.nodes["A"].start_agent()
        yield c
    finally:
        c.close()


def _ask(c: Cluster, user: tuple[int, int], request: dict[str, Any]) -> dict[str, Any]:
    python, env = user_python()
    argv = c.nodes["A"].exec(*as_user(user), python, str(CLIENT), CHANNEL, json.dumps(request))
    out = subprocess.run(argv, capture_output=True, text=True, timeout=60, env={**os.environ, **env})
    assert out.returncode == 0, out.stderr
    return dict(json.loads(out.stdout))


def _start(job: str, home: Path, n: int = 400, **kw: Any) -> dict[str, Any]:
    python, env = user_python()
    return {
        "op": "start",
        "job": job,
        "rank": 0,
        "cmd": [python, str(WHO), str(n)],
        "env": {"PATH": os.defpath, **env},
        "cwd": str(home),
        "umask": 0o022,
        "stdout": str(home / f"{job}.out"),
        "stderr": str(home / f"{job}.out"),
        **kw,
    }


def _refused(answer: dict[str, Any], words: str) -> None:
    assert answer.get("ok") is False and words in answer["error"], answer
    assert "\n" not in answer["error"] and "Traceback" not in answer["error"]


def _workload(init: int) -> psutil.Process:
    return wait_until(lambda: (psutil.Process(init).children() or [None])[0], "the workload to start", 30)


@pytest.mark.timeout(300)
def test_a_users_rank_runs_as_that_user_and_no_other_user_reaches_it(node_a: Cluster) -> None:
    c = node_a
    python, env = user_python()
    with user_dir(NOBODY) as victim_home, user_dir(DAEMON) as home:
        out = victim_home / "rank.out"
        stand_in = subprocess.Popen(
            c.nodes["A"].exec(*as_user(NOBODY), python, "-m", "cli.main", "rank", "--stdout", str(out), "--",
                              python, str(WHO), "400"),
            cwd=victim_home,
            env={"PATH": os.defpath, "HOME": str(victim_home), "RANK": "0", "TPAGENT_JOB": "victim", **env},
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )  # fmt: skip
        try:
            wait_until(lambda: out.exists() and "tick 1 " in out.read_text(), "the victim's rank to tick", 60)
            line = out.read_text().splitlines()[0]
            assert f"uid {NOBODY[0]} euid {NOBODY[0]} gid {NOBODY[1]} groups [] cwd {victim_home}" in line, line
            # Another user reaches nothing of it.
            for request in ({"op": "locate"}, {"op": "signal", "signum": 9}, {"op": "output", "fd": 1, "offset": 0}):
                asked = {"op": "rank", "job": "victim", "rank": 0, "request": request}
                _refused(_ask(c, DAEMON, asked), "rank 0 of job victim was not started here by you")
            _refused(_ask(c, DAEMON, _start("victim", home)), "was started here by another user")
            before = out.read_text()
            _refused(_ask(c, DAEMON, _start("a1", home, stdout=str(out))), "Permission denied")
            assert out.read_text().startswith(before) and f"uid {DAEMON[0]} " not in out.read_text()
            _refused(_ask(c, DAEMON, _start("a2", home, stdout="/root/tpagent-attack.out")), "Permission denied")
            assert not Path("/root/tpagent-attack.out").exists()
            _refused(_ask(c, DAEMON, _start("a3", home, cwd=str(victim_home))), "cannot enter the directory")

            # Its own rank runs with its own rights alone; an LD_PRELOAD reaches only its own process.
            preload = _evil_library(home)
            env_preload = {"LD_PRELOAD": str(preload), "PATH": os.defpath, **env}
            started = _ask(c, DAEMON, _start("mine", home, env=env_preload))
            assert started["ok"], started
            who = _workload(started["pid"])
            assert who.uids().real == who.uids().effective == DAEMON[0] and who.gids().real == DAEMON[1]
            assert Path(f"/proc/{who.pid}/status").read_text().split("Groups:")[1].split("\n")[0].strip() == ""
            assert psutil.Process(started["pid"]).uids().real == 0  # (the namespace's init: root's, as ever)
            # A fresh process of it (a model-aware move's, a rebuild's) starts where it did, not in the agent's.
            spec = joiners.spec_of(started["pid"], proc.start_ticks(started["pid"]), DAEMON[0])
            assert spec.cwd == str(home) and (spec.uid, spec.gid) == DAEMON, spec
            wait_until(lambda: (home / "preload.log").exists(), "its own process to load its library", 30)
            assert set((home / "preload.log").read_text().split()) == {str(DAEMON[0])}
            asked = {"op": "rank", "job": "mine", "rank": 0, "via": "10.233.0.99:7400", "request": {"op": "locate"}}
            _refused(_ask(c, DAEMON, asked), "never moved to 10.233.0.99:7400")
            mine = _ask(c, DAEMON, {"op": "rank", "job": "mine", "rank": 0, "request": {"op": "locate"}})
            assert mine["ok"] and mine["answer"]["state"] == "here", mine
            _refused(
                _ask(c, DAEMON, {"op": "rank", "job": "mine", "rank": 0, "request": {"op": "end"}}), "may only ask"
            )
            asked = {"op": "rank", "job": "mine", "rank": 0, "request": {"op": "signal", "signum": 15}}
            assert _ask(c, DAEMON, asked)["ok"]  # (its own rank: it may)
            wait_until(lambda: not who.is_running() or who.status() == psutil.STATUS_ZOMBIE, "its rank to end", 30)

            # The victim's rank ran on untouched; its stand-in passes SIGTERM on, and ends with its status.
            assert stand_in.poll() is None
            stand_in.send_signal(signal.SIGTERM)
            try:
                relayed, said = stand_in.communicate(timeout=60)
            except subprocess.TimeoutExpired:  # (what it and its agent said, to see why)
                stand_in.kill()
                relayed, said = stand_in.communicate()
                raise AssertionError(f"no end 60 s after SIGTERM: {said} {c.nodes['A'].agent_log()[-6000:]}") from None
            assert stand_in.returncode == 128 + signal.SIGTERM, said
            ticks = [ln.split()[1] for ln in out.read_text().splitlines() if ln.startswith("tick ")]
            assert len(ticks) > 2 and ticks == [str(i) for i in range(len(ticks))]
            assert f"tick {len(ticks) - 1} " in relayed  # (relayed to its launcher, to the last line)
        finally:
            if stand_in.poll() is None:
                stand_in.send_signal(signal.SIGKILL)
            stand_in.communicate()


def _evil_library(home: Path) -> Path:
    """A library that appends the effective UID of whoever loads it to ``home/preload.log``."""
    cc = shutil.which("cc")
    assert cc is not None, "no C compiler (scripts/setup.sh installs gcc)"
    src = home / "evil.c"
    src.write_text(PRELOAD.replace("LOG", json.dumps(str(home / "preload.log"))))
    lib = home / "evil.so"
    subprocess.run([cc, "-shared", "-fPIC", "-o", str(lib), str(src)], check=True, capture_output=True)
    os.chown(lib, *DAEMON)
    (home / "preload.log").touch()
    os.chown(home / "preload.log", *DAEMON)
    (home / "preload.log").unlink()  # (created by whoever loads the library: as itself)
    return lib


def _roots_rank(c: Cluster, job: str, tmp: Path, script: str) -> subprocess.CompletedProcess[str]:
    """``sh -c script`` as rank 0 of ``job`` under a stand-in of root's (the agent's API), to its end."""
    argv = c.nodes["A"].exec(
        str(Path(os.sys.executable).parent / "tpagent"), "rank", "--agent", c.nodes["A"].agent_address,
        "--stdout", str(tmp / f"{job}.out"), "--", "sh", "-c", script,
    )  # fmt: skip
    env = {**c.cli_env("A"), "TPAGENT_JOB": job, "RANK": "0", "WORLD_SIZE": "1"}
    return subprocess.run(argv, env=env, capture_output=True, text=True, timeout=120)


@pytest.mark.timeout(300)
def test_a_rank_of_roots_is_never_followed_into_another_users_of_its_name(node_a: Cluster, tmp_path: Path) -> None:
    """Another user's rank of the same job and rank, started first, is the agent's; root's own
    then runs unknown to the agent (it cannot move), and its stand-in relays its output and
    its status, never the other's.  Once root's has ended, its name stays root's a while (its
    stand-in may yet ask how it ended): another user's start of it is refused."""
    c = node_a
    with user_dir(DAEMON) as home:
        first = _ask(c, DAEMON, _start("taken", home))
        assert first["ok"], first
        ran = _roots_rank(c, "taken", tmp_path, "echo root rank; exit 3")
        assert ran.returncode == 3, ran.stderr
        assert "cannot be moved" in ran.stderr and "root rank" in ran.stdout and "tick " not in ran.stdout, ran

        ended = _roots_rank(c, "ends", tmp_path, "echo root rank; exit 3")
        assert ended.returncode == 3 and "root rank" in ended.stdout, ended
        _refused(_ask(c, DAEMON, _start("ends", home)), "was started here by another user")


@pytest.mark.timeout(300)
def test_a_users_rank_output_is_not_read_back_from_a_file_it_may_only_write(node_a: Cluster) -> None:
    """The agent reads a rank's stdout as root, for its stand-in: a user who gives their rank a
    root file that anyone may write but only root read (mode 0622) as its stdout gets none of it
    back through the output request (before: the whole file).  Their own file is read."""
    c = node_a
    with user_dir(DAEMON) as home, tempfile.TemporaryDirectory(dir="/tmp") as roots:
        os.chmod(roots, 0o755)  # (root's, which anyone may pass through)
        secret = Path(roots) / "root.log"
        secret.write_text("root's secret line\n")
        os.chmod(secret, 0o622)  # (root's: DAEMON may append, not read)
        started = _ask(c, DAEMON, _start("peek", home, stdout=str(secret)))
        assert started["ok"], started
        wait_until(lambda: "tick 1 " in secret.read_text(), "the rank to write into the file", 30)
        asked = {"op": "rank", "job": "peek", "rank": 0, "request": {"op": "output", "fd": 1, "offset": 0}}
        answer = wait_until(lambda: _judged(c, asked), "the output request to be judged", 30)
        _refused(answer, "is a file its user may not read")
        # Anyone may read this one by its mode, but its access list lets DAEMON only write to it.
        listed = Path(roots) / "listed.log"
        listed.write_text("root's secret line\n")
        os.chmod(listed, 0o664)
        os.setxattr(listed, "system.posix_acl_access", _acl(user_obj=6, daemon=2, group_obj=4, mask=6, other=4))
        assert subprocess.run([*as_user(DAEMON), "cat", str(listed)], capture_output=True).returncode != 0
        assert _ask(c, DAEMON, _start("acl", home, stdout=str(listed)))["ok"]
        asked = {"op": "rank", "job": "acl", "rank": 0, "request": {"op": "output", "fd": 1, "offset": 0}}
        _refused(wait_until(lambda: _judged(c, asked), "the output request to be judged", 30), "may not read")
        own = _ask(c, DAEMON, _start("own", home))
        assert own["ok"], own
        asked = {"op": "rank", "job": "own", "rank": 0, "request": {"op": "output", "fd": 1, "offset": 0}}
        wait_until(
            lambda: b"tick 0 " in base64.b64decode((_judged(c, asked) or {}).get("answer", {}).get("data", "")),
            "its own file to be read",
            30,
        )


def _judged(c: Cluster, asked: dict[str, Any]) -> dict[str, Any] | None:
    """DAEMON's answer to ``asked``, once it is not "not yet" (a rank that has not yet said who
    it runs as is not read)."""
    answer = _ask(c, DAEMON, asked)
    return None if not answer.get("ok") and "yet" in answer["error"] else answer


@pytest.mark.timeout(300)
def test_a_caller_in_a_control_group_named_in_no_encoding_does_not_shut_the_channel(node_a: Cluster) -> None:
    """A user with a control group of their own (systemd delegates one to each session) names a
    group in bytes of no encoding, enters it and connects: the agent reads its groups as they
    are, and the channel answers everyone after it (before: its one accepting thread died on a
    UnicodeDecodeError, and every stand-in on the node hung until the agent restarted)."""
    c = node_a
    v2 = next(
        line.split(" - ")[0].split()[4]
        for line in Path("/proc/self/mountinfo").read_text().splitlines()
        if " - cgroup2 " in line
    )
    group = os.path.join(os.fsencode(v2), f"tpagent-test-{os.getpid()}".encode(), b"x\xff")
    os.makedirs(group)
    python, env = user_python()
    request = json.dumps({"op": "rank", "job": "x", "rank": 0, "request": {"op": "locate"}})
    attacker = subprocess.Popen(  # (ip and setpriv exec: its PID is the shell's, which execs the client)
        c.nodes["A"].exec(*as_user(NOBODY), "sh", "-c", 'read go && exec "$0" "$1" "$2" "$3"',
                          python, str(CLIENT), CHANNEL, request),
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env={**os.environ, **env},
    )  # fmt: skip
    try:
        with open(os.path.join(group, b"cgroup.procs"), "w") as procs:
            procs.write(str(attacker.pid))
        said, _ = attacker.communicate("go\n", timeout=60)
        assert said.strip(), "the attacker's connection was not answered"
        asked = {"op": "rank", "job": "victim", "rank": 0, "request": {"op": "locate"}}
        _refused(_ask(c, DAEMON, asked), "rank 0 of job victim was not started here by you")  # (an answer)
        _refused(_ask(c, NOBODY, asked), "rank 0 of job victim was not started here by you")
    finally:
        if attacker.poll() is None:
            attacker.kill()
            attacker.wait()
        os.rmdir(group)
        os.rmdir(os.path.dirname(group))


@pytest.mark.timeout(300)
def test_a_start_whose_output_is_a_fifo_leaves_no_root_process_behind(node_a: Cluster) -> None:
    """A FIFO nobody reads, given as a rank's stdout, held the namespace's root init in its
    open() for good: the start was refused after 10 s, but the init stayed, unkillable by the
    user, one more for each such start.  Now it is refused at once, and nothing of it is left."""
    c = node_a
    with user_dir(DAEMON) as home:
        fifo = home / "out.fifo"
        os.mkfifo(fifo)
        os.chown(fifo, *DAEMON)
        answer = _ask(c, DAEMON, _start("fifo", home, stdout=str(fifo)))
        _refused(answer, "not a plain file")
        left = [
            p.pid
            for p in psutil.process_iter(["cmdline"])
            if "tpagent.workload.nsinit" in (p.info["cmdline"] or []) and str(fifo) in (p.info["cmdline"] or [])
        ]
        assert left == [], f"root processes left of the refused start: {left}"


def _acl(user_obj: int, daemon: int, group_obj: int, mask: int, other: int) -> bytes:
    """A POSIX access list as the kernel's xattr holds it (version 2; tag, permissions, id)."""
    undefined = 0xFFFFFFFF
    entries = [(0x01, user_obj, undefined), (0x02, daemon, DAEMON[0]), (0x04, group_obj, undefined)]
    entries += [(0x10, mask, undefined), (0x20, other, undefined)]
    return struct.pack("<I", 2) + b"".join(struct.pack("<HHI", *e) for e in entries)
