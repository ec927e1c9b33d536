#!/usr/bin/env bash
# On the GPU machine, from the repository root: the carried wheels installed beside the
# image's packages, then the one-shot check into $OUT (or the directory given).
#   bash benchmarks/gpu_run.sh [OUT] [gpu_check.py flags...]
set -uo pipefail
out=${1:-${OUT:-/tmp/gpu-check}}
shift || true
python3 -m pip install -q --no-deps --no-index --target /tmp/gw .gpuwheels/*.whl
export PYTHONPATH=$PWD:/tmp/gw
mkdir -p "$out"
nvidia-smi --query-gpu=name,memory.total,memory.used,driver_version --format=csv > "$out/nvidia-smi.txt" 2>&1 || true
timeout ${GPU_CHECK_TIMEOUT_S:-540} python3 benchmarks/gpu/gpu_check.py --out "$out" "$@"
