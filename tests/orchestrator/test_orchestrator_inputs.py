"""Bad input to the orchestrator (issue 24, item 8), with a real orchestrator served on loopback:
its CLI, an agent's report, and Alertmanager's webhook over HTTPS.  Each is refused in one
sentence (the webhook: 401 or 400 with the reason) and nothing changes."""

from __future__ import annotations

import contextlib
import json
import os
import socket
import ssl
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from host.api import UsageError
from host.hushed import Hushed
from support import users
from support.agents import free_port
from support.certs import node_certs
from support.helpers import NOBODY, ROOT, assert_one_sentence_error, wait_until
from tpagent import __version__
from tpagent.common.credentials import Credentials
from tpagent.daemon.rpc import channel, pb, pb_grpc
from tpagent.orchestrator import webhook
from tpagent.orchestrator.config import OrchestratorConfig
from tpagent.orchestrator.serve import serve
from tpagent.orchestrator.state import State


class Served:
    def __init__(self, tmp: Path, **settings: object) -> None:
        self.secret = tmp / "secret"
        self.secret.write_text(os.urandom(24).hex())
        self.secret.chmod(0o600)
        self.token = tmp / "token"
        self.token.write_text(os.urandom(16).hex())
        self.token.chmod(0o600)
        self.client_tls = node_certs(tmp, "client")
        self.address = f"127.0.0.1:{free_port()}"
        self.webhook = f"127.0.0.1:{free_port()}"
        self.cfg = OrchestratorConfig(
            secret_file=self.secret,
            node="orchestrator",
            listen=self.address,
            tls_dir=node_certs(tmp, "orchestrator"),
            state=tmp / "db" / "state.db",
            **{"metrics_listen": "", **settings},  # type: ignore[arg-type]
            webhook_listen=self.webhook,
            webhook_token_file=self.token,
        )
        self.stop = threading.Event()
        ready = threading.Event()
        threading.Thread(target=serve, args=(self.cfg, ready, self.stop), daemon=True).start()
        assert ready.wait(30)
        creds = Credentials.load(self.secret, self.client_tls)
        self.stub = pb_grpc.OrchestratorStub(channel(self.address, creds))

    def env(self, secret: Path | None = None) -> dict[str, str]:
        return {
            **os.environ,
            "TPAGENT_ORCHESTRATOR": self.address,
            "TPAGENT_SECRET_FILE": str(secret or self.secret),
            "TPAGENT_TLS_DIR": str(self.client_tls),
        }

    def cli(self, *args: str, secret: Path | None = None) -> subprocess.CompletedProcess[str]:
        env = self.env(secret)
        cmd = [sys.executable, "-m", "cli.main", *args]
        return subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=60)

    def hook(self, body: bytes, token: str | None) -> tuple[int, str]:
        headers = {"Content-Type": "application/json"}
        if token is not None:
            headers["Authorization"] = f"Bearer {token}"
        tls = ssl.create_default_context(cafile=str(self.cfg.tls_dir / "ca.crt"))
        request = urllib.request.Request(f"https://{self.webhook}/alertmanager", body, headers, method="POST")
        try:
            with urllib.request.urlopen(request, timeout=10, context=tls) as r:
                return r.status, json.loads(r.read())["message"]
        except urllib.error.HTTPError as e:
            return e.code, json.loads(e.read())["message"]

    def taints(self) -> list[tuple[str, str, str]]:
        v = self.stub.Cluster(pb.Empty(), timeout=10)
        return [(t.node, t.gpu, t.source) for t in v.taints]


@pytest.fixture
def served(tmp_path: Path) -> Iterator[Served]:
    s = Served(tmp_path)
    yield s
    s.stop.set()


def report(version: str = __version__, agent: str = "127.0.0.1:7400") -> pb.NodeReport:
    gpu = pb.Gpu(uuid="GPU-1", name="NVIDIA H100", memory_total=80 << 30)
    return pb.NodeReport(node="n1", agent=agent, version=version, gpus=[gpu], driver_version="580.1")


