"""One-accelerator benchmark: train-step MFU and decode throughput against the roofline.

A Llama-shaped model with random weights (default ~0.89B parameters: hidden 2048, 16
layers, 16 query / 8 kv heads of 128, MLP 5632, vocab 32000, untied head) is measured on
one device:

1. **Peak compute**: a large bf16 matmul (`8192³` by default) timed in the same run;
   `TFLOP/s = 2·n³ / t`. MFU is reported against this measured peak and, when the device
   is known, against its nominal dense bf16 peak.
2. **Train step** (bf16 compute, float32 master params, AdamW, next-token cross-entropy,
   one jitted step with the state donated). Model FLOPs per step
   `= 6·N·tokens + 12·layers·heads·head_dim·L·tokens`, with `N` the parameters that take
   part in matmuls (all but the embedding table and the norms) and the second term the
   attention score / value matmuls over the full `L×L` square (the kernel computes the
   masked square; PaLM's convention). `MFU = model FLOPs / step time / peak`.
3. **Decode** with `jaxrlhf.rollout.generate` (greedy, bf16 params, static KV cache of
   `P+T` slots): per-step time from the difference between `T` and 1 new tokens, so the
   prefill cancels. Each step must read all weights and the whole KV cache (`[B, K, S, H]`
   for k and v in every layer; the kernel reads all `S` slots); the roofline time is those
   bytes over the device copy bandwidth measured in the same run (`2·bytes / t` of a
   large `x + 1` copy: one read, one write). Reported: tokens/s, roofline tokens/s, and
   their ratio.

4. **Rollout at a real checkpoint's shapes against transformers**: a SmolLM2-135M-shaped
   Llama (`_common.SHAPES["smollm2"]`: 30 layers, 576 wide, 9/3 heads, V = 49,152, tied
   head; HF's random init, the values do not change the time) in bf16 on this device, B =
   8 / 16 / 64 rows of the workload's 32-token prompts (random ids where
   workload_prompts.json is not found; `--prompts`) × 256 sampled tokens (τ = 1,
   top-k/top-p off, no early stop): `jaxrlhf.rollout.generate` against transformers' `generate` (torch, bf16,
   its default attention) on the same device with the same weights. Reported: new tokens/s
   of each, their ratio, and the fraction of the weight-streaming floor (bf16 weight bytes
   per new token over the measured copy bandwidth). With `--tunix-python PY` Tunix's
   sampler runs too (`tunix_rollout_worker.py --dtype bfloat16` in PY, after ours at each
   B); `--rollout-peers tunix` leaves transformers out. `--rollout-xla NAME=OPTION:VALUE`
   adds our sampler compiled with those XLA options as more arms (their tokens checked
   against the default arm's at a fixed key): the decode step at this size is bound by
   its kernels' launches, which XLA's command buffers are for.
5. **Attention implementations** (`bench_attention.py`): each one this device runs
   (dense, chunked, and cuDNN on a GPU or splash on a TPU) checked against dense in
   values and gradients on the device, then timed forward + backward at L = 2k and 8k.

Each part runs on its own: one that fails is recorded with its error and the others still
run. `<out>/bench_gpu.json` is rewritten after every part (a run stopped by its time limit
keeps what it finished); `<out>/bench_gpu.md` tables what ran.

    benchmarks/gpu.sh                       # on a GPU machine, ~8.5 minutes on an H200
    python benchmarks/bench_gpu.py --tiny   # a seconds-long smoke run on CPU
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import os
import platform
import sys
import tempfile
import time
import traceback

import jax
import jax.numpy as jnp
import numpy as np
import optax

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)
sys.path.insert(0, os.path.join(REPO, "benchmarks"))

import bench_attention  # noqa: E402
from jaxrlhf.algorithms.common import TrainState  # noqa: E402
from jaxrlhf.models.config import ModelConfig  # noqa: E402
from jaxrlhf.models.transformer import Transformer, init_params  # noqa: E402
from jaxrlhf.rollout.sampler import generate  # noqa: E402

# Nominal dense bf16 peaks (TFLOP/s) and HBM bandwidths (GB/s), by device_kind substring.
NOMINAL = {
    "H200": (989.0, 4800.0), "H100": (989.0, 3350.0), "A100": (312.0, 2039.0), "L4": (121.0, 300.0),
    "TPU v5p": (459.0, 2765.0), "TPU v5 lite": (197.0, 819.0), "TPU v5e": (197.0, 819.0),
    "TPU v4": (275.0, 1228.0), "TPU v6": (918.0, 1640.0),
}


@dataclasses.dataclass
class Setup:
    model: ModelConfig
    train_batch: int
    train_len: int
    train_steps: int
    decode_batch: int
    prompt_len: int
    decode_tokens: int
    matmul_n: int
    copy_mb: int
    repeats: int
    rollout_shape: str = "smollm2"
    rollout_batches: tuple[int, ...] = (8, 16, 64)
    rollout_tokens: int = 256


def setups(tiny: bool) -> Setup:
    if tiny:
        cfg = ModelConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4,
                          num_kv_heads=2, head_dim=16, max_position_embeddings=256,
                          dtype="bfloat16", param_dtype="float32")
        return Setup(cfg, train_batch=2, train_len=32, train_steps=2, decode_batch=2, prompt_len=8,
                     decode_tokens=8, matmul_n=256, copy_mb=8, repeats=2, rollout_shape="workload",
                     rollout_batches=(2,), rollout_tokens=8)
    cfg = ModelConfig(vocab_size=32000, hidden_size=2048, intermediate_size=5632, num_layers=16, num_heads=16,
                      num_kv_heads=8, head_dim=128, max_position_embeddings=4096, rope_theta=500000.0,
                      dtype="bfloat16", param_dtype="float32")
    return Setup(cfg, train_batch=8, train_len=1024, train_steps=10, decode_batch=32, prompt_len=128,
                 decode_tokens=257, matmul_n=8192, copy_mb=2048, repeats=20)


def timed(fn, *args, repeats: int):
    """Median wall seconds of `fn(*args)` after one warm-up call (compilation)."""
    jax.block_until_ready(fn(*args))
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - t0)
    return float(np.median(times))


def measure_peak(n: int, repeats: int) -> dict:
    a = jax.random.normal(jax.random.key(0), (n, n), jnp.bfloat16)
    b = jax.random.normal(jax.random.key(1), (n, n), jnp.bfloat16)
    # several matmuls per call so that dispatch overhead is negligible
    chain = jax.jit(lambda a, b: functools.reduce(lambda x, _: (x @ b) * 0.01, range(8), a))
    t = timed(chain, a, b, repeats=repeats) / 8
    return {"matmul_n": n, "seconds": t, "tflops": 2 * n**3 / t / 1e12}


def measure_bandwidth(mb: int, repeats: int) -> dict:
    x = jnp.ones((mb * 2**20 // 4,), jnp.float32)
    copy = jax.jit(lambda x: x + 1.0)
    t = timed(copy, x, repeats=repeats)
    return {"bytes": 2 * x.nbytes, "seconds": t, "gb_per_s": 2 * x.nbytes / t / 1e9}


def matmul_params(cfg: ModelConfig, params) -> int:
    n = 0
    for path, x in jax.tree_util.tree_flatten_with_path(params)[0]:
        name = "/".join(str(getattr(k, "key", k)) for k in path)
        if "embed_tokens" in name or name.endswith("scale") or name.endswith("bias"):
            continue
        n += int(np.prod(x.shape))
    if cfg.tie_word_embeddings:  # the embedding doubles as the LM head matmul
        n += cfg.vocab_size * cfg.hidden_size
    return n


def bench_train(s: Setup, peak_tflops: float) -> dict:
    cfg = s.model
    model = Transformer(cfg)
    tx = optax.adamw(1e-5, b1=0.9, b2=0.95, weight_decay=0.1)
    params = jax.jit(lambda r: init_params(model, r, seq_len=2))(jax.random.key(0))
    state = TrainState.create(params, tx)

    def loss_fn(p, ids):
        logits = model.apply({"params": p}, ids).logits[:, :-1].astype(jnp.float32)
        return optax.softmax_cross_entropy_with_integer_labels(logits, ids[:, 1:]).mean()

    @functools.partial(jax.jit, donate_argnames=("state",))
    def step(state, ids):
        loss, grads = jax.value_and_grad(loss_fn)(state.params, ids)
        return state.apply_gradients(grads, tx), loss

    ids = jax.random.randint(jax.random.key(1), (s.train_batch, s.train_len), 0, cfg.vocab_size)
    t0 = time.perf_counter()
    state, loss = step(state, ids)
    loss0 = float(loss)
    compile_s = time.perf_counter() - t0
    times = []
    for _ in range(s.train_steps):
        t0 = time.perf_counter()
        state, loss = step(state, ids)
        jax.block_until_ready(loss)
        times.append(time.perf_counter() - t0)
    t = float(np.median(times))
    tokens = s.train_batch * s.train_len
    n_mm = matmul_params(cfg, params)
    attn = 12 * cfg.num_layers * cfg.num_heads * cfg.head_dim * s.train_len * tokens
    flops = 6 * n_mm * tokens + attn
    return {
        "params": int(sum(x.size for x in jax.tree.leaves(params))), "matmul_params": n_mm,
        "batch": s.train_batch, "seq_len": s.train_len, "tokens_per_step": tokens,
        "first_loss": loss0, "last_loss": float(loss), "compile_and_first_step_s": compile_s,
        "step_s": t, "tokens_per_s": tokens / t, "model_flops_per_step": flops,
        "attention_flops_share": attn / flops, "achieved_tflops": flops / t / 1e12,
        "mfu_vs_measured_peak": flops / t / 1e12 / peak_tflops,
    }


def bench_decode(s: Setup, bw_gbs: float) -> dict:
    cfg = s.model.replace(param_dtype="bfloat16")
    model = Transformer(cfg)
    params = jax.jit(lambda r: init_params(model, r, seq_len=2))(jax.random.key(0))
    r = np.random.default_rng(0)
    prompts = jnp.asarray(r.integers(3, cfg.vocab_size, (s.decode_batch, s.prompt_len)), jnp.int32)
    mask = jnp.ones_like(prompts, dtype=bool)
    run = lambda t: generate(model, params, prompts, mask, jax.random.key(0), max_new_tokens=t,
                             temperature=0.0, eos_id=None, max_len=s.prompt_len + s.decode_tokens)
    t_full = timed(run, s.decode_tokens, repeats=max(2, s.repeats // 5))
    t_one = timed(run, 1, repeats=max(2, s.repeats // 5))
    steps = s.decode_tokens - 1
    per_step = max(t_full - t_one, 1e-12) / steps
    weight_bytes = int(sum(x.nbytes for x in jax.tree.leaves(params)))
    slots = s.prompt_len + s.decode_tokens
    kv_bytes = 2 * cfg.num_layers * s.decode_batch * cfg.num_kv_heads * slots * cfg.head_dim * 2  # bf16
    roofline_s = (weight_bytes + kv_bytes) / (bw_gbs * 1e9)
    return {
        "batch": s.decode_batch, "prompt_len": s.prompt_len, "new_tokens": s.decode_tokens,
        "generate_s": t_full, "prefill_plus_one_s": t_one, "decode_step_s": per_step,
        "tokens_per_s": s.decode_batch / per_step, "weight_bytes": weight_bytes, "kv_cache_bytes": kv_bytes,
        "roofline_step_s": roofline_s, "roofline_tokens_per_s": s.decode_batch / roofline_s,
        "fraction_of_roofline": roofline_s / per_step,
    }


def parse_xla_variants(specs: list[str]) -> dict[str, tuple[tuple[str, str], ...]]:
    """`NAME=OPTION:VALUE[;OPTION:VALUE...]` -> `{NAME: ((OPTION, VALUE), ...)}` (VALUE may hold
    commas; an empty VALUE is an empty string)."""
    out = {}
    for spec in specs:
        name, sep, body = spec.partition("=")
        pairs = [kv.partition(":") for kv in body.split(";") if kv]
        if not sep or not name or any(not k or not c for k, c, _ in pairs):
            raise ValueError(f"--rollout-xla {spec!r}: expected NAME=OPTION:VALUE[;OPTION:VALUE...]")
        out[name] = tuple((k, v) for k, _, v in pairs)
    return out


def bench_rollout_peer(s: Setup, bw_gbs: float, repeats: int = 2, peers=("transformers",),
                       tunix_python: str | None = None, prompts_path: str | None = None,
                       xla_variants: dict | None = None) -> dict:
    """Part 4: `generate` vs transformers' `generate` (and Tunix's sampler, in `tunix_python`)
    at a real checkpoint's shapes, bf16, one device. `xla_variants` (`parse_xla_variants`)
    adds our sampler compiled with those XLA options as more arms, each checked for the
    default arm's tokens at a fixed key."""
    import _common  # torch and transformers: for this part only
    import bench_rollout
    import torch

    from jaxrlhf.models import load_pretrained

    hf = _common.hf_llama(seed=0, shape=s.rollout_shape)
    with tempfile.TemporaryDirectory() as tmp:
        hf.save_pretrained(tmp, safe_serialization=True)
        model, params = load_pretrained(tmp, param_dtype="bfloat16", dtype="bfloat16")
    device = "cuda" if torch.cuda.is_available() else "cpu"
    hf = hf.to(device=device, dtype=torch.bfloat16)
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    cfg, t_new, prompt_len = model.config, s.rollout_tokens, 32
    weight_bytes = int(sum(x.nbytes for x in jax.tree.leaves(params)))
    out = {"shape": s.rollout_shape, "torch": torch.__version__, "torch_device": device, "prompt_len": prompt_len,
           "new_tokens": t_new, "weight_bytes": weight_bytes, "runs": []}
    try:  # the workload's 32-token rows (valid ids of any vocabulary), as the Tunix worker reads them
        rows = np.asarray(_common.load_workload(prompts_path)["prompts"])
        out["prompts"] = "workload_prompts.json"
    except FileNotFoundError:
        rows = np.random.default_rng(0).integers(3, cfg.vocab_size, (16, prompt_len))
        out["prompts"] = "random"
    prompts = np.concatenate([rows] * -(-max(s.rollout_batches) // len(rows)))
    floor = lambda median_s: weight_bytes / (bw_gbs * 1e9) / (median_s / t_new)  # weight-streaming floor reached

    if "transformers" in peers:
        # Greedy agreement, for the record: both compute the model in bf16 with their own kernels,
        # so the argmax may part after some tokens; the count of equal leading tokens is reported.
        p2 = prompts[:2]
        ours = generate(model, params, jnp.asarray(p2, jnp.int32), jnp.ones(p2.shape, bool), jax.random.key(0),
                        max_new_tokens=16, temperature=0.0, eos_id=None)
        with torch.no_grad():
            theirs = hf.generate(torch.tensor(p2, device=device), attention_mask=torch.ones(p2.shape, device=device,
                                 dtype=torch.long), do_sample=False, max_new_tokens=16, min_new_tokens=16, pad_token_id=0)
        same = np.asarray(ours.response_ids) == theirs[:, prompt_len:].cpu().numpy()
        out["greedy_equal_leading_tokens"] = [int(np.argmin(np.append(r, False))) for r in same]

    for b in s.rollout_batches:
        ids = jnp.asarray(prompts[:b], jnp.int32)
        mask = jnp.ones(ids.shape, bool)
        keys = iter(jax.random.split(jax.random.key(1), 64))

        def run_ours(key=None):
            return generate(model, params, ids, mask, next(keys) if key is None else key, max_new_tokens=t_new,
                            eos_id=None).response_ids.block_until_ready()

        def with_options(options):
            def run(key=None):
                with _common.sampler_options(options):
                    return run_ours(key)
            return run

        tb = torch.tensor(prompts[:b], device=device)
        tm = torch.ones(tb.shape, device=device, dtype=torch.long)

        def run_hf():
            with torch.no_grad():
                hf.generate(tb, attention_mask=tm, do_sample=True, temperature=1.0, top_k=0, top_p=1.0,
                            max_new_tokens=t_new, min_new_tokens=t_new, use_cache=True, pad_token_id=0)
            sync()

        arms = [("jaxrlhf", run_ours, None)]
        for name, options in (xla_variants or {}).items():
            arms.append((f"jaxrlhf ({name})", with_options(options), options))
        arms += [("transformers", run_hf, None)] if "transformers" in peers else []
        for impl, fn, options in arms:
            t0 = time.perf_counter()
            try:
                fn()
            except Exception as e:  # an option this backend refuses: recorded, the other arms run
                out["runs"].append({"impl": impl, "batch": b, "failed": f"{type(e).__name__}: {str(e)[:300]}"})
                print(json.dumps(out["runs"][-1]), flush=True)
                continue
            row = {"impl": impl, "batch": b, "first_call_s": time.perf_counter() - t0}
            if options is not None:  # the default arm's tokens, for a fixed key
                same = np.asarray(fn(jax.random.key(5))) == np.asarray(run_ours(jax.random.key(5)))
                row.update(xla_options=options, tokens_equal_default=bool(same.all()))
            row.update(_common.timed(fn, warmup=0, repeats=repeats, keep_times=True))
            row.update(tokens_per_s=b * t_new / row["median_s"], weight_floor_fraction=floor(row["median_s"]))
            out["runs"].append(row)
            print(json.dumps(row), flush=True)
        if "tunix" in peers:
            try:
                t = bench_rollout._run_tunix(tunix_python, b, 1, repeats, prompts_path, s.rollout_shape, t_new,
                                             dtype="bfloat16")
                t["weight_floor_fraction"] = floor(t["median_s"])
                out["runs"].append(t)
                print(json.dumps(t), flush=True)
            except Exception as e:  # recorded; our rows and transformers' stand
                out.setdefault("tunix_failed", {})[str(b)] = f"{type(e).__name__}: {str(e)[-800:]}"
                print(f"tunix at B = {b} failed: {e}", flush=True)
        ours = next(r["median_s"] for r in out["runs"] if r["batch"] == b and r["impl"] == "jaxrlhf")
        for peer in peers:
            theirs = next((r.get("median_s") for r in out["runs"] if r["batch"] == b and r["impl"] == peer), None)
            if theirs is not None:
                out[f"speedup_vs_{peer}_B{b}"] = theirs / ours
    return out


def to_markdown(res: dict) -> str:
    d, pk, bw = res["device"], res.get("peak"), res.get("bandwidth")
    tr, de, ro = res.get("train"), res.get("decode"), res.get("rollout")
    nominal = res.get("nominal") or {}
    lines = [f"# jaxrlhf on one {d['kind']} ({d['platform']})", "",
             f"jax {res['jax']}, random weights, {res.get('wall_s', float('nan')):.0f} s wall for the whole run.", "",
             "| measurement | value |", "|---|---|"]
    if pk:
        lines += [f"| bf16 matmul peak (measured, n={pk['matmul_n']}) | {pk['tflops']:.4g} TFLOP/s |"]
    if bw:
        lines += [f"| copy bandwidth (measured) | {bw['gb_per_s']:.4g} GB/s |"]
    if nominal:
        lines += [f"| nominal peak / bandwidth | {nominal['tflops']:.0f} TFLOP/s / {nominal['gb_per_s']:.0f} GB/s |"]
    if tr:
        lines += [
            f"| train step ({tr['params'] / 1e9:.3g}B params, {tr['batch']}×{tr['seq_len']} tokens, AdamW) | "
            f"{tr['step_s'] * 1e3:.1f} ms, {tr['tokens_per_s']:.0f} tokens/s |",
            f"| model FLOPs / step (6·N·tokens + attention) | {tr['model_flops_per_step'] / 1e12:.4g} TFLOP "
            f"(attention {100 * tr['attention_flops_share']:.1f}%) |",
            f"| **MFU** vs measured peak | **{100 * tr['mfu_vs_measured_peak']:.1f}%** |",
        ]
        if "mfu_vs_nominal_peak" in tr:
            lines += [f"| MFU vs nominal peak | {100 * tr['mfu_vs_nominal_peak']:.1f}% |"]
    if de:
        lines += [
            f"| decode (batch {de['batch']}, prompt {de['prompt_len']}, {de['new_tokens']} new) | "
            f"{de['decode_step_s'] * 1e3:.2f} ms/step, {de['tokens_per_s']:.0f} tokens/s |",
            f"| decode roofline (weights {de['weight_bytes'] / 1e9:.2f} GB + KV {de['kv_cache_bytes'] / 1e9:.2f} GB "
            f"per step) | {de['roofline_step_s'] * 1e3:.2f} ms/step, {de['roofline_tokens_per_s']:.0f} tokens/s |",
            f"| **decode fraction of roofline** | **{100 * de['fraction_of_roofline']:.1f}%** |",
        ]
    if ro:
        greedy = ro.get("greedy_equal_leading_tokens")
        lines += ["", f"Rollout, {ro['shape']}-shaped model in bf16, {ro['new_tokens']} sampled tokens a row"
                  + (f" (greedy against transformers: {greedy} equal leading tokens of 16)" if greedy else "") + ":", "",
                  "| B | impl | median s | new tokens/s | weight-streaming floor reached | first call s |",
                  "|---|---|---|---|---|---|"]
        lines += [f"| {r['batch']} | {r['impl']} | {r['median_s']:.3f} | {r['tokens_per_s']:,.0f} | "
                  f"{r['weight_floor_fraction']:.1%} | {r['first_call_s']:.1f} |" if "failed" not in r else
                  f"| {r['batch']} | {r['impl']} | failed: {r['failed'][:120]} | | | |" for r in ro["runs"]]
        lines += [f"- B = {k.rsplit('B', 1)[1]}: jaxrlhf / {k.split('_')[2]} speed = {v:.2f}×"
                  for k, v in ro.items() if k.startswith("speedup_vs_")]
        lines += [f"- Tunix at B = {b} failed: {e}" for b, e in ro.get("tunix_failed", {}).items()]
    lines.append("")
    for row in (res.get("attention") or {}).get("rows", []):
        err = row.get("error_vs_dense")
        cells = [f"{k}: {v['fwd_bwd_ms']:.2f} ms ({v['tflops']:.3g} TFLOP/s)" for k, v in row.items() if k.startswith("L=")]
        lines.append(f"- attention `{row['implementation']}`: " + ("; ".join(cells) or row.get("failed", ""))
                     + (f"; max error vs dense {max(err.values()):.2e}" if err else ""))
    lines += [f"- part `{k}` failed: {v}" for k, v in res.get("failed", {}).items()]
    return "\n".join(lines) + "\n"


PARTS = ("peak", "bandwidth", "train", "decode", "rollout", "attention")


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tiny", action="store_true", help="a tiny model: a smoke run that works on CPU")
    ap.add_argument("--out", default=os.path.join(REPO, "benchmarks", "results", "gpu"))
    ap.add_argument("--skip", nargs="*", default=[], choices=PARTS[2:], help="parts not to run")
    ap.add_argument("--rollout-peers", nargs="+", default=["transformers"], choices=("transformers", "tunix"),
                    help="the rollout part's peers")
    ap.add_argument("--tunix-python", default=None,
                    help="a python with google-tunix: Tunix's sampler in the rollout part (bf16 too)")
    ap.add_argument("--prompts", default=None, help="workload_prompts.json (default: benchmarks/workload_prompts.json)")
    ap.add_argument("--rollout-batches", type=int, nargs="+", default=None, help="the rollout part's B (8 16 64)")
    ap.add_argument("--rollout-xla", nargs="+", default=[], metavar="NAME=OPTION:VALUE[;...]",
                    help="more arms of our sampler, compiled with these XLA options (e.g. "
                         "cmd_while=xla_gpu_enable_command_buffer:FUSION,CUBLAS,CUBLASLT,CUSTOM_CALL,CUDNN,WHILE,CONDITIONAL)")
    args = ap.parse_args(argv)
    try:
        xla_variants = parse_xla_variants(args.rollout_xla)
    except ValueError as e:
        ap.error(str(e))
    if args.tunix_python:
        args.rollout_peers = list(dict.fromkeys(args.rollout_peers + ["tunix"]))
    elif "tunix" in args.rollout_peers:
        ap.error("--rollout-peers tunix needs --tunix-python")
    t_start = time.perf_counter()
    s = setups(args.tiny)
    if args.rollout_batches:
        s = dataclasses.replace(s, rollout_batches=tuple(args.rollout_batches))
    dev = jax.devices()[0]
    kind = getattr(dev, "device_kind", str(dev))
    res = {"jax": jax.__version__, "host": platform.node(), "tiny": args.tiny,
           "device": {"kind": kind, "platform": dev.platform, "count": jax.device_count()},
           "model": dataclasses.asdict(s.model), "failed": {}}
    nominal = next(((k, v) for k, v in NOMINAL.items() if k.lower() in kind.lower()), None)
    if nominal:
        res["nominal"] = {"match": nominal[0], "tflops": nominal[1][0], "gb_per_s": nominal[1][1]}
    print(f"device: {kind} ({dev.platform}) x{jax.device_count()}", flush=True)
    os.makedirs(args.out, exist_ok=True)

    def save():
        res["wall_s"] = time.perf_counter() - t_start
        with open(os.path.join(args.out, "bench_gpu.json"), "w") as f:
            json.dump(res, f, indent=2)
        with open(os.path.join(args.out, "bench_gpu.md"), "w") as f:
            f.write(to_markdown(res))

    peak = lambda: res["peak"]["tflops"]
    bandwidth = lambda: res["bandwidth"]["gb_per_s"]
    parts = {
        "peak": lambda: measure_peak(s.matmul_n, s.repeats),
        "bandwidth": lambda: measure_bandwidth(s.copy_mb, s.repeats),
        "train": lambda: bench_train(s, peak()),
        "decode": lambda: bench_decode(s, bandwidth()),
        "rollout": lambda: bench_rollout_peer(s, bandwidth(), peers=args.rollout_peers, tunix_python=args.tunix_python,
                                              prompts_path=args.prompts, xla_variants=xla_variants),
        "attention": lambda: bench_attention.run(tiny=args.tiny),
    }
    for name in PARTS:
        if name in args.skip:
            continue
        t0 = time.perf_counter()
        try:
            res[name] = parts[name]()
        except Exception as e:  # recorded, and the other parts still run
            traceback.print_exc()
            res["failed"][name] = f"{type(e).__name__}: {str(e)[:500]}"
        if name == "train" and nominal and "train" in res:
            res["train"]["mfu_vs_nominal_peak"] = res["train"]["achieved_tflops"] / nominal[1][0]
        print(f"part {name}: {time.perf_counter() - t0:.1f} s", flush=True)
        save()
    print(to_markdown(res))
    print(f"wrote {args.out}/bench_gpu.json and bench_gpu.md", flush=True)


if __name__ == "__main__":
    main()
