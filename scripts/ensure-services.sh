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
