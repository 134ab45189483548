"""GRPO step benchmark: jaxrlhf vs TRL's GRPOTrainer (PyTorch), in one process (and Tunix's GRPOLearner).

The reference workload, measurement 3 (docs/benchmarks.md#the-reference-workload): a tiny
random-init Llama (vocab 512, hidden 256, intermediate 688, 4 layers, 4/2 heads, head_dim 64,
float32); per step 2 prompts (32 tokens, from the 64 `prompts` of
benchmarks/workload_prompts.json, shuffled with seed 0) × 8 generations of exactly 64
new tokens (τ = 1, no top-k / top-p, no EOS); reward = fraction of completion tokens equal
to id 7; advantages (r − mean_group)/(std_group + 1e-4); loss "dapo" (token mean over the
batch), clip 0.2, β = 0, μ = 1; AdamW lr 1e-6 decayed linearly to 0 over the run,
weight decay 0, max_grad_norm 1.0.

jaxrlhf runs rollout → reward → advantages → update as one jitted program
(`grpo.make_iteration(..., time_split=False)`, state donated); its generation share is the median time of the
rollout alone (the same sampler, jitted on its own) over the median step. TRL runs
`GRPOTrainer` (bf16=False, gradient checkpointing on — TRL's default — and off,
`generation_kwargs={"min_new_tokens": 64}`, `torch.set_num_threads(2)`); its generation time
is the time spent in `_generate_single_turn` within each optimizer step. Both start from
the same weights (the torch init, `torch.manual_seed(0)`, read into JAX with
`load_pretrained`).

    python benchmarks/bench_grpo.py --out /tmp/bench_grpo.json
    python benchmarks/bench_grpo.py --quick            # 1 warm-up + 2 timed steps, a smoke run
    python benchmarks/bench_grpo.py --tunix-python /tmp/venv_tunix/bin/python   # + Tunix
    python benchmarks/bench_grpo.py --lora 16          # + LoRA rows: jaxrlhf and TRL + PEFT
    python benchmarks/bench_grpo.py --shape smollm2 --warmup 1 --time-split   # a real checkpoint's shapes

`--shape smollm2` runs the same workload on a SmolLM2-135M-shaped Llama (30 layers, 576 wide,
9/3 heads, V = 49,152, tied embeddings; `_common.SHAPES`), random torch init as above; the
word tokenizer then covers all 49,152 ids. `--time-split` runs jaxrlhf's step as the three
timed programs of the command line's default (`make_iteration(time_split=True)`) and records
where its time goes (`time_split`: median rollout, scoring and update seconds; its generation
share is then the rollout's, with no separate rollout timing).

With `--lora R`, both frameworks also run the same workload training rank-R adapters on
every projection (q/k/v/o, gate/up/down; alpha 2R, no dropout) instead of all weights:
jaxrlhf with `--config.model.lora`'s adapters (`models.lora`, B = 0 at step 0), TRL with
`peft.LoraConfig` passed as `GRPOTrainer(peft_config=...)`. Rows "jaxrlhf lora R" and "trl
lora R (grad ckpt on/off)"; the LoRA rows' ratios are against "jaxrlhf lora R".

With `--tunix-python PY`, Google's Tunix runs too, last, in that interpreter's environment
(`tunix_grpo_worker.py`: `GRPOLearner` on an `RLCluster`, Tunix's own Llama3 at the
workload's sizes with the same torch-init weights, read from a safetensors copy; see that
file for its settings and the few that differ: EOS and pad forbidden in sampling, advantage
ε 1e-6, its RoPE θ fix). Its row is "tunix"; its step time is the wall time between the
ends of consecutive optimizer steps, its generation time the rollout's `generate` call.
The row records the worker's own peak RSS (`peak_rss_mib`: its VmHWM; its `ru_maxrss`,
which for a subprocess also counts this process's peak at spawn time, is `ru_maxrss_mib`),
the CPU watch of its timed steps
(`cpu_watch`) and of the whole subprocess (`cpu_watch_subprocess`), and
`same_model_max_abs_logit_diff` (its next-token logits after prompt 0 vs the torch model's).

A result with `contended: true` (other processes used CPU while it ran) is not valid.
"""

from __future__ import annotations

import argparse
import functools
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _common  # noqa: E402

G, T_NEW, TARGET, PROMPTS_PER_STEP = 8, 64, 7, 2


# --------------------------------------------------------------------------- jaxrlhf


