"""`generate`'s CPU row blocks against one program, across model sizes: what `cpu_threads`
should default to.

    python benchmarks/bench_row_blocks.py                 # the sizes below, B = 16 and 64
    python benchmarks/bench_row_blocks.py --quick         # 1 warm-up, 2 repeats

Each size is a Llama-shaped model with random float32 weights (only the shapes matter for
speed), 16 or 64 prompts × 32 tokens, exactly 64 new tokens (no EOS), temperature 1. For
each, `generate` runs with `cpu_threads=1` (one program) and with one row block per usable
core (`cpu_threads` = the core count, which bypasses the default's rule); both must sample
the same tokens. The table gives new tokens/s for both and the ratio, the model's weight
bytes, and the blocks the default (`cpu_threads=None`, `rollout.sampler.cpu_row_blocks`)
picks for that model and batch. Writes benchmarks/results/row_blocks.json.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

import numpy as np

NEW_TOKENS = 64
# name: (hidden, intermediate, layers, heads, kv heads, head_dim, vocab)
SIZES = {
    "workload (3.2M)": (256, 688, 4, 4, 2, 64, 512),
    "width 256, V 49k (16M)": (256, 688, 4, 4, 2, 64, 49_152),
    "SmolLM2 shape, 8 layers (60M)": (576, 1536, 8, 9, 3, 64, 49_152),
    "SmolLM2-135M shape (135M)": (576, 1536, 30, 9, 3, 64, 49_152),
}


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--batch", type=int, nargs="+", default=[16, 64])
    ap.add_argument("--sizes", nargs="+", default=list(SIZES))
    ap.add_argument("--out", default=str(Path(__file__).resolve().parent / "results" / "row_blocks.json"))
    args = ap.parse_args()
    warmup, repeats = (1, 2) if args.quick else (1, 3)

    import jax
    import jax.numpy as jnp

    from jaxrlhf.models import ModelConfig, Transformer, init_params
    from jaxrlhf.rollout import generate
    from jaxrlhf.rollout.sampler import _usable_cores, cpu_row_blocks

    cores = _usable_cores()
    rows = []
    for name in args.sizes:
        d, f, layers, heads, kv, hd, v = SIZES[name]
        cfg = ModelConfig(vocab_size=v, hidden_size=d, intermediate_size=f, num_layers=layers, num_heads=heads,
                          num_kv_heads=kv, head_dim=hd, max_position_embeddings=128)
        model = Transformer(cfg)
        params = init_params(model, jax.random.key(0))
        weight_bytes = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(params))
        for b in args.batch:
            ids = jnp.asarray(np.random.default_rng(0).integers(4, v, (b, 32)), jnp.int32)
            mask = jnp.ones_like(ids, bool)
            result = {}
            for label, threads in (("one program", 1), ("row blocks", cores)):
                run = lambda: jax.block_until_ready(generate(model, params, ids, mask, jax.random.key(1),
                                                             max_new_tokens=NEW_TOKENS, cpu_threads=threads))
                for _ in range(warmup):
                    out = run()
                times = []
                for _ in range(repeats):
                    t0 = time.perf_counter()
                    run()
                    times.append(time.perf_counter() - t0)
                result[label] = (min(times), np.asarray(out.response_ids))
            np.testing.assert_array_equal(result["one program"][1], result["row blocks"][1])
            one, blocks = result["one program"][0], result["row blocks"][0]
            default = cpu_row_blocks(b, params, ids, weight_bytes=weight_bytes)
            row = dict(model=name, weight_mb=weight_bytes / 2**20, batch=b, cores=cores, default_blocks=default,
                       one_program_tok_s=b * NEW_TOKENS / one, row_blocks_tok_s=b * NEW_TOKENS / blocks,
                       blocks_over_one=one / blocks)
            rows.append(row)
            print(f"{name:32s} {row['weight_mb']:7.0f} MB  B={b:3d}  one program {row['one_program_tok_s']:8.0f} "
                  f"tok/s  {cores} row blocks {row['row_blocks_tok_s']:8.0f} tok/s  ratio {row['blocks_over_one']:.2f}  "
                  f"default: {default} block(s)",
                  flush=True)
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    Path(args.out).write_text(json.dumps(dict(rows=rows, jax=jax.__version__), indent=2))


if __name__ == "__main__":
    main()
