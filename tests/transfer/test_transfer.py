"""The transfer contract, run against every transport (TCP, TCP in mutual TLS, UCX): data
arrives byte-identical, and each fault (a flipped byte, a cut connection, a dead path, a wrong
secret, a replay) is caught.  TLS itself and attacks on the receiver: test_transfer_security.py."""

from __future__ import annotations

import json
import logging
import os
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from host.api import UsageError
from snapshot.manifest import checksum_files, load
from support.certs import node_certs
from support.helpers import ROOT
from support.proxy import Proxy
from support.transfer_support import SECRET, Receiving, _send, digests, make_snapshot
from transfer.api import (
    AuthError,
    Channel,
    Compress,
    IntegrityError,
    Listener,
    TlsFiles,
    TransferConfig,
    TransferError,
    TransferStats,
    Transport,
)
from transfer.receiver import Receiver
from transfer.sender import Sender
from transfer.tcp import TcpTransport
from transfer.ucx import UcxTransport

os.environ.setdefault("UCX_TLS", "tcp")  # no RDMA hardware here: UCX's own TCP transport
TRANSPORTS = ["tcp", "tcp+tls", "ucx"]


@pytest.fixture(scope="module")
def tls_files(tmp_path_factory: pytest.TempPathFactory) -> TlsFiles:
    """One node's certificate, used by both ends (they share the CA, which is what counts)."""
    return TlsFiles.in_dir(node_certs(tmp_path_factory.mktemp("tls"), "node"))


@pytest.fixture(params=TRANSPORTS)
def transport(request: pytest.FixtureRequest) -> Transport:
    if request.param == "tcp+tls":
        return TcpTransport(tls=request.getfixturevalue("tls_files"))
    return UcxTransport() if request.param == "ucx" else TcpTransport()


@pytest.fixture
def tcp() -> Transport:
    """Faults are injected by a TCP proxy, which UCX's own connections would bypass."""
    return TcpTransport()


@pytest.mark.parametrize("kind", ["model", "random"])
@pytest.mark.parametrize("mib", [0.3, 9.5])
@pytest.mark.parametrize("compress", list(Compress))
def test_arrives_byte_identical(
    transport: Transport, tmp_path: Path, kind: str, mib: float, compress: Compress
) -> None:
    src = make_snapshot(tmp_path / "src", kind, mib)
    rx = Receiving(transport, tmp_path / "dst")
    stats = _send(transport, src, rx.receiver.address, compress=compress, streams=3)
    assert isinstance(rx.join(), TransferStats)
    assert digests(tmp_path / "dst") == digests(src)
    if compress is Compress.ZSTD and kind == "model":
        assert stats.bytes_wire < 0.9 * stats.bytes_raw  # zero regions and bf16 weights shrink
    if kind == "model" and mib > 4:
        assert stats.bytes_wire < 0.85 * stats.bytes_raw  # whole zero chunks cost nothing, in every mode
    if kind == "random":
        assert stats.bytes_wire <= stats.bytes_raw + 64 * stats.chunks  # incompressible chunks go raw: never larger


@pytest.mark.parametrize(
    ("chunk_mib", "digest"),
    [(1, "blake3"), (8, "blake3"), (8, "sha256")],
    ids=["crc32-chunks", "manifest-blake3-chunks", "manifest-sha256-chunks"],
)
def test_flipped_byte_is_caught_and_fetched_again(
    tcp: Transport, make_proxy: Callable[..., Proxy], tmp_path: Path, chunk_mib: int, digest: str
) -> None:
    """Chunks of the manifest's size are checked against its digests (BLAKE3, or SHA-256 for a
    snapshot of the first format), others by CRC-32."""
    src = make_snapshot(tmp_path / "src", "random", 6, digest=digest)
    rx = Receiving(tcp, tmp_path / "dst")
    proxy = make_proxy(_target(rx), flip_at=3 << 20, on=1)  # one data stream: it carries every chunk
    stats = _send(tcp, src, proxy.address, compress=Compress.NONE, streams=1, chunk_size=chunk_mib << 20)
    assert isinstance(rx.join(), TransferStats)
    assert digests(tmp_path / "dst") == digests(src)
    assert stats.bytes_wire > stats.bytes_raw + (chunk_mib << 20) // 2  # the damaged chunk went twice


