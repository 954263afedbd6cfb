#!/usr/bin/env bash
# One GPU session: environment, preflight, codegen, gpu_check, host us, extra shapes
# and the CUDA tests, each with a hard time budget, everything under $OUT (see
# benchmarks/gpu_session.py and docs/benchmarks.md "The GPU session").
#   bash benchmarks/gpu_session.sh                 # on the GPU box, from the checkout
#   bash benchmarks/gpu_session.sh --device cpu    # dry run here (tests/test_gpu_session.py)
# Needs python/kvpool/_core.abi3.so (built where Rust is: bash benchmarks/build_core.sh).
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ ! -e python/kvpool/_core.abi3.so ]; then
  echo "python/kvpool/_core.abi3.so is missing: build it where Rust is (bash benchmarks/build_core.sh) and carry it" >&2
fi
exec "$PY" benchmarks/gpu_session.py "$@"
