"""Mutual TLS for the TCP transport: the SSL contexts, built from :class:`~transfer.api.TlsFiles`,
and what their failures mean, in one sentence each.

Each end presents a certificate signed by the cluster CA and checks the other's against it: the
receiver requires one (CERT_REQUIRED), and the sender also checks that the receiver's names the
host it dialled (an IP address matches an IP subjectAltName).  TLS 1.2 at least, 1.3 wherever
both ends have it (OpenSSL negotiates the highest); no compression, no renegotiation, no session
tickets (nothing is resumed).  The private key is read only from a file private to this user.

TLS proves that a peer holds a certificate of the CA; the HMAC handshake of
:mod:`transfer.stream` still runs inside it, so a certificate from a site-wide CA alone does not
make a peer a member of this cluster: it must hold the cluster secret too.
"""

from __future__ import annotations

import os
import ssl

from host.api import UsageError, unbracketed
from host.trusted import open_private_file, open_trusted
from transfer.api import AuthError, TlsFiles, TransferError

#: OpenSSL's verify codes for a certificate that does not name the host (or IP) dialled.
_NAME_MISMATCH = {62, 63, 64}  # X509_V_ERR_HOSTNAME_MISMATCH, _EMAIL_MISMATCH, _IP_ADDRESS_MISMATCH
#: What OpenSSL says when the other end spoke something other than TLS.
_NOT_TLS = {
    "WRONG_VERSION_NUMBER",
    "HTTP_REQUEST",
    "HTTPS_PROXY_REQUEST",
    "UNKNOWN_PROTOCOL",
    "PACKET_LENGTH_TOO_LONG",
    "RECORD_LAYER_FAILURE",
}


def server_context(files: TlsFiles) -> ssl.SSLContext:
    """The receiver's side: its certificate, and a client certificate of the CA required.
    Files that cannot be used raise :class:`~host.api.UsageError` in one sentence."""
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.verify_mode = ssl.CERT_REQUIRED
    ctx.num_tickets = 0
    _load(ctx, files)
    return ctx


def client_context(files: TlsFiles) -> ssl.SSLContext:
    """The sender's side: its certificate, and the receiver's checked against the CA and
    against the host dialled (``check_hostname``; give it as ``server_hostname``)."""
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)  # CERT_REQUIRED and check_hostname
    _load(ctx, files)
    return ctx


def _load(ctx: ssl.SSLContext, files: TlsFiles) -> None:
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    ctx.options |= ssl.OP_NO_COMPRESSION | ssl.OP_NO_RENEGOTIATION
    ca = open_trusted(files.ca, "the cluster CA")  # (whom this node trusts: only root may change it)
    try:
        ctx.load_verify_locations(cafile=f"/proc/self/fd/{ca}")
    except (OSError, ssl.SSLError) as e:
        raise _refused(files, e, ca=True) from e
    finally:
        os.close(ca)
    # OpenSSL loads the key by path: it gets the descriptor checked here (the key must be
    # private), so a file swapped in after the check is never the one used.
    fd = open_private_file(files.key, "the TLS private key")
    try:
        cert = open_trusted(files.cert, "this node's certificate")
    except UsageError:
        os.close(fd)
        raise
    try:
        ctx.load_cert_chain(f"/proc/self/fd/{cert}", f"/proc/self/fd/{fd}")
    except (OSError, ssl.SSLError) as e:
        raise _refused(files, e, ca=False) from e
    finally:
        os.close(fd)
        os.close(cert)


def _refused(files: TlsFiles, e: Exception, ca: bool) -> UsageError:
    """Why the cluster CA (``ca``), or this node's certificate with its key, cannot be loaded."""
    why = _why(e) if isinstance(e, OSError) else str(e).lower()
    if ca:
        return UsageError(
            f"cannot load the cluster CA from {files.ca} ({why}); "
            "give the PEM certificate the nodes' certificates are signed with."
        )
    return UsageError(
        f"cannot load this node's certificate {files.cert} with its key {files.key} ({why}); "
        "give a PEM certificate and the private key it was made for."
    )