def test_cut_connection_resumes_where_it_stood(
    tcp: Transport, make_proxy: Callable[..., Proxy], tmp_path: Path
) -> None:
    src = make_snapshot(tmp_path / "src", "random", 12)
    rx = Receiving(tcp, tmp_path / "dst")
    proxy = make_proxy(_target(rx), cut_at=5 << 20, on=1)
    stats = _send(tcp, src, proxy.address, compress=Compress.NONE, streams=1, window=2)
    assert isinstance(rx.join(), TransferStats)
    assert digests(tmp_path / "dst") == digests(src)
    assert proxy.connections >= 3  # control, the cut stream, its reconnection
    assert stats.bytes_wire < 1.3 * stats.bytes_raw  # resumed, not started over


def test_dead_path_fails_cleanly_and_keeps_nothing(
    tcp: Transport, make_proxy: Callable[..., Proxy], tmp_path: Path
) -> None:
    src = make_snapshot(tmp_path / "src", "random", 8)
    rx = Receiving(tcp, tmp_path / "dst", timeout=15)
    proxy = make_proxy(_target(rx), cut_at=2 << 20, on=1, dead_after_cut=True)
    with pytest.raises(TransferError, match="failed"):
        _send(tcp, src, proxy.address, compress=Compress.NONE, streams=1, retries=2)
    proxy.close()
    result = rx.join()
    assert isinstance(result, TransferError)  # the stream ended before its trailer
    assert not (tmp_path / "dst").exists()
    assert not list(tmp_path.glob(".dst.partial-*"))


class Harm(Transport):
    """The sender's side of a real transport, harming the first data stream's bytes once: a
    byte flipped (``flip_at``) or the connection dropped (``cut_at``), counted from its first
    byte.  The proxy does this for TCP; UCX picks its own connections, so here it is done
    inside the sending process, on the same real UCX connections."""

    def __init__(self, inner: Transport, flip_at: int | None = None, cut_at: int | None = None) -> None:
        self.inner = inner
        self.flip_at = flip_at
        self.cut_at = cut_at
        self.name = inner.name
        self.connects = 0
        self.harmed = False

    def listen(self, address: str) -> Listener:
        return self.inner.listen(address)

    def connect(self, address: str, timeout: float) -> Channel:
        ch = self.inner.connect(address, timeout)
        self.connects += 1
        return _HarmedChannel(ch, self) if self.connects == 2 else ch  # 1 is the control stream


class _HarmedChannel(Channel):
    def __init__(self, ch: Channel, harm: Harm) -> None:
        self.ch = ch
        self.harm = harm
        self.sent = 0

    def send(self, *parts: bytes | memoryview) -> None:
        data = bytearray(b"".join(parts))
        h = self.harm
        if not h.harmed and h.flip_at is not None and self.sent <= h.flip_at < self.sent + len(data):
            data[h.flip_at - self.sent] ^= 0xFF
            h.harmed = True
        if not h.harmed and h.cut_at is not None and self.sent + len(data) > h.cut_at:
            h.harmed = True
            self.ch.close()
            raise TransferError("connection cut (injected)")
        self.sent += len(data)
        self.ch.send(data)

    def recv_exact(self, n: int) -> bytes | bytearray:
        return self.ch.recv_exact(n)

    def set_timeout(self, seconds: float | None) -> None:
        self.ch.set_timeout(seconds)

    def authenticated(self) -> None:
        self.ch.authenticated()

    def interrupt(self) -> None:
        self.ch.interrupt()

    def close(self) -> None:
        self.ch.close()


@pytest.mark.parametrize("fault", ["flip", "cut"])
def test_faults_on_every_transport(transport: Transport, tmp_path: Path, fault: str) -> None:
    """A flipped byte is caught and the chunk fetched again; a dropped stream reconnects and
    goes on from the last acknowledged chunk.  On TCP and on UCX alike."""
    src = make_snapshot(tmp_path / "src", "random", 20)
    rx = Receiving(transport, tmp_path / "dst")
    harm = Harm(
        transport, flip_at=(3 << 20) if fault == "flip" else None, cut_at=(10 << 20) if fault == "cut" else None
    )
    stats = _send(harm, src, rx.receiver.address, compress=Compress.NONE, streams=1, window=2, chunk_size=8 << 20)
    assert isinstance(rx.join(), TransferStats)
    assert harm.harmed and digests(tmp_path / "dst") == digests(src)
    assert stats.bytes_wire < 1.6 * stats.bytes_raw  # one chunk again, not the whole snapshot
    if fault == "cut":
        assert harm.connects >= 3  # control, the cut stream, its reconnection


