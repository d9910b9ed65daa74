"""Attacks on a root agent on a shared node, played for real: an unprivileged user (nobody)
plants directories, forges command lines, stalls the API, replays and impersonates; each
attack must fail and the normal path must still work.  (Carried files: test_carry_security;
the transfer streams: test_transfer_security.)"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
from pathlib import Path

import grpc
import psutil
import pytest
from prometheus_client import REGISTRY

from conftest import needs_criu
from host import proc as host_proc
from host.api import UsageError
from host.safefs import private_dir
from snapshot import criu, hook
from snapshot.held import wait_released
from support.agents import agent_config, free_port, node_of, serving
from support.certs import node_certs
from support.helpers import NOBODY, ROOT, alive, assert_one_sentence_error, tpagent, wait_until
from tpagent.common.config import AgentConfig
from tpagent.daemon import rpc
from tpagent.daemon.client import GrpcPeer
from tpagent.daemon.rpc import pb, stub
from tpagent.daemon.serve import _own_work_dir
from tpagent.migration.api import Refused, Role, TargetState
from tpagent.migration.decide import target_dropped_copy, target_state
from tpagent.migration.journal import Record
from tpagent.workload import launch

ATTACKERS = Path(__file__).resolve().parent.parent / "attackers"
UID_NOBODY = 65534


def as_nobody(*args: str, **kw: object) -> subprocess.Popen[str]:
    return subprocess.Popen([*NOBODY, *args], text=True, cwd="/", **kw)  # type: ignore[call-overload, no-any-return]


def _give_to_nobody(directory: Path) -> Path:
    for p in [directory, *directory.rglob("*")]:
        os.chown(p, UID_NOBODY, UID_NOBODY, follow_symlinks=False)
    return directory


def _plant_module(directory: Path, marker: Path) -> None:
    """A ``snapshot`` package that, if root ever imported it, leaves ``marker``."""
    pkg = directory / "snapshot"
    pkg.mkdir(parents=True)
    for name in ("__init__.py", "hook.py", "manifest.py"):
        (pkg / name).write_text(f"open({str(marker)!r}, 'w').write('ran as root')\n")


# ---- 1. planted directories ---------------------------------------------------------------


@needs_criu
@pytest.mark.parametrize("plant", ["out-exists", "parent-is-theirs", "grandparent-is-theirs", "shared-like-tmp"])
def test_a_planted_out_directory_is_refused_and_runs_nothing(
    start, playground: Path, tmp_path: Path, plant: str
) -> None:  # type: ignore[no-untyped-def]
    """nobody prepares --out (with their own log/ and a module CRIU's hook would import), or
    owns a directory on the way to it (existing or not yet), or --out is a shared directory
    like /tmp: the dump refuses in one sentence, freezes nothing, writes and changes nothing
    there, and nothing of theirs runs as root."""
    w = start(mib=16)
    marker = tmp_path / "pwned"
    out = playground / "out"
    named = playground
    if plant == "out-exists":
        _plant_module(out / "log", marker)
        _give_to_nobody(out)
        named = out
    elif plant == "grandparent-is-theirs":
        out = playground / "new" / "out"  # (root would make new/, which nobody could then swap)
    elif plant == "shared-like-tmp":
        playground.chmod(0o1777)
        os.chown(playground, 0, 0)
        (playground / "theirs").write_text("a user's file")
        out = named = playground
    before = {p: p.lstat() for p in [playground, *playground.rglob("*")]}
    proc = tpagent("dump", str(w.pid), "--out", str(out))
    assert_one_sentence_error(proc, str(named))
    assert proc.returncode == 2
    assert not marker.exists()
    assert {p: p.lstat() for p in [playground, *playground.rglob("*")]} == before  # nothing written, nothing changed
    n = len(w.ticks())
    wait_until(lambda: len(w.ticks()) > n + 3, "the workload to keep running")


def test_the_hook_runs_isolated_from_where_criu_runs_it(tmp_path: Path) -> None:
    """CRIU runs the hook from inside the snapshot's log/: neither that directory nor
    PYTHONPATH can put a module of someone else's in its place."""
    planted = tmp_path / "planted"
    marker = tmp_path / "pwned"
    _plant_module(planted, marker)
    script = hook.install()
    try:
        env = {**os.environ, "CRTOOLS_SCRIPT_ACTION": "post-dump", "PYTHONPATH": str(planted)}
        subprocess.run([str(script)], cwd=planted, env=env, capture_output=True, timeout=60)
    finally:
        shutil.rmtree(script.parent)
    assert not marker.exists()


def _serve_cli(cfg: AgentConfig, work_dir: Path, listen: str = "") -> subprocess.CompletedProcess[str]:
    return tpagent(
        "serve",
        "--listen",
        listen or cfg.listen,
        "--health-listen",
        "",
        "--metrics-listen",
        "",
        "--work-dir",
        str(work_dir),
        "--secret-file",
        str(cfg.secret_file),
        "--tls-dir",
        str(cfg.tls_dir),
        timeout=60,
    )


def test_an_agent_whose_port_is_taken_or_no_port_says_so_in_one_sentence(tmp_path: Path) -> None:
    """Another process listens on its port (this gRPC raised, a traceback), or the port is over
    65535 (gRPC took it wrapped, 99999 as 34463): one sentence, exit 2.  Held with SO_REUSEPORT,
    as another agent's gRPC holds it, the port was shared: two agents served on it, each taking
    half of the connections.  A host that does not resolve, or is none of this node's, is said
    as such (gRPC logged a line of its own, then the agent blamed another agent)."""
    cfg = agent_config(tmp_path, "n")
    with socket.socket() as held, socket.socket() as shared:
        held.bind(("127.0.0.1", 0))
        held.listen()
        taken = f"127.0.0.1:{held.getsockname()[1]}"
        shared.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        shared.bind(("127.0.0.1", 0))
        shared.listen()
        reused = f"127.0.0.1:{shared.getsockname()[1]}"
        for listen, says in (
            (taken, f"cannot listen on {taken}; is another agent running there?"),
            (reused, f"cannot listen on {reused}; is another agent running there?"),
            ("127.0.0.1:99999", "the setting listen = '127.0.0.1:99999' is not valid: give HOST:PORT, the port 1"),
            ("nowhere.invalid:7500", "cannot listen on nowhere.invalid:7500: nowhere.invalid does not resolve here ("),
            (
                "10.255.255.254:7500",
                "cannot listen on 10.255.255.254:7500: 10.255.255.254 is no address of this node's.",
            ),
        ):
            proc = _serve_cli(cfg, tmp_path / "work", listen)
            assert_one_sentence_error(proc, says)
            assert proc.returncode == 2 and proc.stderr.count("\n") == 1, proc.stderr


def test_an_agent_refuses_a_work_dir_someone_else_prepared(tmp_path: Path, playground: Path) -> None:
    """nobody pre-creates the agent's work directory with a journal record naming a process to
    kill at startup: the agent refuses to start, in one sentence, and kills nothing."""
    victim = subprocess.Popen(["sleep", "600"], start_new_session=True)
    try:
        work = playground / "agent"
        (work / "migrations").mkdir(parents=True)
        record = Record(
            "a" * 32, Role.TARGET, TargetState.RESTORING, pid=victim.pid, snapshot=str(work / "incoming" / ("a" * 32))
        )
        (work / "migrations" / f"{'a' * 32}.json").write_text(json.dumps(record.to_json()))
        _give_to_nobody(work)
        proc = _serve_cli(agent_config(tmp_path, "n"), work)
        assert_one_sentence_error(proc, str(work), "owner UID 65534")
        assert victim.poll() is None
    finally:
        victim.kill()
        victim.wait()


# ---- 2. snapshots are root's alone -----------------------------------------------------------


@needs_criu
def test_snapshot_files_are_root_only(start, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    """Even under a permissive umask, every directory of a snapshot is 0700 and every file
    0600: nobody cannot read an image holding the process's memory."""
    w = start(mib=16)
    out = tmp_path / "open" / "snap"
    tmp_path.chmod(0o755)
    proc = subprocess.run(
        [
            sys.executable,
            "-c",
            "import os, sys; os.umask(0); from cli.main import app; app(prog_name='tpagent')",
            "dump",
            str(w.pid),
            "--out",
            str(out),
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    modes = {p: p.stat().st_mode & 0o777 for p in [out, *out.rglob("*")]}
    assert {m for p, m in modes.items() if p.is_dir()} == {0o700}
    assert {m for p, m in modes.items() if p.is_file()} == {0o600}
    images = sorted((out / "images").glob("pages-*.img"))
    assert images
    (tmp_path / "open").chmod(0o755)  # even with the directory above opened up, the files stay shut
    out.chmod(0o755)
    (out / "images").chmod(0o755)
    reader = as_nobody("cat", str(images[0]), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    _, err = reader.communicate(timeout=30)
    assert reader.returncode != 0 and "Permission denied" in err


def test_a_received_snapshot_is_root_only(tmp_path: Path, playground: Path) -> None:
    """The receiving side too, whatever the umask: the snapshot and its partial directory are
    0700 with files 0600; and it is never received into a directory of a user's."""
    from support.transfer_support import Receiving, _send, digests, make_snapshot
    from transfer.api import TlsFiles
    from transfer.tcp import TcpTransport

    src = make_snapshot(tmp_path / "src", "random", 3)
    tls = TlsFiles.in_dir(node_certs(tmp_path, "n"))
    umask = os.umask(0)
    try:
        rx = Receiving(TcpTransport(tls=tls), tmp_path / "dst")
        _send(TcpTransport(tls=tls), src, rx.receiver.address)
        assert rx.join() is not None and digests(tmp_path / "dst") == digests(src)
        theirs = Receiving(TcpTransport(tls=tls), playground / "dst", timeout=5)
        refused = theirs.join()  # (the request as given: the receive's usage error, exit 2 from the CLI)
        assert isinstance(refused, UsageError) and "can be changed by other users" in str(refused), refused
        assert not list(playground.iterdir())
    finally:
        os.umask(umask)
    modes = {p: p.stat().st_mode & 0o777 for p in [tmp_path / "dst", *(tmp_path / "dst").rglob("*")]}
    assert {m for p, m in modes.items() if p.is_dir()} == {0o700}
    assert {m for p, m in modes.items() if p.is_file()} == {0o600}


def test_agents_served_in_threads_leave_the_process_umask_as_it_was(tmp_path: Path) -> None:
    """The umask is the process's: an agent in a thread must not set it.  Two that did, stopped
    in the order they started, left the process at 077 for good (the first put back the 022 it
    found, the second the 077 it found), and a later test's directory came out 0700.  (`tpagent
    serve`, a process of its own, runs under 077: its CLI sets it.)"""
    from tpagent.daemon.serve import serve

    before = os.umask(0o022)
    try:
        runs = []
        for name in ("a", "b"):
            ready = threading.Event()
            stop = threading.Event()
            t = threading.Thread(target=serve, args=(agent_config(tmp_path, name), ready, stop), daemon=True)
            t.start()
            assert ready.wait(30)
            runs.append((t, stop))
        for t, stop in runs:
            stop.set()
            t.join(60)
            assert not t.is_alive()
        now = os.umask(0o022)
        assert now == 0o022, oct(now)
    finally:
        os.umask(before)


# ---- 6. the secret and the key must be private ------------------------------------------------


@pytest.mark.parametrize("case", ["secret-0644", "secret-of-nobody", "key-0644"])
def test_secret_and_key_files_must_be_root_only(tmp_path: Path, case: str) -> None:
    cfg = agent_config(tmp_path, "n")
    path = cfg.secret_file if case.startswith("secret") else cfg.tls_dir / "tls.key"
    if case.endswith("0644"):
        path.chmod(0o644)
    else:
        os.chown(path, UID_NOBODY, UID_NOBODY)
    for proc in (
        tpagent("node", "--agent", cfg.listen, "--secret-file", str(cfg.secret_file), "--tls-dir", str(cfg.tls_dir)),
        _serve_cli(cfg, tmp_path / "work"),
    ):
        assert_one_sentence_error(proc, str(path), "mode 600")
        assert proc.returncode == 2


# ---- 4. no unauthenticated stall --------------------------------------------------------------


def _health(address: str) -> int:
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    with grpc.insecure_channel(address) as ch:
        return int(health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=10).status)


def _refused(reason: str) -> float:
    return REGISTRY.get_sample_value("tpagent_refused_total", {"plane": "rpc", "reason": reason}) or 0.0


def test_unauthenticated_callers_cannot_stall_the_api(
    tmp_path: Path, playground: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """nobody holds 200 TCP connections that never finish TLS, and (with a certificate of the
    cluster CA but no secret) opens 64 calls that never send their request: the calls are
    refused at once, the API answers authenticated callers, probes are answered, and each
    refusal is logged and counted."""
    cfg = agent_config(tmp_path, "n", health_listen=f"127.0.0.1:{free_port()}")
    stop = serving(cfg)
    stolen = _give_to_nobody(shutil.copytree(node_certs(tmp_path, "another-service"), playground / "theirs"))
    before = _refused("no_credentials")
    attacker = as_nobody(
        sys.executable,
        str(ATTACKERS / "stall.py"),
        cfg.listen,
        str(stolen),
        "200",
        "64",
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
    )
    try:
        assert attacker.stdout is not None
        codes = json.loads(attacker.stdout.readline())
        assert codes == ["UNAUTHENTICATED"] * 64  # refused, none left hanging in a worker thread
        # The 200 half-open connections are still held: the API and the probe both answer.
        info = stub(cfg.listen, cfg.credentials()).Info(pb.Empty(), timeout=10)
        assert info.node == "n"
        assert _health(cfg.health_listen) == 1  # SERVING
    finally:
        attacker.communicate(timeout=30)
        stop.set()
    assert _refused("no_credentials") - before == 64
    assert "refused /tpagent.v1.Agent/Info" in caplog.text


def test_connections_that_never_finish_tls_are_held_only_up_to_the_apis_bound(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """nobody opens 200 connections that never finish TLS to an agent whose API holds 32 (its
    bound, :data:`rpc.MAX_CONNECTIONS`, made small): the connections past it are closed at once,
    not held for the handshake's 10 s each (unbounded, 15 000 of them took an agent from 69 MB to
    617 MB); once they go, authenticated callers are answered."""
    monkeypatch.setattr(rpc, "MAX_CONNECTIONS", 32)
    cfg = agent_config(tmp_path, "n")
    stop = serving(cfg)
    attacker = as_nobody(
        sys.executable, str(ATTACKERS / "hold_connections.py"), cfg.listen, "200", stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
    )  # fmt: skip
    try:
        assert attacker.stdout is not None
        closed = json.loads(attacker.stdout.readline())["closed"]
        assert 200 - 32 <= closed < 200, closed
    finally:
        attacker.communicate(timeout=30)
    try:
        info = wait_until(lambda: _info_or_none(cfg), "the API to answer once they went", 20, 0.2)
        assert info.node == "n"
    finally:
        stop.set()


def test_refusals_under_way_never_take_an_authenticated_callers_turn(tmp_path: Path) -> None:
    """Calls without the secret, however many are being refused at once (as on a machine too busy
    to refuse them quickly), never turn an authenticated call away: they were once counted with the
    API's calls, and 64 of them failed a CI run.  An authenticated call past the API's bound is
    refused at once (RESOURCE_EXHAUSTED), never queued; refusals past their own bound are turned
    away by gRPC itself, with no thread, and each is still counted."""
    creds = agent_config(tmp_path, "n").credentials()
    slow = threading.Event()  # set: refusals go at once
    slow.set()
    refusals: list[str] = []

    def refused(reason: str) -> None:  # (the refusal threads only are held: never gRPC's own)
        refusals.append(reason)
        if threading.current_thread().name.startswith("rpc-refuse"):
            slow.wait(30)

    held, entered = threading.Event(), threading.Semaphore(0)

    def hold(request: pb.NodeInfo, ctx: grpc.ServicerContext) -> pb.NodeInfo:
        entered.release()
        held.wait(30)
        return pb.NodeInfo(node="held")

    codec = {"request_deserializer": pb.NodeInfo.FromString, "response_serializer": pb.NodeInfo.SerializeToString}
    methods = {
        "Unary": grpc.unary_unary_rpc_method_handler(lambda request, ctx: pb.NodeInfo(node="unary"), **codec),
        "Hold": grpc.unary_unary_rpc_method_handler(hold, **codec),
    }
    interceptor = rpc.AuthInterceptor(creds.secret, {"127.0.0.1"}, rpc.Health(), refused, workers=2)
    srv, tls = rpc.server(creds, interceptor)
    srv.add_generic_rpc_handlers((grpc.method_handlers_generic_handler("t.T", methods),))
    port = srv.add_secure_port("127.0.0.1:0", tls)
    srv.start()
    ask = pb.NodeInfo(node="?")
    with grpc.secure_channel(f"127.0.0.1:{port}", grpc.ssl_channel_credentials(creds.ca, creds.key, creds.cert)) as ch:
        calls = {
            name: ch.unary_unary(
                f"/t.T/{name}",
                request_serializer=pb.NodeInfo.SerializeToString,
                response_deserializer=pb.NodeInfo.FromString,
            )
            for name in methods
        }

        def signed(name: str) -> dict[str, object]:
            return {"metadata": rpc.sign(creds.secret, f"/t.T/{name}", "127.0.0.1", ask), "timeout": 10}

        try:
            # 20 refusals under way, more than the API's 2 calls and their old margin of 8 together
            slow.clear()
            unsigned = [calls["Unary"].future(ask, timeout=30) for _ in range(20)]
            wait_until(lambda: interceptor.refusals.taken == 20, "the 20 refusals to be under way")
            assert calls["Unary"](ask, **signed("Unary")).node == "unary"
            slow.set()
            assert [f.exception().code() for f in unsigned] == [grpc.StatusCode.UNAUTHENTICATED] * 20  # type: ignore[union-attr]

            # the API's 2 calls under way: a third is refused at once, and answered once one ends
            holding = [calls["Hold"].future(ask, **signed("Hold")) for _ in range(2)]
            for _ in holding:
                assert entered.acquire(timeout=10)
            with pytest.raises(grpc.RpcError) as e:
                calls["Unary"](ask, **signed("Unary"))
            assert e.value.code() is grpc.StatusCode.RESOURCE_EXHAUSTED
            assert "as many calls as this agent answers at once are under way" in str(e.value.details())
            held.set()
            assert [f.result().node for f in holding] == ["held", "held"]
            assert calls["Unary"](ask, **signed("Unary")).node == "unary"

            # refusals past their bound (made 2): gRPC's own, at once, counted
            interceptor.refusals.bound = 2
            slow.clear()
            before = len(refusals)
            waiting = [calls["Unary"].future(ask, timeout=30) for _ in range(2)]
            wait_until(lambda: interceptor.refusals.taken == 2, "the 2 refusals to be under way")
            with pytest.raises(grpc.RpcError) as e:
                calls["Unary"](ask, timeout=10)
            assert e.value.code() is grpc.StatusCode.UNIMPLEMENTED
            # ...but a caller that signed its call is told why even then (it acts on the answer)
            held.clear()
            holding = [calls["Hold"].future(ask, **signed("Hold")) for _ in range(2)]
            for _ in holding:
                assert entered.acquire(timeout=10)
            busy = calls["Unary"].future(ask, **signed("Unary"))
            wait_until(lambda: interceptor.refusals.taken == 3, "the busy refusal to be under way")
            slow.set()
            assert busy.exception().code() is grpc.StatusCode.RESOURCE_EXHAUSTED  # type: ignore[union-attr]
            assert [f.exception().code() for f in waiting] == [grpc.StatusCode.UNAUTHENTICATED] * 2  # type: ignore[union-attr]
            held.set()
            assert [f.result().node for f in holding] == ["held", "held"]
            assert sorted(refusals[before:]) == ["busy"] + ["no_credentials"] * 3
            wait_until(
                lambda: interceptor.refusals.taken == 0 and interceptor.calls.taken == 0, "every call given back"
            )
        finally:
            slow.set()
            held.set()
            srv.stop(0)


def _info_or_none(cfg: AgentConfig) -> pb.NodeInfo | None:
    try:
        return stub(cfg.listen, cfg.credentials()).Info(pb.Empty(), timeout=5)
    except grpc.RpcError:
        return None


# ---- 5. forged, replayed, misaddressed, impersonated ------------------------------------------


def _raw_info(cfg: AgentConfig, metadata: list[tuple[str, str]]) -> grpc.StatusCode:
    """Info with exactly ``metadata`` (a captured or forged signature), over the node's TLS."""
    creds = cfg.credentials()
    tls = grpc.ssl_channel_credentials(creds.ca, creds.key, creds.cert)
    with grpc.secure_channel(cfg.listen, tls) as ch:
        call = ch.unary_unary(
            "/tpagent.v1.Agent/Info",
            request_serializer=pb.Empty.SerializeToString,
            response_deserializer=pb.NodeInfo.FromString,
        )
        try:
            call(pb.Empty(), metadata=metadata, timeout=10)
            return grpc.StatusCode.OK
        except grpc.RpcError as e:
            return e.code()  # type: ignore[no-any-return]


def test_captured_calls_cannot_be_replayed_or_sent_to_another_node(tmp_path: Path) -> None:
    cfg = agent_config(tmp_path, "n")
    secret = cfg.credentials().secret
    method = "/tpagent.v1.Agent/Info"
    stop = serving(cfg)
    captured = rpc.sign(secret, method, "127.0.0.1", pb.Empty())
    kept = rpc.sign(secret, method, "127.0.0.1", pb.Empty())  # captured, replayed only after a restart
    try:
        assert _raw_info(cfg, captured) is grpc.StatusCode.OK
        assert _raw_info(cfg, captured) is grpc.StatusCode.UNAUTHENTICATED  # a replay
        assert (
            _raw_info(cfg, rpc.sign(secret, method, "10.9.9.9", pb.Empty())) is grpc.StatusCode.UNAUTHENTICATED
        )  # for another node
        other = rpc.sign(secret, "/tpagent.v1.Agent/Status", "127.0.0.1", pb.Empty())  # signed for another method
        assert _raw_info(cfg, other) is grpc.StatusCode.UNAUTHENTICATED
        body = [captured[0], (rpc.BODY_HEADER, "0" * 64)]  # the signature without its request
        assert _raw_info(cfg, body) is grpc.StatusCode.UNAUTHENTICATED
    finally:
        stop.set()
    wait_until(lambda: _raw_info(cfg, []) is grpc.StatusCode.UNAVAILABLE, "the agent to stop")
    stop = serving(cfg)  # the same agent, restarted: its memory of nonces is gone
    try:
        assert _raw_info(cfg, kept) is grpc.StatusCode.UNAUTHENTICATED
        assert stub(cfg.listen, cfg.credentials()).Info(pb.Empty(), timeout=10).node == "n"  # a fresh call works
    finally:
        stop.set()


@pytest.mark.parametrize("impostor", ["another-ca", "cluster-ca-other-name"])
def test_an_impostor_target_cannot_say_the_copy_is_gone(tmp_path: Path, playground: Path, impostor: str) -> None:
    """An impostor (nobody's process) answers NOT_FOUND, once taken by a source as "the copy is
    gone" (after which it resumed its original: two copies).  Over mutual TLS the source never
    hears it: to the source the target does not answer, so it keeps the original frozen."""
    if impostor == "another-ca":
        theirs = node_certs(tmp_path, "rogue", "127.0.0.2", ca="rogue-ca")
        host = "127.0.0.2"
    else:
        theirs = node_certs(tmp_path, "impostor", "127.0.0.9")
        host = "127.0.0.2"  # its certificate names another node
    theirs = _give_to_nobody(shutil.copytree(theirs, playground / "theirs"))
    address = f"{host}:{free_port()}"
    fake = as_nobody(sys.executable, str(ATTACKERS / "fake_target.py"), address, str(theirs), stdout=subprocess.PIPE)
    try:
        assert fake.stdout is not None and fake.stdout.readline().strip() == "listening"
        source = agent_config(tmp_path, "source")
        target = stub(address, source.credentials())
        with pytest.raises(grpc.RpcError) as e:
            target.Status(pb.MigrationRef(migration_id="a" * 32), timeout=10)
        assert e.value.code() is grpc.StatusCode.UNAVAILABLE  # (TLS failed: never NOT_FOUND)
        peer = GrpcPeer(address, source.credentials())
        ctx = node_of(source).ctx
        assert target_state(ctx, peer, "a" * 32, 2.0) == (None, 0)
        assert target_dropped_copy(ctx, peer, "a" * 32, 2.0) is False
    finally:
        fake.kill()
        fake.communicate()


# ---- 9. stream-type handlers: default deny ------------------------------------------------------


def test_streaming_calls_are_refused_by_default(tmp_path: Path) -> None:
    """A method that takes a stream of requests (none of the API does) is refused even when
    signed; a signed unary call of the same server passes."""
    creds = agent_config(tmp_path, "n").credentials()
    codec = {"request_deserializer": pb.NodeInfo.FromString, "response_serializer": pb.NodeInfo.SerializeToString}
    echo = grpc.method_handlers_generic_handler(
        "t.T",
        {
            "Stream": grpc.stream_stream_rpc_method_handler(
                lambda requests, ctx: iter([pb.NodeInfo(node="streamed")]), **codec
            ),
            "Unary": grpc.unary_unary_rpc_method_handler(lambda request, ctx: pb.NodeInfo(node="unary"), **codec),
        },
    )
    srv, tls = rpc.server(creds, rpc.AuthInterceptor(creds.secret, {"127.0.0.1"}, rpc.Health()))
    srv.add_generic_rpc_handlers((echo,))
    port = srv.add_secure_port("127.0.0.1:0", tls)
    srv.start()
    try:
        with grpc.secure_channel(
            f"127.0.0.1:{port}", grpc.ssl_channel_credentials(creds.ca, creds.key, creds.cert)
        ) as ch:
            ask = pb.NodeInfo(node="?")
            codec = {
                "request_serializer": pb.NodeInfo.SerializeToString,
                "response_deserializer": pb.NodeInfo.FromString,
            }
            unary = ch.unary_unary("/t.T/Unary", **codec)(
                ask, metadata=rpc.sign(creds.secret, "/t.T/Unary", "127.0.0.1", ask), timeout=10
            )
            assert unary.node == "unary"
            with pytest.raises(grpc.RpcError) as e:
                list(
                    ch.stream_stream("/t.T/Stream", **codec)(
                        iter([ask]), metadata=rpc.sign(creds.secret, "/t.T/Stream", "127.0.0.1", ask), timeout=10
                    )
                )
            assert e.value.code() is grpc.StatusCode.UNAUTHENTICATED
    finally:
        srv.stop(0)


# ---- 7. being migratable cannot be forged ------------------------------------------------------


@needs_criu
def test_a_forged_command_line_does_not_make_a_process_migratable(start, tmp_path: Path, playground: Path) -> None:  # type: ignore[no-untyped-def]
    """nobody's process calls itself a tpagent launch init and an allowed program (exec -a):
    the agent lists and migrates only what a launch record, NVML or /proc/PID/exe says."""
    allowed = os.path.realpath(shutil.which("sleep") or "/bin/sleep")
    agent = node_of(agent_config(tmp_path, "n", allow_executables=(allowed,)))
    forged = as_nobody(
        "bash",
        "-c",
        f"exec -a '{sys.executable} -m tpagent.workload.nsinit 5 /o /e {allowed}' {shutil.which('cat')}",
        stdin=subprocess.PIPE,
    )
    honest = as_nobody(allowed, "600")
    copy = shutil.copy(allowed, playground / os.path.basename(allowed))  # their own program of the same name
    lookalike = as_nobody(copy, "600")
    w = start(mib=16, launched=True)
    try:
        wait_until(
            lambda: "tpagent.workload.nsinit" in " ".join(psutil.Process(forged.pid).cmdline()),
            "the forged command line",
        )
        listed = {p.pid: p for p in agent.migratable()}
        assert forged.pid not in listed
        assert listed[w.pid].why == "launched" and listed[w.pid].owner == os.getuid() and listed[w.pid].uid == 0
        assert listed[honest.pid].why == "operator" and listed[honest.pid].uid == UID_NOBODY
        assert lookalike.pid not in listed
        with pytest.raises(Refused, match="not a migratable process"):
            agent.start_migration(forged.pid, "10.0.0.3:7400", dry_run=True)
        # A record names one process: the same PID number, started anew, is not launched.
        record = launch.launched(w.pid)
        assert record is not None
        stale = dataclasses.replace(record, pid=honest.pid)
        (launch.RECORDS / f"{honest.pid}.json").write_text(json.dumps(stale.__dict__))
        assert launch.launched(honest.pid) is None
    finally:
        (launch.RECORDS / f"{honest.pid}.json").unlink(missing_ok=True)
        for p in (forged, honest, lookalike):
            p.kill()
            p.communicate()


# ---- 8. CRIU is known by its PID, not by command lines ----------------------------------------


def test_a_command_line_naming_a_snapshot_does_not_block_the_agent(tmp_path: Path) -> None:
    """nobody runs a process whose arguments name the snapshot a migration was restoring when
    the agent died: the restarted agent does not take it for CRIU (it once waited for ever)."""
    cfg = agent_config(tmp_path, "n")
    mid = "c" * 32
    snap = cfg.work_dir / "incoming" / mid
    work = snap.parent / f"{mid}.restore"
    private_dir(work)
    journal = node_of(cfg).journal
    journal.write(Record(mid, Role.TARGET, TargetState.RESTORING, snapshot=str(snap)))
    lookalike = as_nobody("bash", "-c", f"exec -a 'criu restore -D {snap}/images -W {work}' sleep 600")
    try:
        wait_until(lambda: str(work) in " ".join(psutil.Process(lookalike.pid).cmdline()), "the look-alike to run")
        node_of(cfg).recover()  # (the restore it finds is settled in a thread: the agent serves meanwhile)
        wait_until(
            lambda: (r := journal.read(mid)) is not None and r.state is TargetState.DISCARDED,
            "the restore the agent left to be settled, the look-alike not waited for",
            30,
        )
        assert lookalike.poll() is None  # and it was left alone
    finally:
        lookalike.kill()
        lookalike.wait()


def test_a_running_criu_is_recognised_by_pid_and_start_time(tmp_path: Path) -> None:
    work = private_dir(tmp_path / "work")
    stand_in = subprocess.Popen(["sleep", "600"])
    try:
        (work / criu.PIDFILE).write_text(f"{stand_in.pid} {host_proc.started(stand_in.pid)}")
        assert criu.running_in(work)
        released = threading.Thread(target=wait_released, args=(work, None), daemon=True)
        released.start()
        released.join(0.5)
        assert released.is_alive()  # it waits while that CRIU runs ...
        stand_in.send_signal(signal.SIGKILL)
        stand_in.wait()
        released.join(10)
        assert not released.is_alive()  # ... and not a moment longer
        (work / criu.PIDFILE).write_text(f"{os.getpid()} 1.0")  # a PID that lives, but another process
        assert not criu.running_in(work)
    finally:
        stand_in.kill()
        stand_in.wait()


def test_credentials_load_from_a_kubernetes_secret_volume_but_not_through_a_users_symlink(
    tmp_path: Path, playground: Path
) -> None:
    """A Secret volume is a chain of root's symlinks (tls.key -> ..data/tls.key -> ..2026_x/tls.key,
    mode 0400): loaded.  A symlink of nobody's to the real files: refused in one sentence."""
    real = agent_config(tmp_path, "n")
    volume = private_dir(tmp_path / "volume")
    stamp = volume / "..2026_11_23_00_00_00.1"
    shutil.copytree(real.tls_dir, stamp)
    shutil.copy2(real.secret_file, stamp / "secret")
    for f in stamp.iterdir():
        f.chmod(0o400)
    (volume / "..data").symlink_to(stamp.name)
    for name in ("ca.crt", "tls.crt", "tls.key", "secret"):
        (volume / name).symlink_to(f"..data/{name}")
    creds = rpc.Credentials.load(volume / "secret", volume)
    assert creds.key == (real.tls_dir / "tls.key").read_bytes() and creds.secret == real.credentials().secret
    theirs = playground / "tls"
    theirs.mkdir()
    for name in ("ca.crt", "tls.crt", "tls.key"):
        (theirs / name).symlink_to(real.tls_dir / name)
    _give_to_nobody(theirs)
    assert (real.tls_dir / "tls.key").stat().st_uid == 0  # (their links are theirs; what they point at is root's)
    with pytest.raises(UsageError, match="symlink owned by UID 65534"):
        rpc.Credentials.load(real.secret_file, theirs)


# ---- tpagent launch: run as root, in a directory or with logs a user may have prepared -------


@needs_criu
def test_launch_imports_nothing_from_its_directory_and_follows_no_symlink(tmp_path: Path, playground: Path) -> None:
    """Root runs `tpagent launch` from a directory where nobody left a module of the standard
    library's name, and names a log behind nobody's symlink: nothing of theirs runs and
    nothing is written through the link; the workload gets the caller's umask, not 077."""
    marker = tmp_path / "pwned"
    vault = tmp_path / "vault"
    vault.mkdir(mode=0o700)
    (playground / "subprocess.py").write_text(f"open({str(marker)!r}, 'w').write('ran as root')\n")
    (playground / "logs").symlink_to(vault)
    _give_to_nobody(playground)
    tpagent_cmd = str(Path(sys.executable).parent / "tpagent")  # (the installed command, as root would type it)
    refused = subprocess.run(
        [tpagent_cmd, "launch", "--stdout", str(playground / "logs" / "out.log"), "--", "sleep", "60"],
        cwd=playground,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert_one_sentence_error(refused, "symlink")
    assert not marker.exists() and not list(vault.iterdir())
    ok = subprocess.run(
        [
            "sh",
            "-c",
            'umask 022; exec "$0" "$@"',
            tpagent_cmd,
            "launch",
            "--stdout",
            str(tmp_path / "u.log"),
            "--",
            "sh",
            "-c",
            "umask; touch " + str(tmp_path / "made"),
        ],
        cwd=playground,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert ok.returncode == 0, ok.stderr
    wait_until(lambda: (tmp_path / "made").exists(), "the workload to run")
    assert (tmp_path / "u.log").read_text().strip() == "0022" and (tmp_path / "made").stat().st_mode & 0o777 == 0o644
    assert not marker.exists()


@needs_criu
def test_launch_writes_no_log_a_user_planted_where_anyone_may_write(tmp_path: Path) -> None:
    """In a directory of root's that anyone may write in (sticky, as /tmp), nobody leaves a log
    of theirs, readable by all, where root's workload would write: root's `tpagent launch`
    refuses it in one sentence, and nothing of the workload's output reaches it."""
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o1777)
    planted = shared / "job.log"
    planted.touch(mode=0o666)
    os.chown(planted, UID_NOBODY, UID_NOBODY)
    proc = tpagent("launch", "--stdout", str(planted), "--", "sh", "-c", "echo root secret")
    assert_one_sentence_error(proc, f"a file of UID {UID_NOBODY}'s in a directory others may write in", str(planted))
    assert planted.read_text() == ""


@needs_criu
@pytest.mark.parametrize("mode", [0o755, 0o4755, 0o2644])
def test_launch_appends_to_no_program(tmp_path: Path, mode: int) -> None:
    """`--stdout /usr/bin/x` (a typo; or a script in cron.d): root's workload appended its output
    to a program of root's, a setuid one keeping its bit.  Refused, the file as it was."""
    program = tmp_path / "program"
    program.write_bytes(b"#!/bin/sh\n")
    program.chmod(mode)
    proc = tpagent("launch", "--stdout", str(program), "--", "sh", "-c", "echo output")
    assert_one_sentence_error(proc, "an executable file, not a log", str(program))
    assert program.read_bytes() == b"#!/bin/sh\n" and program.stat().st_mode & 0o7777 == mode


@needs_criu
def test_a_snapshot_in_a_users_directory_is_not_restored(start, tmp_path: Path, playground: Path) -> None:  # type: ignore[no-untyped-def]
    """Root verifies a snapshot, then CRIU reads its images again by name: from a directory
    nobody could swap (theirs, or one under theirs) it is refused in one sentence, before
    anything is restored."""
    w = start(mib=16)
    snap = tmp_path / "snap"
    assert tpagent("dump", str(w.pid), "--out", str(snap)).returncode == 0
    w.reap()
    theirs = shutil.copytree(snap, playground / "snap")  # root's copy, 0700, but in nobody's directory
    proc = tpagent("restore", str(theirs))
    assert_one_sentence_error(proc, str(playground), "can be changed by other users")
    assert proc.returncode == 2 and not alive(w.pid)


def test_a_planted_look_alike_is_not_taken_for_a_carried_file(playground: Path, tmp_path: Path) -> None:
    """nobody plants a file with the very bytes of a carried log, but theirs and writable by
    all: the restore does not adopt it (the restored process would write into their file)."""
    import io

    from host import safefs

    planted = playground / "w.log"
    planted.write_bytes(b"the log's bytes")
    os.chown(planted, UID_NOBODY, UID_NOBODY)
    planted.chmod(0o666)
    logs = private_dir(tmp_path / "logs")
    logs.chmod(0o755)
    with pytest.raises(UsageError, match="other content, owner or mode"):
        safefs.write_file(planted, io.BytesIO(b"the log's bytes"), UID_NOBODY, UID_NOBODY, 0o640, 0.0, [])
    mine = logs / "w.log"
    safefs.write_file(mine, io.BytesIO(b"the log's bytes"), 0, 0, 0o640, 0.0, created := [])
    assert created == [mine]
    safefs.write_file(
        mine, io.BytesIO(b"the log's bytes"), 0, 0, 0o640, 0.0, again := []
    )  # the same file: kept as it is
    assert again == [] and mine.stat().st_mode & 0o777 == 0o640


def test_a_restore_left_from_before_a_reboot_kills_nothing(tmp_path: Path) -> None:
    """After a reboot a journal may still name a restore in progress; its restore.pid now names
    some other process (PIDs start again): the restarted agent must not stop it."""
    from snapshot import restore

    work = private_dir(tmp_path / "x.restore")
    bystander = subprocess.Popen(["sleep", "600"])
    try:
        (work / "restore.pid").write_text(str(bystander.pid))
        ticks = host_proc.start_ticks(bystander.pid)
        (work / criu.PIDFILE).write_text(f"12345 {ticks}@an-earlier-boot")  # that CRIU ran in an earlier boot
        assert restore.kill_restored(work) == 0 and bystander.poll() is None
        (work / criu.PIDFILE).write_text(f"12345 {ticks + 500}@{host_proc.boot_id()}")  # it started after the process
        assert restore.kill_restored(work) == 0 and bystander.poll() is None
        (work / criu.PIDFILE).write_text(f"12345 {psutil.boot_time() - 3600!r}")  # (an older tpagent's: unknown)
        assert restore.kill_restored(work) == 0 and bystander.poll() is None
        (work / criu.PIDFILE).write_text(f"12345 {ticks}@{host_proc.boot_id()}")  # the tree that CRIU started
        assert restore.kill_restored(work) == bystander.pid
        assert bystander.wait(10) is not None
    finally:
        bystander.kill()
        bystander.wait()


def test_an_agent_refuses_a_work_dir_that_holds_others_files(tmp_path: Path) -> None:
    """`--work-dir /etc` (root's, 755, full): the agent made its migrations/ there and would have
    written its journals and snapshots beside the system's files.  An empty one is shut to 0700
    and used; one a run before left (0700) is used as it is."""
    cfg = agent_config(tmp_path, "n")
    etc = tmp_path / "etc"
    etc.mkdir(mode=0o755)
    (etc / "passwd").write_text("root:x:0:0::/root:/bin/sh\n")
    proc = _serve_cli(cfg, etc)
    assert_one_sentence_error(proc, f"work_dir {etc} holds files that are not the agent's (passwd, mode 755")
    assert sorted(os.listdir(etc)) == ["passwd"] and etc.stat().st_mode & 0o777 == 0o755
    disk = tmp_path / "disk"  # (a new filesystem mounted there: root's, 755, its lost+found; or an older agent's)
    (disk / "lost+found").mkdir(parents=True)
    (disk / "migrations").mkdir()
    disk.chmod(0o755)
    _own_work_dir(disk)
    assert disk.stat().st_mode & 0o777 == 0o700 and sorted(os.listdir(disk)) == ["lost+found", "migrations"]
    taken = tmp_path / "taken"  # (a refusal of the credentials leaves no work_dir made)
    said = tpagent("serve", "--work-dir", str(taken / "w"), "--secret-file", str(tmp_path / "none"))
    assert said.returncode == 2 and not taken.exists()
