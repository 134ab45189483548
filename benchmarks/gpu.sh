#!/usr/bin/env bash
# Train-step MFU, decode vs roofline, real-shaped rollout vs transformers, attention kernels
# on one GPU (or TPU chip): ~8.5 minutes on an H200 (docs/benchmarks.md, "GPU").
#
#   benchmarks/gpu.sh [--out DIR] [--tiny] [--skip PART ...]   # flags go to bench_gpu.py
#
# Needs jax with the accelerator's plugin (e.g. `pip install -U "jax[cuda12]"`), this repo
# (installed, or on PYTHONPATH), and torch + transformers for the rollout part. Results:
# DIR/bench_gpu.json and DIR/bench_gpu.md (default benchmarks/results/gpu), rewritten after
# each part. The whole run is capped at GPU_BENCH_TIMEOUT seconds (default 540).
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-python3}"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1
export XLA_PYTHON_CLIENT_MEM_FRACTION="${XLA_PYTHON_CLIENT_MEM_FRACTION:-0.85}"
export TF_CPP_MIN_LOG_LEVEL="${TF_CPP_MIN_LOG_LEVEL:-1}"
if command -v nvidia-smi >/dev/null 2>&1; then
  nvidia-smi --query-gpu=name,memory.total,clocks.max.sm,power.limit,driver_version --format=csv || true
fi
"$PYTHON" -c "
import importlib.metadata as m, jax
print(jax.devices())
print(', '.join(f'{p} {m.version(p)}' for p in ('jax', 'jaxlib', 'flax', 'optax', 'torch', 'transformers')))"
exec timeout "${GPU_BENCH_TIMEOUT:-540}" "$PYTHON" benchmarks/bench_gpu.py "$@"