def test_reports_of_another_version_or_from_another_address_are_refused(served: Served) -> None:
    with pytest.raises(grpc.RpcError) as e:
        served.stub.Report(report(version="0.0.1"), timeout=10)
    assert e.value.code() is grpc.StatusCode.FAILED_PRECONDITION
    assert "is tpagent 0.0.1 and this orchestrator" in str(e.value.details())
    with pytest.raises(grpc.RpcError) as e:
        served.stub.Report(report(agent="10.9.9.9:7400"), timeout=10)
    assert "names agent 10.9.9.9:7400, but came from 127.0.0.1" in str(e.value.details())
    assert served.stub.Cluster(pb.Empty(), timeout=10).nodes == []  # (neither was taken)
    assert served.stub.Report(report(), timeout=10).period == served.cfg.report_period
    assert [n.name for n in served.stub.Cluster(pb.Empty(), timeout=10).nodes] == ["n1"]
    with pytest.raises(grpc.RpcError) as e:  # (another agent, its certificate naming localhost, as n1)
        served.stub.Report(report(agent="localhost:7400"), timeout=10)
    assert "n1 reports from 127.0.0.1:7400; a report naming it from localhost:7400 is refused" in str(e.value.details())


def test_bad_taints_and_untaints_are_one_sentence_and_change_nothing(served: Served, tmp_path: Path) -> None:
    served.stub.Report(report(), timeout=10)
    assert_one_sentence_error(served.cli("taint", "nope", "--reason", "x"), "no node 'nope' has reported", "known: n1")
    assert_one_sentence_error(served.cli("taint", "n1", "--gpu", "GPU-9", "--reason", "x"), "has no GPU 'GPU-9'")
    assert_one_sentence_error(served.cli("taint", "n1"), "--reason")
    assert_one_sentence_error(served.cli("untaint", "n1"), "n1 is not tainted")
    assert_one_sentence_error(served.cli("taint", "n1", "--reason", "a\nb"), "printable characters only")
    other = tmp_path / "other-secret"
    other.write_text(os.urandom(24).hex())
    other.chmod(0o600)
    assert_one_sentence_error(served.cli("taint", "n1", "--reason", "x", secret=other), "refused the call")
    assert served.taints() == []
    ok = served.cli("taint", "n1", "--gpu", "GPU-1", "--reason", "fan failing")
    assert ok.returncode == 0 and "tainted n1 GPU GPU-1" in ok.stdout, ok
    assert_one_sentence_error(served.cli("taint", "n1", "--gpu", "GPU-1", "--reason", "y"), "tainted already")
    assert served.taints() == [("n1", "GPU-1", "operator")]
    assert_one_sentence_error(served.cli("untaint", "n1"), "its GPU(s) GPU-1 are: untaint each with --gpu")
    assert served.cli("untaint", "n1").returncode == 2


def test_the_webhook_refuses_what_is_not_authenticated_or_malformed_then_taints_and_untaints(served: Served) -> None:
    served.stub.Report(report(), timeout=10)
    token = served.token.read_text().strip()
    firing = {"status": "firing", "labels": {"alertname": "Xid", "node": "n1", "UUID": "GPU-1"}, "fingerprint": "f1"}
    body = json.dumps({"version": "4", "status": "firing", "alerts": [firing]}).encode()
    assert served.hook(body, None)[0] == 401
    assert served.hook(body, token + "x") == (401, served.hook(body, "wrong")[1])
    assert served.hook(b"{", token)[0] == 400
    assert served.taints() == []
    # Alertmanager groups several hosts' alerts and never sends again what was refused: an alert
    # naming a node that never reported changes nothing and is named; the others are taken.
    unknown = {**firing, "labels": {"alertname": "Xid", "node": "n2"}}
    both = json.dumps({"version": "4", "status": "firing", "alerts": [unknown, firing]}).encode()
    code, text = served.hook(both, token)
    assert code == 200 and text.startswith("ignored: no node 'n2' has reported") and text.endswith("; tainted n1"), text
    assert served.hook(body, token) == (200, "nothing to change")  # (repeated by Alertmanager: once)
    assert served.taints() == [("n1", "GPU-1", "alert:f1")]
    resolved = json.dumps({"version": "4", "status": "resolved", "alerts": [{**firing, "status": "resolved"}]})
    assert served.hook(resolved.encode(), token) == (200, "untainted n1")
    assert served.taints() == []
    weird = {**firing, "fingerprint": "f2", "annotations": {"summary": "line\n\x1b[31mred"}}
    assert served.hook(json.dumps({"version": "4", "alerts": [weird]}).encode(), token) == (200, "tainted n1")
    assert "alert Xid: line??[31mred" in [t.reason for t in served.stub.Cluster(pb.Empty(), timeout=10).taints]


