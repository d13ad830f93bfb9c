#!/usr/bin/env bash
# Makes sure the PostgreSQL (127.0.0.1:5432, trust auth, database `test`) and Redis
# (127.0.0.1:6379) that the tests use are running; installs them with apt-get if absent.
set -euo pipefail
SUDO=""; [ "$(id -u)" -ne 0 ] && SUDO="sudo"

if ! command -v pg_ctlcluster >/dev/null 2>&1 || ! command -v redis-server >/dev/null 2>&1; then
  $SUDO apt-get update -q
  $SUDO apt-get install -y -q postgresql redis-server
fi
if ! pg_isready -q -h 127.0.0.1 -p 5432; then
  $SUDO pg_ctlcluster --skip-systemctl-redirect "$(ls /etc/postgresql | head -n1)" main start
  for _ in $(seq 30); do pg_isready -q -h 127.0.0.1 -p 5432 && break; sleep 1; done
fi
if ! redis-cli -h 127.0.0.1 -p 6379 ping >/dev/null 2>&1; then
  redis-server --daemonize yes --bind 127.0.0.1 --port 6379 --save "" --appendonly no
  for _ in $(seq 30); do redis-cli -h 127.0.0.1 -p 6379 ping >/dev/null 2>&1 && break; sleep 1; done
fi
pg_isready -h 127.0.0.1 -p 5432
psql -h 127.0.0.1 -U postgres -d test -tAc 'select 1' >/dev/null
redis-cli -h 127.0.0.1 -p 6379 ping

# Debian's Chromium for the dashboard's browser tests (Playwright drives it through
# executable_path=/usr/bin/chromium; no browser is ever downloaded).
if ! command -v chromium >/dev/null 2>&1; then
  for _ in $(seq 10); do  # another apt-get may hold the lock
    $SUDO apt-get update -q && $SUDO env DEBIAN_FRONTEND=noninteractive \
      apt-get install -y -q chromium && break
    sleep 6
  done
fi
command -v chromium >/dev/null

# Job network namespaces (agent/runtime/jobnet.py): ip (iproute2), nft (nftables) and
# nsenter (util-linux); without them the agent runs jobs in the host namespace and says so.
if ! command -v ip >/dev/null 2>&1 || ! command -v nft >/dev/null 2>&1 \
    || ! command -v nsenter >/dev/null 2>&1; then
  for _ in $(seq 10); do  # another apt-get may hold the lock
    $SUDO apt-get update -q && $SUDO env DEBIAN_FRONTEND=noninteractive \
      apt-get install -y -q iproute2 nftables util-linux && break
    sleep 6
  done
fi

# Process-job isolation (tests/integration/test_agent_hardening.py): mkfs.ext4 (e2fsprogs)
# for the per-attempt scratch filesystems, util-linux's setpriv/unshare/mount, and gcc to
# build the LD_PRELOAD probe library (that test skips without it).
missing=""
[ -x /usr/sbin/mkfs.ext4 ] || [ -x /sbin/mkfs.ext4 ] || command -v mkfs.ext4 >/dev/null 2>&1 \
  || missing="$missing e2fsprogs"
command -v setpriv >/dev/null 2>&1 || missing="$missing util-linux"
command -v gcc >/dev/null 2>&1 || missing="$missing gcc"
if [ -n "$missing" ]; then
  for _ in $(seq 10); do  # another apt-get may hold the lock
    $SUDO apt-get update -q && $SUDO env DEBIAN_FRONTEND=noninteractive \
      apt-get install -y -q $missing && break
    sleep 6
  done
fi

# libfaketime for the skewed-clock test (tests/e2e/test_clock_skew.py; it skips without it).
if ! command -v faketime >/dev/null 2>&1; then
  for _ in $(seq 10); do  # another apt-get may hold the lock
    $SUDO apt-get update -q && $SUDO env DEBIAN_FRONTEND=noninteractive \
      apt-get install -y -q faketime && break
    sleep 6
  done
fi

# Container runtime for jobs with an `image` (tests need it; they fail, not skip, without it):
# podman + runc, a local docker-registry on 127.0.0.1:5000 (plain HTTP, loopback only) and the
# offline-built test images (scripts/build-test-images.sh). The agent passes its own podman
# settings (--runtime runc --cgroup-manager cgroupfs, CONTAINERS_CONF with default_ulimits = []),
# so nothing global is configured here. GPUFLEET_SKIP_CONTAINERS=1 leaves this part out.
if [ "${GPUFLEET_SKIP_CONTAINERS:-0}" != 1 ]; then
  missing=""
  command -v podman >/dev/null 2>&1 || missing="$missing podman"
  command -v runc >/dev/null 2>&1 || missing="$missing runc"
  command -v docker-registry >/dev/null 2>&1 || missing="$missing docker-registry"
  dpkg -s busybox-static >/dev/null 2>&1 || missing="$missing busybox-static"
  command -v curl >/dev/null 2>&1 || missing="$missing curl"
  command -v gcc >/dev/null 2>&1 || missing="$missing gcc"
  dpkg -s libc6-dev >/dev/null 2>&1 || missing="$missing libc6-dev"
  if [ -n "$missing" ]; then
    for _ in $(seq 10); do  # another apt-get may hold the lock
      $SUDO apt-get update -q && $SUDO env DEBIAN_FRONTEND=noninteractive \
        apt-get install -y -q podman runc docker-registry busybox-static curl gcc libc6-dev && break
      sleep 6
    done
  fi
  REGISTRY_CONF=/etc/gpufleet/registry.yml
  if [ ! -f "$REGISTRY_CONF" ]; then
    $SUDO mkdir -p /etc/gpufleet /var/lib/gpufleet/registry
    printf '%s\n' 'version: 0.1' 'log:' '  level: warn' 'storage:' '  filesystem:' \
      '    rootdirectory: /var/lib/gpufleet/registry' '  delete:' '    enabled: true' \
      'http:' '  addr: 127.0.0.1:5000' | $SUDO tee "$REGISTRY_CONF" >/dev/null
  fi
  if ! curl -sf http://127.0.0.1:5000/v2/ >/dev/null 2>&1; then
    $SUDO mkdir -p /var/log/gpufleet
    $SUDO sh -c "nohup docker-registry serve $REGISTRY_CONF >>/var/log/gpufleet/registry.log 2>&1 &"
    for _ in $(seq 30); do curl -sf http://127.0.0.1:5000/v2/ >/dev/null 2>&1 && break; sleep 1; done
  fi
  curl -sf http://127.0.0.1:5000/v2/ >/dev/null
  "$(dirname "$0")/build-test-images.sh"
fi

# Deployment artefacts and the multi-host harness (tests/deploy, tests/multihost): haproxy
# (`haproxy -c` on the shipped configs, and the load balancer of the namespace fleet),
# iproute2 (`ip netns`), util-linux's setpriv, systemd-analyze (units are verified when it is
# there).
missing=""
command -v haproxy >/dev/null 2>&1 || missing="$missing haproxy"
command -v ip >/dev/null 2>&1 || missing="$missing iproute2"
command -v setpriv >/dev/null 2>&1 || missing="$missing util-linux"
if [ -n "$missing" ]; then
  for _ in $(seq 10); do  # another apt-get may hold the lock
    $SUDO apt-get update -q && $SUDO env DEBIAN_FRONTEND=noninteractive \
      apt-get install -y -q $missing && break
    sleep 6
  done
fi
command -v haproxy >/dev/null && command -v ip >/dev/null
