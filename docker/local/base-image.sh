#!/usr/bin/env bash
# Builds local/bookworm-python (Debian bookworm, minbase + python3-venv) with debootstrap and imports it,
# for machines that cannot pull the official base images. Idempotent: does nothing if the image exists.
set -euo pipefail
eval "$(bash "$(dirname "$0")/engine.sh")"   # the engine that answers, started if need be
IMAGE=${1:-local/bookworm-python:latest}
if docker image inspect "$IMAGE" >/dev/null 2>&1; then exit 0; fi
MIRROR=$(grep -rhE '^[[:space:]]*(URIs:|deb )' /etc/apt/sources.list /etc/apt/sources.list.d/ 2>/dev/null \
         | grep -oE 'https?://[^ ]*/debian/?$' | head -1 || true)
MIRROR=${MIRROR:-http://deb.debian.org/debian}
DIR=$(mktemp -d)
trap 'rm -rf "$DIR"' EXIT
debootstrap --variant=minbase bookworm "$DIR/rootfs" "$MIRROR" >"$DIR/debootstrap.log" 2>&1 \
  || { tail -20 "$DIR/debootstrap.log" >&2; exit 1; }
# Local trust anchors too (a TLS-intercepting proxy's CA, as on build machines behind one), so apt and pip
# inside the images trust what the host trusts.
mkdir -p "$DIR/rootfs/usr/local/share/ca-certificates"
cp /usr/local/share/ca-certificates/*.crt "$DIR/rootfs/usr/local/share/ca-certificates/" 2>/dev/null || true
chroot "$DIR/rootfs" /bin/sh -c 'apt-get update -q && DEBIAN_FRONTEND=noninteractive \
  apt-get install -y -q --no-install-recommends python3 python3-venv ca-certificates && update-ca-certificates \
  && apt-get clean \
  && rm -rf /var/lib/apt/lists/*' >"$DIR/chroot.log" 2>&1 || { tail -20 "$DIR/chroot.log" >&2; exit 1; }
tar -C "$DIR/rootfs" -c . | docker import -c 'ENV LANG=C.UTF-8' \
  -c 'ENV PIP_CERT=/etc/ssl/certs/ca-certificates.crt SSL_CERT_FILE=/etc/ssl/certs/ca-certificates.crt' \
  - "$IMAGE" >/dev/null
