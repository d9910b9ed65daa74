"""Certificates for mutual-TLS tests, made by the script the README gives users
(``scripts/make-certs.sh``): one CA per CA directory, one certificate directory per node."""

from __future__ import annotations

import subprocess
from pathlib import Path

from support.helpers import ROOT

MAKE_CERTS = ROOT / "scripts" / "make-certs.sh"


def node_certs(tmp: Path, name: str, *addrs: str, ca: str = "ca") -> Path:
    """``tmp/certs-CA/NAME`` holding ca.crt, tls.crt and tls.key (the layout of a cert-manager
    Secret, for :meth:`transfer.api.TlsFiles.in_dir`), signed by the CA in ``tmp/CA`` (made on
    first use).  The certificate names NAME, localhost, 127.0.0.1 and each of ``addrs`` (IP
    addresses or DNS names).  Nodes made with the same ``tmp`` and ``ca`` share a CA; another
    is another cluster's."""
    out = tmp / f"certs-{ca}" / name
    if not (out / "tls.key").exists():
        subprocess.run(
            ["bash", str(MAKE_CERTS), str(tmp / ca), str(out), name, *addrs],
            check=True,
            capture_output=True,
            timeout=60,
        )
    return out
