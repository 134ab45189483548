"""LM-head benchmark: the plain `h @ W → token_logprobs + entropy` path against the fused
`ops.linear_logprobs`, XLA:CPU's temporary memory and wall time.

    python benchmarks/bench_lm_head.py                  # both parts, markdown to stdout
    python benchmarks/bench_lm_head.py --part memory    # compiles only: ~1 min, no big arrays
    python benchmarks/bench_lm_head.py --part speed     # ~3 min on 2 cores, ~3 GB RAM

with the package importable (`pip install -e ".[bench]"`, or `PYTHONPATH=.` in a checkout).
Writes every number to benchmarks/results/lm_head.json (or --out). Not a test: nothing here
asserts speed, but the speed part checks that both paths give the same numbers.

(a) Memory: B = 8, D = 896 (Qwen2.5-0.5B's width), V = 49,152 and 151,936, T = 1,024 and
  4,096, float32 and bf16 `h` and `W`, τ = 0.7, log-probs and entropies. For each, XLA's
  temporary buffers (`jit(f).lower(...).compile().memory_analysis().temp_size_in_bytes`)
  of the forward pass `f = Σ logp + Σ H` and of `grad(f)` w.r.t. `(h, W)`, beside one
  float32 `[B, T, V]` copy. Compiled from shapes only, never run (the plain path at T = 4k
  would need ~80 GB). The plain path is what `common.head_logprobs` runs with
  `logprobs_head="plain"`: one `[B·T, D] @ [D, V]` matmul, then `ops.token_logprobs` and
  `ops.entropy`. The fused path's gradient w.r.t. a bf16 `W` is accumulated in float32:
  `D·V·4` bytes of its temp (the float32 gradient is the output itself).
(b) Speed: B = 4, T = 256, D = 896, V = 49,152, float32, τ = 0.7: wall time of the jitted
  forward pass and of `value_and_grad`, plain and fused (default chunk sizes), with the
  CPU time other processes used meanwhile (`contended: true` is not a valid figure).
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from jaxrlhf import ops

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _common  # noqa: E402

MiB = 2**20
B, D, TAU = 8, 896, 0.7
MEMORY_SHAPES = [(v, t) for v in (49_152, 151_936) for t in (1024, 4096)]
SPEED_SHAPE = (4, 256, 49_152)  # B, T, V


def plain(h_BxTxD, w_DxV, y_BxT):
    b, t, d = h_BxTxD.shape
    logits = (h_BxTxD.reshape(b * t, d) @ w_DxV).reshape(b, t, -1)  # as project_logits
    return jnp.sum(ops.token_logprobs(logits, y_BxT, TAU)) + jnp.sum(ops.entropy(logits, TAU))


def fused(h_BxTxD, w_DxV, y_BxT):
    out = ops.linear_logprobs(h_BxTxD, w_DxV, y_BxT, temperature=TAU, with_entropy=True)
    return jnp.sum(out.logp) + jnp.sum(out.entropy)


FUNCTIONS = {"plain": plain, "fused": fused}


def temp_mib(fn, *shapes) -> float:
    return jax.jit(fn).lower(*shapes).compile().memory_analysis().temp_size_in_bytes / MiB


def bench_memory() -> list[dict]:
    rows = []
    for dtype in ("float32", "bfloat16"):
        for v, t in MEMORY_SHAPES:
            shapes = (jax.ShapeDtypeStruct((B, t, D), dtype), jax.ShapeDtypeStruct((D, v), dtype),
                      jax.ShapeDtypeStruct((B, t), jnp.int32))
            row = {"dtype": dtype, "B": B, "T": t, "D": D, "V": v, "f32_copy_mib": B * t * v * 4 / MiB}
            for name, fn in FUNCTIONS.items():
                row[f"{name}_forward_mib"] = temp_mib(fn, *shapes)
                row[f"{name}_grad_mib"] = temp_mib(jax.grad(fn, argnums=(0, 1)), *shapes)
            rows.append(row)
            print(f"  {dtype} T={t} V={v}: plain {row['plain_forward_mib']:.0f} / {row['plain_grad_mib']:.0f} MiB, "
                  f"fused {row['fused_forward_mib']:.0f} / {row['fused_grad_mib']:.0f} MiB", file=sys.stderr)
    return rows


def _memory_table(rows) -> str:
    lines = ["| dtype | T | V | one f32 [B, T, V] | plain forward | plain grad | fused forward | fused grad |",
             "|---|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        lines.append(f"| {r['dtype']} | {r['T']:,} | {r['V']:,} | {r['f32_copy_mib']:,.0f} MiB | "
                     f"{r['plain_forward_mib']:,.0f} MiB | {r['plain_grad_mib']:,.0f} MiB | "
                     f"{r['fused_forward_mib']:,.0f} MiB | {r['fused_grad_mib']:,.0f} MiB |")
    return "\n".join(lines)


def bench_speed(repeats: int) -> dict:
    b, t, v = SPEED_SHAPE
    rng = np.random.default_rng(0)
    h = jnp.asarray(rng.standard_normal((b, t, D)), jnp.float32)
    w = jnp.asarray(0.05 * rng.standard_normal((D, v)), jnp.float32)
    y = jnp.asarray(rng.integers(0, v, (b, t)))
    out = {"B": b, "T": t, "D": D, "V": v, "dtype": "float32"}
    results = {}
    with _common.CpuWatch() as watch:
        for name, fn in FUNCTIONS.items():
            for mode, f in (("forward", fn), ("value_and_grad", jax.value_and_grad(fn, argnums=(0, 1)))):
                f = jax.jit(f)
                results[name, mode] = jax.block_until_ready(f(h, w, y))
                t_ = _common.timed(lambda: jax.block_until_ready(f(h, w, y)), warmup=1, repeats=repeats)
                out[f"{name}_{mode}_ms"] = {k: 1e3 * t_[k] for k in ("min_s", "median_s", "max_s")}
                print(f"  {name} {mode}: median {out[f'{name}_{mode}_ms']['median_s']:.0f} ms", file=sys.stderr)
    out["cpu_watch"] = watch.result(detail=True)
    # Same numbers: the loss, and the gradients relative to their largest entry.
    (l0, (dh0, dw0)), (l1, (dh1, dw1)) = results["plain", "value_and_grad"], results["fused", "value_and_grad"]
    np.testing.assert_allclose(l1, l0, rtol=1e-5)
    for g1, g0 in ((dh1, dh0), (dw1, dw0)):
        np.testing.assert_allclose(g1, g0, rtol=1e-4, atol=1e-4 * float(jnp.max(jnp.abs(g0))))
    return out


def _speed_table(r) -> str:
    lines = [f"B = {r['B']}, T = {r['T']}, D = {r['D']}, V = {r['V']:,}, {r['dtype']} "
             f"(others' CPU meanwhile: {r['cpu_watch']['others_cores']} cores"
             f"{', contended' if r['cpu_watch']['contended'] else ''})", "",
             "| path | forward (median ms) | value_and_grad (median ms) |", "|---|---:|---:|"]
    for name in FUNCTIONS:
        lines.append(f"| {name} | {r[f'{name}_forward_ms']['median_s']:.0f} | "
                     f"{r[f'{name}_value_and_grad_ms']['median_s']:.0f} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--part", choices=("all", "memory", "speed"), default="all")
    parser.add_argument("--repeats", type=int, default=5, help="timed runs of each speed function")
    parser.add_argument("--out", default=None, help="JSON output (default: benchmarks/results/lm_head.json)")
    args = parser.parse_args()
    results = {
        "date_utc": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "machine": {"platform": platform.platform(), "processor": platform.processor(),
                    "cpu_count": os.cpu_count(), "load_average_at_start": os.getloadavg(),
                    "jax_backend": jax.default_backend(), "jax": jax.__version__},
    }
    if args.part in ("all", "memory"):
        results["memory"] = bench_memory()
        print(f"## XLA temp memory, B = {B}, D = {D}, log-probs + entropies\n\n{_memory_table(results['memory'])}\n")
    if args.part in ("all", "speed"):
        results["speed"] = bench_speed(args.repeats)
        print(f"## Speed\n\n{_speed_table(results['speed'])}\n")
    results["machine"]["load_average_at_end"] = os.getloadavg()
    print(f"wrote {_common.write_json(args.out, 'lm_head.json', results)}")


if __name__ == "__main__":
    main()
