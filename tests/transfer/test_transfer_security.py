"""The transfer layer against its attackers: mutual TLS (a certificate of another CA, a
receiver that is not the one dialled, plaintext on the wire), strangers that hold connections
without finishing a handshake (run as user nobody: a real unprivileged peer), a control stream
that breaks, and what a UCX stranger may send before it has authenticated."""

from __future__ import annotations

import contextlib
import logging
import shutil
import socket
import subprocess
import sys
import threading
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest
from test_transfer import _target, trickle

from host.api import UsageError
from support.certs import node_certs
from support.helpers import wait_until
from support.proxy import Proxy
from support.transfer_support import SECRET, Receiving, _send, digests, make_snapshot
from transfer.api import AuthError, TlsFiles, TransferConfig, TransferError, TransferStats, Transport
from transfer.sender import Sender
from transfer.tcp import TcpTransport

TRICKLE = Path(__file__).resolve().parent.parent / "attackers" / "trickle_peer.py"


@pytest.fixture(scope="module")
def certs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, TlsFiles]:
    """Two nodes of the cluster CA, and one of another CA (same names: only the CA differs)."""
    cluster = tmp_path_factory.mktemp("cluster-ca")
    other = tmp_path_factory.mktemp("other-ca")
    return {
        "sender": TlsFiles.in_dir(node_certs(cluster, "sender")),
        "receiver": TlsFiles.in_dir(node_certs(cluster, "receiver")),
        "foreign": TlsFiles.in_dir(node_certs(other, "sender")),
    }


def _nothing_kept(tmp_path: Path) -> bool:
    return not (tmp_path / "dst").exists() and not list(tmp_path.glob(".dst.partial-*"))


# --- mutual TLS ---------------------------------------------------------------------------


@pytest.mark.parametrize("tls", [False, True], ids=["tcp", "tcp+tls"])
def test_tls_leaves_no_plaintext_on_the_wire(tmp_path: Path, certs: dict[str, TlsFiles], tls: bool) -> None:
    """Through a recording proxy: with TLS neither the stream's magic nor the snapshot's bytes
    cross the wire in clear (and without it they do: the check can see them)."""
    src = make_snapshot(tmp_path / "src", "random", 2)
    rx = Receiving(TcpTransport(tls=certs["receiver"] if tls else None), tmp_path / "dst")
    proxy = Proxy(_target(rx))
    try:
        _send(TcpTransport(tls=certs["sender"] if tls else None), src, proxy.address, streams=2)
        assert isinstance(rx.join(), TransferStats)
        assert digests(tmp_path / "dst") == digests(src)
        wait_until(lambda: len(proxy.recorded) >= 3, "the proxy to see its connections end")
    finally:
        proxy.close()
    wire = b"".join(proxy.recorded)
    sample = (src / "images" / "pages-1.img").read_bytes()[1 << 20 : (1 << 20) + 64]
    assert (b"TPXFER01" in wire and sample in wire) is not tls
    assert (b"TPXFER01" not in wire and sample not in wire) is tls


def test_sender_with_a_certificate_of_another_ca_is_refused(tmp_path: Path, certs: dict[str, TlsFiles]) -> None:
    """It trusts the cluster CA (so it accepts the receiver), but its own certificate is of another."""
    src = make_snapshot(tmp_path / "src", "model", 1)
    rx = Receiving(TcpTransport(tls=certs["receiver"]), tmp_path / "dst", timeout=3)
    foreign = TlsFiles(certs["sender"].ca, certs["foreign"].cert, certs["foreign"].key)
    with pytest.raises(AuthError, match="refused this node's TLS certificate"):
        _send(TcpTransport(tls=foreign), src, rx.receiver.address)
    assert isinstance(rx.join(), TransferError)
    assert _nothing_kept(tmp_path)
    assert rx.refused == ["tls_failed"]  # once: an AuthError is not retried


def test_receiver_with_a_certificate_of_another_ca_is_refused_by_the_sender(
    tmp_path: Path, certs: dict[str, TlsFiles]
) -> None:
    src = make_snapshot(tmp_path / "src", "model", 1)
    rx = Receiving(TcpTransport(tls=certs["foreign"]), tmp_path / "dst", timeout=3)
    with pytest.raises(AuthError, match="receiver's certificate is not signed by the cluster CA"):
        _send(TcpTransport(tls=certs["sender"]), src, rx.receiver.address)
    assert isinstance(rx.join(), TransferError)
    assert _nothing_kept(tmp_path)


