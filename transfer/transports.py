"""The transports by name: the one place that turns a ``--transport`` / ``transport =`` setting
into a :class:`~transfer.api.Transport`.

``make_transport(name, io_timeout, tls)`` with ``name`` one of :data:`NAMES`:

``"tcp"``
    :class:`~transfer.tcp.TcpTransport`: in mutual TLS with ``tls`` (this node's certificate
    files, checked here: files that cannot be used raise :class:`~host.api.UsageError`),
    plain TCP when ``tls`` is None (still authenticated by the HMAC handshake, but readable
    on the wire).
``"ucx"``
    :class:`~transfer.ucx.UcxTransport`, imported only when asked for (ucxx comes with the
    optional ``ucx`` extra; without it this raises :class:`~transfer.api.TransferError`).
    UCX has no TLS: ``tls`` is ignored, the stream is authenticated but not encrypted (see
    :mod:`transfer.ucx`).

Any other name raises :class:`~host.api.UsageError` in one sentence: like unusable TLS
files it is a request that cannot be carried out as given, and callers already map that
error (the CLI to its usage exit code).
"""

from __future__ import annotations

from host.api import UsageError
from transfer.api import TlsFiles, Transport
from transfer.tcp import TcpTransport

#: Every transport :func:`make_transport` knows, the default first.
NAMES = ("tcp", "ucx")


def make_transport(name: str, io_timeout: float, tls: TlsFiles | None) -> Transport:
    """The transport called ``name`` (see the module docstring), whose channels wait at most
    ``io_timeout`` seconds for the peer."""
    if name == "tcp":
        return TcpTransport(io_timeout, tls=tls)
    if name == "ucx":
        from transfer.ucx import UcxTransport  # (lazy: an optional dependency)

        return UcxTransport(io_timeout)
    raise UsageError(f"unknown transport {name!r}: choose one of {', '.join(NAMES)}.")
