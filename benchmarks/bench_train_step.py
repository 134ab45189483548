"""Train-step benchmark: jaxrlhf vs transformers (PyTorch), side by side in one process.

The reference workload, measurement 2 (docs/benchmarks.md#the-reference-workload): a tiny
random-init Llama (vocab 512, hidden 256, 4 layers), batch [16, 96] (`train_batch` of
benchmarks/workload_prompts.json), loss = mean next-token cross-entropy over the 16 x 95 shifted positions, AdamW lr 1e-5 (b1 0.9, b2 0.999, eps 1e-8,
weight decay 0). One step = forward + backward + optimizer update; on the JAX side a single
jitted function with the state donated, on the torch side zero_grad + forward + backward +
step. Both start from the same weights (the torch init, `torch.manual_seed(0)`, saved with
`save_pretrained` and read back with `jaxrlhf.models.load_pretrained`), so their first
losses must agree (about ln 512 = 6.238).

Timed steps alternate between the two frameworks so that a change in machine load hits
both alike; the CPU time other processes used during the timed window is recorded
(`cpu_watch.others_cores`), and a result with `contended: true` is not valid.

    python benchmarks/bench_train_step.py --out /tmp/bench_train_step.json
"""

from __future__ import annotations

import argparse
import math
import os
import platform
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _common  # noqa: E402


def build_jax(ckpt_dir, batch_BxL):
    import jax
    import jax.numpy as jnp
    import optax

    from jaxrlhf.models import load_pretrained

    model, params = load_pretrained(ckpt_dir)
    tx = optax.adamw(1e-5, b1=0.9, b2=0.999, eps=1e-8, weight_decay=0.0)

    def loss_fn(params, ids_BxL):
        logits_BxLxV = model.apply({"params": params}, ids_BxL).logits
        logits_BxTxV, targets_BxT = logits_BxLxV[:, :-1], ids_BxL[:, 1:]
        # CE = logsumexp(logits) - logit[target], without materialising log-softmax.
        lse_BxT = jax.nn.logsumexp(logits_BxTxV, axis=-1)
        tgt_BxT = jnp.take_along_axis(logits_BxTxV, targets_BxT[..., None], axis=-1)[..., 0]
        return jnp.mean(lse_BxT - tgt_BxT)

    def train_step(state, ids_BxL):
        params, opt_state = state
        loss, grads = jax.value_and_grad(loss_fn)(params, ids_BxL)
        updates, opt_state = tx.update(grads, opt_state, params)
        return (optax.apply_updates(params, updates), opt_state), loss

    step = jax.jit(train_step, donate_argnums=0)
    state = (params, tx.init(params))
    ids = jnp.asarray(batch_BxL, jnp.int32)
    t0 = time.perf_counter()
    compiled = step.lower(state, ids).compile()
    compile_s = time.perf_counter() - t0
    box = {"state": state}

    def run():
        box["state"], loss = compiled(box["state"], ids)
        return float(jax.block_until_ready(loss))

    return run, compile_s


def build_torch(tm, batch_BxL):
    import torch

    opt = torch.optim.AdamW(tm.parameters(), lr=1e-5, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0)
    ids = torch.as_tensor(np.asarray(batch_BxL), dtype=torch.long)
    tm.train()

    def run():
        opt.zero_grad(set_to_none=True)
        loss = tm(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        return float(loss.detach())

    return run


def _stats(times):
    s = _common.summary(times, count_key="n")
    return {**s, "tokens_per_s_median": 16 * 96 / s["median_s"]}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--prompts", default=None, help="workload_prompts.json (default: benchmarks/workload_prompts.json)")
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--framework", choices=("both", "jax", "torch"), default="both",
                    help="run one side alone to read its own peak RSS")
    ap.add_argument("--out", default=None, help="write the JSON result here")
    args = ap.parse_args(argv)
    if args.steps < 6:
        ap.error("--steps must be >= 6 (the reference workload's protocol)")
    sys.path.insert(0, str(_common.REPO))

    t_start = time.perf_counter()
    import torch
    import transformers

    torch.set_num_threads(2)
    batch = np.asarray(_common.load_workload(args.prompts)["train_batch"], np.int64)
    assert batch.shape == (16, 96), batch.shape

    torch.manual_seed(0)
    tm = transformers.LlamaForCausalLM(_common.hf_llama_config(attn_implementation="sdpa"))
    n_params = sum(p.numel() for p in tm.parameters())
    runners, compile_s = {}, None
    with tempfile.TemporaryDirectory() as ckpt:
        if args.framework in ("both", "jax"):
            tm.save_pretrained(ckpt, safe_serialization=True)
            runners["jax"], compile_s = build_jax(ckpt, batch)
    if args.framework in ("both", "torch"):
        runners["torch"] = build_torch(tm, batch)
    else:
        del tm

    first_loss = {}
    for name, run in runners.items():
        first_loss[name] = run()
        for _ in range(args.warmup - 1):
            run()
    times = {name: [] for name in runners}
    with _common.CpuWatch() as watch:
        for _ in range(args.steps):
            for name, run in runners.items():
                t0 = time.perf_counter()
                run()
                times[name].append(time.perf_counter() - t0)

    import jax

    result = dict(
        workload="reference workload, measurement 2 (train step)",
        params=n_params,
        first_loss=first_loss,
        ln_vocab=math.log(512),
        jax_compile_s=compile_s,
        stats={name: _stats(t) for name, t in times.items()},
        times=times,
        peak_rss_mib=_common.peak_rss_mib(),
        peak_rss_note=f"whole process, frameworks loaded: {args.framework}",
        cpu_watch=watch.result(detail=True),
        versions=dict(jax=jax.__version__, torch=torch.__version__, transformers=transformers.__version__,
                      python=platform.python_version()),
        nproc=os.cpu_count(),
        warmup=args.warmup,
        total_s=time.perf_counter() - t_start,
    )
    if "jax" in times and "torch" in times:
        result["speedup_jax_over_torch_median"] = (result["stats"]["torch"]["median_s"]
                                                   / result["stats"]["jax"]["median_s"])
    print(_markdown(result))
    if args.out:
        _common.write_json(args.out, "train_step.json", result)
    return result


def _markdown(r) -> str:
    lines = ["| framework | first loss | min s/step | median s/step | max s/step | tokens/s (median) |",
             "|---|---|---|---|---|---|"]
    for name, s in r["stats"].items():
        lines.append(f"| {name} | {r['first_loss'][name]:.4f} | {s['min_s']:.4f} | {s['median_s']:.4f} "
                     f"| {s['max_s']:.4f} | {s['tokens_per_s_median']:.0f} |")
    extra = [f"params {r['params']:,}; ln(512) = {r['ln_vocab']:.4f}"]
    if r.get("jax_compile_s") is not None:
        extra.append(f"jax first-call compile {r['jax_compile_s']:.2f} s")
    if "speedup_jax_over_torch_median" in r:
        extra.append(f"jax/torch speed ratio (median) {r['speedup_jax_over_torch_median']:.2f}x")
    extra.append(f"peak RSS {r['peak_rss_mib']:.0f} MiB ({r['peak_rss_note']})")
    w = r["cpu_watch"]
    extra.append(f"other processes used {w['others_cores']:.2f} cores during timing "
                 f"(load {w['loadavg_before'][0]:.2f} -> {w['loadavg_after'][0]:.2f}); "
                 f"contended: {w['contended']}")
    return "\n".join(lines + [""] + ["- " + e for e in extra])


if __name__ == "__main__":
    main()