def test_receiver_must_be_named_by_its_certificate(tmp_path: Path, certs: dict[str, TlsFiles]) -> None:
    """The sender checks the address it dialled: 127.0.0.3 is not in the receiver's
    certificate (its name, localhost and 127.0.0.1 are), so the same receiver is refused
    there and accepted under a name it has."""
    src = make_snapshot(tmp_path / "src", "model", 1)
    rx = Receiving(TcpTransport(tls=certs["receiver"]), tmp_path / "dst", timeout=3, listen="127.0.0.3:0")
    with pytest.raises(AuthError, match="does not name 127.0.0.3"):
        _send(TcpTransport(tls=certs["sender"]), src, rx.receiver.address)
    assert isinstance(rx.join(), TransferError) and _nothing_kept(tmp_path)

    rx = Receiving(TcpTransport(tls=certs["receiver"]), tmp_path / "dst2")
    _send(TcpTransport(tls=certs["sender"]), src, f"localhost:{_target(rx)[1]:d}")
    assert isinstance(rx.join(), TransferStats)
    assert digests(tmp_path / "dst2") == digests(src)


def test_tls_and_plain_ends_do_not_mix(tmp_path: Path, certs: dict[str, TlsFiles]) -> None:
    src = make_snapshot(tmp_path / "src", "model", 1)
    rx = Receiving(TcpTransport(), tmp_path / "dst", timeout=3)
    with pytest.raises(AuthError, match="does not answer in TLS"):
        _send(TcpTransport(tls=certs["sender"]), src, rx.receiver.address)
    assert isinstance(rx.join(), TransferError) and _nothing_kept(tmp_path)

    rx = Receiving(TcpTransport(tls=certs["receiver"]), tmp_path / "dst", timeout=5)
    with pytest.raises(TransferError):
        _send(TcpTransport(), src, rx.receiver.address, retries=1)
    assert isinstance(rx.join(), TransferError) and _nothing_kept(tmp_path)
    assert set(rx.refused) == {"tls_failed"}


def test_a_private_key_others_can_read_is_refused(tmp_path: Path, certs: dict[str, TlsFiles]) -> None:
    node = tmp_path / "node"
    shutil.copytree(certs["sender"].key.parent, node)
    (node / "tls.key").chmod(0o644)
    with pytest.raises(UsageError, match="mode 600"):
        TcpTransport(tls=TlsFiles.in_dir(node))
    (node / "tls.key").chmod(0o600)
    assert TcpTransport(tls=TlsFiles.in_dir(node)).name == "tcp"


def test_the_secret_is_not_in_the_config_repr() -> None:
    assert "x" * 16 not in repr(TransferConfig(secret=b"x" * 16))


# --- strangers that never finish a handshake -------------------------------------------------


@pytest.fixture
def strangers() -> Iterator[list[subprocess.Popen[str]]]:
    started: list[subprocess.Popen[str]] = []
    yield started
    for p in started:
        if p.stdin is not None:
            p.stdin.close()  # it ends when its stdin closes
        try:
            p.wait(10)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()
        if p.stdout is not None:
            p.stdout.close()


def _trickle(
    started: list[subprocess.Popen[str]], address: tuple[str, int], per_source: int, sources: list[str]
) -> None:
    """tests/attackers/trickle_peer.py, as user nobody: connections that trickle a byte every 0.5 s."""
    cmd = [
        "setpriv",
        "--reuid=nobody",
        "--regid=nogroup",
        "--clear-groups",
        "--",
        sys.executable,
        "-I",
        "-S",
        str(TRICKLE),
        address[0],
        str(address[1]),
        "0.5",
        str(per_source),
        *sources,
    ]
    p = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    started.append(p)
    assert p.stdout is not None and p.stdout.readline() == "ready\n"
    assert psutil.Process(p.pid).uids().real == 65534  # nobody: a real unprivileged peer


