"""Compile time of the policy train path: the unrolled decoder stack vs `scan_layers=True`.

Times the ahead-of-time `jax.jit(f).lower(...).compile()` of `f = jax.grad` of the summed
`jaxrlhf.algorithms.common.response_logprobs` (the GRPO/policy-gradient forward and
backward pass, without the optimizer) for a SmolLM2-135M-shaped decoder (hidden 576,
intermediate 1536, 9 query / 3 kv heads, head_dim 64, vocab 49,152, tied embeddings,
float32) at several depths. Nothing runs and no weights are allocated: the params are
`jax.eval_shape` structs. Each compilation also reports XLA's `memory_analysis()`
temp (scratch) bytes. XLA:CPU's schedule ignores remat for this figure (see
docs/models.md), so compare it across layouts, not across `--remat` policies.

Each (depth, layout) pair is compiled `--repeats` times in this one process (a fresh
function each time, so nothing is cached), the layouts alternating, so a change in machine
load hits both alike; the table shows the fastest. `cpu_watch.others_cores` records how
many cores other processes used meanwhile (`contended: true`: the timing is not clean).

    python benchmarks/bench_compile.py                       # 8, 16, 30, 60 layers
    python benchmarks/bench_compile.py --layers 8 --remat dots --out /tmp/compile.json
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _common  # noqa: E402

# SmolLM2-135M (HuggingFaceTB/SmolLM2-135M config.json), depth left to --layers.
SMOLLM2_135M = dict(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_heads=9, num_kv_heads=3,
                    head_dim=64, tie_word_embeddings=True, rope_theta=100000.0, rms_norm_eps=1e-5,
                    max_position_embeddings=8192)


def compile_once(num_layers: int, scan: bool, *, remat: str, b: int, p: int, t: int) -> dict:
    """Lower and compile `grad(sum(response_logprobs))` once; seconds and temp bytes."""
    import jax
    import jax.numpy as jnp

    from jaxrlhf.algorithms.common import response_logprobs
    from jaxrlhf.models import ModelConfig, Transformer, init_params

    config = ModelConfig(num_layers=num_layers, scan_layers=scan, remat=remat, **SMOLLM2_135M)
    model = Transformer(config)
    params = jax.eval_shape(lambda: init_params(model, jax.random.key(0), seq_len=2))
    seq = jax.ShapeDtypeStruct((b, p + t), jnp.int32)
    mask = jax.ShapeDtypeStruct((b, p + t), jnp.bool_)

    def loss(params, seq_BxL, mask_BxL):
        logp_BxT = response_logprobs(model, params, seq_BxL, mask_BxL, p)[0]
        return jnp.sum(logp_BxT)

    start = time.perf_counter()
    lowered = jax.jit(jax.grad(loss)).lower(params, seq, mask)
    lowered_s = time.perf_counter() - start
    compiled = lowered.compile()
    total_s = time.perf_counter() - start
    mem = compiled.memory_analysis()
    return dict(layers=num_layers, scan_layers=scan, remat=remat, lower_s=round(lowered_s, 2),
                compile_s=round(total_s - lowered_s, 2), total_s=round(total_s, 2),
                temp_bytes=None if mem is None else int(mem.temp_size_in_bytes),
                argument_bytes=None if mem is None else int(mem.argument_size_in_bytes))


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", default="8,16,30,60", help="comma-separated depths")
    ap.add_argument("--remat", default="none", help="ModelConfig.remat for both layouts")
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--prompt", type=int, default=64)
    ap.add_argument("--response", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=1, help="compilations per (depth, layout); the fastest counts")
    ap.add_argument("--out", default=None, help="JSON file for the rows (default: print only)")
    args = ap.parse_args()
    import jax

    rows = []
    for n in [int(x) for x in args.layers.split(",")]:
        for rep in range(args.repeats):
            for scan in (False, True) if (len(rows) // 2) % 2 == 0 else (True, False):
                with _common.CpuWatch() as watch:
                    row = compile_once(n, scan, remat=args.remat, b=args.batch, p=args.prompt, t=args.response)
                row["cpu_watch"] = watch.result()
                rows.append(row)
                print(json.dumps(row), flush=True)

    mib = lambda x: "n/a" if x is None else f"{x / 2**20:,.0f}"
    by = {}
    for r in rows:  # the fastest compilation of each (depth, layout)
        key = (r["layers"], r["scan_layers"])
        if key not in by or r["total_s"] < by[key]["total_s"]:
            by[key] = r
    print(f"\nB = {args.batch}, P = {args.prompt}, T = {args.response}, remat = {args.remat!r}, "
          f"jax {jax.__version__}, {platform.processor() or platform.machine()}; lower + compile seconds "
          f"(fastest of {args.repeats}), XLA temp MiB\n")
    print("| layers | unrolled s | scanned s | unrolled temp MiB | scanned temp MiB |")
    print("|---|---|---|---|---|")
    for n in sorted({r["layers"] for r in rows}):
        u, s = by[n, False], by[n, True]
        flag = " (contended)" if u["cpu_watch"]["contended"] or s["cpu_watch"]["contended"] else ""
        print(f"| {n} | {u['total_s']:.1f} | {s['total_s']:.1f}{flag} | {mib(u['temp_bytes'])} | "
              f"{mib(s['temp_bytes'])} |")
    if args.out:
        path = _common.write_json(args.out, "compile.json", dict(rows=rows, args=vars(args)))
        print(f"\nwrote {path}")


if __name__ == "__main__":
    main()
