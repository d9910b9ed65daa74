#!/usr/bin/env bash
# Set up (scripts/setup.sh), then type-check the package and run the whole test suite.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
.venv/bin/mypy
# Without a working CRIU the integration tests would skip; here that must fail instead.
TPAGENT_TESTS_NEED_CRIU=1 .venv/bin/pytest "$@"
