"""Where a rollout's time goes: one `rollout.sample` call profiled, its ops summed by part.

    python benchmarks/profile_decode.py --shape smollm2 --batch 16 --new-tokens 256

Compiles `sample` on a random init of the shape, as `generate` runs it as one program (with
`models.decode_compiler_options`), runs it once to warm up, times one call, then runs it
once more under `jax.profiler.trace` and sums each traced op's duration by the part of the
program its HLO instruction's `op_name` names: the layers' seven projections, the rest of
attention (over the KV cache), the norms, the LM head, the pick of the next token (its
draw and log-prob), and what runs outside the decode loop (the prefill). The sum runs over
every thread, and XLA:CPU runs independent ops on both cores at once, so it can exceed
the wall time: read the shares. Events whose name is no instruction of the program (on
other backends, library kernels named by the library) are summed as "unattributed".

Writes benchmarks/results/profile_decode.json (or --out).
"""

from __future__ import annotations

import argparse
import collections
import datetime
import glob
import gzip
import json
import platform
import re
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _common  # noqa: E402

_PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def part_of(op_name: str) -> str:
    """The part of a `sample` program that an HLO instruction's `op_name` metadata names."""
    if "while/body" not in op_name:
        return "outside the decode loop (prefill)"
    for proj in _PROJECTIONS:
        if f"/{proj}/" in op_name:
            return proj
    if "lm_head" in op_name:
        return "LM head"
    if "/pick/" in op_name:
        return "pick (draw, log-prob)"
    if "self_attn/" in op_name:
        return "attention over the cache"
    if "layernorm/" in op_name or "Transformer/norm/" in op_name:
        return "norms"
    if "/mlp/" in op_name:
        return "MLP activation"
    return "other"


def op_parts(hlo_text: str) -> dict[str, str]:
    """Instruction name -> `part_of` its op_name, for every instruction of an HLO module's
    text that has one (also under the names GPU kernels take: '.' as '_')."""
    parts = {}
    for m in re.finditer(r"^\s*(?:ROOT )?%([\w.\-]+) = .*?op_name=\"([^\"]*)\"", hlo_text, re.M):
        parts[m.group(1)] = parts[m.group(1).replace(".", "_")] = part_of(m.group(2))
    return parts


def split(trace_dir: str, parts: dict[str, str]) -> dict[str, float]:
    """Seconds of traced ops per part (every thread), from the Perfetto trace in `trace_dir`."""
    path = sorted(glob.glob(f"{trace_dir}/**/*.trace.json.gz", recursive=True))[-1]
    events = json.load(gzip.open(path))
    events = events["traceEvents"] if isinstance(events, dict) else events
    total = collections.Counter()
    for e in events:
        name = e.get("name", "")
        if e.get("ph") != "X" or name.startswith(("$", "end:")):
            continue
        if name in parts:
            total[parts[name]] += e["dur"] / 1e6
        elif "fusion" in name or "gemm" in name.lower() or "kernel" in name.lower():
            total["unattributed"] += e["dur"] / 1e6
    return dict(total)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", choices=sorted(_common.SHAPES), default="smollm2")
    ap.add_argument("--batch", type=int, nargs="+", default=[16])
    ap.add_argument("--new-tokens", type=int, default=256)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()

    import jax
    import jax.numpy as jnp

    from jaxrlhf.models import decode_compiler_options, load_pretrained
    from jaxrlhf.rollout import sampler

    hf = _common.hf_llama(seed=0, shape=args.shape)
    with tempfile.TemporaryDirectory() as tmp:
        hf.save_pretrained(tmp, safe_serialization=True)
        model, params = load_pretrained(tmp)
    prompts = np.asarray(_common.load_workload()["prompts"], np.int32)
    weight_bytes = sampler.weight_bytes_of(params)
    results = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(), "jax": jax.__version__,
               "backend": jax.default_backend(), "machine": platform.processor() or platform.machine(),
               "shape": args.shape, "new_tokens": args.new_tokens, "rows": []}
    with _common.CpuWatch() as watch:
        for b in args.batch:
            ids = jnp.asarray(np.concatenate([prompts] * (b // len(prompts) + 1))[:b])
            mask = jnp.ones_like(ids, bool)
            options = tuple(decode_compiler_options(b, weight_bytes, sampler.platform_of(params)))
            # The program `generate` runs for one row block, compiled once: its text names the ops.
            fn = sampler._compiled(model, options, max_new_tokens=args.new_tokens).lower(
                params, ids, mask, jax.random.key(0)).compile()
            parts = op_parts(fn.as_text())
            jax.block_until_ready(fn(params, ids, mask, jax.random.key(0)))
            start = time.perf_counter()
            jax.block_until_ready(fn(params, ids, mask, jax.random.key(1)))
            wall = time.perf_counter() - start
            with tempfile.TemporaryDirectory() as trace_dir:
                with jax.profiler.trace(trace_dir, create_perfetto_trace=True):
                    jax.block_until_ready(fn(params, ids, mask, jax.random.key(2)))
                seconds = split(trace_dir, parts)
            traced = sum(seconds.values())
            steps = args.new_tokens
            print(f"B={b} x {steps} new tokens: {wall:.2f} s unprofiled ({wall / steps * 1e3:.1f} ms a token); "
                  f"traced op time {traced:.2f} s over all threads", flush=True)
            for part, s in sorted(seconds.items(), key=lambda kv: -kv[1]):
                print(f"  {part:36s} {s / steps * 1e3:7.2f} ms a step  {100 * s / traced:5.1f} %")
            results["rows"].append(dict(batch=b, wall_s=wall, traced_s=traced, options=[list(o) for o in options],
                                        seconds=seconds))
    results.update(watch.result())
    print(f"others' cores {results['others_cores']}")
    print("wrote", _common.write_json(args.out, "profile_decode.json", results))


if __name__ == "__main__":
    main()
