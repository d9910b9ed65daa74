#!/usr/bin/env bash
# Set up (scripts/setup.sh), then run the demo: a training job checkpointed and restored mid-run.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
.venv/bin/python examples/demo.py "$@"