def run_jax(ckpt_dir, prompts_64x32, order, warmup, steps, lora_rank=0, time_split=False):
    import jax
    import jax.numpy as jnp

    from jaxrlhf.algorithms import common, grpo
    from jaxrlhf.algorithms.experience import SamplingConfig
    from jaxrlhf.models import Transformer, load_pretrained, lora

    model, params = load_pretrained(ckpt_dir)
    if lora_rank:
        model = Transformer(model.config.replace(lora=lora.LoraConfig(rank=lora_rank, alpha=2.0 * lora_rank)),
                            head=model.head)
        params = lora.add_adapters(model, params, jax.random.key(1))
    total = warmup + steps
    tx, schedule = common.make_optimizer(common.OptimConfig(
        lr=1e-6, schedule="linear", total_steps=total, b1=0.9, b2=0.999, eps=1e-8, weight_decay=0.0,
        max_grad_norm=1.0))
    cfg = grpo.GRPOConfig(
        sampling=SamplingConfig(max_new_tokens=T_NEW, temperature=1.0, top_k=0, top_p=1.0, eos_id=None, pad_id=0,
                                num_samples=G),
        advantage="grpo", adv_eps=1e-4, beta=0.0, clip_low=0.2, agg="token-mean", num_iterations=1)

    reward = _common.token_fraction_reward(TARGET, name="frac7")
    # prompt_buckets=None: the prompts keep the length the peers run them at.
    iteration = grpo.make_iteration(model, tx, cfg, reward, schedule=schedule, donate=True, prompt_buckets=None,
                                    time_split=time_split)
    rollout = jax.jit(functools.partial(grpo.rollout, model=model, cfg=cfg))
    box = {"state": grpo.init_state(params, tx)}
    rng = jax.random.key(0)

    def batch(i):
        rows = order[(PROMPTS_PER_STEP * i + np.arange(PROMPTS_PER_STEP)) % len(order)]
        ids = jnp.asarray(prompts_64x32[rows], jnp.int32)
        return ids, jnp.ones_like(ids, bool)

    def step(i):
        ids, mask = batch(i)
        box["state"], metrics = iteration(box["state"], ids, mask, {}, rng)
        return jax.device_get(metrics)

    def gen(i):  # the rollout run again alone, seconds; None with the time split (the step timed its own)
        if time_split:
            return None
        ids, mask = batch(i)
        t0 = time.perf_counter()
        jax.block_until_ready(rollout(box["state"], ids, mask, rng))
        return time.perf_counter() - t0

    t0 = time.perf_counter()
    first = step(0)
    compile_s = time.perf_counter() - t0
    rollout_compile_s = gen(0)
    for i in range(1, warmup):
        step(i)
        gen(i)
    step_times, gen_times, history = [], [], []
    with _common.CpuWatch() as watch:
        for i in range(warmup, total):
            t0 = time.perf_counter()
            history.append(step(i))
            step_times.append(time.perf_counter() - t0)
            gen_times.append(gen(i))
    split = None
    if time_split:
        gen_times = [float(m["time/rollout_s"]) for m in history]
        split = {part: statistics.median(float(m[f"time/{part}_s"]) for m in history)
                 for part in ("rollout", "scoring", "update")}
    return dict(
        stats=_common.summary(step_times, count_key="n"), step_times=step_times, generation_times=gen_times,
        generation_share=statistics.median(gen_times) / statistics.median(step_times), time_split=split,
        first_call_s=compile_s, rollout_first_call_s=rollout_compile_s,
        first_step=dict(reward_mean=float(first["reward/mean"]), ratio_max=float(first["ratio_max"]),
                        clipfrac=float(first["clipfrac"]), grad_norm=float(first["grad_norm"]),
                        response_length_mean=float(first["response_length/mean"])),
        last_reward_mean=float(history[-1]["reward/mean"]), cpu_watch=watch.result(detail=True),
        note="three timed programs per step (rollout; reward + advantages; update), state donated; generation "
             "is the step's own rollout time" if time_split else
             "one jitted program per step (rollout + reward + advantages + update, state donated); generation "
             "timed separately as the jitted rollout alone")


# --------------------------------------------------------------------------- TRL