def test_a_stranger_that_never_finishes_tls_is_cut_off(
    tmp_path: Path, certs: dict[str, TlsFiles], monkeypatch: pytest.MonkeyPatch
) -> None:
    """It starts a TLS record and trickles its body, a byte well inside each read's timeout:
    the handshake deadline (1 s here) still closes it, and a real sender gets through."""

    from transfer import receiver

    monkeypatch.setattr(receiver, "HANDSHAKE_TIMEOUT", 1.0)
    src = make_snapshot(tmp_path / "src", "model", 1)
    rx = Receiving(TcpTransport(tls=certs["receiver"]), tmp_path / "dst")
    # A TLS handshake record of 16 KiB whose body comes a byte at a time.
    assert trickle(rx, b"\x16\x03\x01\x40\x00", b"\0") < 20, (
        "the receiver kept a stranger's unfinished TLS handshake open"
    )
    _send(TcpTransport(tls=certs["sender"]), src, rx.receiver.address)
    assert isinstance(rx.join(), TransferStats)
    assert digests(tmp_path / "dst") == digests(src)
    assert rx.refused == ["handshake_timeout"]


def test_a_stranger_whose_handshake_times_out_as_its_deadline_passes_is_refused_once(
    tmp_path: Path, certs: dict[str, TlsFiles], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two deadlines can end a stranger's handshake: its reads' (io_timeout) and the gate's
    (HANDSHAKE_TIMEOUT), which the receiver's loop sweeps.  Here the read's comes first (0.5 s)
    and the receiver is slow to let the connection go (its callback takes 2 s, as a thread may
    on a busy machine) while the gate's passes (1.5 s): one connection, one refusal, one reason
    (CI once counted ['handshake_timeout', 'handshake_timeout'] for one stranger)."""
    from transfer import receiver

    monkeypatch.setattr(receiver, "HANDSHAKE_TIMEOUT", 1.5)
    calls: list[str] = []

    def slow(reason: str) -> None:
        calls.append(reason)
        if len(calls) == 1:  # (the first: in the connection's own thread, which then lets it go)
            time.sleep(2.0)

    rx = Receiving(TcpTransport(tls=certs["receiver"]), tmp_path / "dst", timeout=4, io_timeout=0.5, on_refused=slow)
    with socket.create_connection(_target(rx)) as s:
        s.sendall(b"\x16\x03\x01\x40\x00")  # a TLS handshake record of 16 KiB whose body never comes
        s.settimeout(30)
        with contextlib.suppress(OSError):
            while s.recv(4096):  # until the receiver closes it
                pass
    assert isinstance(rx.join(), TransferError)  # (no sender came)
    assert rx.refused == ["handshake_timeout"]


def _held(port: int) -> tuple[int, int]:
    """The receiver's connections, as the kernel sees them in one look: from the strangers'
    hosts (127.0.0.2 and up), and from the sender's (127.0.0.1)."""
    peers = [
        c.raddr.ip
        for c in psutil.net_connections("tcp")
        if c.laddr and c.laddr.port == port and c.raddr and c.status == psutil.CONN_ESTABLISHED
    ]
    return sum(ip != "127.0.0.1" for ip in peers), sum(ip == "127.0.0.1" for ip in peers)


@pytest.mark.parametrize("tls", [False, True], ids=["tcp", "tcp+tls"])
def test_strangers_that_trickle_do_not_stall_a_real_sender(
    tmp_path: Path, certs: dict[str, TlsFiles], strangers: list[subprocess.Popen[str]], tls: bool
) -> None:
    """180 connections from eleven other hosts (loopback addresses), each stuck in its TLS or
    HMAC handshake and opened again when closed: more than the receiver's 128 places for
    strangers, and one host more than its 16.  A real sender still gets through while they
    are held: its handshakes take milliseconds, so it evicts the oldest strangers, never the
    other way round."""
    src = make_snapshot(tmp_path / "src", "random", 64)
    rx = Receiving(TcpTransport(tls=certs["receiver"] if tls else None), tmp_path / "dst", timeout=120)
    target = _target(rx)
    _trickle(strangers, target, 15, [f"127.0.0.{i}" for i in range(2, 12)] + ["127.0.0.12"] * 2)
    counts = lambda: Counter(rx.refused)  # noqa: E731
    wait_until(
        lambda: counts()["evicted"] >= 38 and counts()["per_peer_limit"] >= 14,
        "the receiver to evict strangers and refuse the greedy host",
    )
    assert _held(target[1])[0] >= 100  # they hold their places...
    # ...and still do while the sender's connections are in: the kernel's table, looked at
    # over and over during the send.  (Not after it: a receiver that has its snapshot closes
    # every connection.)
    looks: list[tuple[int, int]] = []
    failed: list[BaseException] = []
    done = threading.Event()

    def look() -> None:
        try:
            while not done.wait(0.02):
                looks.append(_held(target[1]))
        except BaseException as e:  # (raised below, not lost in the thread)
            failed.append(e)

    looking = threading.Thread(target=look, daemon=True)
    looking.start()
    try:
        stats = _send(TcpTransport(tls=certs["sender"] if tls else None), src, rx.receiver.address, streams=4)
    finally:
        done.set()
        looking.join()
    if failed:
        raise failed[0]
    both = [strangers for strangers, senders in looks if senders >= 1]
    assert both, f"no look at the kernel's table saw the sender's connections ({len(looks)} looks)"
    assert max(both) >= 100, f"at most {max(both)} strangers held places while the sender's connections were in"
    assert isinstance(rx.join(), TransferStats)
    assert digests(tmp_path / "dst") == digests(src)
    assert stats.bytes_raw == sum(p.stat().st_size for p in src.rglob("*") if p.is_file())
    assert set(counts()) <= {"evicted", "per_peer_limit", "handshake_timeout"}  # nothing of the sender's


def test_strangers_on_the_senders_own_host_do_not_keep_it_out(
    tmp_path: Path, certs: dict[str, TlsFiles], strangers: list[subprocess.Popen[str]]
) -> None:
    """A local user on the sending node holds 30 connections from the node's own address, over
    its bound of 16: a newcomer from that host evicts the host's oldest stranger rather than
    being refused, so the sender's own connections still get through."""
    src = make_snapshot(tmp_path / "src", "random", 8)
    rx = Receiving(TcpTransport(tls=certs["receiver"]), tmp_path / "dst", timeout=120)
    _trickle(strangers, _target(rx), 30, ["127.0.0.1"])
    wait_until(lambda: Counter(rx.refused)["per_peer_limit"] >= 14, "the receiver to bound the host's strangers")
    _send(TcpTransport(tls=certs["sender"]), src, rx.receiver.address, streams=4)
    assert isinstance(rx.join(), TransferStats)
    assert digests(tmp_path / "dst") == digests(src)


# --- a control stream that breaks ------------------------------------------------------------


class CuttableProxy(Proxy):
    """The fault tests' proxy, able to cut one of its connections when the test says."""

    def __post_init__(self) -> None:
        self.pipes: list[tuple[socket.socket, socket.socket]] = []
        super().__post_init__()

    def _pipe(self, src: socket.socket, dst: socket.socket, harm: bool, record: bool) -> None:
        if record:  # the client->server pipe of each connection, in connection order (the control
            self.pipes.append((src, dst))  # stream's is first: data streams open after its HAVE)
        super()._pipe(src, dst, harm, record)

    def cut(self, n: int) -> None:
        for s in self.pipes[n]:
            with contextlib.suppress(OSError):
                s.shutdown(socket.SHUT_RDWR)


def _transport(certs: dict[str, TlsFiles], tls: bool, end: str) -> Transport:
    return TcpTransport(tls=certs[end] if tls else None)


@pytest.mark.parametrize("tls", [False, True], ids=["tcp", "tcp+tls"])
def test_control_stream_cut_mid_transfer_is_opened_again(tmp_path: Path, certs: dict[str, TlsFiles], tls: bool) -> None:
    src = make_snapshot(tmp_path / "src", "random", 24)
    rx = Receiving(_transport(certs, tls, "receiver"), tmp_path / "dst")
    proxy = CuttableProxy(_target(rx))
    at_cut: list[tuple[int, int]] = []

    def progress(acked: int, wire_bytes: int, total: int) -> None:
        if acked >= 6 << 20 and not at_cut:
            at_cut.append((acked, total))
            proxy.cut(0)

    config = TransferConfig(secret=SECRET, chunk_size=1 << 20, io_timeout=10, streams=2, window=2)
    try:
        stats = Sender(_transport(certs, tls, "sender"), config, progress).send(src, proxy.address)
    finally:
        proxy.close()
    assert isinstance(rx.join(), TransferStats)
    assert digests(tmp_path / "dst") == digests(src)
    assert at_cut and at_cut[0][0] < at_cut[0][1]  # cut while chunks were still to come
    assert proxy.connections >= 4  # control, two data streams, control again
    assert stats.bytes_wire < 1.3 * stats.bytes_raw  # the data streams went on: nothing sent over


def test_control_stream_cut_in_its_handshake_is_tried_again(tmp_path: Path) -> None:
    src = make_snapshot(tmp_path / "src", "model", 4)
    rx = Receiving(TcpTransport(), tmp_path / "dst")
    proxy = Proxy(_target(rx), cut_at=20, on=0)  # the control stream's HELLO, cut short
    try:
        _send(TcpTransport(), src, proxy.address, streams=2)
    finally:
        proxy.close()
    assert isinstance(rx.join(), TransferStats)
    assert digests(tmp_path / "dst") == digests(src)
    assert rx.refused == ["handshake_failed"]  # the cut connection; the second one got through


def test_control_stream_that_never_comes_back_is_given_up(tmp_path: Path) -> None:
    """The path dies for good just after the control stream was cut: the sender fails in one
    sentence, and the receiver, after its grace period (as long as a sender of its settings goes
    on reconnecting: 2 s of silence and one retry, 5 s here), keeps nothing."""
    src = make_snapshot(tmp_path / "src", "random", 24)
    rx = Receiving(TcpTransport(), tmp_path / "dst", io_timeout=2, retries=1, connect_timeout=1)
    proxy = CuttableProxy(_target(rx))

    def progress(acked: int, wire_bytes: int, total: int) -> None:
        if acked >= 4 << 20 and not proxy.dead:
            proxy.dead = True  # new connections are refused from now on
            proxy.cut(0)

    config = TransferConfig(secret=SECRET, chunk_size=1 << 20, io_timeout=10, streams=1, window=2, retries=2)
    try:
        with pytest.raises(TransferError, match="control stream"):
            Sender(TcpTransport(), config, progress).send(src, proxy.address)
    finally:
        proxy.close()
    result = rx.join()
    assert isinstance(result, TransferError) and "did not come back within 5 s" in str(result)
    assert _nothing_kept(tmp_path)


@pytest.mark.timeout(120)
def test_a_port_that_takes_the_connection_and_says_nothing_is_given_up_on_its_connect_timeout(
    tmp_path: Path,
) -> None:
    """No receiver, only a listener that never speaks: each try waits out the connect timeout
    for the handshake, not the streams' silence of io_timeout (here 10 minutes: before, this
    send took 20 minutes; with the CLI's defaults, 6), and the sentence says what was there."""
    src = make_snapshot(tmp_path / "src", "random", 2)
    silent = socket.create_server(("127.0.0.1", 0))
    held: list[socket.socket] = []

    def accept() -> None:
        with contextlib.suppress(OSError):  # (closed at the end)
            while True:
                held.append(silent.accept()[0])

    threading.Thread(target=accept, daemon=True).start()
    config = TransferConfig(secret=SECRET, io_timeout=600, connect_timeout=1, retries=2)
    try:
        with pytest.raises(TransferError, match="took the connection but not tpagent's handshake"):
            Sender(TcpTransport(), config).send(src, f"127.0.0.1:{silent.getsockname()[1]}")
    finally:
        silent.close()
        for s in held:
            s.close()
    assert len(held) == 3  # (the first try, and its two retries)


# --- UCX before authentication ---------------------------------------------------------------


def test_ucx_stranger_cannot_send_a_large_message_before_authenticating(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A UCX peer whose first message announces 64 MiB is refused on the length alone (the
    receiver allocates nothing for it); a real sender, whose messages grow only after the
    handshake, gets through afterwards."""
    ucx = pytest.importorskip("transfer.ucx")
    transport = ucx.UcxTransport()
    src = make_snapshot(tmp_path / "src", "random", 3)
    rx = Receiving(transport, tmp_path / "dst")
    stranger = transport.connect(rx.receiver.address, 10)
    stranger.set_timeout(2)
    sent: list[BaseException] = []

    def send_big() -> None:
        try:
            stranger.send(bytes(64 << 20))
        except TransferError as e:  # the receiver never takes the payload
            sent.append(e)

    with caplog.at_level(logging.WARNING):
        t = threading.Thread(target=send_big)
        t.start()
        wait_until(lambda: rx.refused, "the receiver to refuse the stranger")
        t.join(30)
    stranger.close()
    assert rx.refused == ["handshake_failed"]
    assert any("over the limit of 4096" in r.getMessage() for r in caplog.records)
    _send(transport, src, rx.receiver.address)
    assert isinstance(rx.join(), TransferStats)
    assert digests(tmp_path / "dst") == digests(src)
