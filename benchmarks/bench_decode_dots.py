"""Which dots a CPU decode step should use: XLA:CPU's YNNPACK dots against its own.

    python benchmarks/bench_decode_dots.py                  # chain, generate, dtype
    python benchmarks/bench_decode_dots.py --parts chain    # one part
    python benchmarks/bench_decode_dots.py --parts head windows --rows 8 16 64 --batch 8 16 --new-tokens 256
    python benchmarks/bench_decode_dots.py --parts draw --rows 8 16 64
    python benchmarks/bench_decode_dots.py --parts fused --rows 8 16 64

XLA:CPU sends every dot to YNNPACK by default; `models.decode_compiler_options` compiles a
decode of few rows through large weights with XLA's own (Eigen) dots instead. Each part
times both forms of the same jitted program alternately in one process (medians):

- `chain`: a SmolLM2-135M-shaped stack's seven projections (30 layers, [M, 576] rows,
  q/o 576², k/v 576 × 192, gate/up 576 × 1536, down 1536 × 576; 425 MB of float32
  weights, separate arrays as the unrolled model holds them) for M = 1 .. 128; also with
  bfloat16 weights and bfloat16 × bfloat16 → float32 dots (the accelerators' form), which
  reads half the bytes.
- `generate`: `rollout.generate` on the SmolLM2-135M shape (random init; `--batch`,
  `--new-tokens`) and on the workload's tiny model, compiled with `()` and with
  `_CPU_FEW_ROW_OPTIONS`, as one program and (tiny model) as two row blocks; the tokens
  must be equal.
- `dtype`: `generate` at each `--batch` with the whole model in float32, with bfloat16
  params and float32 compute, with bf16 params whose layer projections take bf16 dots
  accumulating in float32 (`matmul_dtype="bfloat16"`), and in bf16 throughout
  (`load_pretrained(dtype=, param_dtype=, matmul_dtype=)`), alternated in one process.
- `head`: a SmolLM2-sized tied LM head ([49152, 576]) on M rows, `hidden @ E.T` (what the
  model's head computes) against `models.vocab_major_logits` (`E @ hidden.T`, transposed
  after an optimisation barrier), with YNNPACK's and XLA's dots.
- `windows`: `generate` on the SmolLM2 shape (`--batch`, `--new-tokens`) as before the
  decode windows and the vocab-major head (one cache of P + T slots, the model's head),
  with the head only, and with both (the default); the tokens must be equal.
- `draw`: one sampled token per row from [M, 49152] logits, as the sampler drew it until
  2026-12-04 (Threefry Gumbel noise over the whole vocabulary, `argmax(logits + g)`), by
  the inverse CDF of one uniform per row (its draw for part of that day; `_inverse_cdf`
  here), and by its two-level Gumbel-max now (`rollout.sampler._draw`: 448 variates a
  row); all from each row's key as the sampler derives it.
- `fused`: `chain`'s float32 stack (YNNPACK) with its seven projections against the same
  with q/k/v and gate/up each one concatenated kernel: whether fewer, wider dots pay.

Writes benchmarks/results/decode_dots.json (or --out).
"""

from __future__ import annotations

import argparse
import datetime
import platform
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _common  # noqa: E402


def _alternate(arms: dict, args: tuple, repeats: int) -> dict:
    """Median seconds of each `arms[name](*args)` (jitted), run alternately after one warm-up."""
    import jax

    for fn in arms.values():
        jax.block_until_ready(fn(*args))
    times = {name: [] for name in arms}
    for _ in range(repeats):
        for name, fn in arms.items():
            start = time.perf_counter()
            jax.block_until_ready(fn(*args))
            times[name].append(time.perf_counter() - start)
    return {name: float(np.median(t)) for name, t in times.items()}


# The SmolLM2-135M layer's projection sizes: hidden, MLP, k/v width (3 heads of 64), layers.
D, F, KV, LAYERS = 576, 1536, 192, 30


