#!/usr/bin/env bash
# The checks that need a real NVIDIA GPU (NVML inventory and health, CUDA jobs pinned to their
# reservation): tests/gpu, which skip everywhere else. Run from the repository root on a GPU
# machine with the driver, python3 with PyTorch (CUDA build), and the project's dependencies.
# Where those dependencies cannot be installed from an index, put their wheels in .whl/ (see
# docs/design/runtime.md, "Checked on a real GPU"); they are installed into /tmp/site.
#
# Usage: scripts/device-check.sh [LOG_DIR]   (default: $OUT or /tmp/device-check)
set -u
out=${1:-${OUT:-/tmp/device-check}}
mkdir -p "$out"
base=/tmp/gpufleet-device-check
rm -rf "$base"
{
  date -u
  nvidia-smi --query-gpu=index,name,uuid,memory.total,driver_version --format=csv
  python3 --version
  if compgen -G ".whl/*.whl" > /dev/null; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
      --target /tmp/site .whl/*.whl || exit 1
    export PYTHONPATH=/tmp/site
  fi
  export PYTHONPATH="$PWD/src:$PWD${PYTHONPATH:+:$PYTHONPATH}"
  python3 - <<'PY'
import time
t = time.perf_counter()
from gpufleet.agent.inventory import load_inventory
inv = load_inventory("probe", None)
print(f"inventory ({(time.perf_counter() - t) * 1000:.0f} ms, imports included): {inv}")
import torch
print("torch", torch.__version__, "cuda", torch.version.cuda, "devices", torch.cuda.device_count())
PY
  python3 -m pytest -p no:cacheprovider -q -n 0 --timeout 300 -rs -v --basetemp "$base" \
    tests/gpu tests/unit/test_agent_inventory.py tests/unit/test_agent_gpu_health.py
  rc=$?
  for log in "$base"/*/agent-*.log; do
    [ -f "$log" ] && { echo "--- $log (last 40 lines)"; tail -n 40 "$log"; }
  done
  exit $rc
} 2>&1 | tee "$out/device-check.log"
exit "${PIPESTATUS[0]}"
