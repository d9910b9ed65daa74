#!/usr/bin/env bash
# Set up everything tpagent needs on a fresh Debian 12 machine (as root): a private CRIU >= 4.2,
# a virtual environment in .venv with tpagent, its dependencies and the test tools.  Idempotent.
#
#   scripts/setup.sh                  from the package registries (apt, PyPI)
#   scripts/setup.sh --bundle DIR --seal SHA256
#                                     from an offline bundle (scripts/bundle.sh), no network at all;
#                                     the venv sees the node's own torch and cuda-bindings.  SEAL is
#                                     what bundle.sh printed, given by another way than the bundle
#
# TPAGENT_BUNDLE=DIR is --bundle DIR, TPAGENT_BUNDLE_SEAL is --seal; TPAGENT_VENV (default .venv)
# and TPAGENT_CRIU_PREFIX (default /opt/tpagent/criu) say where things go.
set -euo pipefail
cd "$(dirname "$0")/.."

if [ "$(id -u)" != 0 ]; then
  echo "setup: run as root (CRIU needs it)" >&2
  exit 2
fi
bundle=${TPAGENT_BUNDLE:-}
venv=${TPAGENT_VENV:-.venv}
seal=${TPAGENT_BUNDLE_SEAL:-}
while [ $# -gt 0 ]; do
  case $1 in
    --bundle) bundle=${2:?setup: --bundle takes the bundle directory}; shift 2 ;;
    --seal) seal=${2:?setup: --seal takes the sha256 bundle.sh printed}; shift 2 ;;
    *) echo "usage: scripts/setup.sh [--bundle DIR --seal SHA256]" >&2; exit 2 ;;
  esac
done

if [ -n "$bundle" ]; then
  [[ $seal =~ ^[0-9a-fA-F]{64}$ ]] || {
    echo "setup: give the bundle's seal (--seal, the sha256 scripts/bundle.sh printed): its own SHA256SUMS proves it whole, not whose it is" >&2
    exit 2
  }
  # The node's python3 (never this venv's, even where it is first on PATH) runs as root: -I.
  node_path=$(tr ':' '\n' <<<"$PATH" | grep -vxF "$(realpath -m "$venv/bin")" | grep -vxF "$venv/bin" | paste -sd:)
  node_python=$(PATH=$node_path command -v python3) || { echo "setup: no python3 on this node" >&2; exit 2; }
  # Checked against the seal, copied (symlinks and unlisted files refused), and only the copy used.
  copy=$(mktemp -d /var/tmp/tpagent-bundle.XXXXXX)
  trap 'rm -rf "$copy"' EXIT
  "$node_python" -I scripts/bundle_check.py copy "$bundle" "$seal" "$copy/b"
  sealed=$bundle
  bundle=$copy/b
  for tool in unshare setpriv; do
    command -v $tool >/dev/null || echo "setup: warning: $tool is not on this node (a bundle brings no system packages)" >&2
  done
  TPAGENT_CRIU_FROM=$bundle/criu.tar.gz scripts/install-criu.sh
  # Nothing but the bundle: no index, no configured mirror.
  export PIP_CONFIG_FILE=/dev/null PIP_NO_INDEX=1 PIP_FIND_LINKS=$bundle/wheels PIP_DISABLE_PIP_VERSION_CHECK=1
  unset PIP_INDEX_URL PIP_EXTRA_INDEX_URL
  [ -x "$venv/bin/python" ] || "$node_python" -m venv --system-site-packages "$venv"
  # The node's python3 may itself be a virtual environment (its torch installed there, as on
  # the GPU nodes): a venv made from it sees its base interpreter's packages, not that
  # environment's.  A .pth adds them (after the venv's own, which win), each only if root alone
  # can change it and every directory above it (the agent runs as root and imports from there).
  purelib=$("$venv/bin/python" -I -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
  "$node_python" -I scripts/bundle_check.py node-site "$purelib/node-site-packages.pth" "$venv"
  # ip and nft where the node has none: the bundle's (its machine's, with their libraries and
  # loader), root's, as the venv's bin/ip and bin/nft (the GPU proof puts that first on PATH)
  tools=$(realpath "$venv")/lib/tpagent-tools
  rm -rf "$tools" "$venv/bin/ip" "$venv/bin/nft"  # (a run before this one's, if any)
  for tool in ip nft; do
    if command -v $tool >/dev/null; then continue; fi
    if [ ! -x "$bundle/tools/$tool" ]; then
      echo "setup: warning: $tool is not on this node, nor in the bundle" >&2
      continue
    fi
    if [ ! -d "$tools" ]; then
      mkdir -p "$tools" && cp -R "$bundle/tools/." "$tools/"
      chown -R root:root "$tools" && chmod -R go-w "$tools"
    fi
    {
      echo '#!/bin/bash'
      printf 'd=%q\n' "$tools"
      printf 'exec "$d/lib/ld.so" --library-path "$d/lib" "$d/%s" "$@"\n' "$tool"
    } >"$venv/bin/$tool"
    chmod 755 "$venv/bin/$tool"
    echo "setup: $tool is not on this node: the bundle's is $venv/bin/$tool"
  done
  skip='^tpagent=='
  if "$venv/bin/python" -c 'import cuda.bindings' 2>/dev/null; then
    skip='^(tpagent|cuda-bindings|cuda-pathfinder)=='  # the node's own CUDA bindings stay
  fi
  grep -Ev "$skip" "$bundle/requirements.txt" >"$venv/bundle-requirements.txt"
  "$venv/bin/pip" install -q --require-hashes -r "$venv/bundle-requirements.txt"
  "$venv/bin/pip" install -q --no-deps --no-build-isolation -e .
  echo "setup: tpagent installed from $sealed (checked against its seal, copied) into $venv, offline"
  exit 0
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
command -v cc >/dev/null || need+=(gcc)  # a test builds a library that keeps its address as NCCL does
command -v prometheus-alertmanager >/dev/null || need+=(prometheus-alertmanager)  # the orchestrator's webhook test
command -v slurmctld >/dev/null || need+=(slurmctld slurmd slurm-client munge)  # the Slurm adapter's tests
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
# The install also compiles the agent's gRPC API into tpagent/daemon/proto/ (setup.py; not kept in git).
.venv/bin/pip install -q --disable-pip-version-check -e '.[test,ucx]' 'torch==2.13.0'
