"""Reference workload, measurement 1: new tokens/s of sampling, jaxrlhf vs transformers `generate`.

The workload: docs/benchmarks.md#the-reference-workload.

    python benchmarks/bench_rollout.py            # B = 16 and B = 64, both frameworks
    python benchmarks/bench_rollout.py --quick    # fewer repeats
    python benchmarks/bench_rollout.py --tunix-python /tmp/venv_tunix/bin/python   # + Tunix
    python benchmarks/bench_rollout.py --skewed   # continuous batching on skewed lengths
    python benchmarks/bench_rollout.py --shape smollm2 --batch 8 16 64 --new-tokens 256   # real-shaped

`--shape smollm2` times a real checkpoint's shapes instead of the workload's tiny model: a
SmolLM2-135M-shaped Llama (30 layers, 576 wide, 9/3 heads of 64, V = 49,152, tied head;
random HF init, the values do not change the time) on the workload's prompts (their ids
are valid tokens of any vocabulary). Each row then also reports the fraction of the
weight-streaming floor it reached: the bytes of the weights read per decode step over the
memory bandwidth measured in the same process (a streaming sum over a 512 MiB array), against
the measured seconds per new token.

With `--tunix-python`, Google's Tunix sampler runs too, in that interpreter's environment
(`tunix_rollout_worker.py`; Tunix's own Llama3 at the same shapes, `--shape` included, same
jax), right after ours and transformers' for each B, in the same run.

The `jaxrlhf` row is `generate` as a user calls it: on this CPU it runs the prompts as one
row block per core, each on its own thread (`cpu_threads`, jaxrlhf/rollout/sampler.py),
since XLA:CPU runs one decode program on about one core. `jaxrlhf (one program)` is
`cpu_threads=1`; both must sample the same tokens for a fixed key (checked).

With `--cpu-devices N` (N > 1), one more row: our sampler with the batch split over N
XLA:CPU devices, one per core (`rollout_devices_worker.py`, its own process, since the
device count is fixed when jax starts). Its greedy tokens and the sampled tokens of a fixed
key must equal the one-device sampler's. The headline ratios are the `jaxrlhf` row's: one
device, one process, what `generate` does by default.

16 prompts x 32 tokens -> exactly 64 new tokens, temperature 1, top-k/top-p off, KV cache on,
tiny Llama in float32 on the CPU, torch with 2 threads. Both models get the same weights
(the HF model's default init after `torch.manual_seed(0)`, converted), and greedy decoding
is checked to agree before timing. Writes benchmarks/results/rollout.json (or --out).

`--skewed` measures continuous batching instead (`rollout.continuous`; `skewed`): the
workload's model (random init) with an EOS bias, a queue of 64 prompts × 4 samples = 256
rows of up to T = 96 tokens (τ = 1), and useful (valid) tokens per second of S slots
(`--slots`, default 32) against the static sampler run over the same queue in batches of S
rows (the same cache memory) and as one batch of 256. All three must sample the same
tokens; the arms are timed alternately, medians reported. Writes rollout_skewed.json.
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

NEW_TOKENS = 64
SKEW_T, SKEW_SAMPLES, SKEW_EOS, SKEW_BIAS = 96, 4, 2, 0.75


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--prompts", default=None)
    ap.add_argument("--out", default=None)
    ap.add_argument("--batch", type=int, nargs="+", default=[16, 64])
    ap.add_argument("--tunix-python", default=None, help="a python with google-tunix installed")
    ap.add_argument("--cpu-devices", type=int, default=0,
                    help="also run the sampler with the batch over this many CPU devices (0: off)")
    ap.add_argument("--skewed", action="store_true", help="continuous batching on a skewed-length workload")
    ap.add_argument("--shape", choices=sorted(_common.SHAPES), default="workload",
                    help="the model's shapes: the workload's tiny Llama, or a real checkpoint's")
    ap.add_argument("--new-tokens", type=int, default=NEW_TOKENS, help="new tokens per row (default 64)")
    ap.add_argument("--slots", type=int, nargs="+", default=[32], help="--skewed: slot counts S")
    ap.add_argument("--no-one-program", action="store_true",
                    help="skip the `cpu_threads=1` row (saves time at large B)")
    ap.add_argument("--bf16-dots", action="store_true",
                    help="also our sampler with bf16 params whose layer projections take bf16 dots accumulating "
                         "in float32 (`ModelConfig.matmul_dtype`); the peers stay float32")
    args = ap.parse_args()
    warmup, repeats = (1, 3) if args.quick else (3, 6)
    if args.shape != "workload" and (args.cpu_devices > 1 or args.skewed):
        ap.error("--shape runs jaxrlhf, transformers and Tunix only: the multi-device worker and --skewed "
                 "build the workload's model")
    if args.skewed:
        return skewed(args, warmup, repeats)

    import jax
    import jax.numpy as jnp
    import torch

    from jaxrlhf.models import load_pretrained
    from jaxrlhf.rollout import generate, sampler

    torch.set_num_threads(2)
    workload = _common.load_workload(args.prompts)
    prompts = np.asarray(workload["prompts"], np.int32)
    hf = _common.hf_llama(seed=0, shape=args.shape)
    new_tokens = args.new_tokens
    with tempfile.TemporaryDirectory() as tmp:
        hf.save_pretrained(tmp, safe_serialization=True)
        model, params = load_pretrained(tmp)
        bf16 = (load_pretrained(tmp, param_dtype="bfloat16", dtype="float32", matmul_dtype="bfloat16")
                if args.bf16_dots else None)

    weight_bytes = sum(x.nbytes for x in jax.tree.leaves(params))
    bf16_bytes = sum(x.nbytes for x in jax.tree.leaves(bf16[1])) if bf16 is not None else 0
    results = {"workload": "reference workload, measurement 1" if args.shape == "workload" else f"{args.shape}-shaped model",
               "shape": args.shape, "new_tokens": new_tokens, "weight_bytes": weight_bytes,
               "bandwidth_gb_s": _bandwidth_gb_s(), "date": datetime.datetime.now(datetime.timezone.utc).isoformat(),
               "machine": platform.processor() or platform.machine(), "jax": jax.__version__,
               "torch": torch.__version__, "runs": []}

    def floor_fraction(median_s: float) -> float:
        """The weight-streaming floor (weights read once per new token at the measured
        bandwidth) over the measured seconds per new token."""
        return weight_bytes / (results["bandwidth_gb_s"] * 1e9) / (median_s / new_tokens)

    # Same tokens under greedy decoding: the two implementations compute the same model.
    p8 = prompts[:2]
    greedy = generate(model, params, p8, np.ones_like(p8, bool), jax.random.key(0), max_new_tokens=16,
                      temperature=0.0)
    with torch.no_grad():
        theirs = hf.generate(torch.tensor(p8, dtype=torch.long), attention_mask=torch.ones(p8.shape, dtype=torch.long),
                             do_sample=False, max_new_tokens=16, min_new_tokens=16, pad_token_id=0)
    results["greedy_tokens_equal"] = bool((np.asarray(greedy.response_ids) == theirs[:, 32:].numpy()).all())

    for b in args.batch:
        batch = np.concatenate([prompts] * (b // len(prompts) + 1))[:b] if b > len(prompts) else prompts[:b]
        mask = np.ones_like(batch, bool)
        jbatch, jmask = jnp.asarray(batch), jnp.asarray(mask)
        keys = iter(jax.random.split(jax.random.key(1), 1000))

        start = time.perf_counter()
        generate(model, params, jbatch, jmask, next(keys), max_new_tokens=new_tokens).response_ids.block_until_ready()
        compile_s = time.perf_counter() - start
        one = lambda key: generate(model, params, jbatch, jmask, key, max_new_tokens=new_tokens, cpu_threads=1)
        if not (one(jax.random.key(7)).response_ids == generate(model, params, jbatch, jmask, jax.random.key(7),
                                                                 max_new_tokens=new_tokens).response_ids).all():
            raise RuntimeError("generate's row blocks sample other tokens than one program")

        def run_ours():
            generate(model, params, jbatch, jmask, next(keys), max_new_tokens=new_tokens).response_ids.block_until_ready()

        def run_one_program():
            one(next(keys)).response_ids.block_until_ready()

        tb, tm = torch.tensor(batch, dtype=torch.long), torch.ones(batch.shape, dtype=torch.long)

        def run_hf():
            with torch.no_grad():
                hf.generate(tb, attention_mask=tm, do_sample=True, temperature=1.0, top_k=0, top_p=1.0,
                            max_new_tokens=new_tokens, min_new_tokens=new_tokens, use_cache=True, pad_token_id=0)

        def run_bf16_dots():
            generate(*bf16, jbatch, jmask, next(keys), max_new_tokens=new_tokens).response_ids.block_until_ready()

        arms = [("jaxrlhf", run_ours), ("jaxrlhf (one program)", run_one_program)]
        arms += [("jaxrlhf (bf16 dots)", run_bf16_dots)] if bf16 is not None else []
        arms += [("transformers", run_hf)]
        for name, fn in [a for a in arms if not (args.no_one_program and a[1] is run_one_program)]:
            with _common.CpuWatch() as watch:
                t = _common.timed(fn, warmup=warmup, repeats=repeats)
            t.update(watch.result(), impl=name, batch=b, tokens_per_s=b * new_tokens / t["median_s"],
                     weight_floor_fraction=floor_fraction(t["median_s"]) * (
                         bf16_bytes / weight_bytes if fn is run_bf16_dots else 1))
            if name == "jaxrlhf":
                # The blocks `generate` ran: its default rule reads the weights' size too.
                t.update(first_call_s=compile_s,
                         row_blocks=sampler.cpu_row_blocks(b, params, jbatch, weight_bytes=weight_bytes))
            results["runs"].append(t)
        if args.tunix_python:
            t = _run_tunix(args.tunix_python, b, warmup, repeats, args.prompts, args.shape, new_tokens)
            t["weight_floor_fraction"] = floor_fraction(t["median_s"])
            results["runs"].append(t)
        if args.cpu_devices > 1:
            sampled = generate(model, params, jbatch, jmask, jax.random.key(7), max_new_tokens=new_tokens)
            results["runs"].append(_run_devices(args.cpu_devices, b, warmup, repeats, args.prompts,
                                                np.asarray(greedy.response_ids), np.asarray(sampled.response_ids)))
    results["peak_rss_mib"] = _common.peak_rss_mib()

    print(f"greedy tokens equal: {results['greedy_tokens_equal']}\n")
    print(f"{results['workload']}: {weight_bytes / 2**20:,.0f} MiB of weights, {new_tokens} new tokens a row; "
          f"measured bandwidth {results['bandwidth_gb_s']:.1f} GB/s")
    print("| B | impl | median s | min s | max s | new tokens/s | weight-streaming floor reached | first call s | "
          "others' cores |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in results["runs"]:
        floor = f"{r['weight_floor_fraction']:.0%}" if "weight_floor_fraction" in r else ""
        print(f"| {r['batch']} | {r['impl']} | {r['median_s']:.4f} | {r['min_s']:.4f} | {r['max_s']:.4f} | "
              f"{r['tokens_per_s']:,.0f} | {floor} | {r.get('first_call_s', float('nan')):.2f} | {r['others_cores']} |")
    multi = f"jaxrlhf ({args.cpu_devices} CPU devices)"
    for b in args.batch:
        for label, key in (("jaxrlhf", ""), ("jaxrlhf (one program)", "_one_program"), (multi, "_multi_device"),
                           ("jaxrlhf (bf16 dots)", "_bf16_dots")):
            ours = next((r for r in results["runs"] if r["batch"] == b and r["impl"] == label), None)
            for peer in ("transformers", "tunix"):
                theirs = next((r for r in results["runs"] if r["batch"] == b and r["impl"] == peer), None)
                if ours is not None and theirs is not None:
                    ratio = theirs["median_s"] / ours["median_s"]
                    results[f"speedup{key}_vs_{peer}_B{b}"] = ratio
                    print(f"B={b}: {label} / {peer} speed = {ratio:.2f}x")
    print(f"peak RSS {results['peak_rss_mib']:.0f} MiB")
    print("wrote", _common.write_json(args.out, "rollout.json", results))


def _bandwidth_gb_s(mib: int = 512, repeats: int = 5) -> float:
    """Memory bandwidth this process reaches, GB/s: the best of `repeats` jitted sums over a
    `mib` MiB float32 array (each reads it once)."""
    import jax
    import jax.numpy as jnp

    x = jnp.ones((mib * 2**20 // 4,), jnp.float32)
    total = jax.jit(jnp.sum)
    total(x).block_until_ready()
    best = _common.timed(lambda: total(x).block_until_ready(), warmup=0, repeats=repeats)["min_s"]
    return x.nbytes / best / 1e9


def eos_biased_params(params, bias: float, eos_id: int):
    """`params` with a near-constant EOS logit bias: every token embedding's coordinate 0 is
    1 (the final norm then keeps that coordinate large and steady), and the LM head reads
    coordinate 0 into the EOS logit only, times `bias`. The other logits are the random
    model's, and the context still moves the EOS logit, so rows end at very different steps."""
    embed = params["embed_tokens"]["embedding"].at[:, 0].set(1.0)
    head = params["lm_head"]["kernel"].at[0, :].set(0.0).at[0, eos_id].set(bias)
    return dict(params, embed_tokens={"embedding": embed}, lm_head={"kernel": head})


