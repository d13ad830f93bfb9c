#!/usr/bin/env bash
# A gpufleet fleet over network-namespace "hosts" on this machine (tests/multihost): PostgreSQL,
# Redis, an S3 server, haproxy, 2 controllers, 2 API servers, 3 agents and a client host on a
# private 10.77.0.0/24 that exists only inside the namespaces. Needs root.
#
#   scripts/multihost.sh up [--agents N] [--dir DIR]   (foreground; Ctrl-C stops and removes it)
#   scripts/multihost.sh status | down
#   scripts/multihost.sh exec HOST -- CMD...           e.g. exec client -- gpufleet nodes
#   scripts/multihost.sh cut HOST | restore HOST       take a host's link down / up
set -euo pipefail
cd "$(dirname "$0")/.."
exec .venv/bin/python -m tests.multihost "$@"