def test_wrong_secret_is_refused_and_logged(
    transport: Transport, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    src = make_snapshot(tmp_path / "src", "model", 1)
    rx = Receiving(transport, tmp_path / "dst", timeout=3)
    with caplog.at_level(logging.WARNING), pytest.raises(AuthError, match="cluster secret"):
        _send(transport, src, rx.receiver.address, secret=b"not-the-cluster-secret-at-all")
    assert isinstance(rx.join(), TransferError)
    assert not (tmp_path / "dst").exists()
    assert any("refused a stream" in r.getMessage() for r in caplog.records)
    assert rx.refused == ["auth_failed"]  # what the agent's metrics count


def test_replayed_connection_is_refused(tcp: Transport, make_proxy: Callable[..., Proxy], tmp_path: Path) -> None:
    """Bytes recorded from a genuine sender, played again: the receiver's fresh nonce defeats them."""
    src = make_snapshot(tmp_path / "src", "model", 1)
    rx = Receiving(tcp, tmp_path / "dst")
    proxy = make_proxy(_target(rx))
    _send(tcp, src, proxy.address, streams=1)
    assert isinstance(rx.join(), TransferStats)
    recorded = proxy.recorded[0]

    rx2 = Receiving(tcp, tmp_path / "dst2", timeout=3)
    host, port = _target(rx2)
    with socket.create_connection((host, port)) as s:
        s.sendall(recorded)
        reply = b"".join(iter(lambda: s.recv(4096), b""))
    assert b"authentication failed" in reply
    assert isinstance(rx2.join(), TransferError)
    assert not (tmp_path / "dst2").exists()


def test_a_trickling_stranger_is_cut_off(tcp: Transport, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """One byte at a time, each well inside the per-read timeout: the handshake's own deadline
    (1 s here) still closes the connection, and a real sender gets through afterwards."""

    from transfer import receiver

    monkeypatch.setattr(receiver, "HANDSHAKE_TIMEOUT", 1.0)
    src = make_snapshot(tmp_path / "src", "model", 1)
    rx = Receiving(tcp, tmp_path / "dst")
    assert trickle(rx, b"", b"T") < 20, "the receiver kept a trickling stranger's connection open"
    _send(tcp, src, rx.receiver.address)
    assert isinstance(rx.join(), TransferStats)
    assert digests(tmp_path / "dst") == digests(src)
    assert rx.refused == ["handshake_timeout"]


def test_receiver_refuses_a_non_empty_output(transport: Transport, tmp_path: Path) -> None:
    (tmp_path / "dst").mkdir()
    (tmp_path / "dst" / "keep").write_text("x")
    receiver = Receiver(transport, TransferConfig(secret=SECRET), "127.0.0.1:0")
    try:
        with pytest.raises(UsageError, match="not empty"):  # (the request as given: exit 2)
            receiver.receive(tmp_path / "dst", 1)
        with pytest.raises(UsageError, match=r"above 0 \(at most 2e\+06\), not nan"):
            receiver.receive(tmp_path / "new", float("nan"))
    finally:
        receiver.close()


def _target(rx: Receiving) -> tuple[str, int]:
    host, port = rx.receiver.address.rsplit(":", 1)
    return host, int(port)


def trickle(rx: Receiving, first: bytes, byte: bytes) -> int:
    """A stranger: sends ``first``, then ``byte`` every 0.3 s, up to 100 times (far beyond the
    1 s the receiver allows here) or until it is cut off; how many it got to send."""
    sent = 0
    with socket.create_connection(_target(rx)) as s:
        try:
            s.sendall(first)
            for _ in range(100):
                s.sendall(byte)
                sent += 1
                time.sleep(0.3)
        except OSError:
            pass
    return sent


@pytest.fixture
def make_proxy() -> Iterator[Callable[..., Proxy]]:
    made: list[Proxy] = []

    def make(*args: Any, **kwargs: Any) -> Proxy:
        made.append(Proxy(*args, **kwargs))
        return made[-1]

    yield make
    for p in made:
        p.close()


@pytest.mark.parametrize("chunk_mib", [1, 3])  # 3 MiB does not divide the manifest's 64 MiB: verified at the end
def test_snapshot_that_fails_verification_is_never_handed_over(
    transport: Transport, tmp_path: Path, chunk_mib: int
) -> None:
    """Every chunk arrives intact (CRCs match), but the source image was altered after its
    manifest was written: the receiver's SHA-256 check refuses the whole snapshot."""
    src = make_snapshot(tmp_path / "src", "random", 5)
    with open(src / "images" / "pages-1.img", "r+b") as f:
        f.seek(4 << 20)
        b = f.read(1)
        f.seek(4 << 20)
        f.write(bytes([b[0] ^ 1]))
    rx = Receiving(transport, tmp_path / "dst")
    config = TransferConfig(secret=SECRET, chunk_size=chunk_mib << 20, io_timeout=10)
    with pytest.raises(IntegrityError, match="does not match its checksum"):
        Sender(transport, config).send(src, rx.receiver.address)
    assert isinstance(rx.join(), IntegrityError)
    assert not (tmp_path / "dst").exists()
    assert not list(tmp_path.glob(".dst.partial-*"))


def test_receiver_killed_mid_transfer(tmp_path: Path) -> None:
    """A `tpagent receive` process SIGKILLed mid-stream: the sender fails in one sentence, the
    half-written copy never becomes the snapshot, and the next receiver clears it and succeeds."""
    import os
    import signal
    import subprocess
    import sys

    from support.helpers import ROOT, tpagent

    src = make_snapshot(tmp_path / "src", "random", 48)
    secret = tmp_path / "secret"
    secret.write_bytes(SECRET)
    secret.chmod(0o600)  # the CLI reads the secret only from a private file
    env = {
        **os.environ,
        "TPAGENT_SECRET_FILE": str(secret),
        "TPAGENT_TLS_DIR": str(node_certs(tmp_path / "tls", "node")),
    }
    rx = subprocess.Popen(
        [sys.executable, "-m", "cli.main", "receive", "--listen", "127.0.0.1:0", "--out", str(tmp_path / "dst")],
        cwd=ROOT,
        env=env,
        stderr=subprocess.PIPE,
        text=True,
    )
    assert rx.stderr is not None
    address = rx.stderr.readline().split()[-1]
    host, port = address.rsplit(":", 1)
    proxy = Proxy((host, int(port)))
    killer = threading.Thread(target=lambda: (_wait_bytes(proxy, 8 << 20), os.kill(rx.pid, signal.SIGKILL)))
    killer.start()
    sent = subprocess.run(
        [sys.executable, "-m", "cli.main", "send", str(src), proxy.address, "--streams", "1", "--chunk-mib", "1"],
        cwd=ROOT,
        env={**env, "TPAGENT_COMPRESS": "none"},
        capture_output=True,
        text=True,
        timeout=120,
    )
    killer.join()
    rx.wait()
    rx.stderr.close()
    proxy.close()
    assert sent.returncode == 1 and "Traceback" not in sent.stderr
    assert "tpagent:" in sent.stderr.splitlines()[-1]
    assert not (tmp_path / "dst").exists()
    assert list(tmp_path.glob(".dst.partial-*"))  # what the killed receiver left behind...
    again = Receiving(TcpTransport(), tmp_path / "dst")
    _send(TcpTransport(), src, again.receiver.address)
    assert isinstance(again.join(), TransferStats)
    assert not list(tmp_path.glob(".dst.partial-*"))  # ...is cleared by the next one
    assert digests(tmp_path / "dst") == digests(src)
    assert tpagent("inspect", str(tmp_path / "dst")).returncode == 0


def test_ucx_logs_never_reach_a_json_result(tmp_path: Path) -> None:
    """UCX writes its log to stdout unless told otherwise: with --json, send's and receive's
    stdout is their JSON result alone (UCX's version and warnings were printed before it)."""
    src = make_snapshot(tmp_path / "src", "random", 4)
    secret = tmp_path / "secret"
    secret.write_bytes(SECRET)
    secret.chmod(0o600)
    env = {
        **os.environ,
        "TPAGENT_SECRET_FILE": str(secret),
        "TPAGENT_TRANSPORT": "ucx",
        "TPAGENT_PLAINTEXT": "1",
        "UCX_LOG_LEVEL": "info",
    }  # (info: UCX says at least its version)
    env.pop("UCX_LOG_FILE", None)
    rx = subprocess.Popen(
        [sys.executable, "-m", "cli.main", "receive", "--listen", "127.0.0.1:0", "--out", str(tmp_path / "dst"),
         "--json", "--timeout", "120"],
        cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        assert rx.stderr is not None
        address = next(ln for ln in rx.stderr if ln.startswith("listening on")).split()[-1]
        sent = subprocess.run(
            [sys.executable, "-m", "cli.main", "send", str(src), address, "--json"],
            cwd=ROOT, env=env, capture_output=True, text=True, timeout=120,
        )  # fmt: skip
        received, said = rx.communicate(timeout=120)
    finally:
        rx.kill()
    assert sent.returncode == 0 and rx.returncode == 0, sent.stderr
    assert json.loads(sent.stdout)["bytes_raw"] == json.loads(received)["bytes_raw"] > 4 << 20
    assert "UCX" in sent.stderr + said  # (the log went to stderr: it was there to go somewhere)
    assert digests(tmp_path / "dst") == digests(src)


def _wait_bytes(proxy: Proxy, n: int) -> None:
    import time

    deadline = time.monotonic() + 60
    while proxy.forwarded < n and time.monotonic() < deadline:
        time.sleep(0.01)


def test_files_the_manifest_does_not_list_are_refused(
    tcp: Transport, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A sender (holding the secret, but buggy or hostile) that slips in a file of its own."""
    from transfer import sender
    from transfer.wire import Layout

    src = make_snapshot(tmp_path / "src", "model", 1)
    (src / "run.sh").write_text("echo not part of the snapshot\n")
    real = sender.snapshot_layout
    monkeypatch.setattr(sender, "snapshot_layout", lambda snap, cs: Layout((*real(snap, cs).files, ("run.sh", 30)), cs))
    rx = Receiving(tcp, tmp_path / "dst")
    with pytest.raises(IntegrityError, match="does not list"):
        _send(tcp, src, rx.receiver.address)
    assert isinstance(rx.join(), IntegrityError)
    assert not (tmp_path / "dst").exists()


class Writer:
    """Writes a finished snapshot's files into ``dst`` piece by piece, the manifest last, as
    CRIU and the sealing hook would; ``sealed()`` answers the sender."""

    def __init__(
        self, ref: Path, dst: Path, piece: int = 256 << 10, rewrite_first_after_send: Callable[[], bool] | None = None
    ) -> None:
        self.ref = ref
        self.dst = dst
        self.piece = piece
        self.rewrite = rewrite_first_after_send
        self.done = threading.Event()
        self.error: BaseException | None = None
        (dst / "images").mkdir(parents=True)
        threading.Thread(target=self._run, daemon=True).start()

    def _run(self) -> None:
        images = sorted((self.ref / "images").iterdir())
        for src in images:
            data = src.read_bytes()
            with open(self.dst / "images" / src.name, "wb") as f:
                for off in range(0, len(data), self.piece):
                    f.write(data[off : off + self.piece])
                    f.flush()
                    time.sleep(0.02)
        if self.rewrite is not None:  # what if a writer went back over bytes already sent?
            while not self.rewrite():
                time.sleep(0.01)
            with open(self.dst / "images" / images[-1].name, "r+b") as f:
                f.write(b"\xff" * 16)
            m = load(self.ref)
            m.files = checksum_files(self.dst)  # sealed over what the files hold in the end
            m.write(self.dst)
        else:
            (self.dst / "manifest.json.tmp").write_bytes((self.ref / "manifest.json").read_bytes())
            (self.dst / "manifest.json.tmp").rename(self.dst / "manifest.json")
        self.done.set()

    def sealed(self) -> bool:
        if self.error is not None:
            raise self.error
        return self.done.is_set()


def _send_followed(
    transport: Transport,
    writer: Writer,
    address: str,
    progress: Callable[[int, int, int], None] | None = None,
    chunk_mib: int = 1,
) -> TransferStats:
    """chunk_mib 8 (the manifest's region): the receiver hashes chunks as they arrive, else it reads them back."""
    config = TransferConfig(secret=SECRET, chunk_size=chunk_mib << 20, io_timeout=10, streams=3)
    return Sender(transport, config, progress).send(writer.dst, address, sealed=writer.sealed)


@pytest.mark.parametrize("chunk_mib", [1, 8])
def test_snapshot_is_sent_while_it_is_still_written(transport: Transport, tmp_path: Path, chunk_mib: int) -> None:
    ref = make_snapshot(tmp_path / "ref", "model", 20)
    writer = Writer(ref, tmp_path / "src")
    rx = Receiving(transport, tmp_path / "dst")
    before_sealed: list[int] = []

    def progress(acked: int, wire_bytes: int, total: int) -> None:
        if not writer.done.is_set():
            before_sealed.append(acked)

    stats = _send_followed(transport, writer, rx.receiver.address, progress, chunk_mib)
    assert isinstance(rx.join(), TransferStats)
    assert digests(tmp_path / "dst") == digests(ref)
    assert stats.bytes_raw == sum(p.stat().st_size for p in ref.rglob("*") if p.is_file())
    assert before_sealed and max(before_sealed) >= 4 << 20  # most bytes went out before the writer finished


def test_followed_snapshot_whose_writer_fails_leaves_nothing(tcp: Transport, tmp_path: Path) -> None:
    ref = make_snapshot(tmp_path / "ref", "random", 4)
    writer = Writer(ref, tmp_path / "src")
    writer.error = RuntimeError("criu dump failed")
    rx = Receiving(tcp, tmp_path / "dst", timeout=20)
    with pytest.raises(RuntimeError, match="criu dump failed"):  # the writer's own error, for its caller
        _send_followed(tcp, writer, rx.receiver.address)
    assert isinstance(rx.join(), TransferError)
    assert not (tmp_path / "dst").exists() and not list(tmp_path.glob(".dst.partial-*"))


@pytest.mark.parametrize("chunk_mib", [1, 8])
def test_followed_bytes_changed_after_sending_are_caught(tcp: Transport, tmp_path: Path, chunk_mib: int) -> None:
    ref = make_snapshot(tmp_path / "ref", "random", 18)
    acked: list[int] = []
    writer = Writer(ref, tmp_path / "src", rewrite_first_after_send=lambda: bool(acked) and acked[-1] >= 8 << 20)
    rx = Receiving(tcp, tmp_path / "dst")
    with pytest.raises(IntegrityError, match="rejected"):
        _send_followed(tcp, writer, rx.receiver.address, lambda a, w, t: acked.append(a), chunk_mib)
    assert isinstance(rx.join(), IntegrityError)
    assert not (tmp_path / "dst").exists() and not list(tmp_path.glob(".dst.partial-*"))


@pytest.mark.parametrize("followed", [False, True])  # a finished snapshot; one still written (a migration's)
@pytest.mark.parametrize("chunk_mib", [1, 8])  # CRC-checked chunks, and chunks checked by the manifest's SHA-256
def test_a_full_disk_is_named_and_nothing_is_kept(tmp_path: Path, chunk_mib: int, followed: bool) -> None:
    """The receiving disk fills up mid-transfer (a 4 MiB tmpfs, an 8 MiB snapshot): every
    write's result is checked, the receiver says so in one sentence, keeps nothing, and the
    sender is told the disk is full (not "connection refused")."""
    small = tmp_path / "small"
    small.mkdir(mode=0o700)
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=4m,mode=700", "tpagent-test", str(small)], check=True)
    try:
        src = make_snapshot(tmp_path / "src", "random", 8)
        rx = Receiving(TcpTransport(), small / "dst")
        with pytest.raises(TransferError, match="No space left on device"):
            if followed:
                _send_followed(
                    TcpTransport(),
                    Writer(src, tmp_path / "followed", piece=4 << 20),
                    rx.receiver.address,
                    chunk_mib=chunk_mib,
                )
            else:
                _send(TcpTransport(), src, rx.receiver.address, chunk_size=chunk_mib << 20)
        result = rx.join()
        assert isinstance(result, TransferError) and "is full" in str(result), result
        assert not list(small.iterdir())  # no partial snapshot left behind
    finally:
        subprocess.run(["umount", "-l", str(small)], check=True)