def check_pem(files: TlsFiles, ca: bytes, cert: bytes, key: bytes) -> None:
    """UsageError, in the sentences :func:`_load` says, unless ``ca`` holds a PEM certificate
    and ``cert`` with ``key`` a certificate and the private key it was made for: what was read
    of ``files`` for a library that takes them as they are (gRPC's aborts the process on an empty key)."""
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    try:
        ctx.load_verify_locations(cadata=ca.decode("latin-1"))
    except (ValueError, ssl.SSLError) as e:
        raise _refused(files, e, ca=True) from e
    fds = [os.memfd_create("tpagent-tls", os.MFD_CLOEXEC) for _ in (cert, key)]
    try:
        for fd, data in zip(fds, (cert, key), strict=True):
            with os.fdopen(os.dup(fd), "wb") as f:
                f.write(data)
        ctx.load_cert_chain(f"/proc/self/fd/{fds[0]}", f"/proc/self/fd/{fds[1]}")
    except (OSError, ssl.SSLError) as e:
        raise _refused(files, e, ca=False) from e
    finally:
        for fd in fds:
            os.close(fd)


def client_failure(e: ssl.SSLError, address: str, handshake: bool) -> TransferError:
    """A TLS error on the sender's side, as one sentence: the receiver's certificate failed,
    the receiver refused ours, it does not speak TLS (:class:`AuthError`: trying again will
    not help), or the connection failed (:class:`TransferError`)."""
    host = unbracketed(address.rpartition(":")[0])
    if isinstance(e, ssl.SSLCertVerificationError):
        if e.verify_code in _NAME_MISMATCH:
            return AuthError(
                f"the receiver's certificate does not name {host} ({_why(e)}); "
                "dial the receiver by a name or address its certificate lists."
            )
        return AuthError(
            f"the receiver's certificate is not signed by the cluster CA ({_why(e)}); refusing to send to it."
        )
    refused = refused_by_peer(e)
    if refused is not None:
        return refused
    if handshake and e.reason in _NOT_TLS:
        return AuthError(
            f"the receiver at {address} does not answer in TLS ({_why(e)}); "
            "give both nodes the TLS certificates, or neither."
        )
    return TransferError(f"TLS with {address} failed: {_why(e)}")


def refused_by_peer(e: OSError) -> AuthError | None:
    """The peer's alert that it refused this node's certificate.  In TLS 1.3 a receiver
    checks the sender's certificate after the sender's handshake has ended, so the sender
    may learn it from its first read."""
    reason = getattr(e, "reason", None) or ""
    if "ALERT" in reason and any(k in reason for k in ("CERTIFICATE", "UNKNOWN_CA", "ACCESS_DENIED")):
        return AuthError(
            f"the receiver refused this node's TLS certificate ({_why(e)}); "
            "is it signed by the same cluster CA as the receiver's?"
        )
    return None


def server_failure(e: ssl.SSLError) -> AuthError:
    """Why the receiver refused a peer's TLS handshake, as one sentence for its log."""
    if isinstance(e, ssl.SSLCertVerificationError):
        return AuthError(f"its certificate is not signed by the cluster CA ({_why(e)})")
    if e.reason == "PEER_DID_NOT_RETURN_A_CERTIFICATE":
        return AuthError("it presented no certificate (the cluster's TLS is mutual)")
    if e.reason in _NOT_TLS:
        return AuthError(f"it does not speak TLS ({_why(e)})")
    return AuthError(f"its TLS handshake failed ({_why(e)})")


def _why(e: OSError) -> str:
    if isinstance(e, ssl.SSLCertVerificationError):
        return str(e.verify_message).rstrip(".")
    if isinstance(e, ssl.SSLError) and e.reason:
        return e.reason.lower().replace("_", " ")
    return e.strerror or str(e)
