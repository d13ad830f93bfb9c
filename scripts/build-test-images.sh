#!/usr/bin/env bash
# Builds the container images the tests, the benchmark and the README example use, offline,
# and pushes them to the local registry (ensure-services.sh starts it on 127.0.0.1:5000):
#
#   $REGISTRY/gpufleet/busybox:1   busybox-static only (/bin/sh, sleep, ...): ~1 MB
#   $REGISTRY/gpufleet/privprobe:1 busybox plus /bin/privprobe (scripts/test-images/privprobe.c,
#                                  static) installed setuid-root: what a hostile image could
#                                  gain (the container hardening tests)
#   $REGISTRY/gpufleet/python:3.11 the host's Debian python3.11 + stdlib + busybox, plus numpy,
#                                  scipy and scikit-learn copied from a virtualenv (for
#                                  examples/train_digits.py) when one with them is given
#
# Usage: scripts/build-test-images.sh [VENV_SITE_PACKAGES]   (idempotent: skips images the
# registry already has; FORCE=1 rebuilds). Needs podman, busybox-static, python3.11, gcc and
# libc6-dev (static libc, for privprobe).
set -euo pipefail
cd "$(dirname "$0")/.."
REGISTRY="${GPUFLEET_TEST_REGISTRY:-127.0.0.1:5000}"
SITE="${1:-}"
if [ -z "$SITE" ] && [ -d .venv/lib/python3.11/site-packages ]; then
  SITE=.venv/lib/python3.11/site-packages
fi
PODMAN=(podman --runtime runc --cgroup-manager cgroupfs)

in_registry() {  # repo tag
  curl -sf "http://$REGISTRY/v2/$1/manifests/$2" \
    -H 'Accept: application/vnd.oci.image.manifest.v1+json' \
    -H 'Accept: application/vnd.docker.distribution.manifest.v2+json' >/dev/null 2>&1
}

registry_label() {  # repo tag label: the label's value in the registry's image config, or ""
  local digest
  digest="$(curl -sf "http://$REGISTRY/v2/$1/manifests/$2" \
    -H 'Accept: application/vnd.oci.image.manifest.v1+json' \
    -H 'Accept: application/vnd.docker.distribution.manifest.v2+json' |
    python3 -c 'import json, sys; print(json.load(sys.stdin)["config"]["digest"])')" || return 0
  curl -sf "http://$REGISTRY/v2/$1/blobs/$digest" | python3 -c \
    'import json, sys; print((json.load(sys.stdin).get("config") or {}).get("Labels", {}).get(sys.argv[1], ""))' \
    "$3" || true
}

push() {  # local-ref repo tag
  "${PODMAN[@]}" push --tls-verify=false "$1" "$REGISTRY/$2:$3" >/dev/null
  # a copy pulled earlier under the registry's name would otherwise stay and start "warm"
  "${PODMAN[@]}" tag "$1" "$REGISTRY/$2:$3"
  echo "pushed $REGISTRY/$2:$3"
}

busybox_root() {  # dir
  mkdir -p "$1/bin" "$1/tmp" "$1/etc"
  cp "$(command -v busybox)" "$1/bin/busybox"
  for c in $("$1/bin/busybox" --list); do [ -e "$1/bin/$c" ] || ln -s busybox "$1/bin/$c"; done
  echo "root:x:0:0:root:/root:/bin/sh" >"$1/etc/passwd"
  echo "root:x:0:" >"$1/etc/group"
}

WORK="$(mktemp -d)"
trap 'rm -rf "$WORK"' EXIT
if [ -z "${CONTAINERS_CONF:-}" ]; then  # the settings the agent passes too (no global file)
  printf '[containers]\ndefault_ulimits = []\n[engine]\nevents_logger = "file"\n' >"$WORK/containers.conf"
  export CONTAINERS_CONF="$WORK/containers.conf"
fi

if [ "${FORCE:-0}" = 1 ] || ! in_registry gpufleet/busybox 1; then
  busybox_root "$WORK/bb"
  tar -C "$WORK/bb" -cf "$WORK/bb.tar" .
  "${PODMAN[@]}" import --change 'CMD ["/bin/sh"]' "$WORK/bb.tar" localhost/gpufleet/busybox:1 >/dev/null
  push localhost/gpufleet/busybox:1 gpufleet/busybox 1
fi

if [ "${FORCE:-0}" = 1 ] || ! in_registry gpufleet/privprobe 1; then
  busybox_root "$WORK/pp"
  gcc -static -O2 -o "$WORK/pp/bin/privprobe" scripts/test-images/privprobe.c
  chmod 4755 "$WORK/pp/bin/privprobe"
  tar --owner=0 --group=0 -C "$WORK/pp" -cf "$WORK/pp.tar" .
  "${PODMAN[@]}" import --change 'CMD ["/bin/privprobe"]' "$WORK/pp.tar" localhost/gpufleet/privprobe:1 >/dev/null
  push localhost/gpufleet/privprobe:1 gpufleet/privprobe 1
