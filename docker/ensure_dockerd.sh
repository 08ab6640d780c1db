#!/usr/bin/env bash
# Make sure a Docker daemon answers: install Debian's docker.io + docker-compose when absent,
# start dockerd in the background when it is not running, wait until `docker info` works.
set -euo pipefail
need=()
command -v dockerd >/dev/null || need+=(docker.io)
command -v docker-compose >/dev/null || need+=(docker-compose)
command -v debootstrap >/dev/null || need+=(debootstrap)
if [ ${#need[@]} -gt 0 ]; then
  echo "installing ${need[*]} (apt)"
  apt-get update -q >/dev/null && DEBIAN_FRONTEND=noninteractive apt-get install -y -q "${need[@]}" >/dev/null
fi
if ! docker info >/dev/null 2>&1; then
  echo "starting dockerd (log: /var/log/pdserve-dockerd.log)"
  nohup dockerd > /var/log/pdserve-dockerd.log 2>&1 &
  for _ in $(seq 60); do docker info >/dev/null 2>&1 && break; sleep 1; done
fi
docker info >/dev/null 2>&1 || { tail -20 /var/log/pdserve-dockerd.log; echo "dockerd did not start"; exit 1; }
echo "dockerd: $(docker version --format '{{.Server.Version}}')"
