#!/usr/bin/env bash
# Set up everything tpagent needs on a fresh Debian 12 machine (as root): a private CRIU >= 4.2,
# a virtual environment in .venv with tpagent, its dependencies and the test tools.  Idempotent.
set -euo pipefail
cd "$(dirname "$0")/.."

if [ "$(id -u)" != 0 ]; then
  echo "setup: run as root (CRIU needs it)" >&2
  exit 2
fi
need=()
command -v dpkg >/dev/null && command -v apt-get >/dev/null || { echo "setup: needs Debian's apt-get and dpkg" >&2; exit 2; }
command -v unshare >/dev/null || need+=(util-linux)
command -v ip >/dev/null || need+=(iproute2)
command -v zstd >/dev/null || need+=(zstd)  # bench/transfer.py's naive route
command -v nft >/dev/null || need+=(nftables)  # removes the network lock CRIU leaves on a node a workload left
command -v openssl >/dev/null || need+=(openssl)  # scripts/make-certs.sh (test and small-cluster certificates)
command -v setpriv >/dev/null || need+=(util-linux)  # the security tests attack as user nobody
command -v mksquashfs >/dev/null || need+=(squashfs-tools)  # a test mounts a squashfs, as GPU nodes' driver files are
python3 -c 'import venv, ensurepip' 2>/dev/null || need+=(python3-venv)
[ -f /usr/share/keyrings/debian-archive-keyring.gpg ] || need+=(debian-archive-keyring)
if [ ${#need[@]} -gt 0 ]; then
  apt-get update -q >/dev/null
  DEBIAN_FRONTEND=noninteractive apt-get install -y -q "${need[@]}" >/dev/null
fi

scripts/install-criu.sh

if [ ! -x .venv/bin/python ]; then
  python3 -m venv .venv
fi
.venv/bin/pip install -q --disable-pip-version-check --upgrade pip >/dev/null
# torch (CPU build) only drives the demo and the workload in the tests; tpagent itself does not import it.
# The install also compiles the agent's gRPC API into tpagent/proto/ (setup.py; not kept in git).
.venv/bin/pip install -q --disable-pip-version-check -e '.[test,ucx]' 'torch==2.13.0'
