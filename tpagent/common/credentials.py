"""What a node proves itself with, read from root's private files (no gRPC here)."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from host.api import UsageError
from host.safefs import read_private_file
from transfer.api import TlsFiles, read_secret


@dataclass(frozen=True)
class Credentials:
    """What a node proves itself with: the cluster secret and its TLS certificate."""

    secret: bytes = field(repr=False)
    ca: bytes = field(repr=False)
    cert: bytes = field(repr=False)
    key: bytes = field(repr=False)

    @classmethod
    def load(cls, secret_file: Path | None, tls_dir: Path) -> Credentials:
        """Read and check both (the secret and the key: private files of ours), or UsageError."""
        secret = read_secret(secret_file)
        files = TlsFiles.in_dir(tls_dir)
        key = read_private_file(files.key, "the TLS private key")
        try:
            ca = files.ca.read_bytes()
            cert = files.cert.read_bytes()
        except OSError as e:
            raise UsageError(
                f"cannot read the TLS certificate {e.filename}: {e.strerror}; "
                f"put the cluster CA (ca.crt) and this node's certificate (tls.crt, tls.key) in {tls_dir} "
                "(scripts/make-certs.sh makes them, or cert-manager)."
            ) from e
        return cls(secret, ca, cert, key)
