#!/usr/bin/env bash
# Makes the images' base from Debian bookworm's own packages, for machines that reach a Debian
# mirror but no image registry: debootstrap's minimal system plus Python 3.11 (bookworm's own, with
# venv), the CA certificates and the bookworm, bookworm-updates and bookworm-security sources,
# upgraded to the mirror's latest, then imported into podman. The Dockerfiles take it as their base:
#   bash docker/debian-base.sh                                   # localhost/kinetics-fast-base:bookworm
#   podman build --format docker --build-arg BASE_IMAGE=localhost/kinetics-fast-base:bookworm -f docker/Dockerfile ...
# Knobs: the image's name as the first argument; DEBIAN_MIRROR and DEBIAN_SECURITY_MIRROR (default
# deb.debian.org's). An image of that name already there is kept (delete it to make it again:
# `podman rmi NAME`). Needs root, debootstrap and podman.
set -euo pipefail
IMAGE=${1:-localhost/kinetics-fast-base:bookworm}
MIRROR=${DEBIAN_MIRROR:-http://deb.debian.org/debian}
SECURITY=${DEBIAN_SECURITY_MIRROR:-http://deb.debian.org/debian-security}

if podman image exists "$IMAGE"; then
  echo "debian-base: $IMAGE is there already"
  exit 0
fi
rootfs=$(mktemp -d /var/tmp/kf-base.XXXXXX)
trap 'rm -rf "$rootfs"' EXIT
echo "debian-base: debootstrap bookworm from $MIRROR"
debootstrap --variant=minbase --include=python3,python3-venv,ca-certificates bookworm "$rootfs" "$MIRROR" >/dev/null
cat > "$rootfs/etc/apt/sources.list" <<EOF
deb $MIRROR bookworm main
deb $MIRROR bookworm-updates main
deb $SECURITY bookworm-security main
EOF
cp /etc/resolv.conf "$rootfs/etc/resolv.conf"
chroot "$rootfs" apt-get update -qq
DEBIAN_FRONTEND=noninteractive chroot "$rootfs" apt-get upgrade -y -qq >/dev/null
chroot "$rootfs" apt-get clean
rm -rf "$rootfs"/var/lib/apt/lists/* "$rootfs"/var/cache/apt/*.bin
: > "$rootfs/etc/resolv.conf"  # the runtime writes its own
tar -C "$rootfs" --numeric-owner -c . |
  podman import --change 'ENV LANG=C.UTF-8' --change 'CMD ["python3"]' - "$IMAGE" >/dev/null
echo "debian-base: $IMAGE ($(podman image inspect --format '{{.Size}}' "$IMAGE") bytes)"