def run_trl(tm_state_dict, prompts_64x32, warmup, steps, gradient_checkpointing, lora_rank=0, shape="workload"):
    import datasets
    import transformers
    from trl import GRPOConfig, GRPOTrainer

    model = transformers.LlamaForCausalLM(_common.hf_llama_config(shape, attn_implementation="sdpa"))
    model.load_state_dict(tm_state_dict)
    tokenizer = _common.word_tokenizer(padding_side="left", vocab_size=model.config.vocab_size)
    prompts = [" ".join(f"t{int(t)}" for t in row) for row in prompts_64x32]
    assert tokenizer(prompts[0])["input_ids"] == [int(t) for t in prompts_64x32[0]]
    dataset = datasets.Dataset.from_dict({"prompt": prompts})

    def frac7(prompts, completions, completion_ids, **kwargs):
        return [sum(1 for t in ids if t == TARGET) / max(len(ids), 1) for ids in completion_ids]

    gen_times = []

    class Timed(GRPOTrainer):
        def _generate_single_turn(self, *args, **kwargs):
            t0 = time.perf_counter()
            out = super()._generate_single_turn(*args, **kwargs)
            gen_times.append(time.perf_counter() - t0)
            return out

    step_times = []

    class StepTimer(transformers.TrainerCallback):
        def on_step_begin(self, args, state, control, **kw):
            self.t0 = time.perf_counter()
            self.gen_before = len(gen_times)

        def on_step_end(self, args, state, control, **kw):
            step_times.append((time.perf_counter() - self.t0, sum(gen_times[self.gen_before:])))

    total = warmup + steps
    with tempfile.TemporaryDirectory() as out_dir:
        args = GRPOConfig(
            output_dir=out_dir, per_device_train_batch_size=PROMPTS_PER_STEP * G, gradient_accumulation_steps=1,
            steps_per_generation=1, num_generations=G, max_completion_length=T_NEW,
            generation_kwargs={"min_new_tokens": T_NEW}, temperature=1.0, top_k=0, top_p=1.0, beta=0.0,
            loss_type="dapo", scale_rewards="group", epsilon=0.2, num_iterations=1, learning_rate=1e-6,
            lr_scheduler_type="linear", weight_decay=0.0, max_grad_norm=1.0, optim="adamw_torch_fused",
            bf16=False, gradient_checkpointing=gradient_checkpointing, use_cpu=True, max_steps=total,
            logging_steps=1, save_strategy="no", report_to="none", seed=0, log_completions=False,
            disable_tqdm=True)
        peft_config = None
        if lora_rank:
            import peft

            peft_config = peft.LoraConfig(r=lora_rank, lora_alpha=2 * lora_rank, lora_dropout=0.0, bias="none",
                                          task_type="CAUSAL_LM", target_modules=["q_proj", "k_proj", "v_proj", "o_proj",
                                                                                 "gate_proj", "up_proj", "down_proj"])
        trainer = Timed(model=model, reward_funcs=frac7, args=args, train_dataset=dataset,
                        processing_class=tokenizer, callbacks=[StepTimer()], peft_config=peft_config)
        trainer.remove_callback(transformers.PrinterCallback)  # keep stdout for the table
        with _common.CpuWatch() as watch:
            trainer.train()
        logs = [h for h in trainer.state.log_history if "reward" in h]
    timed = step_times[warmup:]
    times = [s for s, _ in timed]
    gens = [g for _, g in timed]
    return dict(
        stats=_common.summary(times, count_key="n"), step_times=times, generation_times=gens,
        generation_share=statistics.median(gens) / statistics.median(times),
        first_step=dict(reward_mean=logs[0].get("reward") if logs else None,
                        completion_length=logs[0].get("completions/mean_length") if logs else None),
        last_reward_mean=logs[-1].get("reward") if logs else None, cpu_watch=watch.result(detail=True),
        note=f"GRPOTrainer, gradient_checkpointing={gradient_checkpointing}"
             + (f", PEFT LoRA rank {lora_rank}" if lora_rank else "") + "; cpu_watch covers all "
             f"{total} steps including warm-up")