def _stack_weights(rng) -> list[dict]:
    """`LAYERS` dicts of a SmolLM2-shaped layer's seven float32 projection kernels, separate
    arrays as the unrolled model holds them."""
    import jax.numpy as jnp

    shapes = dict(q=(D, D), k=(D, KV), v=(D, KV), o=(D, D), gate=(D, F), up=(D, F), down=(F, D))
    return [{n: jnp.asarray(rng.standard_normal(s, np.float32) * 0.02) for n, s in shapes.items()}
            for _ in range(LAYERS)]


def chain(rows: list[int], repeats: int) -> list[dict]:
    import jax
    import jax.numpy as jnp

    from jaxrlhf.models import _kernels

    d = D
    rng = np.random.default_rng(0)
    w32 = _stack_weights(rng)
    w16 = jax.tree.map(lambda w: w.astype(jnp.bfloat16), w32)

    def stack(bf16: bool):
        def mm(x, w):
            return jnp.dot(x.astype(jnp.bfloat16), w, preferred_element_type=jnp.float32) if bf16 else x @ w

        def f(h, weights):
            for w in weights:
                q, k, v = mm(h, w["q"]), mm(h, w["k"]), mm(h, w["v"])
                h = h + mm(q + jnp.tile(k + v, (1, 3)), w["o"])
                h = h + mm(jax.nn.silu(mm(h, w["gate"])) * mm(h, w["up"]), w["down"])
                h = h * 0.5
            return h
        return f

    xla = dict(_kernels._CPU_FEW_ROW_OPTIONS)
    out = []
    for m in rows:
        x = jnp.asarray(rng.standard_normal((m, d), np.float32))
        f32 = _alternate({"ynnpack": jax.jit(stack(False)), "xla": jax.jit(stack(False), compiler_options=xla)},
                         (x, w32), repeats)
        b16 = _alternate({"ynnpack": jax.jit(stack(True)), "xla": jax.jit(stack(True), compiler_options=xla)},
                         (x, w16), repeats)
        row = dict(rows=m, f32_ynnpack_s=f32["ynnpack"], f32_xla_s=f32["xla"], bf16_ynnpack_s=b16["ynnpack"],
                   bf16_xla_s=b16["xla"])
        print(f"chain M={m}: float32 YNNPACK {row['f32_ynnpack_s'] * 1e3:.1f} ms, XLA {row['f32_xla_s'] * 1e3:.1f} ms; "
              f"bf16 YNNPACK {row['bf16_ynnpack_s'] * 1e3:.1f} ms, XLA {row['bf16_xla_s'] * 1e3:.1f} ms", flush=True)
        out.append(row)
    return out


def fused(rows: list[int], repeats: int) -> list[dict]:
    """`chain`'s float32 stack with its seven projections as the model holds them, against
    the same stack with q/k/v as one [576, 960] kernel and gate/up as one [576, 3072] (the
    concatenated weights built once, outside the timed program), YNNPACK's dots."""
    import jax
    import jax.numpy as jnp

    d, f, kv = D, F, KV
    rng = np.random.default_rng(0)
    sep = _stack_weights(rng)
    cat = [dict(qkv=jnp.concatenate([w["q"], w["k"], w["v"]], 1), o=w["o"],
                gate_up=jnp.concatenate([w["gate"], w["up"]], 1), down=w["down"]) for w in sep]

    def separate(h, weights):
        for w in weights:
            q, k, v = h @ w["q"], h @ w["k"], h @ w["v"]
            h = h + (q + jnp.tile(k + v, (1, 3))) @ w["o"]
            h = h + (jax.nn.silu(h @ w["gate"]) * (h @ w["up"])) @ w["down"]
            h = h * 0.5
        return h

    def together(h, weights):
        for w in weights:
            qkv = h @ w["qkv"]
            q, k, v = qkv[:, :d], qkv[:, d:d + kv], qkv[:, d + kv:]
            h = h + (q + jnp.tile(k + v, (1, 3))) @ w["o"]
            gu = h @ w["gate_up"]
            h = h + (jax.nn.silu(gu[:, :f]) * gu[:, f:]) @ w["down"]
            h = h * 0.5
        return h

    out = []
    for m in rows:
        x = jnp.asarray(rng.standard_normal((m, d), np.float32))
        a, b = jax.jit(separate), jax.jit(together)
        np.testing.assert_allclose(np.asarray(a(x, sep)), np.asarray(b(x, cat)), rtol=1e-4, atol=1e-4)
        t = _alternate({"separate": lambda x: a(x, sep), "fused": lambda x: b(x, cat)}, (x,), repeats)
        row = dict(rows=m, separate_s=t["separate"], fused_s=t["fused"])
        print(f"fused M={m}: seven projections {row['separate_s'] * 1e3:.2f} ms, q/k/v and gate/up fused "
              f"{row['fused_s'] * 1e3:.2f} ms ({row['separate_s'] / row['fused_s']:.3f}x)", flush=True)
        out.append(row)
    return out