def test_an_alert_said_twice_in_a_message_is_taken_once_and_the_others_with_it(served: Served) -> None:
    """Alertmanager never sends again a message it got a 4xx for: one whose first alert came
    twice tainted its node, then answered 400 at the second, and the alerts after it were lost."""
    served.stub.Report(report(), timeout=10)
    two = pb.NodeReport(node="n2", agent="127.0.0.1:7401", version=__version__, driver_version="580.1")
    served.stub.Report(two, timeout=10)
    token = served.token.read_text().strip()
    f1 = {"status": "firing", "labels": {"alertname": "Xid", "node": "n1"}, "fingerprint": "f1"}
    f2 = {"status": "firing", "labels": {"alertname": "Xid", "node": "n2"}, "fingerprint": "f2"}
    body = json.dumps({"version": "4", "alerts": [f1, f1, f2]}).encode()
    assert served.hook(body, token) == (200, "tainted n1; tainted n2")
    assert sorted(served.taints()) == [("n1", "", "alert:f1"), ("n2", "", "alert:f2")]
    gone = [{**f, "status": "resolved"} for f in (f1, f1, f2)]
    assert served.hook(json.dumps({"version": "4", "alerts": gone}).encode(), token) == (
        200,
        "untainted n1; untainted n2",
    )
    assert served.taints() == []