def skewed(args, warmup: int, repeats: int):
    """Continuous batching against the static sampler on a skewed-length queue (module doc)."""
    import functools

    import jax
    import jax.numpy as jnp

    from jaxrlhf.models import Transformer, init_params
    from jaxrlhf.rollout import sample, sample_continuous

    model = Transformer(_common.jax_llama_config())
    params = eos_biased_params(init_params(model, jax.random.key(0)), SKEW_BIAS, SKEW_EOS)
    prompts = np.asarray(_common.load_workload(args.prompts)["prompts"], np.int32)  # [64, 32]
    ids, mask = jnp.asarray(prompts), jnp.ones(prompts.shape, bool)
    rows = len(prompts) * SKEW_SAMPLES
    kw = dict(max_new_tokens=SKEW_T, temperature=1.0, eos_id=SKEW_EOS, num_samples=SKEW_SAMPLES)
    static = jax.jit(functools.partial(sample, model, **kw))
    key = jax.random.key(1)
    whole = static(params, ids, mask, key)
    lengths = np.asarray(whole.lengths)
    useful = int(lengths.sum())
    results = {"workload": "skewed lengths", "date": datetime.datetime.now(datetime.timezone.utc).isoformat(),
               "machine": platform.processor() or platform.machine(), "jax": jax.__version__, "rows": rows,
               "max_new_tokens": SKEW_T, "eos_bias": SKEW_BIAS, "useful_tokens": useful,
               "lengths": {"mean": float(lengths.mean()), "median": float(np.median(lengths)),
                           "p90": float(np.percentile(lengths, 90)),
                           "at_most_T/4": float((lengths <= SKEW_T // 4).mean()),
                           "reach_T": int((lengths == SKEW_T).sum())},
               "runs": []}

    def block(out):
        return out.response_ids.block_until_ready()

    for s in args.slots:
        per = s // SKEW_SAMPLES  # prompts per static batch of S rows
        if per < 1 or len(prompts) % per:
            raise SystemExit(f"--slots {s}: S / {SKEW_SAMPLES} samples must divide the {len(prompts)} prompts")
        cont = jax.jit(functools.partial(sample_continuous, model, slots=s, **kw))

        def batches():
            return [static(params, ids[i:i + per], mask[i:i + per], key, first_row=jnp.int32(i * SKEW_SAMPLES))
                    for i in range(0, len(prompts), per)]

        got = cont(params, ids, mask, key)
        split = [np.asarray(o.response_ids) for o in batches()]
        for name, tokens in (("continuous", np.asarray(got.response_ids)), ("static, S rows", np.concatenate(split))):
            if not (tokens == np.asarray(whole.response_ids)).all():
                raise RuntimeError(f"{name} sampled other tokens than one static batch (S={s})")
        arms = {f"continuous, S={s}": lambda: block(cont(params, ids, mask, key)),
                f"static, batches of S={s}": lambda: [block(o) for o in batches()],
                f"static, one batch of {rows}": lambda: block(static(params, ids, mask, key))}
        times = {name: [] for name in arms}
        for _ in range(warmup):
            for fn in arms.values():
                fn()
        with _common.CpuWatch() as watch:
            for _ in range(repeats):  # alternate the arms: a shared machine's load hits all of them
                for name, fn in arms.items():
                    start = time.perf_counter()
                    fn()
                    times[name].append(time.perf_counter() - start)
        for name, ts in times.items():
            t = _common.summary(ts)
            t.update(watch.result(), impl=name, slots=s, useful_tokens_per_s=useful / t["median_s"])
            results["runs"].append(t)
        cont_s = times[f"continuous, S={s}"]
        for name in list(arms)[1:]:
            results[f"speedup_S{s}_vs_{name}"] = float(np.median(times[name]) / np.median(cont_s))
    results["peak_rss_mib"] = _common.peak_rss_mib()

    ln = results["lengths"]
    print(f"{rows} rows, T = {SKEW_T}: lengths mean {ln['mean']:.1f}, median {ln['median']:.0f}, p90 {ln['p90']:.0f}, "
          f"{ln['at_most_T/4']:.0%} within T/4, {ln['reach_T']} reach T; {useful} useful tokens; same tokens: True\n")
    print("| impl | median s | min s | max s | useful tokens/s | others' cores |")
    print("|---|---|---|---|---|---|")
    for r in results["runs"]:
        print(f"| {r['impl']} | {r['median_s']:.3f} | {r['min_s']:.3f} | {r['max_s']:.3f} | "
              f"{r['useful_tokens_per_s']:,.0f} | {r['others_cores']} |")
    for k, v in results.items():
        if k.startswith("speedup"):
            print(f"{k}: {v:.2f}x")
    print("wrote", _common.write_json(args.out, "rollout_skewed.json", results))


def _run_tunix(python: str, batch: int, warmup: int, repeats: int, prompts: str | None, shape: str = "workload",
               new_tokens: int = NEW_TOKENS, dtype: str = "float32") -> dict:
    """Tunix's sampler on the same workload and model shapes, in its own interpreter (see the
    module doc)."""
    cmd = [python, str(Path(__file__).with_name("tunix_rollout_worker.py")), "--batch", str(batch),
           "--warmup", str(warmup), "--repeats", str(repeats), "--shape", shape, "--new-tokens", str(new_tokens),
           "--dtype", dtype]
    r, watch = _common.run_json_worker(cmd + (["--prompts", prompts] if prompts else []), "tunix")
    if r["new_tokens_per_row"] != [new_tokens]:
        raise RuntimeError(f"tunix generated {r['new_tokens_per_row']} tokens per row, expected {new_tokens}")
    t = _common.summary(r["times"])
    # The watch spans the worker's start-up and compile too; its own process is excluded.
    t.update(watch.result(), impl="tunix", batch=batch, tokens_per_s=batch * new_tokens / t["median_s"],
             first_call_s=r["first_call_s"], versions={"tunix": r["tunix"], "jax": r["jax"]}, dtype=r["dtype"],
             device=r["device"])
    return t


def _run_devices(devices: int, batch: int, warmup: int, repeats: int, prompts: str | None,
                 greedy_1dev: np.ndarray, sampled_1dev: np.ndarray) -> dict:
    """Our sampler with the batch over `devices` CPU devices, in its own process."""
    cmd = [sys.executable, str(Path(__file__).with_name("rollout_devices_worker.py")), "--devices", str(devices),
           "--batch", str(batch), "--new-tokens", str(NEW_TOKENS), "--warmup", str(warmup),
           "--repeats", str(repeats)] + (["--prompts", prompts] if prompts else [])
    r, watch = _common.run_json_worker(cmd, f"{devices} devices")
    same_greedy = bool((np.asarray(r["greedy_tokens"]) == greedy_1dev).all())
    same_sampled = bool((np.asarray(r["sampled_tokens_key7"]) == sampled_1dev).all())
    if not same_greedy:
        raise RuntimeError(f"the sampler over {devices} devices decodes other greedy tokens than on one")
    t = _common.summary(r["times"])
    t.update(watch.result(), impl=f"jaxrlhf ({devices} CPU devices)", batch=batch,
             tokens_per_s=batch * NEW_TOKENS / t["median_s"], first_call_s=r["first_call_s"],
             greedy_tokens_equal_one_device=same_greedy, sampled_tokens_equal_one_device=same_sampled,
             peak_rss_mib=r["peak_rss_mib"])
    return t


if __name__ == "__main__":
    main()
