"""What a node proves itself with, read from root's private files (no gRPC here)."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

from host.api import UsageError
from host.trusted import read_private_file, read_trusted
from transfer.api import CERT_MAX, TlsFiles, read_secret
from transfer.tls import check_pem


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
        missing = [f for f in (files.ca, files.cert, files.key) if not os.path.lexists(f)]
        if missing:
            raise UsageError(
                f"there is no {missing[0]}; put the cluster CA (ca.crt) and this node's certificate (tls.crt, "
                f"tls.key) in {tls_dir} (scripts/make-certs.sh makes them, or cert-manager)."
            )
        key = read_private_file(files.key, "the TLS private key")
        # (the CA says whom this node trusts: a file only root can change)
        ca = read_trusted(files.ca, "the cluster CA", CERT_MAX)
        cert = read_trusted(files.cert, "this node's certificate", CERT_MAX)
        check_pem(files, ca, cert, key)  # (one sentence: gRPC's own check aborts the process)
        return cls(secret, ca, cert, key)
