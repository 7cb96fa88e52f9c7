#!/usr/bin/env bash
# Prints `export DOCKER_HOST=…` for a Docker engine that answers: the one already configured, or one this
# script starts in the background with its own data root and socket (no host firewall changes), for
# machines where no daemon runs. Used by `make test-deploy`; stop it with `kill $(cat $ROOT/dockerd.pid)`.
set -euo pipefail
ROOT=${CHATSERVE_DOCKER_ROOT:-/var/lib/chatserve-docker}
if docker info >/dev/null 2>&1; then
  echo "export DOCKER_HOST=${DOCKER_HOST:-unix:///var/run/docker.sock}"
  exit 0
fi
SOCK=unix://$ROOT/docker.sock
if DOCKER_HOST=$SOCK docker info >/dev/null 2>&1; then
  echo "export DOCKER_HOST=$SOCK"
  exit 0
fi
command -v dockerd >/dev/null || { echo "no dockerd: apt-get install docker.io" >&2; exit 3; }
mkdir -p "$ROOT"
nohup setsid dockerd --iptables=false --ip-forward=false --ip-masq=false --storage-driver=overlay2 \
  --data-root "$ROOT/data" --exec-root "$ROOT/exec" --pidfile "$ROOT/dockerd.pid" -H "$SOCK" \
  >"$ROOT/dockerd.log" 2>&1 </dev/null &
for _ in $(seq 120); do
  if DOCKER_HOST=$SOCK docker info >/dev/null 2>&1; then
    echo "export DOCKER_HOST=$SOCK"
    exit 0
  fi
  sleep 0.5
done
echo "dockerd did not answer; see $ROOT/dockerd.log" >&2
tail -20 "$ROOT/dockerd.log" >&2
exit 3