def test_what_the_webhook_says_back_of_a_message_is_bounded_and_printable(
    served: Served, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Anyone may call it without the token: each such call is counted, and said at most once a
    second (it was a warning each: hundreds a second from one caller).  What a message holds is
    said back short and printable (a version of a million characters was said back whole; an
    alert's name was said with its newlines and escape sequences, in the answer and the log)."""
    from prometheus_client import REGISTRY

    monkeypatch.setattr(webhook, "UNKNOWN", Hushed(webhook.log))  # (none said in the last second)
    counted = {"plane": "webhook", "reason": "token"}
    before = REGISTRY.get_sample_value("tpagent_refused_total", counted) or 0.0
    for _ in range(50):
        assert served.hook(b"{}", "wrong")[0] == 401
    assert REGISTRY.get_sample_value("tpagent_refused_total", counted) == before + 50
    said = [r for r in caplog.records if "no or a wrong bearer token" in r.getMessage()]
    assert 1 <= len(said) <= 5, len(said)
    token = served.token.read_text().strip()
    code, text = served.hook(json.dumps({"version": "v" * 1_000_000, "alerts": []}).encode(), token)
    assert code == 400 and "is not known" in text and len(text) < 200, len(text)
    odd = {"status": "firing", "labels": {"alertname": "Xid\nFAKE \x1b[2J"}}
    code, text = served.hook(json.dumps({"version": "4", "alerts": [odd]}).encode(), token)
    assert code == 400 and text.startswith("alert 0 (Xid?FAKE ?[2J) names no node"), text
    assert not [r for r in caplog.records if "\x1b" in r.getMessage() or "\nFAKE" in r.getMessage()]


def test_the_webhook_listens_on_an_ipv6_address_too() -> None:
    """(An IPv6 webhook_listen passed the configuration's checks, then could never be served.)"""
    try:
        with socket.socket(socket.AF_INET6) as s:
            s.bind(("::1", 0))
    except OSError as e:
        pytest.skip(f"this node has no IPv6 loopback ({e})")
    hook = webhook.Webhook(("::1", 0), None, "token", None)  # type: ignore[arg-type]
    try:
        assert hook.server_address[0] == "::1" and hook.socket.family == socket.AF_INET6
    finally:
        hook.server_close()


def test_bytes_that_are_not_tls_or_json_this_deep_get_one_line_not_a_traceback_each(
    served: Served, capfd: pytest.CaptureFixture[str], caplog: pytest.LogCaptureFixture
) -> None:
    """60 connections to the webhook send plain HTTP or bytes that are no TLS record: each broke
    in its handler, said in at most a line a second, never socketserver's 27-line traceback on
    stderr (before: 200 of them wrote 5 400 lines); a body nested deeper than the JSON parser
    goes is refused in one sentence, not dropped with a traceback."""
    host, _, port = served.webhook.rpartition(":")
    for i in range(60):
        with socket.create_connection((host, int(port)), timeout=10) as s:
            s.sendall(b"POST /alertmanager HTTP/1.1\r\nHost: x\r\n\r\n" if i % 2 else b"\x16\x03\x01\x00\x05hello")
            with contextlib.suppress(OSError):
                s.recv(100)
    token = served.token.read_text().strip()
    assert served.hook(b"[" * 100_000, token) == (
        400,
        "the message is not JSON this webhook reads: it is nested too deeply.",
    )
    assert "Traceback" not in capfd.readouterr().err
    broke = [r for r in caplog.records if "a webhook connection from 127.0.0.1 broke" in r.getMessage()]
    assert 1 <= len(broke) <= 5, [r.getMessage() for r in broke]


def test_health_findings_taint_silence_is_reported_and_the_metrics_and_events_say_so(tmp_path: Path) -> None:
    """A report's health finding becomes a pre-emptive taint naming the GPU and the reading; an agent
    that stops reporting is marked unreachable (and said so), never moved from; `tpagent events
    --follow` shows each as it happens; the metrics count taints by kind and the spares free."""
    s = Served(tmp_path, unreachable_after=1.0, report_period=0.2, metrics_listen=f"127.0.0.1:{free_port()}")
    try:
        follow = subprocess.Popen(
            [sys.executable, "-m", "cli.main", "events", "--follow"],
            cwd=ROOT,
            env=s.env(),
            stdout=subprocess.PIPE,
            text=True,
        )
        hot = pb.Finding(gpu="GPU-1", what="temperature", reading="88 C, at or over 82 C")
        r = report()
        r.findings.append(hot)
        s.stub.Report(r, timeout=10)
        view = s.stub.Cluster(pb.Empty(), timeout=10)
        assert [(t.node, t.gpu, t.kind, t.source, t.reason) for t in view.taints] == [
            ("n1", "GPU-1", "preemptive", "health:temperature", "88 C, at or over 82 C")
        ]
        s.stub.Report(r, timeout=10)  # (the same finding again: still one taint)
        assert len(s.stub.Cluster(pb.Empty(), timeout=10).taints) == 1
        wait_until(lambda: not s.stub.Cluster(pb.Empty(), timeout=10).nodes[0].reachable, "n1 to be unreachable", 10)

        def scraped() -> str:
            with urllib.request.urlopen(f"http://{s.cfg.metrics_listen}/metrics", timeout=10) as page:
                return page.read().decode()

        # (the gauges are the process's: an orchestrator of an earlier test, still stopping, may set
        # them once more after this one did; this one's next tick sets them again)
        want = ['tpagent_orchestrator_taints{kind="preemptive"} 1.0', "tpagent_orchestrator_spares_free 0.0"]
        wait_until(lambda: all(w in scraped() for w in want), "the metrics to count the taint and no spare", 10)
        seen: list[str] = []
        assert follow.stdout is not None
        for line in follow.stdout:
            seen.append(line)
            if "unreachable" in line:
                break
        assert any("n1 reports" in ln for ln in seen) and any("tainted by its health: 88 C" in ln for ln in seen), seen
        follow.kill()
        follow.wait()
        follow.stdout.close()
    finally:
        s.stop.set()


def test_a_user_without_the_cluster_secret_is_refused(served: Served) -> None:
    """User nobody on the orchestrator's own host: the secret is root's, so the CLI cannot sign."""
    env = {**served.env(), "HOME": "/"}
    proc = subprocess.run(
        [*NOBODY, sys.executable, "-m", "cli.main", "taint", "n1", "--reason", "x"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert_one_sentence_error(proc)
    assert served.taints() == []


def test_the_webhook_is_not_held_by_callers_that_trickle_or_crowd(
    served: Served, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A caller sending its request a byte at a time is cut off at the request's deadline; a
    crowd of CONNECTIONS_MAX callers that hold their places without a word does not keep
    Alertmanager's message out while they hold them (before: it was closed at once)."""
    monkeypatch.setattr(webhook, "REQUEST_WITHIN", 1.0)
    host, _, port = served.webhook.rpartition(":")
    tls = ssl.create_default_context(cafile=str(served.cfg.tls_dir / "ca.crt"))

    def connect() -> ssl.SSLSocket:
        return tls.wrap_socket(socket.create_connection((host, int(port)), timeout=10), server_hostname=host)

    slow = connect()
    with pytest.raises(OSError):  # (the server shuts the connection: a send fails, or a read sees its end)
        for byte in b"POST /alertmanager HTTP/1.1\r\nHost: x\r\nX-Trickle: " + b"x" * 100:  # (28 s at its pace)
            slow.sendall(bytes([byte]))
            time.sleep(0.2)
        pytest.fail("a caller trickling its request was never cut")
    slow.close()
    monkeypatch.setattr(webhook, "REQUEST_WITHIN", 600.0)  # (the crowd holds its places all through)
    crowd = [connect() for _ in range(webhook.CONNECTIONS_MAX)]
    served.stub.Report(report(), timeout=10)
    alert = {"status": "firing", "labels": {"alertname": "Xid", "node": "n1"}, "fingerprint": "f9"}
    body = json.dumps({"version": "4", "alerts": [alert]}).encode()
    try:
        assert served.hook(body, served.token.read_text().strip()) == (200, "tainted n1")
    finally:
        for s in crowd:
            s.close()


@pytest.mark.parametrize("setting", ["listen", "health_listen", "metrics_listen", "webhook_listen"])
def test_a_port_taken_is_said_with_the_setting_that_names_it(tmp_path: Path, setting: str) -> None:
    """(A metrics port another process held was "[Errno 98] Address already in use", naming nothing;
    one of gRPC's printed gRPC's own log line first.)"""
    secret = tmp_path / "secret"
    secret.write_text(os.urandom(24).hex())
    secret.chmod(0o600)
    token = tmp_path / "token"
    token.write_text(os.urandom(16).hex())
    token.chmod(0o600)
    with socket.create_server(("127.0.0.1", 0)) as taken:
        port = taken.getsockname()[1]
        settings = {"listen": f"127.0.0.1:{free_port()}", "metrics_listen": "", setting: f"127.0.0.1:{port}"}
        config = tmp_path / "o.toml"
        config.write_text(
            "".join(f'{name} = "{value}"\n' for name, value in settings.items())
            + f'node = "orchestrator"\nsecret_file = "{secret}"\n'
            f'tls_dir = "{node_certs(tmp_path, "orchestrator")}"\nstate = "{tmp_path / "db" / "state.db"}"\n'
            f'webhook_token_file = "{token}"\n'
        )
        said = subprocess.run(
            [sys.executable, "-m", "cli.main", "orchestrator", "--config", str(config)],
            cwd=ROOT, capture_output=True, text=True, timeout=60,
        )  # fmt: skip
    if setting in ("listen", "health_listen"):
        what = "listen" if setting == "listen" else "serve health checks"
        assert_one_sentence_error(said, f"cannot {what} on 127.0.0.1:{port}; is another orchestrator running there?")
    else:
        assert_one_sentence_error(said, f"127.0.0.1:{port} ({setting}): Address already in use")
    assert said.returncode == 2 and said.stderr.count("\n") == 1, said.stderr


def test_an_empty_file_of_another_users_is_no_database_of_root(tmp_path: Path) -> None:
    """--state naming another user's empty file made it root's alone (0600)."""
    theirs = tmp_path / "state.db"
    theirs.touch(0o644)
    os.chown(theirs, *users.NOBODY)
    with pytest.raises(UsageError, match=f"{theirs} is a file of UID {users.NOBODY[0]}'s; give a new path"):
        State(theirs)
    st = theirs.stat()
    assert (st.st_uid, st.st_mode & 0o777, st.st_size) == (users.NOBODY[0], 0o644, 0)
