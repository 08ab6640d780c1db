#!/usr/bin/env bash
# Build the local base image (Debian bookworm minbase + python3/venv + gcc) without any image
# registry: debootstrap a rootfs from Debian's package mirror, tar it, `docker import` it. gcc is
# there because workers build their C CPU kernels (engine/kernels/cpu_library.py) at start-up for
# the CPU they run on; without it they fall back to the slower torch path.
# Cached: the rootfs tar lives in $CACHE (git-ignored); an existing image is kept.
#   docker/build_base.sh IMAGE CACHE_DIR
set -euo pipefail
IMAGE=${1:-pdserve-base:bookworm-cc}
CACHE=${2:-.cache/image}
MIRROR=${DEBIAN_MIRROR:-http://deb.debian.org/debian}
TAR="$CACHE/bookworm-minbase-cc.tar"

if docker image inspect "$IMAGE" >/dev/null 2>&1; then
  echo "base image $IMAGE: present"; exit 0
fi
mkdir -p "$CACHE"
if [ ! -s "$TAR" ]; then
  command -v debootstrap >/dev/null || { apt-get update -q && apt-get install -y -q debootstrap; }
  ROOT=$(mktemp -d "$CACHE/rootfs.XXXXXX")
  trap 'rm -rf "$ROOT"' EXIT
  echo "debootstrap bookworm minbase into $ROOT (a few minutes)"
  debootstrap --variant=minbase --include=python3,python3-venv,ca-certificates,libnuma1,gcc,libc6-dev \
    bookworm "$ROOT" "$MIRROR" > "$CACHE/debootstrap.log" 2>&1 \
    || { tail -20 "$CACHE/debootstrap.log"; exit 1; }
  chroot "$ROOT" apt-get clean
  rm -rf "$ROOT"/var/lib/apt/lists/* "$ROOT"/var/cache/apt/*.bin "$ROOT"/usr/share/doc/* "$ROOT"/usr/share/man/*
  tar -C "$ROOT" --numeric-owner -cf "$TAR.tmp" .
  mv "$TAR.tmp" "$TAR"
fi
docker import --change 'ENV LANG=C.UTF-8' --change 'CMD ["/bin/bash"]' "$TAR" "$IMAGE" >/dev/null
echo "base image $IMAGE: imported from $TAR"
