"""host/sockets.py on the sockets of real processes, read back from /proc: a unix socket bound by
another process (and not its abstract or unbound ones), and what a process tree holds beside a
loopback peer in another process.  (The same module on this test's own sockets alone:
tests/unit/test_tcp_sockets.py.)"""

from __future__ import annotations

import json
import mmap
import os
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from host import ends, ptrace, sockets
from support.helpers import kill_and_wait, tpagent, wait_until


def test_a_process_s_bound_sockets_are_found_and_its_abstract_or_unbound_ones_are_not(tmp_path: Path) -> None:
    path = tmp_path / "run dir" / "app.sock"  # (a space in a path, as /proc/net/unix shows it)
    path.parent.mkdir()
    code = (
        "import socket, sys\n"
        "a = socket.socket(socket.AF_UNIX); a.bind(sys.argv[1]); a.listen()\n"
        "b = socket.socket(socket.AF_UNIX); b.bind('\\0tpagent-test-abstract'); b.listen()\n"
        "c, d = socket.socketpair()\n"
        "print('ready', flush=True); sys.stdin.read()\n"
    )
    with subprocess.Popen(
        [sys.executable, "-c", code, str(path)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    ) as p:
        try:
            assert p.stdout is not None and p.stdout.readline() == "ready\n"
            assert sockets.unix_bound([p.pid]) == [str(path)]
            assert sockets.unix_bound([os.getpid()]) == []  # (another process's socket is not this one's)
        finally:
            p.kill()


_SERVER = (
    "import socket,sys,time; s=socket.create_server(('127.0.0.1',0)); print(s.getsockname()[1], flush=True); "
    "c,_=s.accept(); time.sleep(60)"
)


@pytest.fixture
def outside() -> Iterator[int]:
    """The port of a loopback server in another process (outside "the tree": this process)."""
    with subprocess.Popen([sys.executable, "-c", _SERVER], stdout=subprocess.PIPE, text=True) as p:
        assert p.stdout is not None
        yield int(p.stdout.readline())
        p.kill()


def test_both_ends_in_the_tree_stay_together_and_a_loopback_peer_outside_is_named(outside: int) -> None:
    with socket.create_server(("127.0.0.1", 0)) as server, socket.create_connection(server.getsockname()) as client:
        accepted, _ = server.accept()
        lone = socket.create_connection(("127.0.0.1", outside))
        try:
            port = server.getsockname()[1]
            near = client.getsockname()[1]
            far = lone.getsockname()[1]
            # (only this test's sockets: earlier tests of the session may have left theirs open)
            held = [s for s in sockets.tree_tcp([os.getpid()]) if {s.local[1], s.remote[1]} & {port, near, far}]
            assert sorted(s.name for s in held) == sorted(
                [
                    f"127.0.0.1:{port} (listening)",
                    f"127.0.0.1:{near} -> 127.0.0.1:{port}",
                    f"127.0.0.1:{port} -> 127.0.0.1:{near}",
                    f"127.0.0.1:{far} -> 127.0.0.1:{outside}",
                ]
            )
            behind = sockets.left_behind(held)
            assert len(behind) == 1 and f"127.0.0.1:{far} -> 127.0.0.1:{outside}" in behind[0]
            # loopback connections need nothing of the target; the listener needs its port free there
            assert [s.name for s in sockets.must_check_on_target(held)] == [f"127.0.0.1:{port} (listening)"]
            taken = sockets.unusable_here("node-b", [(f"0.0.0.0:{port}", "")])  # (here: this machine)
            assert len(taken) == 1 and f"needs port {port}, which is taken on node-b" in taken[0]
        finally:
            accepted.close()
            lone.close()


def test_a_connection_whose_loopback_peer_closed_and_left_stays_nothing_behind(tmp_path: Path) -> None:
    """A server that never closed a connection its client closed (CLOSE-WAIT; the client's end
    an orphan in FIN-WAIT-2 that no process owns, and then not even that): nothing of the peer is
    left to reset, so nothing keeps the server from moving."""
    with socket.create_server(("127.0.0.1", 0)) as server:
        port = server.getsockname()[1]
        client = subprocess.run(
            [sys.executable, "-c", f"import socket; socket.create_connection(('127.0.0.1', {port})).close()"],
            timeout=30,
        )
        assert client.returncode == 0
        leaked, _ = server.accept()
        try:
            assert leaked.recv(1) == b""  # (its FIN came; the server keeps its end open)
            held = [s for s in sockets.tree_tcp([os.getpid()]) if s.local[1] == port and not s.listening]
            assert len(held) == 1 and held[0].peer_closed, held
            assert sockets.left_behind(held) == []
        finally:
            leaked.close()


_CONNECTS = (
    "import socket,sys,time; s=socket.socket(socket.AF_UNIX); s.connect(chr(0)+sys.argv[1]); s.send(b'r'); "
    "time.sleep(60)"
)


@pytest.mark.parametrize(
    "agent, runtime", [(True, True), (False, True), (False, False)], ids=["its-agent", "a-stranger", "no-runtime"]
)
def test_a_connection_out_of_the_tree_is_a_tie_but_a_rank_runtimes_to_its_agent(agent: bool, runtime: bool) -> None:
    """A unix connection to a process outside the tree cannot be dumped (CRIU takes no half of
    one), and is refused before the freeze; the one a rank's runtime holds to its agent (the name
    its TPAGENT_RANK_SOCKET says) it lets go of before its job's move, so only a move of the
    rank alone is refused for it (named as such)."""
    name = f"tpagent-test-{os.getpid()}-{agent}-{runtime}"
    env = {k: v for k, v in os.environ.items() if k != "TPAGENT_RANK_SOCKET"}
    if runtime:
        env["TPAGENT_RANK_SOCKET"] = name if agent else "tpagent-another"
    with socket.socket(socket.AF_UNIX) as listener:
        listener.settimeout(30)
        listener.bind("\0" + name)
        listener.listen()
        with subprocess.Popen(
            [sys.executable, "-c", _CONNECTS, name], env=env, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL
        ) as p:
            try:
                accepted, _ = listener.accept()
                with accepted:
                    assert accepted.recv(1) == b"r"
                    said = ends.refusals([p.pid])
                    if agent:  # (let go of for its job's move, and for that only)
                        assert ends.refusals([p.pid], agent_let_go=True) == []
                        assert len(said) == 1 and "is a rank whose runtime is connected to its agent (fd 3)" in said[0]
                    else:
                        assert (
                            len(said) == 1
                            and f"PID {p.pid} holds a unix socket (fd 3) connected to PID {os.getpid()} (" in said[0]
                        ), said
            finally:
                p.kill()


_MAPS = (
    "import mmap, sys\n"
    "with open(sys.argv[1], 'r+b') as f:\n"
    "    m = mmap.mmap(f.fileno(), 4096, prot=mmap.PROT_READ | (mmap.PROT_WRITE if sys.argv[2] == 'w' else 0))\n"
    "print('mapped', flush=True); sys.stdin.read()\n"
)


@pytest.mark.parametrize("tree, theirs", [("r", "r"), ("w", "r"), ("r", "w"), ("w", "w")])
def test_a_node_local_file_mapped_shared_outside_the_tree_ties_it_when_either_side_writes(
    tmp_path: Path, tree: str, theirs: str
) -> None:
    """The tree (a process of its own) and this test's process map one file shared, each
    writable or not: taken along (carried), the file ties the tree to this process if either
    writes it; a file not taken along, or only read on both sides, is no tie."""
    seg = tmp_path / "seg"
    seg.write_bytes(bytes(4096))
    with (
        open(seg, "r+b") as f,
        subprocess.Popen(
            [sys.executable, "-c", _MAPS, str(seg), tree], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
        ) as p,
    ):
        ours = mmap.mmap(f.fileno(), 4096, prot=mmap.PROT_READ | (mmap.PROT_WRITE if theirs == "w" else 0))
        try:
            assert p.stdout is not None and p.stdout.readline() == "mapped\n"
            said = ends.shared_maps([p.pid], [seg])
            if "w" in (tree, theirs):
                assert len(said) == 1 and said[0].startswith(f"PID {p.pid} maps {seg} shared with PID "), said
                assert f"PID {os.getpid()} (" in said[0]  # (this process, the first found outside)
            else:
                assert said == []
            assert ends.shared_maps([p.pid], []) == []  # (not taken along: the restore maps the same file)
        finally:
            ours.close()
            p.kill()


_CONTROLLED = (
    "import os, sys\n"
    "os.setsid()\n"
    "fd = os.open(sys.argv[1], os.O_RDWR)\n"  # (a session leader's first terminal: its controlling one)
    "tty = os.open('/dev/tty', os.O_RDWR); os.close(fd)\n"
    "print(tty, flush=True); sys.stdin.read()\n"
)


def test_a_terminal_whose_master_is_outside_the_tree_ties_it_even_as_dev_tty() -> None:
    """The tree holds its controlling terminal only as /dev/tty; this test's process holds the
    master (as tmux does): a tie, named with the terminal's own name.  A tree that holds the
    master too (this process, with both ends) is not tied by it."""
    master, slave = os.openpty()
    name = os.ttyname(slave)
    try:
        with subprocess.Popen(
            [sys.executable, "-c", _CONTROLLED, name], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
        ) as p:
            try:
                assert p.stdout is not None
                tty = int(p.stdout.readline())
                said = [s for s in ends.refusals([p.pid]) if "terminal" in s]
                assert len(said) == 1 and said[0].startswith(f"PID {p.pid}'s terminal ({name}, fd {tty}) "), said
                assert f"other end by PID {os.getpid()} (" in said[0]
            finally:
                p.kill()
        assert [s for s in ends.refusals([os.getpid()]) if f"terminal ({name}," in s] == []
    finally:
        os.close(master)
        os.close(slave)


_FORKS_SHARING = (
    "import mmap, os, sys, time\n"
    "m = mmap.mmap(-1, 4096, flags=mmap.MAP_SHARED)\n"  # (shared anonymous memory, then a child)
    "child = os.fork()\n"
    "if child == 0:\n"
    "    time.sleep(600); os._exit(0)\n"
    "print(child, flush=True); sys.stdin.read(); os.kill(child, 9)\n"
)


def test_memory_shared_with_a_parent_outside_the_tree_ties_it() -> None:
    """A child checkpointed without the parent it shares anonymous memory with (mmap
    MAP_SHARED, then fork): a tie, naming the parent; the tree of both is not tied by it."""
    with subprocess.Popen(
        [sys.executable, "-c", _FORKS_SHARING], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    ) as p:
        try:
            assert p.stdout is not None
            child = int(p.stdout.readline())
            said = [s for s in ends.refusals([child]) if "shares memory" in s]
            comm = Path(f"/proc/{p.pid}/comm").read_text().strip()
            assert said == [
                f"PID {child} shares memory (a shared anonymous mapping) with PID {p.pid} ({comm}) outside its tree, "
                "and one of them writes it: its copy would have memory of its own, no longer shared; checkpoint the "
                "tree that holds both."
            ]
            assert [s for s in ends.refusals([p.pid, child]) if "shares memory" in s] == []
        finally:
            p.kill()


_FORKS_SHARING_MORE = (
    "import mmap, os, socket, sys, tempfile\n"
    "f = tempfile.NamedTemporaryFile(dir='/dev/shm'); f.truncate(4096)\n"
    "m = mmap.mmap(f.fileno(), 4096); f.close()\n"  # (removed once mapped: multiprocessing.Value)
    "efd = os.eventfd(0)\n"
    "s = socket.socket(); s.bind(('127.0.0.1', 0)); s.listen()\n"
    "child = os.fork()\n"
    "if child == 0:\n"
    "    sys.stdin.read(); os._exit(0)\n"
    "print(child, f.name, efd, s.fileno(), flush=True); sys.stdin.read(); os.kill(child, 9)\n"
)


def test_a_removed_files_memory_an_eventfd_and_a_socket_shared_with_a_parent_outside_the_tree_tie_it() -> None:
    """The other kinds of what a child forked from a parent outside the tree shares with it: a
    removed file mapped shared (``multiprocessing.Value``: a /dev/shm file removed once mapped), an
    eventfd, a listening socket.  Each was dumped and restored without a word: the copy's memory
    and counts its own (the parent's posts never reaching it, its waits for ever), its port still
    the parent's (its restore refused once the original had ended).  Each a tie now, naming the
    parent; and the tree of both is not tied by them."""
    with subprocess.Popen(
        [sys.executable, "-c", _FORKS_SHARING_MORE], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    ) as p:
        try:
            assert p.stdout is not None
            child, name, efd, sock = p.stdout.readline().split()
            comm = Path(f"/proc/{p.pid}/comm").read_text().strip()
            said = ends.refusals([int(child)])
            assert [s for s in said if "outside its tree" in s and "pipe" not in s] == [
                f"PID {child} holds a socket (fd {sock}) that PID {p.pid} ({comm}) outside its tree holds too "
                "(inherited, or passed to it): its copy would have one of its own, apart from theirs (an eventfd's "
                "counts never meeting; a socket's port or connection still theirs); checkpoint the tree that holds "
                "both, or close it in one of them.",
                f"PID {child} holds an eventfd (fd {efd}) that PID {p.pid} ({comm}) outside its tree holds too "
                "(inherited, or passed to it): its copy would have one of its own, apart from theirs (an eventfd's "
                "counts never meeting; a socket's port or connection still theirs); checkpoint the tree that holds "
                "both, or close it in one of them.",
                f"PID {child} shares memory (the removed file {name}) with PID {p.pid} ({comm}) outside its tree, and "
                "one of them writes it: its copy would have memory of its own, no longer shared; checkpoint the tree "
                "that holds both.",
            ]
            assert [s for s in ends.refusals([p.pid, int(child)]) if "outside its tree" in s and "pipe" not in s] == []
        finally:
            p.kill()


_EPOLL_SHARED_WITH_A_WORKER = (
    "import os, select, sys\n"
    "ep = select.epoll()\n"
    "child = os.fork()\n"  # (a DataLoader worker: the epoll instance is its too)
    "if child == 0:\n"
    "    sys.stdin.read(); os._exit(0)\n"
    "r, w = os.pipe(); ep.register(r, select.EPOLLIN)\n"  # (a watch of a descriptor the worker never had)
    "print(child, ep.fileno(), flush=True); sys.stdin.read(); os.kill(child, 9)\n"
)


def test_an_epoll_instance_a_worker_shares_is_judged_where_its_watches_were_made() -> None:
    """A parent's epoll instance, which a worker it forked holds too (gloo's, asyncio's, with
    DataLoader workers): a watch the parent adds later names a descriptor only the parent has.
    The tree of both is not refused (CRIU dumps the instance from the parent, the first that holds
    it); the parent's watch of a descriptor it closed, as the worker holds it, is."""
    from host import criu_limits

    with subprocess.Popen(
        [sys.executable, "-c", _EPOLL_SHARED_WITH_A_WORKER], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    ) as p:
        try:
            assert p.stdout is not None
            child, ep = p.stdout.readline().split()
            said = [s for s in criu_limits.uncheckpointable([p.pid, int(child)]) if "epoll" in s]
            assert said == []
            alone = [s for s in criu_limits.uncheckpointable([int(child)]) if "epoll" in s]
            assert alone == [
                f"PID {child} uses an epoll instance watching a descriptor it has closed (another process still "
                f"holding that file) (fd {ep}), which CRIU cannot checkpoint."
            ]
        finally:
            p.kill()


_FORKS_OPEN_FILES = (
    "import os, sys, time\n"
    "shared = open(sys.argv[1], 'w')\n"  # (as a shell's `>`: one offset for parent and child)
    "appended = open(sys.argv[2], 'a')\n"  # (O_APPEND: every write at the end, whoever makes it)
    "null = open(os.devnull, 'w')\n"  # (a device: no offset to keep)
    "child = os.fork()\n"
    "if child == 0:\n"
    "    own = open(sys.argv[1])\n"  # (opened by itself: an offset of its own)
    "    while True: time.sleep(1)\n"
    "open(sys.argv[3], 'w').write(str(child))\n"
    "os.wait()\n"
)


def _holding(pid: int, path: Path) -> list[str]:
    return [fd for fd in os.listdir(f"/proc/{pid}/fd") if os.readlink(f"/proc/{pid}/fd/{fd}") == str(path)]


def test_an_open_file_shared_with_a_parent_outside_the_tree_at_one_offset_is_warned_about(tmp_path: Path) -> None:
    """A child checkpointed without its parent, both holding one open file (opened without
    O_APPEND, then fork: a shell's ``>`` redirect): its copy writes on from the offset it had,
    over what the parent writes meanwhile.  Said, naming the file and the parent, by doctor and
    in the snapshot's warnings; not the file the child opened itself, one opened to append, or
    /dev/null; nor for the tree of both."""
    log = tmp_path / "out.log"
    pid_file = tmp_path / "child.pid"
    argv = [sys.executable, "-c", _FORKS_OPEN_FILES, str(log), str(tmp_path / "appended.log"), str(pid_file)]
    # (its own session: where CI runs, this test's session leader is outside the PID namespace)
    devnull = subprocess.DEVNULL
    with subprocess.Popen(argv, stdin=devnull, stdout=devnull, stderr=devnull, start_new_session=True) as p:
        child = 0
        try:
            wait_until(lambda: pid_file.exists() and pid_file.read_text() != "", "the child to be forked")
            child = int(pid_file.read_text())
            wait_until(lambda: len(_holding(child, log)) == 2, "the child to open the file itself")
            comm = Path(f"/proc/{p.pid}/comm").read_text().strip()
            (fd,) = _holding(p.pid, log)
            said = (
                f"PID {child} shares its open file {log} (fd {fd}) with PID {p.pid} ({comm}) outside its tree, at one "
                "offset (a shell's `>` both inherited): its copy writes on from the offset it had, not theirs, so what "
                "both write after a restore overwrites the other's (and CRIU refuses the restore if they wrote while "
                "it was frozen); open it to append (`>>`) to keep both."
            )
            assert ends.shared_offsets([child]) == [said]
            assert ends.shared_offsets([p.pid, child]) == []
            assert ends.refusals([child]) == []  # (said, not refused)
            doctor = tpagent("doctor", "--pid", str(child))
            assert f"WARN  shared file    {said[:-1]}" in doctor.stdout
            snap = tmp_path / "snap"
            dumped = tpagent("dump", str(child), "--out", str(snap), "--leave-running")
            assert dumped.returncode == 0, dumped.stderr
            assert said in json.loads((snap / "manifest.json").read_text())["warnings"]
        finally:
            if child:
                kill_and_wait(child)
            p.kill()


_ASKS_PARENT_DEATH = (
    "import ctypes, sys\n"
    "ctypes.CDLL(None).prctl(1, int(sys.argv[1]))\n"  # (PR_SET_PDEATHSIG)
    "for line in sys.stdin:\n"
    "    print(sum(range(int(line))), flush=True)\n"  # (it computes on, as it stood)
)


@pytest.mark.parametrize("sig", [0, 12])
def test_a_root_that_asked_to_die_with_its_parent_outside_the_tree_is_a_tie(sig: int) -> None:
    """Its parent-death signal is read inside it (ptrace, nothing outside shows it), twice, and
    it computes on as before; asked for (SIGUSR2), its parent (this test) outside the tree ties
    it."""
    with subprocess.Popen(
        [sys.executable, "-c", _ASKS_PARENT_DEATH, str(sig)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    ) as p:
        assert p.stdin is not None and p.stdout is not None
        try:
            p.stdin.write("1000\n")
            p.stdin.flush()
            assert p.stdout.readline() == f"{sum(range(1000))}\n"
            assert ptrace.parent_death_signal(p.pid) == ptrace.parent_death_signal(p.pid) == sig
            p.stdin.write("2000\n")
            p.stdin.flush()
            assert p.stdout.readline() == f"{sum(range(2000))}\n"
            said = [s for s in ends.refusals([p.pid]) if "parent dies" in s]
            if sig:
                assert said == [
                    f"PID {p.pid} asks to be killed when its parent dies (SIGUSR2, PR_SET_PDEATHSIG) and its parent, "
                    f"PID {os.getpid()} ({Path('/proc/self/comm').read_text().strip()}), is outside its tree: its "
                    "copy, restored as another process's child, would be killed as it starts; checkpoint the tree "
                    f"from PID {os.getpid()}, or start the workload with `tpagent launch`."
                ]
            else:
                assert said == []
        finally:
            p.kill()


_FILTERED = (
    "import ctypes, struct, sys\n"
    "libc = ctypes.CDLL(None)\n"
    "libc.prctl(1, 12)\n"  # (PR_SET_PDEATHSIG, SIGUSR2)
    "allow = ctypes.create_string_buffer(struct.pack('HBBI', 0x06, 0, 0, 0x7FFF0000))\n"  # (BPF: return ALLOW)
    "prog = ctypes.create_string_buffer(struct.pack('HxxxxxxQ', 1, ctypes.addressof(allow)))\n"
    "assert libc.prctl(38, 1, 0, 0, 0) == 0\n"  # (PR_SET_NO_NEW_PRIVS)
    "assert libc.prctl(22, 2, ctypes.c_ulong(ctypes.addressof(prog)), 0, 0) == 0\n"  # (PR_SET_SECCOMP, FILTER)
    "print('filtered', flush=True); sys.stdin.read()\n"
)


def test_a_process_under_a_seccomp_filter_is_not_made_to_call() -> None:
    """A filter could kill it for a call it does not expect: its parent-death signal is not
    asked (None), and it runs on."""
    with subprocess.Popen(
        [sys.executable, "-c", _FILTERED], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    ) as p:
        try:
            assert p.stdout is not None and p.stdout.readline() == "filtered\n"
            assert ptrace.parent_death_signal(p.pid) is None
            assert p.poll() is None
        finally:
            p.kill()


_READS_FIFO = (
    "import os, sys, time\n"
    "fd = os.open(sys.argv[1], os.O_RDONLY | os.O_NONBLOCK)\n"  # (only reads it: a one-way end)
    "os.unlink(sys.argv[1]) if sys.argv[2] == 'unlink' else None\n"
    "print(fd, flush=True)\n"
    "time.sleep(600)\n"
)


@pytest.mark.parametrize("other", ["hard link", "a file of the same name"])
def test_a_named_pipes_other_end_is_known_by_its_inode_not_its_name(tmp_path: Path, other: str) -> None:
    """The tree reads a FIFO; outside it, this test holds "hard link": the same FIFO under another
    name, for writing (a tie, missed when ends were matched by the path's text), or "a file of the
    same name": a plain file named as /proc names the FIFO once removed ("NAME (deleted)"), for
    writing (no tie: taken for one before, so that one user could keep another's job from moving,
    as a reviewer showed)."""
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    if other == "hard link":
        os.link(fifo, tmp_path / "other-name")
    how = "unlink" if other != "hard link" else "keep"
    with subprocess.Popen(
        [sys.executable, "-c", _READS_FIFO, str(fifo), how], stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, text=True
    ) as p:
        try:
            assert p.stdout is not None
            fd = int(p.stdout.readline())
            theirs = tmp_path / ("other-name" if other == "hard link" else "fifo (deleted)")
            ours = os.open(theirs, os.O_WRONLY | os.O_NONBLOCK | (os.O_CREAT if other != "hard link" else 0), 0o600)
            try:
                said = [s for s in ends.refusals([p.pid]) if "named pipe" in s]
            finally:
                os.close(ours)
            if other == "hard link":
                assert said and said[0].startswith(f"PID {p.pid} reads the named pipe {fifo} (fd {fd}) that PID "), said
                assert f"PID {os.getpid()} (" in said[0], said
            else:
                assert said == [], said
        finally:
            p.kill()