def _load(shape: str, **kw):
    from jaxrlhf.models import load_pretrained

    hf = _common.hf_llama(seed=0, shape=shape)
    with tempfile.TemporaryDirectory() as tmp:
        hf.save_pretrained(tmp, safe_serialization=True)
        return load_pretrained(tmp, **kw)


def generate_ab(batches: list[int], new_tokens: int, repeats: int) -> list[dict]:
    import jax
    import jax.numpy as jnp

    from jaxrlhf.models import _kernels
    from jaxrlhf.rollout import generate

    prompts = np.asarray(_common.load_workload()["prompts"], np.int32)
    out = []
    cases = [("smollm2", b, 1) for b in batches] + [("workload", 16, 1), ("workload", 16, 2)]
    models = {}
    for shape, b, threads in cases:
        if shape not in models:
            models[shape] = _load(shape)
        model, params = models[shape]
        ids = jnp.asarray(np.concatenate([prompts] * (b // len(prompts) + 1))[:b])
        mask = jnp.ones_like(ids, bool)
        n = new_tokens if shape != "workload" else 64

        def arm(options):
            def run(key):
                with _common.sampler_options(options):
                    return generate(model, params, ids, mask, key, max_new_tokens=n, cpu_threads=threads)
            return run

        arms = {"ynnpack": arm(()), "xla": arm(_kernels._CPU_FEW_ROW_OPTIONS)}
        ours, theirs = (arms[a](jax.random.key(3)).response_ids for a in ("ynnpack", "xla"))
        same = bool((ours == theirs).all())
        t = _alternate(arms, (jax.random.key(1),), repeats)
        weight_bytes = sum(x.nbytes for x in jax.tree.leaves(params))
        row = dict(shape=shape, batch=b, cpu_threads=threads, new_tokens=n, ynnpack_s=t["ynnpack"], xla_s=t["xla"],
                   tokens_equal=same, default_rule=list(map(list, _kernels.decode_compiler_options(
                       b // threads, weight_bytes, "cpu"))))
        print(f"generate {shape} B={b} x {n} tokens, {threads} block(s): YNNPACK {t['ynnpack']:.2f} s, XLA "
              f"{t['xla']:.2f} s ({t['ynnpack'] / t['xla']:.2f}x); tokens equal {same}; the rule picks "
              f"{'XLA' if row['default_rule'] else 'YNNPACK'}", flush=True)
        out.append(row)
    return out


DTYPES = (("float32", {}), ("bf16 params, f32 compute", dict(param_dtype="bfloat16", dtype="float32")),
          ("bf16 params, bf16 dots, f32 compute", dict(param_dtype="bfloat16", dtype="float32",
                                                       matmul_dtype="bfloat16")),
          ("bf16 params and compute", dict(param_dtype="bfloat16", dtype="bfloat16")))


def dtypes(batches: list[int], new_tokens: int, repeats: int) -> list[dict]:
    import jax
    import jax.numpy as jnp

    from jaxrlhf.rollout import generate

    prompts = np.asarray(_common.load_workload()["prompts"], np.int32)
    models = {name: _load("smollm2", **kw) for name, kw in DTYPES}
    out = []
    for batch in batches:
        ids = jnp.asarray(np.concatenate([prompts] * (batch // len(prompts) + 1))[:batch])
        mask = jnp.ones_like(ids, bool)
        arms = {name: (lambda key, loaded=loaded: generate(*loaded, ids, mask, key, max_new_tokens=new_tokens))
                for name, loaded in models.items()}
        t = _alternate(arms, (jax.random.key(1),), repeats)
        for name, _ in DTYPES:
            print(f"dtype {name}: B={batch} x {new_tokens} tokens {t[name]:.2f} s", flush=True)
            out.append(dict(dtype=name, batch=batch, new_tokens=new_tokens, median_s=t[name]))
    return out


def head(rows: list[int], repeats: int) -> list[dict]:
    import jax
    import jax.numpy as jnp

    from jaxrlhf.models import _kernels

    e = jax.random.normal(jax.random.key(0), (49152, 576), jnp.float32) * 0.02
    out = []
    for m in rows:
        h = jax.random.normal(jax.random.key(1), (m, 576), jnp.float32)
        arms = {}
        for dots, options in (("ynnpack", None), ("xla", dict(_kernels._CPU_FEW_ROW_OPTIONS))):
            arms[f"row_major_{dots}"] = jax.jit(lambda h, e: h @ e.T, compiler_options=options)
            arms[f"vocab_major_{dots}"] = jax.jit(lambda h, e: jax.lax.optimization_barrier(e @ h.T).T,
                                                  compiler_options=options)
        t = _alternate(arms, (h, e), repeats)
        print(f"head M={m}: " + ", ".join(f"{k} {v * 1e3:.1f} ms" for k, v in t.items()), flush=True)
        out.append(dict(rows=m, **{f"{k}_ms": v * 1e3 for k, v in t.items()}))
    return out


def windows(batches: list[int], new_tokens: int, repeats: int) -> list[dict]:
    import functools

    import jax
    import jax.numpy as jnp

    from jaxrlhf.rollout import generate, sampler

    prompts = np.asarray(_common.load_workload()["prompts"], np.int32)
    model, params = _load("smollm2")
    real = (sampler._compiled, sampler._MAX_WINDOWS, sampler.vocab_major_decode_head)
    out = []
    for b in batches:
        ids = jnp.asarray(np.concatenate([prompts] * (b // len(prompts) + 1))[:b])
        mask = jnp.ones_like(ids, bool)

        def arm(max_windows, vocab_major):
            compiled = functools.lru_cache(maxsize=8)(real[0].__wrapped__)  # this arm's own programs

            def run(key):
                sampler._compiled, sampler._MAX_WINDOWS = compiled, max_windows
                sampler.vocab_major_decode_head = lambda: vocab_major
                try:
                    return generate(model, params, ids, mask, key, max_new_tokens=new_tokens)
                finally:
                    sampler._compiled, sampler._MAX_WINDOWS, sampler.vocab_major_decode_head = real
            return run

        arms = {"before": arm(1, False), "head": arm(1, True), "windows_and_head": arm(real[1], True)}
        ids_of = {k: np.asarray(f(jax.random.key(3)).response_ids) for k, f in arms.items()}
        same = all(bool((v == ids_of["before"]).all()) for v in ids_of.values())
        t = _alternate(arms, (jax.random.key(1),), repeats)
        print(f"windows B={b} x {new_tokens}: " + ", ".join(
            f"{k} {v:.2f} s ({b * new_tokens / v:.1f} tok/s)" for k, v in t.items()) + f"; tokens equal {same}",
            flush=True)
        out.append(dict(batch=b, new_tokens=new_tokens, tokens_equal=same, **{f"{k}_s": v for k, v in t.items()}))
    return out


def _inverse_cdf(logits_BxV, u_B, blk=256):
    """The comparison arm for the sampler's inverse-CDF draw of 2026-12-04 (one uniform per
    row; replaced by `_draw` the same day): its two-level running sums, the first block,
    then token, whose running sum of exp(x − max x) exceeds u·Σ, without its guards that
    skip zero-mass entries (the same work, timed on logits with no zero-mass tokens)."""
    import jax.numpy as jnp

    b, v = logits_BxV.shape
    nb = -(-v // blk)
    p = jnp.exp(logits_BxV - jnp.max(logits_BxV, axis=-1, keepdims=True))
    p_BxNxK = jnp.pad(p, ((0, 0), (0, nb * blk - v))).reshape(b, nb, blk)
    sums_BxN = p_BxNxK.sum(axis=-1)
    ends_BxN = jnp.cumsum(sums_BxN, axis=-1)
    target_B = u_B * ends_BxN[:, -1]
    j_B = jnp.minimum(jnp.sum(ends_BxN <= target_B[:, None], axis=-1), nb - 1)
    start_B = jnp.where(j_B > 0, jnp.take_along_axis(ends_BxN, jnp.maximum(j_B - 1, 0)[:, None], axis=1)[:, 0], 0.0)
    block_BxK = jnp.take_along_axis(p_BxNxK, j_B[:, None, None], axis=1)[:, 0]
    k_B = jnp.minimum(jnp.sum(start_B[:, None] + jnp.cumsum(block_BxK, axis=-1) <= target_B[:, None], axis=-1),
                      blk - 1)
    return jnp.minimum(j_B * blk + k_B, v - 1)


def draw(rows: list[int], repeats: int) -> list[dict]:
    import jax
    import jax.numpy as jnp

    from jaxrlhf.rollout import sampler

    v = 49152
    out = []
    for m in rows:
        logits = jax.random.normal(jax.random.key(0), (m, v)) * 3
        keys = sampler._row_keys(jax.random.key(1), m)
        t = jnp.int32(5)

        def gumbel(logits, keys, t):
            g = jax.vmap(lambda k: jax.random.gumbel(jax.random.fold_in(k, t), (v,), jnp.float32))(keys)
            return sampler._argmax(logits + g)

        def inverse_cdf(logits, keys, t):
            u = jax.vmap(lambda k: jax.random.uniform(jax.random.fold_in(k, t), ()))(keys)
            return _inverse_cdf(logits, u)

        def two_level(logits, keys, t):
            return sampler._draw(logits, sampler._step_noise(keys, t, v))

        arms = {"gumbel": jax.jit(gumbel), "inverse_cdf": jax.jit(inverse_cdf), "two_level": jax.jit(two_level)}
        t_ = _alternate(arms, (logits, keys, t), repeats)
        row = dict(rows=m, vocab=v, **{f"{k}_s": x for k, x in t_.items()})
        print(f"draw M={m} V={v}: Gumbel noise over V + argmax {row['gumbel_s'] * 1e3:.2f} ms, inverse CDF "
              f"{row['inverse_cdf_s'] * 1e3:.2f} ms, two-level Gumbel-max {row['two_level_s'] * 1e3:.2f} ms",
              flush=True)
        out.append(row)
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parts = ["chain", "generate", "dtype", "head", "windows", "draw", "fused"]
    ap.add_argument("--parts", nargs="+", choices=parts, default=parts[:3])
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 4, 8, 16, 32, 64, 128])
    ap.add_argument("--batch", type=int, nargs="+", default=[8, 16])
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()

    import jax

    results = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(), "jax": jax.__version__,
               "machine": platform.processor() or platform.machine()}
    with _common.CpuWatch() as watch:
        if "chain" in args.parts:
            results["chain"] = chain(args.rows, args.repeats)
        if "generate" in args.parts:
            results["generate"] = generate_ab(args.batch, args.new_tokens, max(3, args.repeats // 2))
        if "dtype" in args.parts:
            results["dtype"] = dtypes(args.batch, args.new_tokens, max(2, args.repeats // 2))
        if "head" in args.parts:
            results["head"] = head(args.rows, args.repeats)
        if "windows" in args.parts:
            results["windows"] = windows(args.batch, args.new_tokens, max(2, args.repeats // 2))
        if "draw" in args.parts:
            results["draw"] = draw(args.rows, max(args.repeats, 9))
        if "fused" in args.parts:
            results["fused"] = fused(args.rows, max(args.repeats, 9))
    results.update(watch.result())
    print(f"others' cores {results['others_cores']}")
    print("wrote", _common.write_json(args.out, "decode_dots.json", results))


if __name__ == "__main__":
    main()
