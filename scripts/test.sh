#!/usr/bin/env bash
# Set up (scripts/setup.sh), then type-check the package and run the whole test suite.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
.venv/bin/mypy
.venv/bin/pytest "$@"