# --------------------------------------------------------------------------- main


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--prompts", default=None, help="workload_prompts.json (default: benchmarks/workload_prompts.json)")
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--quick", action="store_true", help="1 warm-up + 2 timed steps (a smoke run, not a result)")
    ap.add_argument("--framework", choices=("both", "jax", "trl"), default="both")
    ap.add_argument("--out", default=None, help="write the JSON result here")
    ap.add_argument("--lora", type=int, default=0, metavar="R",
                    help="also run both frameworks training rank-R LoRA adapters (TRL through peft)")
    ap.add_argument("--tunix-python", default=None,
                    help="a python with google-tunix installed: also run Tunix's GRPOLearner (tunix_grpo_worker.py)")
    ap.add_argument("--shape", choices=sorted(_common.SHAPES), default="workload",
                    help="the model's shapes: the workload's tiny Llama, or a real checkpoint's")
    ap.add_argument("--trl-grad-ckpt", choices=("both", "on", "off"), default="both",
                    help="TRL's gradient checkpointing: both rows (default), or only its default (on) or off")
    ap.add_argument("--time-split", action="store_true",
                    help="jaxrlhf's step as three timed programs, with its rollout / scoring / update seconds")
    args = ap.parse_args(argv)
    if args.tunix_python and args.shape != "workload":
        ap.error("--tunix-python runs the workload's shapes only (tunix_grpo_worker.py builds them)")
    if args.quick:
        args.warmup, args.steps = 1, 2
    elif args.steps < 6:
        ap.error("--steps must be >= 6 (the reference workload's protocol); use --quick for a smoke run")
    sys.path.insert(0, str(_common.REPO))

    t_start = time.perf_counter()
    import torch
    import transformers

    torch.set_num_threads(2)
    prompts = np.asarray(_common.load_workload(args.prompts)["prompts"], np.int64)
    assert prompts.shape == (64, 32), prompts.shape
    # TRL's sampler draws a seeded permutation of the pool; ours is numpy's, also seed 0.
    order = np.random.default_rng(0).permutation(len(prompts))

    torch.manual_seed(0)
    tm = transformers.LlamaForCausalLM(_common.hf_llama_config(args.shape, attn_implementation="sdpa"))
    n_params = sum(p.numel() for p in tm.parameters())
    state_dict = {k: v.clone() for k, v in tm.state_dict().items()}
    results, errors = {}, {}
    tunix_ckpt = tunix_probe = None
    if args.tunix_python:  # the same weights for Tunix, and the torch logits to check its model against
        tunix_ckpt = tempfile.TemporaryDirectory()
        tm.save_pretrained(tunix_ckpt.name, safe_serialization=True)
        with torch.no_grad():
            tunix_probe = tm(torch.as_tensor(prompts[:1])).logits[0, -1].double().numpy()
    if args.framework in ("both", "jax"):
        with tempfile.TemporaryDirectory() as ckpt:
            tm.save_pretrained(ckpt, safe_serialization=True)
            results["jaxrlhf"] = run_jax(ckpt, prompts, order, args.warmup, args.steps, time_split=args.time_split)
            if args.lora:
                results[f"jaxrlhf lora {args.lora}"] = run_jax(ckpt, prompts, order, args.warmup, args.steps,
                                                               lora_rank=args.lora, time_split=args.time_split)
    del tm
    if args.framework in ("both", "trl"):
        ckpt_modes = {"both": (True, False), "on": (True,), "off": (False,)}[args.trl_grad_ckpt]
        for rank, gc in [(r, gc) for r in ([0, args.lora] if args.lora else [0]) for gc in ckpt_modes]:
            name = f"trl{f' lora {rank}' if rank else ''} (grad ckpt {'on' if gc else 'off'})"
            try:
                results[name] = run_trl(state_dict, prompts, args.warmup, args.steps, gc, lora_rank=rank,
                                        shape=args.shape)
            except ImportError as e:  # TRL (or peft) not installed: report the rest
                errors[name] = f"{type(e).__name__}: {e}"
    if args.tunix_python:
        try:
            results["tunix"] = _run_tunix(args.tunix_python, tunix_ckpt.name, tunix_probe, args.warmup, args.steps,
                                          args.prompts)
        except RuntimeError as e:
            errors["tunix"] = str(e)
        finally:
            tunix_ckpt.cleanup()

    import jax

    versions = dict(jax=jax.__version__, torch=torch.__version__, transformers=transformers.__version__,
                    python=platform.python_version())
    try:
        import trl

        versions["trl"] = trl.__version__
    except ImportError:
        pass
    if "tunix" in results:
        versions["tunix"] = results["tunix"]["versions"]["tunix"]
        versions["jax_tunix_env"] = results["tunix"]["versions"]["jax"]
    result = dict(
        workload="reference workload, measurement 3 (GRPO step)", shape=args.shape, params=n_params, results=results,
        errors=errors,
        quick=args.quick, warmup=args.warmup, steps=args.steps, peak_rss_mib=_common.peak_rss_mib(),
        peak_rss_note=f"whole process, frameworks run: {args.framework}"
        + (" (tunix ran in a subprocess: its own peak RSS is in its row)" if args.tunix_python else ""),
        versions=versions, nproc=os.cpu_count(),
        contended=any(r["cpu_watch"]["contended"] for r in results.values()), total_s=time.perf_counter() - t_start)
    print(_markdown(result))
    if args.out:
        _common.write_json(args.out, "grpo.json", result)
    return result


