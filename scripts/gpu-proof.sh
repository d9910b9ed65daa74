#!/usr/bin/env bash
# The GPU proof in one command (bench/gpu_proof.py: what it runs and the report it writes).
#   scripts/gpu-proof.sh [--out DIR] [--sizes-gib 1,8,16] [--budget-s 540] [--tests-s S]
# Set up first (scripts/setup.sh, or scripts/setup.sh --bundle DIR --seal SEAL on a node with no registry).
set -euo pipefail
cd "$(dirname "$0")/.."
py=${TPAGENT_VENV:-.venv}/bin/python
[ -x "$py" ] || { echo "gpu-proof: no $py: run scripts/setup.sh (or --bundle DIR --seal SEAL) first" >&2; exit 2; }
exec "$py" bench/gpu_proof.py "$@"
