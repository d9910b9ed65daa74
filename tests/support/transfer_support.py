"""What the transfer tests share (and the security tests reuse): a snapshot-shaped
directory with a real manifest, its digests, a receiver running in a thread, a send."""

from __future__ import annotations

import hashlib
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from host.proc import ProcInfo
from snapshot.manifest import DIGEST, Manifest, checksum_files
from transfer.api import TransferConfig, TransferStats, Transport
from transfer.receiver import Receiver
from transfer.sender import Sender

SECRET = b"0123456789abcdef-cluster-secret"


def make_snapshot(directory: Path, kind: str, mib: float, seed: int = 0, digest: str = DIGEST) -> Path:
    """A snapshot-shaped directory: model-like (bf16/fp32 weights randn*0.02, Adam moments,
    zero regions) or random bytes, with a real manifest (its chunk digests ``digest``'s)."""
    rng = np.random.default_rng(seed)
    n = int(mib * 2**20)
    (directory / "images").mkdir(parents=True)
    if kind == "random":
        pages = rng.bytes(n)
    else:
        q = n // 4
        weights = (rng.standard_normal(q // 4) * 0.02).astype(np.float32).tobytes()
        bf16 = (rng.standard_normal(q // 2) * 0.02).astype(np.float32).view(np.uint32) >> 16
        moments = (np.abs(rng.standard_normal(q // 4)) * 1e-4).astype(np.float32).tobytes()
        pages = (
            weights + bf16.astype(np.uint16).tobytes() + moments + bytes(n - len(weights) - 2 * (q // 2) - len(moments))
        )
    (directory / "images" / "pages-1.img").write_bytes(pages)
    (directory / "images" / "core-1.img").write_bytes(rng.bytes(4099))
    (directory / "images" / "empty.img").write_bytes(b"")
    m = Manifest(
        root_pid=1,
        namespace=False,
        processes=[ProcInfo(1, 0, ("x",), (1,), False)],
        gpus=[],
        criu={"version": "4.2.1", "shell_job": False, "tcp_established": False},
        cuda={"driver_version": None, "pids": []},
        tpagent_version="test",
        digest=digest,
    )
    m.files = checksum_files(directory, digest=digest)
    m.write(directory)
    return directory


def digests(directory: Path) -> dict[str, str]:
    return {
        str(p.relative_to(directory)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(directory.rglob("*"))
        if p.is_file()
    }


class Receiving:
    def __init__(
        self,
        transport: Transport,
        out: Path,
        timeout: float = 60,
        secret: bytes = SECRET,
        io_timeout: float = 10,
        listen: str = "127.0.0.1:0",
        on_refused: Callable[[str], None] | None = None,
        **settings: Any,
    ) -> None:
        """``on_refused``: called after each refusal is noted in ``refused`` (in the receiver's
        thread that refused it, as the agent's metrics are); ``settings``: more of its
        TransferConfig."""
        self.refused: list[str] = []  # what on_refused was called with, in order
        self._on_refused = on_refused
        self.receiver = Receiver(
            transport,
            TransferConfig(secret=secret, io_timeout=io_timeout, **settings),
            listen,
            on_refused=self._refusal,
        )
        self.result: TransferStats | BaseException | None = None
        self.thread = threading.Thread(target=self._run, args=(out, timeout), daemon=True)
        self.thread.start()

    def _refusal(self, reason: str) -> None:
        self.refused.append(reason)
        if self._on_refused is not None:
            self._on_refused(reason)

    def _run(self, out: Path, timeout: float) -> None:
        try:
            self.result = self.receiver.receive(out, timeout)
        except BaseException as e:  # handed to the test
            self.result = e
        finally:
            self.receiver.close()

    def join(self) -> TransferStats | BaseException | None:
        self.thread.join(120)
        return self.result


def _send(transport: Transport, src: Path, address: str, **cfg: object) -> TransferStats:
    config = TransferConfig(
        secret=cfg.pop("secret", SECRET), chunk_size=cfg.pop("chunk_size", 1 << 20), io_timeout=10, **cfg
    )  # type: ignore[arg-type]
    return Sender(transport, config).send(src, address)
