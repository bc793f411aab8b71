#!/usr/bin/env bash
# Stand-ins for the compose cluster's public base images, for machines that reach no image registry
# but do reach the Debian archive: a Debian root filesystem made by `debootstrap --variant=minbase`
# with python3.11 and its venv module (for deploy/Dockerfile's BASE_IMAGE, in place of
# python:3.11-slim), `docker import`ed, and Debian's redis-server on top of it (for the compose
# file's PDROUTER_REDIS_IMAGE, in place of redis:7.4-alpine). An image already there is kept, so
# the daemon caches them between runs. Run as root (debootstrap), with a Docker daemon up.
#
#   scripts/compose_standin_images.sh            # prints "BASE_IMAGE=..." and "REDIS_IMAGE=..."
#
# Variables: STANDIN_BASE_TAG, STANDIN_REDIS_TAG (the tags), DEBIAN_SUITE (bookworm, whose
# python3 is 3.11), DEBIAN_MIRROR (http://deb.debian.org/debian), DOCKER (the docker command).
set -euo pipefail

BASE_TAG=${STANDIN_BASE_TAG:-pdrouter-standin/python:3.11-slim}
REDIS_TAG=${STANDIN_REDIS_TAG:-pdrouter-standin/redis:7}
SUITE=${DEBIAN_SUITE:-bookworm}
MIRROR=${DEBIAN_MIRROR:-http://deb.debian.org/debian}
DOCKER=${DOCKER:-docker}

have_image() { $DOCKER image inspect "$1" >/dev/null 2>&1; }

if ! have_image "$BASE_TAG"; then
  command -v debootstrap >/dev/null || { echo "compose-standin: debootstrap is not installed" >&2; exit 1; }
  root=$(mktemp -d /var/tmp/pdrouter-standin.XXXXXX)
  trap 'rm -rf "$root"' EXIT
  echo "compose-standin: debootstrap $SUITE from $MIRROR into $root" >&2
  debootstrap --variant=minbase \
    --include=python3.11,python3.11-venv,python3-venv,python-is-python3,ca-certificates \
    "$SUITE" "$root/rootfs" "$MIRROR" >"$root/debootstrap.log" 2>&1 \
    || { tail -20 "$root/debootstrap.log" >&2; echo "compose-standin: debootstrap failed" >&2; exit 1; }
  # What an image does not need: package caches and lists (apt-get update refills the lists).
  rm -rf "$root"/rootfs/var/cache/apt/*.bin "$root"/rootfs/var/cache/apt/archives/*.deb \
         "$root"/rootfs/var/lib/apt/lists/* "$root"/rootfs/tmp/* "$root"/rootfs/var/log/*
  tar -C "$root/rootfs" --numeric-owner -c . | $DOCKER import \
    --change 'ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin' \
    --change 'ENV LANG=C.UTF-8' \
    --change 'CMD ["python3"]' \
    --message "debootstrap --variant=minbase $SUITE + python3.11 (stand-in for python:3.11-slim)" \
    - "$BASE_TAG" >/dev/null
  rm -rf "$root"
  trap - EXIT
fi

if ! have_image "$REDIS_TAG"; then
  echo "compose-standin: building $REDIS_TAG (Debian's redis-server on $BASE_TAG)" >&2
  printf '%s\n' \
    "FROM $BASE_TAG" \
    "RUN apt-get update && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends redis-server \\" \
    " && apt-get clean && rm -rf /var/lib/apt/lists/*" \
    "WORKDIR /var/lib/redis" \
    "EXPOSE 6379" \
    'CMD ["redis-server", "--bind", "0.0.0.0", "--protected-mode", "no"]' \
    | $DOCKER build -q -t "$REDIS_TAG" - >/dev/null
fi

echo "BASE_IMAGE=$BASE_TAG"
echo "REDIS_IMAGE=$REDIS_TAG"
