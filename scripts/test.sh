#!/usr/bin/env bash
# Set up (scripts/setup.sh), then check the code (mypy, ruff, the import layers) and run the test
# tiers, each once, in this order (tests/conftest.py says which test is in which tier):
#
#   unit     tests/unit, as nobody: no process, server or job; each test well under a second
#   rank     tests/rank, as nobody: the rank runtime and the rewire of ranks (torch jobs)
#   gpu      as root: tests marked gpu (skipped without an NVIDIA GPU)
#   image    as root: the container image, built from the Dockerfile (scripts/image.sh:
#            buildah, a debootstrap base kept between runs) and run (tests/image)
#   cluster  as root: real CRIU, processes, network namespaces as nodes (tests/snapshot,
#            transfer, agent, cli), and root's own branches (tests/host)
#
# Each tier's wall time is printed after it, and all of them at the end.  The last tier gets this
# script's arguments (bash scripts/test.sh -x -k migrate, or a test's path).
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
.venv/bin/mypy
.venv/bin/ruff check .
.venv/bin/ruff format --check .
.venv/bin/python scripts/check_layers.py

# The tiers that need no privilege prove it: they run as nobody, with a home and a temporary
# directory of their own, and write nothing into the tree (no bytecode, no pytest cache).
scratch=$(mktemp -d)
logs=$(mktemp -d)
tiers=()
report() {
  if [ ${#tiers[@]} -gt 0 ]; then
    printf '\n'
    printf '%s\n' "${tiers[@]}"
  fi
  rm -rf "$scratch" "$logs"
}
trap report EXIT
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
as_nobody+=(PYTHONPATH="$site_packages" "$python" -m pytest -p no:cacheprovider)

# tier NAME COMMAND...: run one tier's pytest, then say its wall time and pytest's count.
tier() {
  local name=$1 start rc=0 took counts
  shift
  start=$(date +%s.%N)
  "$@" 2>&1 | tee "$logs/$name" || rc=$?
  took=$(awk -v a="$start" -v b="$(date +%s.%N)" 'BEGIN { printf "%.1f", b - a }')
  # pytest's last line: "==== 240 passed, 4 skipped in 12.31s ====" (colours, if any, taken off)
  counts=$(sed -e 's/\x1b\[[0-9;]*m//g' "$logs/$name" |
    sed -n -E 's/^=+ (.*) in [0-9.]+s( \([0-9:]+\))? =+$/\1/p' | tail -n 1)
  tiers+=("tier $name: $took s, ${counts:-no summary}$([ "$rc" = 0 ] || echo " (exit $rc)")")
  echo "${tiers[-1]}"
  if [ "$rc" = 5 ]; then
    echo "test: tier $name ran no test: its directory or its mark is wrong" >&2
  fi
  return "$rc"
}

# Without a working CRIU the tests that need it would skip; here that fails instead (and a test
# that needs CRIU in a tier run as nobody fails at once).
export TPAGENT_TESTS_NEED_CRIU=1
tier unit "${as_nobody[@]}" -m unit tests/unit --timeout=60
tier rank "${as_nobody[@]}" -m rank tests/rank
tier gpu .venv/bin/pytest -m gpu
tier image .venv/bin/pytest -m image tests/image
tier cluster .venv/bin/pytest -m cluster "$@"
