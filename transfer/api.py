"""The transfer layer's contract: move a snapshot directory from one node to another.

A :class:`Transport` makes byte channels between two nodes (TCP here, UCX beside it); the
sender and receiver (:mod:`transfer.sender`, :mod:`transfer.receiver`) speak the stream format of
:mod:`transfer.wire` over any of them.  Errors: :class:`TransferError` for the transport or
the peer, :class:`AuthError` for a peer that cannot prove the cluster secret,
:class:`IntegrityError` for data that arrived damaged and could not be fetched again
(:class:`SnapshotDamaged` where it left damaged: the snapshot sent does not match its manifest).
"""

from __future__ import annotations

import abc
import enum
from dataclasses import dataclass, field
from pathlib import Path

from host import paths
from host.api import port_number, unbracketed


class TransferError(Exception):
    """The transport or the peer failed; ``str(e)`` is one sentence for the user."""


class AuthError(TransferError):
    """The peer did not prove it holds the cluster secret (or we could not prove it)."""


class IntegrityError(TransferError):
    """Data failed verification and could not be repaired by fetching it again."""


class ChunkRefused(IntegrityError):
    """A chunk the receiver refused as damaged each time it was sent (the chunk's ``index``)."""

    def __init__(self, index: int, times: int) -> None:
        super().__init__(f"chunk {index} arrived damaged {times} times; giving up")
        self.index = index


class SnapshotDamaged(IntegrityError):
    """The snapshot being sent does not match its own manifest: sending it again cannot help."""


class BadAddress(TransferError):
    """A peer's address that is no ``HOST:PORT``: the request as given, never retried."""


class Compress(str, enum.Enum):
    AUTO = "auto"  # compress while it pays (the link is slower than the compressor)
    ZSTD = "zstd"  # always try zstd (a chunk that does not shrink still goes raw)
    NONE = "none"  # never compress (all-zero chunks still cost nothing)


#: Most data streams one transfer may use.
MAX_STREAMS = 64


#: The shortest cluster secret accepted.
MIN_SECRET = 16


def read_secret(path: Path | None) -> bytes:
    """The cluster secret (the same file on every node): only from a file of ours with mode
    600 or stricter, at least :data:`MIN_SECRET` bytes; else UsageError in one sentence."""
    from host.api import UsageError
    from host.trusted import read_private_file

    if path is None:
        raise UsageError(
            "no cluster secret: pass --secret-file or set TPAGENT_SECRET_FILE (the same file on every node)."
        )
    secret = read_private_file(path, "the cluster secret").strip()
    if len(secret) < MIN_SECRET:
        raise UsageError(f"the cluster secret in {path} is shorter than {MIN_SECRET} bytes; make it longer.")
    return secret


#: Where a node's certificates live unless told otherwise.
DEFAULT_TLS_DIR = paths.TLS_DIR


CERT_MAX = 1 << 20  #: the most a PEM file of certificates is read (a CA bundle: some hundred KiB)


@dataclass(frozen=True)
class TlsFiles:
    """Mutual TLS from certificate files, in the layout of a cert-manager Secret: the cluster
    CA (``ca.crt``), this node's certificate (``tls.crt``) and its private key (``tls.key``)."""

    ca: Path
    cert: Path
    key: Path

    @classmethod
    def in_dir(cls, directory: Path) -> TlsFiles:
        return cls(directory / "ca.crt", directory / "tls.crt", directory / "tls.key")


#: The longest pause between a sender's attempts to open a broken stream again (0.2 s, doubling).
RETRY_PAUSE_MAX = 2.0


def retry_pause(attempt: int) -> float:
    return min(0.1 * 2.0**attempt, RETRY_PAUSE_MAX)


@dataclass(frozen=True)
class TransferConfig:
    secret: bytes = field(repr=False)
    streams: int = 4  # 1 .. MAX_STREAMS
    chunk_size: int = 8 << 20
    compress: Compress = Compress.AUTO
    zstd_level: int = 1
    #: Chunks in flight per stream, unacknowledged: bounds memory and gives backpressure.
    window: int = 4
    connect_timeout: float = 10.0
    #: A stream with nothing received for this long is considered dead.
    io_timeout: float = 60.0
    #: Reconnects per stream before the transfer fails.
    retries: int = 5
    #: A chunk that arrives damaged this many times fails the transfer.
    chunk_retries: int = 3
    #: Longest wait on the control stream (for the trailer, for the receiver's verification).
    session_timeout: float = 3600.0

    @property
    def reconnect_window(self) -> float:
        """How long a sender goes on opening a broken stream again (a silence, then its retries:
        each a connect and a pause of at most :data:`RETRY_PAUSE_MAX`), and so how long a
        receiver keeps a transfer whose control stream broke: a partition that heals within it
        resumes the transfer."""
        return self.io_timeout + self.retries * (self.connect_timeout + RETRY_PAUSE_MAX)

    #: A receiver gives up (and frees its address) if no sender has begun within this long
    #: (None: it waits its whole timeout, as `tpagent receive` does for a person to send).
    start_timeout: float | None = None