def _run_tunix(python, ckpt, probe, warmup, steps, prompts) -> dict:
    """Tunix's GRPOLearner on the same workload, in its own interpreter (tunix_grpo_worker.py)."""
    cmd = [python, str(Path(__file__).with_name("tunix_grpo_worker.py")), "--warmup", str(warmup),
           "--steps", str(steps), "--ckpt", ckpt] + (["--prompts", prompts] if prompts else [])
    w, watch = _common.run_json_worker(cmd, "tunix")
    checks = w["checks"]
    if checks["new_tokens_per_completion"] != [T_NEW] or checks["completions_per_step"] != [PROMPTS_PER_STEP * G]:
        raise RuntimeError(f"tunix generated {checks['completions_per_step']} completions of "
                           f"{checks['new_tokens_per_completion']} tokens, expected {PROMPTS_PER_STEP * G} x {T_NEW}")
    if checks["optimizer_steps"] != warmup + steps or checks["params_changed"] == 0:
        raise RuntimeError(f"tunix took {checks['optimizer_steps']} optimizer steps and changed "
                           f"{checks['params_changed']} parameters")
    times, gens = w["step_times"], w["generation_times"]
    return dict(
        stats=_common.summary(times, count_key="n"), step_times=times, generation_times=gens,
        generation_share=statistics.median(gens) / statistics.median(times), first_call_s=w["first_call_s"],
        warmup_step_times=w["warmup_step_times"], first_step=w["first_step"], last_reward_mean=w["last_reward_mean"],
        **_common.tunix_row(w, watch, probe),
        versions={"tunix": w["settings"]["tunix"], "jax": w["settings"]["jax"]},
        note="tunix.rl.grpo GRPOLearner + RLCluster in a subprocess (tunix_grpo_worker.py); " + w["timing"])


def _markdown(r) -> str:
    lines = ["| framework | min s/step | median s/step | max s/step | generation share (median) | first reward | "
             "other cores busy |", "|---|---|---|---|---|---|---|"]
    for name, res in r["results"].items():
        s = res["stats"]
        lines.append(f"| {name} | {s['min_s']:.3f} | {s['median_s']:.3f} | {s['max_s']:.3f} | "
                     f"{res['generation_share']:.0%} | {res['first_step']['reward_mean']} | "
                     f"{res['cpu_watch']['others_cores']:.2f} |")
    extra = [f"shape {r['shape']}, params {r['params']:,}; {r['steps']} timed steps after {r['warmup']} warm-up"
             + (" (--quick: a smoke run, not a result)" if r["quick"] else "")]
    jx = r["results"].get("jaxrlhf")
    if jx:
        extra.append(f"jaxrlhf first call (compile + step) {jx['first_call_s']:.1f} s; first step ratio_max "
                     f"{jx['first_step']['ratio_max']}, clipfrac {jx['first_step']['clipfrac']}")
        for name, res in r["results"].items():
            if res.get("time_split"):
                extra.append(f"{name} time split (medians): " + ", ".join(
                    f"{part} {sec:.3f} s" for part, sec in res["time_split"].items()))
        for name, res in r["results"].items():
            if name.startswith("trl"):
                gen = statistics.median(res["generation_times"])
                rest = res["stats"]["median_s"] - gen
                extra.append(f"{name}: generation {gen:.3f} s, the rest of the step {rest:.3f} s (medians)")
        for name, res in r["results"].items():
            if name.startswith("jaxrlhf"):
                continue
            ours = next((k for k in r["results"] if k.startswith("jaxrlhf lora")), "jaxrlhf") if " lora " in name \
                else "jaxrlhf"
            extra.append(f"{name} / {ours} median step time: "
                         f"{res['stats']['median_s'] / r['results'][ours]['stats']['median_s']:.2f}x")
        for name, res in r["results"].items():
            if name.startswith("jaxrlhf lora"):
                extra.append(f"{name} / jaxrlhf (all weights) median step time: "
                             f"{res['stats']['median_s'] / jx['stats']['median_s']:.2f}x")
    tx = r["results"].get("tunix")
    if tx:
        extra.append(f"tunix: peak RSS {tx['peak_rss_mib']:.0f} MiB (its own process, VmHWM); first step "
                     f"(compile + step) {tx['first_call_s']:.1f} s; same model as torch: max |logit diff| "
                     f"{tx['same_model_max_abs_logit_diff']:.1e}; differs in: {'; '.join(tx['differences'])}")
    for name, err in r["errors"].items():
        extra.append(f"{name}: not run ({err})")
    extra.append(f"peak RSS {r['peak_rss_mib']:.0f} MiB ({r['peak_rss_note']})")
    extra.append(f"contended: {r['contended']}")
    return "\n".join(lines + [""] + ["- " + e for e in extra])


if __name__ == "__main__":
    main()
