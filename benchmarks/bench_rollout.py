"""WORKLOAD.md measurement 1: new tokens/s of sampling, jaxrlhf vs transformers `generate`.

    python benchmarks/bench_rollout.py            # B = 16 and B = 64, both frameworks
    python benchmarks/bench_rollout.py --quick    # fewer repeats
    python benchmarks/bench_rollout.py --tunix-python /tmp/venv_tunix/bin/python   # + Tunix

With `--tunix-python`, Google's Tunix sampler runs too, in that interpreter's environment
(`tunix_rollout_worker.py`; Tunix's own Llama3 at the workload's sizes, same jax), right
after ours and transformers' for each B, in the same run.

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


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--prompts", default=None)
    ap.add_argument("--out", default=None)
    ap.add_argument("--batch", type=int, nargs="+", default=[16, 64])
    ap.add_argument("--tunix-python", default=None, help="a python with google-tunix installed")
    ap.add_argument("--cpu-devices", type=int, default=0,
                    help="also run the sampler with the batch over this many CPU devices (0: off)")
    args = ap.parse_args()
    warmup, repeats = (1, 3) if args.quick else (3, 6)

    import jax
    import jax.numpy as jnp
    import torch

    from jaxrlhf.models import load_pretrained
    from jaxrlhf.rollout import generate, sampler

    torch.set_num_threads(2)
    workload = _common.load_workload(args.prompts)
    prompts = np.asarray(workload["prompts"], np.int32)
    hf = _common.hf_llama(seed=0)
    with tempfile.TemporaryDirectory() as tmp:
        hf.save_pretrained(tmp, safe_serialization=True)
        model, params = load_pretrained(tmp)

    results = {"workload": "measurement 1", "date": datetime.datetime.now(datetime.timezone.utc).isoformat(),
               "machine": platform.processor() or platform.machine(), "jax": jax.__version__,
               "torch": torch.__version__, "runs": []}

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
        generate(model, params, jbatch, jmask, next(keys), max_new_tokens=NEW_TOKENS).response_ids.block_until_ready()
        compile_s = time.perf_counter() - start
        one = lambda key: generate(model, params, jbatch, jmask, key, max_new_tokens=NEW_TOKENS, cpu_threads=1)
        if not (one(jax.random.key(7)).response_ids == generate(model, params, jbatch, jmask, jax.random.key(7),
                                                                 max_new_tokens=NEW_TOKENS).response_ids).all():
            raise RuntimeError("generate's row blocks sample other tokens than one program")

        def run_ours():
            generate(model, params, jbatch, jmask, next(keys), max_new_tokens=NEW_TOKENS).response_ids.block_until_ready()

        def run_one_program():
            one(next(keys)).response_ids.block_until_ready()

        tb, tm = torch.tensor(batch, dtype=torch.long), torch.ones(batch.shape, dtype=torch.long)

        def run_hf():
            with torch.no_grad():
                hf.generate(tb, attention_mask=tm, do_sample=True, temperature=1.0, top_k=0, top_p=1.0,
                            max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS, use_cache=True, pad_token_id=0)

        for name, fn in (("jaxrlhf", run_ours), ("jaxrlhf (one program)", run_one_program), ("transformers", run_hf)):
            with _common.CpuWatch() as watch:
                t = _common.timed(fn, warmup=warmup, repeats=repeats)
            t.update(watch.result(), impl=name, batch=b, tokens_per_s=b * NEW_TOKENS / t["median_s"])
            if name == "jaxrlhf":
                t.update(first_call_s=compile_s, row_blocks=sampler.cpu_row_blocks(b, params, jbatch))
            results["runs"].append(t)
        if args.tunix_python:
            results["runs"].append(_run_tunix(args.tunix_python, b, warmup, repeats, args.prompts))
        if args.cpu_devices > 1:
            sampled = generate(model, params, jbatch, jmask, jax.random.key(7), max_new_tokens=NEW_TOKENS)
            results["runs"].append(_run_devices(args.cpu_devices, b, warmup, repeats, args.prompts,
                                                np.asarray(greedy.response_ids), np.asarray(sampled.response_ids)))
    results["peak_rss_mib"] = _common.peak_rss_mib()

    print(f"greedy tokens equal: {results['greedy_tokens_equal']}\n")
    print("| B | impl | median s | min s | max s | new tokens/s | first call s | others' cores |")
    print("|---|---|---|---|---|---|---|---|")
    for r in results["runs"]:
        print(f"| {r['batch']} | {r['impl']} | {r['median_s']:.4f} | {r['min_s']:.4f} | {r['max_s']:.4f} | "
              f"{r['tokens_per_s']:,.0f} | {r.get('first_call_s', float('nan')):.2f} | {r['others_cores']} |")
    multi = f"jaxrlhf ({args.cpu_devices} CPU devices)"
    for b in args.batch:
        for label, key in (("jaxrlhf", ""), ("jaxrlhf (one program)", "_one_program"), (multi, "_multi_device")):
            ours = next((r for r in results["runs"] if r["batch"] == b and r["impl"] == label), None)
            for peer in ("transformers", "tunix"):
                theirs = next((r for r in results["runs"] if r["batch"] == b and r["impl"] == peer), None)
                if ours is not None and theirs is not None:
                    ratio = theirs["median_s"] / ours["median_s"]
                    results[f"speedup{key}_vs_{peer}_B{b}"] = ratio
                    print(f"B={b}: {label} / {peer} speed = {ratio:.2f}x")
    print(f"peak RSS {results['peak_rss_mib']:.0f} MiB")
    print("wrote", _common.write_json(args.out, "rollout.json", results))


def _run_tunix(python: str, batch: int, warmup: int, repeats: int, prompts: str | None) -> dict:
    """Tunix's sampler on the same workload, in its own interpreter (see the module doc)."""
    cmd = [python, str(Path(__file__).with_name("tunix_rollout_worker.py")), "--batch", str(batch),
           "--warmup", str(warmup), "--repeats", str(repeats)] + (["--prompts", prompts] if prompts else [])
    r, watch = _common.run_json_worker(cmd, "tunix")
    if r["new_tokens_per_row"] != [NEW_TOKENS]:
        raise RuntimeError(f"tunix generated {r['new_tokens_per_row']} tokens per row, expected {NEW_TOKENS}")
    t = _common.summary(r["times"])
    # The watch spans the worker's start-up and compile too; its own process is excluded.
    t.update(watch.result(), impl="tunix", batch=batch, tokens_per_s=batch * NEW_TOKENS / t["median_s"],
             first_call_s=r["first_call_s"], versions={"tunix": r["tunix"], "jax": r["jax"]})
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
