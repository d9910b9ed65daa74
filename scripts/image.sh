#!/usr/bin/env bash
# Build the container image from the Dockerfile, without a Docker engine: buildah (chroot
# isolation) on a Debian trixie base made here with debootstrap (no registry is needed).  As root.
#
#   scripts/image.sh            build tpagent:VERSION (VERSION: pyproject.toml's); print its name
#
# The base is kept between runs: its debootstrap tarball in TPAGENT_IMAGE_CACHE (default
# /var/cache/tpagent-image) and the image debian:trixie-slim in buildah's storage.  Inside the
# build, apt and pip use this machine's settings where it has its own: apt's
# /etc/apt/apt.conf.d/99artifact-registry and the host's CA bundle (for pip, as PIP_CERT).
# What the image is checked for: tests/image/ (run by scripts/test.sh).
set -euo pipefail
cd "$(dirname "$0")/.."

if [ "$(id -u)" != 0 ]; then
  echo "image: building the image needs root (buildah, debootstrap)" >&2
  exit 2
fi
version=$(python3 -c 'import tomllib; print(tomllib.load(open("pyproject.toml", "rb"))["project"]["version"])')
image=tpagent:$version
cache=${TPAGENT_IMAGE_CACHE:-/var/cache/tpagent-image}
base=debian:trixie-slim

missing=()
command -v buildah >/dev/null || missing+=(buildah)
command -v debootstrap >/dev/null || missing+=(debootstrap)
if [ ${#missing[@]} -gt 0 ]; then
  echo "image: installing ${missing[*]}" >&2
  apt-get update -q >/dev/null
  DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends "${missing[@]}" >/dev/null
fi

if ! buildah inspect --type image "$base" >/dev/null 2>&1; then
  mkdir -p "$cache"
  chmod 700 "$cache"
  tarball=$cache/trixie-minbase.tar
  if [ ! -s "$tarball" ]; then
    root=$(mktemp -d)
    echo "image: making the base with debootstrap (kept in $tarball)" >&2
    debootstrap --variant=minbase trixie "$root" http://deb.debian.org/debian >/dev/null
    rm -rf "$root"/var/cache/apt/archives/*.deb "$root"/var/lib/apt/lists/*
    tar -C "$root" -cf "$tarball.new" .
    mv "$tarball.new" "$tarball"
    rm -rf "$root"
  fi
  ctr=$(buildah from scratch)
  tar -C "$(buildah mount "$ctr")" -xf "$tarball"
  buildah umount "$ctr" >/dev/null
  buildah config --cmd /bin/bash "$ctr"
  buildah commit -q --rm "$ctr" "$base" >/dev/null
fi

args=(--isolation chroot --pull-never --network host --layers -t "$image")
if [ -f /etc/apt/apt.conf.d/99artifact-registry ]; then
  args+=(-v /etc/apt/apt.conf.d/99artifact-registry:/etc/apt/apt.conf.d/99artifact-registry:ro)
fi
if [ -f /etc/ssl/certs/ca-certificates.crt ]; then
  # (mounted beside the image's own CA file: over it, the image's ca-certificates would break)
  args+=(-v /etc/ssl/certs/ca-certificates.crt:/run/host-ca.crt:ro --build-arg PIP_CERT=/run/host-ca.crt)
fi
buildah bud "${args[@]}" . >&2
buildah rmi --prune >/dev/null 2>&1 || true  # (the images this tag named before: not kept)
echo "$image"