@dataclass(frozen=True)
class TransferStats:
    bytes_raw: int
    bytes_wire: int
    chunks: int
    seconds: float

    @property
    def ratio(self) -> float:
        return self.bytes_raw / self.bytes_wire if self.bytes_wire else float("inf")


class Refusal(str, enum.Enum):
    """Why a receiver closed an incoming connection before it could carry a transfer; the
    value is what ``Receiver(on_refused=...)`` is called with (a metrics label)."""

    HANDSHAKE_TIMEOUT = "handshake_timeout"  # did not finish TLS + HMAC within HANDSHAKE_TIMEOUT
    EVICTED = "evicted"  # the oldest stranger, pushed out when all stranger places were taken
    PER_PEER_LIMIT = "per_peer_limit"  # its host already held as many unproven connections as allowed
    TLS_FAILED = "tls_failed"  # the TLS handshake failed (no certificate, another CA, not TLS...)
    AUTH_FAILED = "auth_failed"  # the HMAC handshake failed: it does not hold the cluster secret
    HANDSHAKE_FAILED = "handshake_failed"  # it closed or broke the connection during the handshake
    TOO_MANY_STREAMS = "too_many_streams"  # authenticated, but all places for streams were taken


class Channel(abc.ABC):
    """A reliable, ordered byte stream to one peer."""

    #: ``HOST:PORT`` of the other end where the transport knows it (logs, per-host limits).
    peer: str = "?"

    @abc.abstractmethod
    def send(self, *parts: bytes | memoryview) -> None: ...

    @abc.abstractmethod
    def recv_exact(self, n: int) -> bytes | bytearray: ...

    def recv_scratch(self, n: int) -> bytes | bytearray | memoryview:
        """Like :meth:`recv_exact`, into a buffer the channel may reuse: valid only until
        the next receive on this channel (saves a fresh buffer per chunk)."""
        return self.recv_exact(n)

    @abc.abstractmethod
    def set_timeout(self, seconds: float | None) -> None:
        """How long a receive may wait for the peer (None: for ever)."""

    def establish(self) -> None:  # noqa: B027 (an optional hook: nothing to do by default)
        """Finish setting up a channel that :meth:`Listener.accept` returned (TCP with TLS:
        its handshake).  The receiver calls it in the connection's own thread, under its
        handshake deadline, so a peer that never completes it cannot hold up ``accept``.
        TLS that fails raises :class:`AuthError`."""

    def authenticated(self) -> None:  # noqa: B027 (an optional hook: nothing to do by default)
        """The peer has passed the HMAC handshake: lift the limits kept on a stranger (UCX:
        the largest message it may send).  Until then a channel accepts only handshake-sized
        messages."""

    def interrupt(self) -> None:
        """From another thread: make a blocked or later send or receive fail at once (the
        channel is shut down, not yet closed: its owner still calls :meth:`close`)."""
        self.close()

    @abc.abstractmethod
    def close(self) -> None: ...


class Listener(abc.ABC):
    address: str

    @abc.abstractmethod
    def accept(self, timeout: float | None) -> Channel | None:
        """The next incoming channel, or None when ``timeout`` passed first."""

    @abc.abstractmethod
    def close(self) -> None: ...


class Transport(abc.ABC):
    name: str

    @abc.abstractmethod
    def connect(self, address: str, timeout: float) -> Channel: ...

    @abc.abstractmethod
    def listen(self, address: str) -> Listener: ...


def parse_address(address: str) -> tuple[str, int]:
    """``HOST:PORT`` (``[v6]:PORT`` too) -> (host, port), or TransferError in one sentence."""
    host, sep, port = address.rpartition(":")
    number = port_number(port)
    if not sep or number is None:
        raise BadAddress(f"{address[:80]!r} is not HOST:PORT.")
    bare = unbracketed(host)
    if not _is_host(bare):
        raise BadAddress(f"{address[:80]!r} names no host: a host name is text DNS can hold.")
    return bare or "0.0.0.0", number


def _is_host(text: str) -> bool:
    """Whether ``text`` may be given to the resolver: what it cannot hold (no encoding's bytes, a
    space, a newline, a stray bracket) was asked of it over and over as a network failure."""
    try:
        text.encode("idna")
    except UnicodeError:
        return False
    return text.isprintable() and not any(c.isspace() or c in "[]" for c in text)


def peer_address(address: str) -> tuple[str, int]:
    """:func:`parse_address` of an address to connect to: its host given, its port above 0 (a
    listener's ``:0``, any port, names no peer)."""
    host, port = parse_address(address)
    if not unbracketed(address.rpartition(":")[0]) or port == 0:
        raise BadAddress(f"{address[:80]!r} is not HOST:PORT.")
    return host, port
