#!/usr/bin/env bash
# Builds the gpufleet image (deploy/container/Containerfile) with podman, offline inside the
# build: the wheelhouse (gpufleet, its dependencies with the s3 extra, pip) is made here first,
# from the package index this host's pip is configured for (or its cache), and is the build
# context.
#
#   deploy/container/build.sh [TAG]            default TAG: localhost/gpufleet:$VERSION
#
# Environment: BASE_IMAGE (default python:3.11-slim-bookworm; CI: the offline-built
# 127.0.0.1:5000/gpufleet/python:3.11), EXTRAS (default s3), PIP (default .venv/bin/pip, else
# pip3), WHEELS (reuse a wheelhouse dir instead of building one), PODMAN_ARGS (extra flags for
# `podman build`).
set -euo pipefail
cd "$(dirname "$0")/../.."
VERSION="$(sed -n 's/^version = "\(.*\)"/\1/p' pyproject.toml | head -n1)"
TAG="${1:-localhost/gpufleet:$VERSION}"
BASE_IMAGE="${BASE_IMAGE:-docker.io/library/python:3.11-slim-bookworm}"
EXTRAS="${EXTRAS:-s3}"
PIP="${PIP:-}"
if [ -z "$PIP" ]; then
  if [ -x .venv/bin/pip ]; then PIP=.venv/bin/pip; else PIP=pip3; fi
fi
CTX="$(mktemp -d)"
trap 'rm -rf "$CTX"' EXIT
mkdir -p "$CTX/wheels"
if [ -n "${WHEELS:-}" ]; then
  cp "$WHEELS"/*.whl "$CTX/wheels/"
else
  # --no-build-isolation: gpufleet's own wheel is built with this environment's setuptools.
  # Markers are evaluated for this host's Python: async-timeout is what redis needs on a
  # Python older than 3.11.3 (Debian 12's python3.11 is 3.11.2), so it comes along always.
  "$PIP" wheel -q --no-build-isolation --wheel-dir "$CTX/wheels" ".[$EXTRAS]" pip async-timeout
fi
cp deploy/container/Containerfile "$CTX/Containerfile"
# shellcheck disable=SC2086
podman --runtime runc --cgroup-manager cgroupfs build ${PODMAN_ARGS:-} \
  --build-arg "BASE_IMAGE=$BASE_IMAGE" --build-arg "EXTRAS=$EXTRAS" \
  --build-arg "VERSION=$VERSION" -t "$TAG" -f "$CTX/Containerfile" "$CTX"
echo "built $TAG"
