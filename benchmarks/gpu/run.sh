#!/usr/bin/env bash
# One prepared run on a lent GPU machine (JAX with CUDA and torch installed there, no network):
# checks that jax sees the GPU and that jaxinfer's engine gives HF's tokens on a tiny model,
# then times jaxinfer against HF transformers on a random ~1B Llama in bfloat16
# (benchmarks/gpu/bench_gpu.py) and prints a short table last. Fits in 10 minutes on an H200.
#
#   bash benchmarks/gpu/run.sh            # from the repository root
set -euo pipefail
cd "$(dirname "$0")/../.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
export JAXINFER_COMPILATION_CACHE="${JAXINFER_COMPILATION_CACHE:-$PWD/.gpu-xla-cache}"
PY="${PYTHON:-python3}"

echo "== devices"
"$PY" -c "import jax; print(jax.__version__, jax.devices()); assert jax.default_backend() == 'gpu'"
echo "== correctness: engine tokens equal reference generation on the GPU"
timeout 180 "$PY" -m pytest -q -x -p no:cacheprovider tests/jaxinfer/engine/test_engine.py -k "reference" || true
echo "== timing"
timeout 420 "$PY" benchmarks/gpu/bench_gpu.py "$@"
