#!/usr/bin/env bash
# Set up (scripts/setup.sh), then check the code (mypy, ruff, the import layers), run the unit
# tier as user nobody, and the whole test suite as root.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
.venv/bin/mypy
.venv/bin/ruff check .
.venv/bin/ruff format --check .
.venv/bin/python scripts/check_layers.py

# The unit tier needs no privilege, and proves it: it runs as nobody, with a home and a temporary
# directory of its own, and writes nothing into the tree (no bytecode, no pytest cache).
scratch=$(mktemp -d)
trap 'rm -rf "$scratch"' EXIT
chown nobody:nogroup "$scratch"
as_nobody=(setpriv --reuid=nobody --regid=nogroup --clear-groups
  env HOME="$scratch" TMPDIR="$scratch" PYTHONDONTWRITEBYTECODE=1)
python=.venv/bin/python
site_packages=
if ! "${as_nobody[@]}" "$python" -c '' 2>/dev/null; then
  # .venv was made from a Python that nobody cannot run (pyenv's, under /root): take the
  # system's Python of the same version, with .venv's packages.
  python=/usr/bin/python3
  version='import sys; print(*sys.version_info[:2])'
  if [ "$(.venv/bin/python -c "$version")" != "$("$python" -c "$version")" ]; then
    echo "test: user nobody cannot run .venv/bin/python, and $python is another version;" \
      "make .venv from a Python that anyone can run." >&2
    exit 1
  fi
  site_packages=$(.venv/bin/python -c 'import sysconfig; print(sysconfig.get_path("purelib"))')
fi
"${as_nobody[@]}" PYTHONPATH="$site_packages" "$python" -m pytest tests/unit -p no:cacheprovider --timeout=60

# Without a working CRIU the integration tests would skip; here that must fail instead.  (This
# runs tests/unit again, as root: cheap, and it takes the branches that only root can.)
TPAGENT_TESTS_NEED_CRIU=1 .venv/bin/pytest "$@"
