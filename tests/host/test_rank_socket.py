"""The socket ranks reach their agent on (tpagent.jobs.ranks, tpagent.jobs.door), as anyone on the
node may reach it: a hello that names a rank is believed only once that rank's registration is
there, from a process that still runs; what strangers open is bounded and costs no thread; the
name is the agent's or nobody's (a rank believes only root or its own user there).  The attacks
run as user nobody (tests/attackers/rank_channel.py)."""

from __future__ import annotations

import contextlib
import json
import os
import socket
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from host import paths, signals
from host.api import UsageError
from support.helpers import NOBODY, process_with_pid, wait_until
from tpagent.common.threads import Threads
from tpagent.jobs import door, ranks
from tpagent.workload import launch
from tpagent_rank import codec, lines
from tpagent_rank import protocol as P

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="the word to come back is root's, in /run/tpagent")


@pytest.fixture
def agent(monkeypatch: pytest.MonkeyPatch) -> Iterator[ranks.Ranks]:
    monkeypatch.setattr(door, "PENDING_FOR", 1.0)  # (how long a hello waits for its registration)
    threads = Threads()
    served = ranks.Ranks(f"tpagent-test-{uuid.uuid4().hex[:12]}", "10.0.0.1:7400", threads)
    served.start()
    yield served
    threads.stopping.set()
    served.close()
    threads.join(5.0)


def _hello(agent: ranks.Ranks, job: str, rank: int = 1) -> socket.socket:
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.settimeout(10)
    s.connect("\0" + agent.name)
    s.sendall(codec.said(lines.Hello(job, rank, 4)))
    return s


def _first_line(s: socket.socket) -> dict[str, object]:
    return codec.parse_line(s.makefile("rb").readline(P.LINE_MAX + 1))


def test_a_hello_for_a_rank_not_registered_spends_no_word_to_come_back(agent: ranks.Ranks) -> None:
    """The word a released rank waits for (a file named after its job and rank) is spent only by
    that rank, once registered: anyone else's hello naming it must not take it away (the rank
    would then never come back, and its job would end)."""
    job = f"job-{uuid.uuid4().hex[:8]}"
    go = paths.RANK_GO / P.go_name(job, 1)
    go.parent.mkdir(parents=True, exist_ok=True)
    go.touch()
    try:
        with _hello(agent, job) as s:
            said = _first_line(s)
        assert codec.is_said(said, lines.LineOp.REFUSED) and "not registered" in str(said["error"]), said
        assert go.exists(), "a stranger's hello took the word the rank waits for"
    finally:
        go.unlink(missing_ok=True)


#: A rank's runtime as a restored copy stands: it let go of its agent to be frozen, and connects
#: again only once its word to come back is there.
LEAVING_RANK = """
import sys, time
from tpagent_rank.agent import Rank
r = Rank(sys.argv[2], 0, 2, None, None, sys.argv[1])
r.torn = r.leaving = True
r.start()
time.sleep(120)
"""


