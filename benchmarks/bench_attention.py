"""Every attention implementation this device runs: checked against dense, then timed.

For each implementation `jaxrlhf.models.attention` can run here ("dense", "chunked", and
"cudnn" on an NVIDIA GPU or "splash" on a TPU), on causal self-attention with left-padded
rows (GQA, bf16 on accelerators, float32 on CPU):

1. values and gradients (q, k, v) against the dense form on the same device, at the check
   length (max abs error, relative to the dense values' scale);
2. forward + backward time, and XLA's temp bytes for the gradient, at each length.

    python benchmarks/bench_attention.py              # on any backend
    python benchmarks/bench_attention.py --tiny       # seconds, on CPU
    (benchmarks/gpu.sh runs it as part of bench_gpu.py)
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from jaxrlhf.models import attention  # noqa: E402
from jaxrlhf.models.attention import AttentionMask  # noqa: E402


def implementations() -> list[str]:
    kernel = {"gpu": ["cudnn"], "tpu": ["splash"]}.get(jax.default_backend(), [])
    return ["dense", "chunked"] + kernel


def _inputs(b, l, n, kh, h, dtype, seed=0):
    r = np.random.default_rng(seed)
    q = jnp.asarray(r.normal(size=(b, l, n, h)), dtype)
    k = jnp.asarray(r.normal(size=(b, kh, l, h)), dtype)
    v = jnp.asarray(r.normal(size=(b, kh, l, h)), dtype)
    valid = np.ones((b, l), bool)
    valid[0, : l // 8] = False  # a left-padded row
    mask = AttentionMask(jnp.asarray(valid), jnp.arange(l, dtype=jnp.int32))
    return q, k, v, mask


def _fn(impl, mask, scale):
    def f(q, k, v):
        return attention.attend(q, k, v, mask, implementation=impl, scale=scale, queries_are_keys=True)
    return f


def check(impl, *, b, l, n, kh, h, dtype) -> dict:
    q, k, v, mask = _inputs(b, l, n, kh, h, dtype)
    cot = jnp.asarray(np.random.default_rng(1).normal(size=q.shape), dtype)
    out = {}
    for name in (impl, "dense"):
        y, vjp = jax.jit(lambda q, k, v, name=name: jax.vjp(_fn(name, mask, h ** -0.5), q, k, v))(q, k, v)
        out[name] = [np.asarray(y, np.float32)] + [np.asarray(g, np.float32) for g in vjp(cot)]
    errs = {}
    for label, got, want in zip(("out", "dq", "dk", "dv"), out[impl], out["dense"]):
        errs[label] = float(np.max(np.abs(got - want)) / max(np.max(np.abs(want)), 1e-30))
    return errs


def timing(impl, *, b, l, n, kh, h, dtype, repeats) -> dict:
    q, k, v, mask = _inputs(b, l, n, kh, h, dtype)
    loss = lambda q, k, v: jnp.sum(_fn(impl, mask, h ** -0.5)(q, k, v).astype(jnp.float32))
    step = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2)))
    compiled = step.lower(q, k, v).compile()
    temp = compiled.memory_analysis().temp_size_in_bytes if compiled.memory_analysis() else None
    jax.block_until_ready(step(q, k, v))
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        jax.block_until_ready(step(q, k, v))
        times.append(time.perf_counter() - t0)
    # causal fwd + bwd: 2 (fwd) + 5 (bwd) matmuls of 2·B·N·L²·H/2 FLOPs each
    flops = 7 * b * n * l * l * h
    t = float(np.median(times))
    return dict(fwd_bwd_ms=1e3 * t, tflops=flops / t / 1e12, temp_mib=None if temp is None else temp / 2**20)


def run(tiny: bool = False, lengths=None) -> dict:
    accel = jax.default_backend() in ("gpu", "tpu")
    dtype = jnp.bfloat16 if accel else jnp.float32
    shape = dict(b=1, n=4, kh=2, h=32) if tiny else dict(b=2, n=16, kh=8, h=128)
    lengths = lengths or ([256, 512] if tiny else [2048, 8192])
    res = {"backend": jax.default_backend(), "dtype": jnp.dtype(dtype).name, **shape, "rows": []}
    for impl in implementations():
        row = {"implementation": impl}
        try:
            if impl != "dense":
                row["error_vs_dense"] = check(impl, l=lengths[0], dtype=dtype, **shape)
            for l in lengths:
                if impl == "dense" and l > 8192:
                    continue
                row[f"L={l}"] = timing(impl, l=l, dtype=dtype, repeats=2 if tiny else 5, **shape)
        except Exception as e:  # a kernel this device cannot run is reported, not hidden
            row["failed"] = f"{type(e).__name__}: {str(e)[:300]}"
        res["rows"].append(row)
        print(json.dumps(row), flush=True)
    return res


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tiny", action="store_true")
    ap.add_argument("--lengths", default=None)
    args = ap.parse_args()
    lengths = [int(x) for x in args.lengths.split(",")] if args.lengths else None
    print(json.dumps(run(args.tiny, lengths), indent=1))


if __name__ == "__main__":
    main()
