#!/usr/bin/env bash
# Train-step MFU and decode throughput vs roofline on one GPU (or TPU chip), ~5-8 minutes.
#
#   benchmarks/gpu.sh [--out DIR] [--tiny]      # extra flags go to bench_gpu.py
#
# Needs jax with the accelerator's plugin (e.g. `pip install -U "jax[cuda12]"`) and this
# repo installed (`pip install -e .`). Results: DIR/bench_gpu.json and DIR/bench_gpu.md
# (default benchmarks/results/gpu). The whole run is capped at 9 minutes.
set -euo pipefail
cd "$(dirname "$0")/.."
export XLA_PYTHON_CLIENT_MEM_FRACTION="${XLA_PYTHON_CLIENT_MEM_FRACTION:-0.92}"
export TF_CPP_MIN_LOG_LEVEL="${TF_CPP_MIN_LOG_LEVEL:-1}"
if command -v nvidia-smi >/dev/null 2>&1; then
  nvidia-smi --query-gpu=name,memory.total,clocks.max.sm,power.limit --format=csv || true
fi
python -c "import jax; print('jax', jax.__version__, jax.devices())"
exec timeout 540 python benchmarks/bench_gpu.py "$@"