fi

# The README example needs numpy and scikit-learn in the image: an image built before the
# virtualenv had them (the label says "no") is rebuilt once they are there.
EXAMPLES=no
if [ -n "$SITE" ] && [ -d "$SITE/sklearn" ]; then EXAMPLES=yes; fi
if [ "${FORCE:-0}" = 1 ] || ! in_registry gpufleet/python 3.11 ||
  { [ "$EXAMPLES" = yes ] && [ "$(registry_label gpufleet/python 3.11 gpufleet.examples)" != yes ]; } ||
  [ "$(registry_label gpufleet/python 3.11 gpufleet.libc)" != full ]; then
  R="$WORK/py"
  busybox_root "$R"
  PY="$(readlink -f /usr/bin/python3.11)"
  mkdir -p "$R/usr/bin" "$R/usr/lib" "$R/usr/local/lib/python3.11/dist-packages"
  cp "$PY" "$R/usr/bin/python3.11"
  ln -s python3.11 "$R/usr/bin/python3"; ln -s python3.11 "$R/usr/bin/python"
  tar -C /usr/lib --exclude='python3.11/test' --exclude='__pycache__' \
    --exclude='python3.11/idlelib' --exclude='python3.11/tkinter' -cf - python3.11 |
    tar -C "$R/usr/lib" -xf -
  if [ "$EXAMPLES" = yes ]; then
    for p in numpy numpy.libs scipy scipy.libs sklearn scikit_learn.libs joblib cloudpickle threadpoolctl.py narwhals; do
      [ -e "$SITE/$p" ] && cp -a "$SITE/$p" "$R/usr/local/lib/python3.11/dist-packages/"
    done
    find "$R/usr/local/lib/python3.11/dist-packages" -name __pycache__ -prune -exec rm -rf {} +
    rm -rf "$R"/usr/local/lib/python3.11/dist-packages/scipy/*/tests
  fi
  # Shared libraries of the interpreter and of every extension module, with their paths.
  find "$R/usr" -name '*.so*' -type f -print0 | xargs -0 -r ldd 2>/dev/null |
    awk '/=> \//{print $3} /^\s*\/lib/{print $1}' | sort -u >"$WORK/libs"
  ldd "$PY" | awk '/=> \//{print $3} /^\s*\/lib/{print $1}' >>"$WORK/libs"
  sort -u "$WORK/libs" | while read -r lib; do
    [ -e "$lib" ] || continue
    mkdir -p "$R$(dirname "$lib")"; cp -L "$lib" "$R$lib"
  done
  [ -e "$R/lib64" ] || { mkdir -p "$R/lib64"; cp -L /lib64/ld-linux-x86-64.so.2 "$R/lib64/"; }
  # The whole C library (librt, libutil, libnss_*, ...), not only what the interpreter links:
  # manylinux wheels (grpcio, pydantic-core) need more of it, e.g. in the gpufleet image that
  # deploy/container/build.sh builds FROM this one.
  dpkg -L libc6 | grep -E '^/(usr/)?lib[^/]*/([^/]+/)?[^/]+\.so(\.[0-9]+)*$' | while read -r lib; do
    [ -e "$lib" ] && [ ! -e "$R$lib" ] || continue
    mkdir -p "$R$(dirname "$lib")"; cp -L "$lib" "$R$lib"
  done
  mkdir -p "$R/opt/gpufleet"; cp examples/train_digits.py "$R/opt/gpufleet/"
  tar -C "$R" -cf "$WORK/py.tar" .
  "${PODMAN[@]}" import --change 'CMD ["/usr/bin/python3"]' --change 'ENV PYTHONDONTWRITEBYTECODE=1' \
    --change "LABEL gpufleet.examples=$EXAMPLES" --change "LABEL gpufleet.libc=full" \
    "$WORK/py.tar" localhost/gpufleet/python:3.11 >/dev/null
  "${PODMAN[@]}" run --rm --network none localhost/gpufleet/python:3.11 \
    python3 -c 'import json, ssl, sqlite3; print("python ok")'
  if [ "$EXAMPLES" = yes ]; then
    "${PODMAN[@]}" run --rm --network none localhost/gpufleet/python:3.11 \
      python3 -c 'import numpy, sklearn; print("examples ok")'
  else
    echo "note: no virtualenv with scikit-learn (run make install first): gpufleet/python:3.11 has no numpy/scikit-learn; it is rebuilt with them once they are installed" >&2
  fi
  push localhost/gpufleet/python:3.11 gpufleet/python 3.11
fi
