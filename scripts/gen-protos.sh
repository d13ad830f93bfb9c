#!/usr/bin/env bash
# Regenerates the gRPC stubs from src/gpufleet/rpc/protos/*.proto (needs the dev extra).
set -euo pipefail
cd "$(dirname "$0")/.."
python -m grpc_tools.protoc -I src \
  --python_out=src --grpc_python_out=src --mypy_out=src --mypy_grpc_out=src \
  src/gpufleet/rpc/protos/fleet.proto
