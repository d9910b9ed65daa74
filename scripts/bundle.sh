#!/usr/bin/env bash
# Write an offline bundle of tpagent for nodes with no package registry (run it where the
# registries are reachable; as root, for the CRIU prefix):
#
#   scripts/bundle.sh OUT [--python 3.12] [--platform manylinux_2_28_x86_64]
#
# OUT/criu.tar.gz  the private CRIU >= 4.2 prefix of scripts/install-criu.sh (its loader and libraries)
# OUT/wheels/    tpagent's wheel and the wheels of every runtime dependency, for that Python and
#                platform, plus what `pip install -e .` of a checkout needs to build (grpcio-tools...)
#                and the GPU proof's test runner (pytest); cuda-bindings too, used only where the
#                node has none of its own
# OUT/tools/     ip (iproute2) and nft (nftables) of this machine, each with its libraries and
#                their loader: used only where the node has none (GPU images may lack both: the
#                proof's tests make network namespaces with ip; tpagent removes CRIU's network
#                lock with nft)
# OUT/requirements.txt   every wheel, pinned, with its sha256 (pip --require-hashes)
# OUT/SHA256SUMS         every file of the bundle
#
# It prints its seal, the sha256 of OUT/SHA256SUMS (also written beside it, as OUT.seal): give it
# to the node by another way than the bundle.  Install with `scripts/setup.sh --bundle OUT --seal
# SEAL` (no network at all): the bundle is checked against the seal and copied, only the copy used.  torch is not in it: the
# GPU nodes have their own, which the bundle's venv sees.  The UCX transport is not in it
# either (its wheels are large and need the node's RDMA stack): TCP (with TLS) is what moves.
set -euo pipefail
cd "$(dirname "$0")/.."

usage() { echo "usage: scripts/bundle.sh OUT [--python X.Y] [--platform PLATFORM]" >&2; exit 2; }
[ $# -ge 1 ] || usage
out=$1
shift
py=3.12
platforms=(manylinux_2_28_x86_64 manylinux_2_17_x86_64 manylinux2014_x86_64)
while [ $# -gt 0 ]; do
  case $1 in
    --python) py=${2:?}; shift 2 ;;
    --platform) platforms=("${2:?}"); shift 2 ;;
    *) usage ;;
  esac
done
[[ $py =~ ^3\.[0-9]+$ ]] || { echo "bundle: --python takes a version like 3.12" >&2; exit 2; }
if [ -e "$out" ] && [ -n "$(ls -A "$out")" ]; then
  echo "bundle: $out exists and is not empty; give a new directory" >&2
  exit 2
fi
[ -x .venv/bin/python ] || scripts/setup.sh

mkdir -p "$out/wheels"
scripts/install-criu.sh >/dev/null
tar -C "${TPAGENT_CRIU_PREFIX:-/opt/tpagent/criu}" --exclude=./usr/share/doc --exclude=./usr/share/man \
  --exclude=./usr/share/lintian -czf "$out/criu.tar.gz" .
mkdir -p "$out/tools/lib"
for tool in ip nft; do
  bin=$(command -v $tool) || { echo "bundle: $tool is not on this machine (apt-get install iproute2 nftables)" >&2; exit 2; }
  cp -L "$bin" "$out/tools/$tool"
  ldd "$bin" | grep -o '/[^ ]*' | while read -r lib; do
    name=${lib##*/}
    case $name in ld-linux*) name=ld.so ;; esac  # (the loader, under one name whatever the machine)
    [ -e "$out/tools/lib/$name" ] || cp -L "$lib" "$out/tools/lib/$name"
  done
done

abi=cp${py/./}
pip_for_target=(.venv/bin/pip download -q --disable-pip-version-check --only-binary=:all: -d "$out/wheels"
  --python-version "$py" --implementation cp --abi "$abi")
for p in "${platforms[@]}"; do pip_for_target+=(--platform "$p"); done
# What tpagent needs at run time (pyproject's dependencies, cuda-bindings aside: it
# is fetched alone, as nodes with a CUDA stack have their own), what a checkout's `pip install -e .`
# builds with (pyproject's build-system), and the proof's test runner.
runtime=$(.venv/bin/python - <<'PY'
import tomllib
deps = tomllib.load(open("pyproject.toml", "rb"))["project"]["dependencies"]
print("\n".join(d.split("#")[0].strip() for d in deps if not d.startswith("cuda-bindings")))
PY
)
build=$(.venv/bin/python -c 'import tomllib; print("\n".join(tomllib.load(open("pyproject.toml","rb"))["build-system"]["requires"]))')
mapfile -t wanted < <(printf '%s\n' "$runtime" "$build" "wheel" "pytest>=8" "pytest-timeout>=2.3" "cuda-bindings>=12.8")
"${pip_for_target[@]}" "${wanted[@]}"
rm -rf build  # (setuptools' staging area: a stale one would put files since removed into the wheel)
.venv/bin/pip wheel -q --disable-pip-version-check --no-deps -w "$out/wheels" .
rm -rf build

(
  cd "$out/wheels"
  for w in *.whl; do
    name=${w%%-*}
    version=$(echo "$w" | cut -d- -f2)
    echo "${name//_/-}==$version --hash=sha256:$(sha256sum "$w" | cut -d' ' -f1)"
  done
) >"$out/requirements.txt"
echo "python=$py platforms=${platforms[*]} made=$(date -u +%FT%TZ) from=$(git rev-parse --short HEAD 2>/dev/null || echo unknown)" >"$out/BUNDLE"
(cd "$out" && find . -type f ! -name SHA256SUMS -print0 | sort -z | xargs -0 sha256sum >SHA256SUMS)
seal=$(sha256sum "$out/SHA256SUMS" | cut -d' ' -f1)
echo "$seal" >"${out%/}.seal"
echo "bundle: $out, $(du -sh "$out" | cut -f1) ($(du -sh "$out/wheels" | cut -f1) wheels, $(du -sh "$out/criu.tar.gz" | cut -f1) CRIU), for Python $py"
echo "bundle: its seal is $seal (in ${out%/}.seal): scripts/setup.sh --bundle DIR --seal $seal"