def test_a_released_rank_whose_line_breaks_before_its_welcome_comes_back(
    agent: ranks.Ranks, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A released rank's first connection breaks after the agent took it in, before its welcome
    reached it (the line broke, the agent restarted).  It must still come back: with the word it
    waits for already spent it would wait for good, and its job with it.  (The door, whose caller's
    socket was closed under it, must take the next one: it kept the first by a descriptor the
    next connection reuses, and stopped.)"""
    job = f"job-{uuid.uuid4().hex[:8]}"
    welcomes = []
    send = ranks.Connection.send

    def breaks_first(conn: ranks.Connection, data: bytes) -> None:
        welcomes.append(conn.peer.pid)
        if len(welcomes) == 1:
            conn.sock.shutdown(socket.SHUT_RDWR)
        send(conn, data)

    monkeypatch.setattr(ranks.Connection, "send", breaks_first)
    init, holder = launch.start(
        [sys.executable, "-c", LEAVING_RANK, agent.name, job], tmp_path / "out", tmp_path / "err"
    )
    try:
        agent.expect(job, 0, init)
        agent.release(job, 0)
        deadline = time.monotonic() + 20
        while len(welcomes) < 2 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert len(welcomes) == 2, f"the rank did not come back after its first line broke (welcomes: {welcomes})"
        conn = agent.entry(job, 0).conn
        assert conn is not None and not conn.closed.is_set(), "the rank's second connection did not hold"
        assert conn.hello.state == P.RankState.TORN_DOWN.value, conn.hello
    finally:
        signals.kill_tree(init)
        holder.wait(10)
        (paths.RANK_GO / P.go_name(job, 0)).unlink(missing_ok=True)


def test_a_released_rank_that_ends_leaves_no_word_to_come_back(agent: ranks.Ranks, tmp_path: Path) -> None:
    """A rank told to come back (its word, a file in /run/tpagent/rank-go) that ends instead (its
    job finished or failed first) takes its word with it when its init reports the end: none is
    left behind, on a node whose agent runs for months, for another rank of that name to take."""
    job = f"job-{uuid.uuid4().hex[:8]}"
    go = paths.RANK_GO / P.go_name(job, 0)
    try:
        with _ending_rank(agent, job, tmp_path, 0) as (ends, holder):
            agent.release(job, 0)
            assert go.exists()
            ends.touch()
            assert holder.wait(30) == 0
            wait_until(lambda: agent.entry(job, 0).exit_code == 0, "the init to report the rank's end")
            assert not go.exists(), "the word to come back of a rank that ended was left behind"
    finally:
        go.unlink(missing_ok=True)


@contextlib.contextmanager
def _ending_rank(agent: ranks.Ranks, job: str, tmp: Path, code: int) -> Iterator[tuple[Path, subprocess.Popen[bytes]]]:
    """Rank 0 of ``job``, launched and registered, that ends with ``code`` once the file it is
    given is there; and its namespace's holder."""
    ends = tmp / "end"
    wait = f"import os, time\nwhile not os.path.exists({str(ends)!r}): time.sleep(0.02)\nos._exit({code})"
    env = {**os.environ, "TPAGENT_RANK_SOCKET": agent.name}
    init, holder = launch.start([sys.executable, "-c", wait], tmp / "out", tmp / "err", env=env)
    try:
        agent.expect(job, 0, init)
        yield ends, holder
    finally:
        signals.kill_tree(init)
        holder.wait(10)


def test_a_ranks_end_is_known_to_the_agent_once_its_namespace_is_gone(
    agent: ranks.Ranks, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A stand-in that sees its rank's namespace end asks the agent at once how the rank ended
    (or whether its death is held for a rebuild).  The init reports the end before it ends, but a
    busy agent may read that word late: the init waits until the agent has taken it, or the
    stand-in would hear "gone without a status" (and the agent, finding the init gone, would not
    believe the word at all).  Here the agent takes half a second to read the report."""
    job = f"job-{uuid.uuid4().hex[:8]}"
    with _ending_rank(agent, job, tmp_path, 3) as (ends, holder):
        launched = launch.launched

        def slowly(pid: int, *args: Any) -> launch.LaunchRecord | None:
            time.sleep(0.5)
            return launched(pid, *args)

        monkeypatch.setattr(launch, "launched", slowly)
        ends.touch()
        assert holder.wait(30) == 3
        where = agent.locate(job, 0)
        assert where == P.Located(state=P.Whereabouts.EXITED.value, code=3), f"once the namespace ended: {where}"


#: A rank that connects, then, once told, prints its last lines and ends at once.
FINISHING_RANK = """
import os, sys, time
from tpagent_rank.agent import Rank
Rank(sys.argv[2], 0, 2, None, None, sys.argv[1]).start()
while not os.path.exists(sys.argv[3]):
    time.sleep(0.02)
for step in range(32):
    print("step", step, flush=True)
os._exit(0)
"""


def test_what_a_rank_printed_before_it_ended_is_read_after_it_ended(agent: ranks.Ranks, tmp_path: Path) -> None:
    """A rank that ends before its stand-in first asks for its output on this node (it moved
    back here and finished its last steps at once) is read all the same: the agent holds its
    files from its hello on (it opened them at the first ask, and a rank ended by then was never
    read: its last lines missed its launcher's log)."""
    job = f"job-{uuid.uuid4().hex[:8]}"
    ends = tmp_path / "end"
    init, holder = launch.start(
        [sys.executable, "-c", FINISHING_RANK, agent.name, job, str(ends)],
        tmp_path / "out",
        tmp_path / "err",
        env={**os.environ, "TPAGENT_RANK_SOCKET": agent.name},  # (where the init reports the end)
    )
    try:
        agent.expect(job, 0, init)
        wait_until(lambda: agent.entry(job, 0).conn is not None, "the rank to connect")
        ends.touch()
        assert holder.wait(30) == 0
        wait_until(lambda: agent.entry(job, 0).exit_code == 0, "the init to report the rank's end")
        written = agent.output(job, 0, 1, 0, 1 << 20)
        assert written.data.decode().splitlines() == [f"step {k}" for k in range(32)]
    finally:
        signals.kill_tree(init)
        holder.wait(10)


def test_the_connections_waiting_for_a_registration_are_bounded(agent: ranks.Ranks) -> None:
    waiting = [_hello(agent, f"job-{i}") for i in range(door.PER_USER_MAX)]
    try:
        with _hello(agent, "one-too-many") as s:
            s.settimeout(0.5)  # (refused at once, not after the others' wait)
            said = _first_line(s)
        assert codec.is_said(said, lines.LineOp.REFUSED) and "too many connections" in str(said["error"]), said
    finally:
        for s in waiting:
            s.close()


# ---- attacks, as user nobody ------------------------------------------------------------------

ATTACKER = Path(__file__).resolve().parent.parent / "attackers" / "rank_channel.py"


def _attacker(*args: str) -> subprocess.Popen[str]:
    cmd = [*NOBODY, sys.executable, "-I", "-S", str(ATTACKER), *args]
    return subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, cwd="/")


def _end(p: subprocess.Popen[str]) -> str:
    """What it printed once told to stop."""
    out, _ = p.communicate("", timeout=30)
    return out


#: A rank's side, as root inside a launched namespace: hello as rank 0 of JOB, print the
#: agent's first LINES lines, hold the connection.
RANK_CLIENT = """
import socket, sys, time
s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
s.connect("\\0" + sys.argv[1])
s.sendall(b'{"op": "hello", "job": "%s", "rank": 0, "world": 2}\\n' % sys.argv[2].encode())
f = s.makefile("rb")
for _ in range(int(sys.argv[3])):
    print(f.readline().decode().strip(), flush=True)
time.sleep(120)
"""


@contextlib.contextmanager
def _launched_rank(tmp: Path, agent: ranks.Ranks, job: str, printed: int = 1) -> Iterator[Path]:
    """Rank 0 of ``job``, launched (a PID namespace of its own) and registered: its stdout file,
    where it prints the first ``printed`` lines the agent sends it."""
    with _registered(tmp, agent, job, [sys.executable, "-I", "-c", RANK_CLIENT, agent.name, job, str(printed)]) as out:
        yield out


@contextlib.contextmanager
def _registered(tmp: Path, agent: ranks.Ranks, job: str, cmd: list[str]) -> Iterator[Path]:
    """``cmd`` launched and registered as rank 0 of ``job``: its stdout file."""
    out = tmp / f"{job}.out"
    init, holder = launch.start(cmd, out, tmp / f"{job}.err")
    try:
        agent.expect(job, 0, init)
        yield out
    finally:
        signals.kill_tree(init)
        holder.wait(10)


def _first_of(path: Path, within: float = 30.0) -> str:
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        text = path.read_text() if path.exists() else ""
        if text.endswith("\n"):
            return text.strip()
        time.sleep(0.05)
    raise AssertionError(f"{path} got no line within {within:.0f} s")


def test_a_user_holding_the_name_before_the_agent_is_no_agent_to_a_rank_and_stops_the_agent(tmp_path: Path) -> None:
    """An abstract name is anyone's while no agent holds it (a restart, boot).  A rank must not
    take its holder for the agent (answer it, be parked or torn down by it), and an agent that
    finds the name taken must not start as if it served ranks."""
    name = f"tpagent-test-{uuid.uuid4().hex[:12]}"
    impostor = _attacker("pose", name)
    assert impostor.stdout is not None and impostor.stdout.readline().strip() == "ready"
    victim = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import sys, time; from tpagent_rank.agent import Rank; "
            "Rank('job', 0, 2, None, None, sys.argv[1]).start(); time.sleep(60)",
            name,
        ],
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert victim.stderr is not None
        said = victim.stderr.readline()
        assert "not by the agent" in said and "UID 65534" in said, said
        with pytest.raises(UsageError, match=f"rank socket @{name} is taken"):
            ranks.Ranks(name, "10.0.0.1:7400", Threads()).start()
    finally:
        victim.kill()
        victim.communicate()
        printed = _end(impostor)
    assert "answered" not in printed, f"the rank answered the impostor: {printed}"


def test_a_flood_of_connections_costs_no_thread_and_a_rank_still_gets_in(agent: ranks.Ranks, tmp_path: Path) -> None:
    """Hundreds of connections from one user, silent or with a hello that never ends: the agent
    starts no thread for them, and a registered rank of another user is welcomed meanwhile."""
    before = threading.active_count()
    flood = _attacker("flood", agent.name, "600")
    try:
        assert flood.stdout is not None
        opened = flood.stdout.readline().split()
        assert opened[0] == "opened" and int(opened[1]) > door.PER_USER_MAX, opened
        assert threading.active_count() <= before + 1, "threads were started for strangers' connections"
        with _launched_rank(tmp_path, agent, f"job-{uuid.uuid4().hex[:8]}") as out:
            first = json.loads(_first_of(out))
            assert first["op"] == "welcome", first
            assert threading.active_count() <= before + 2  # (the rank's reader, and no other)
    finally:
        _end(flood)


def test_a_call_waiting_for_a_rank_is_written_after_its_welcome(
    agent: ranks.Ranks, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A call that waits for a rank to connect (a rewire's rebuild, asked of a rank just told to
    come back) is written on the rank's connection only after its welcome, however long the door
    takes between taking the rank in and welcoming it (here half a second, as on a busy machine).
    A rank whose first line is not its welcome takes itself as not registered and hangs up, the
    request unread: the rebuild failed and the job ended (the spare-dies rewire test, under load)."""
    said = codec.said

    def slow_welcome(message: Any) -> bytes:
        if isinstance(message, lines.Welcome):
            time.sleep(0.5)
        return said(message)

    monkeypatch.setattr(codec, "said", slow_welcome)
    job = f"job-{uuid.uuid4().hex[:8]}"
    with _launched_rank(tmp_path, agent, job, printed=2) as out:

        def ask() -> None:
            with contextlib.suppress(Exception):  # (the client never answers: how the call ends is not the point)
                agent.call(job, 0, P.Where(), 5.0)

        asking = threading.Thread(target=ask)
        asking.start()
        wait_until(lambda: out.exists() and out.read_text().count("\n") == 2, "the rank to print two lines", 30)
        first, second = (json.loads(ln) for ln in out.read_text().splitlines())
        asking.join(30)
    assert first["op"] == "welcome", f"the rank's first line is not its welcome: {first}"
    assert second["op"] == P.Op.WHERE.value, second


def _taken(agent: ranks.Ranks, pid: int) -> bool:
    """Whether the agent's door has taken a connection from ``pid`` (and holds it, waiting)."""
    assert agent.door is not None
    try:
        return any(c.peer.pid == pid for c in list(agent.door.callers.values()))
    except RuntimeError:  # (the door's thread changed them meanwhile: look again)
        return False


def test_a_report_on_a_connection_whose_process_exited_is_not_believed_though_its_pid_now_is_an_init(
    agent: ranks.Ranks, tmp_path: Path
) -> None:
    """The kernel names the process that connected as the peer for as long as the connection
    lives, in whatever process holds it now.  Once that PID is reused by a launched workload's
    init (here the test reuses it at once, as a user could by cycling PIDs), a report of that
    init's end from the old connection must not end the rank that runs on."""
    attacker = _attacker("stale", agent.name)
    assert attacker.stdout is not None and attacker.stdin is not None
    line = attacker.stdout.readline().split()
    stale_pid = int(line[-1])
    wait_until(lambda: _taken(agent, stale_pid), "the agent to take the connection")  # (while its process runs)
    attacker.stdin.write("leave\n")
    attacker.stdin.flush()
    assert attacker.wait(10) == 0 and attacker.pid == stale_pid  # (exited, reaped: its PID is free)
    job = f"job-{uuid.uuid4().hex[:8]}"
    recycled = process_with_pid(stale_pid)
    try:
        launch.register(recycled.pid)
        agent.expect(job, 0, recycled.pid)
        attacker.stdin.write("go\n")
        attacker.stdin.flush()
        answer = attacker.stdout.readline().strip()
        assert agent.entry(job, 0).exit_code is None, f"the rank was reported ended: {answer}"
        assert agent.locate(job, 0).state == P.Whereabouts.HERE.value
        assert "no launched workload's init" in answer, answer
    finally:
        recycled.kill()
        recycled.wait()
        (launch.RECORDS / f"{recycled.pid}.json").unlink(missing_ok=True)
        _end(attacker)


# ---- a user's rank that says what no rank should (a reviewer's attacks) --------------------------

RANK_LINES = Path(__file__).resolve().parent.parent / "attackers" / "rank_lines.py"


@contextlib.contextmanager
def _lines_rank(tmp: Path, agent: ranks.Ranks, job: str, mode: str) -> Iterator[Path]:
    """Rank 0 of ``job`` as nobody, launched and registered, saying ``mode``'s lines
    (tests/attackers/rank_lines.py): its stdout file, where it prints the agent's first line."""
    with _registered(
        tmp, agent, job, [*NOBODY, sys.executable, "-I", "-S", str(RANK_LINES), agent.name, job, "0", mode]
    ) as out:
        yield out


def test_text_that_is_no_utf8_never_reaches_the_nodes_report(agent: ranks.Ranks, tmp_path: Path) -> None:
    """A job key or a failure's reason of a lone surrogate (JSON's "\\udc80") was taken, and every
    report of the node failed from then on (its digest, its protobuf): every user's ranks unreported."""
    from tpagent.daemon.rpc import pb

    tmp_path.chmod(0o755)
    with _lines_rank(tmp_path, agent, "sur", "surrogate") as out:
        assert "refused" in _first_of(out) or _first_of(out) == "(closed)"
        assert agent.entry("sur", 0).conn is None
    with _lines_rank(tmp_path, agent, "brk", "broke") as out:
        assert "welcome" in _first_of(out)
        wait_until(lambda: agent.entry("brk", 0).conn is None, "its connection to be closed for the line", 10)
    assert agent.digests() is not None and not agent.broken()
    for (job, rank), why in agent.broken().items():
        pb.RankReport(job=job, rank=rank, broke=why)


def test_lines_nested_deep_or_said_again_cost_one_line_of_log(
    agent: ranks.Ranks, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A line of arrays 20 000 deep was a RecursionError logged with its traceback each time (any
    user, thousands a second); a "broke" said 500 times was 500 warnings and 500 reports at once."""
    tmp_path.chmod(0o755)
    with caplog.at_level("WARNING"), _lines_rank(tmp_path, agent, "deep", "deep") as out:
        assert "welcome" in _first_of(out)
        wait_until(lambda: agent.entry("deep", 0).conn is None, "its connection to be closed for the line", 10)
    assert not [r for r in caplog.records if r.exc_info], [r.getMessage() for r in caplog.records]
    caplog.clear()
    with caplog.at_level("WARNING"), _lines_rank(tmp_path, agent, "brokes", "brokes") as out:
        assert "welcome" in _first_of(out)
        wait_until(lambda: agent.broken().get(("brokes", 0)) == "x", "its failure to be taken", 10)
        time.sleep(0.5)  # (the rest of its 500 lines read meanwhile: a condition with nothing to wait for)
        said = [r for r in caplog.records if "a collective failed" in r.getMessage()]
    assert len(said) == 1, len(said)


def test_a_rank_that_reads_nothing_holds_no_call_past_its_send_bound(
    agent: ranks.Ranks, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Its buffer full, a write to it waited for ever under the connection's lock: every later call
    to it, whatever its timeout (the node's job listing too), hung until it died."""
    from tpagent.jobs import connection

    monkeypatch.setattr(connection, "SEND_WITHIN", 1, raising=False)
    tmp_path.chmod(0o755)
    with _lines_rank(tmp_path, agent, "mute", "mute") as out:
        assert "welcome" in _first_of(out)
        conn = agent.entry("mute", 0).conn
        assert conn is not None

        def ask() -> None:  # (each unanswered request fills its buffer a little more)
            while not conn.closed.is_set():
                with contextlib.suppress(connection.RankGone):
                    conn.call(P.Where(), 0)  # (not through agent.call: it waits 0.1 s at least)

        threading.Thread(target=ask, daemon=True).start()
        wait_until(conn.closed.is_set, "its connection to be closed once a write to it waited 1 s", 30)
        t0 = time.monotonic()
        with pytest.raises(connection.RankGone):
            agent.call("mute", 0, P.Where(), 2)
        assert time.monotonic() - t0 < 5
