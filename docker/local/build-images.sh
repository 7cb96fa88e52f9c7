#!/usr/bin/env bash
# Builds the images the compose stack runs: chatserve:cpu from docker/Dockerfile, and, when the official
# base images cannot be pulled, a local Debian base plus Redis and HAProxy images on it. Classic builder
# (BuildKit would fetch its frontend), host network for apt and pip during the build.
set -euo pipefail
eval "$(bash "$(dirname "$0")/engine.sh")"   # the engine that answers, started if need be
cd "$(dirname "$0")/../.."
export DOCKER_BUILDKIT=0
build() { docker build --network host -q "$@" >/dev/null; }
# The classic builder ignores docker/Dockerfile.dockerignore: send exactly the files the image copies.
build_app() { tar -c --exclude=__pycache__ pyproject.toml README.md chatserve kernels static docker/Dockerfile \
                | docker build --network host -q -f docker/Dockerfile "$@" - >/dev/null; }
if [ "${CHATSERVE_LOCAL_BASE:-auto}" = auto ]; then
  if timeout 60 docker pull -q python:3.12-slim-bookworm >/dev/null 2>&1; then
    CHATSERVE_LOCAL_BASE=0
  else
    CHATSERVE_LOCAL_BASE=1
  fi
fi
if [ "$CHATSERVE_LOCAL_BASE" = 1 ]; then
  echo "building on a local Debian base (official images out of reach)" >&2
  bash docker/local/base-image.sh local/bookworm-python:latest
  build -f docker/local/Dockerfile.redis -t chatserve-local/redis:latest docker/local
  build -f docker/local/Dockerfile.haproxy -t chatserve-local/haproxy:latest docker/local
  # torch's CPU build as this machine's pip resolves it (PyPI's default wheel is the CUDA one), baked into
  # a base layer; docker/Dockerfile then finds torch==2.13.0 installed.
  ctx=$(mktemp -d)
  python3 -m pip download -q --no-deps --only-binary=:all: torch==2.13.0 -d "$ctx"
  cp docker/local/Dockerfile.torch "$ctx/"
  build -f "$ctx/Dockerfile.torch" -t local/bookworm-python-torch:latest "$ctx"
  rm -rf "$ctx"
  build_app --build-arg BASE_IMAGE=local/bookworm-python-torch:latest --build-arg TORCH_INDEX_URL= -t chatserve:cpu
else
  docker pull -q redis:7.4-alpine >/dev/null && docker tag redis:7.4-alpine chatserve-local/redis:latest
  docker pull -q haproxy:2.6-bookworm >/dev/null && docker tag haproxy:2.6-bookworm chatserve-local/haproxy:latest
  build_app -t chatserve:cpu
fi
echo "images: chatserve:cpu chatserve-local/redis chatserve-local/haproxy" >&2
