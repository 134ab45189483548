"""Reference workload, measurement 4: seconds per RLHF-PPO update, jaxrlhf vs TRL's PPOTrainer.

The workload: docs/benchmarks.md#the-reference-workload.

    python benchmarks/bench_ppo.py                  # 4 and 1 PPO epochs, both frameworks
    python benchmarks/bench_ppo.py --quick          # fewer repeats
    python benchmarks/bench_ppo.py --trl-path DIR   # TRL with PPOTrainer installed in DIR:
        pip install --no-deps --target DIR "trl==0.19.1"   (TRL >= 0.20 moved PPO out;
        recent releases dropped it; --no-deps keeps the CPU torch of the environment)

One update = rollout (16 prompts × 32 tokens → exactly 64 new tokens, τ = 1, no stop) +
scoring (old and reference log-probs, values, reward-model score) + k1 KL shaping
(β = 0.05) + GAE (γ = 1, λ = 0.95) + advantage whitening + K PPO epochs of 1 minibatch of
16 (clip 0.2, value clip 0.2, vf_coef 0.1), AdamW lr 3e-6 with linear decay, max grad
norm 1.0. Tiny Llama policy in float32; value and reward models are
`LlamaForSequenceClassification(num_labels=1)` of the same size (seeds: policy 0,
reward 1, value 2; the reference is a copy of the policy). Both frameworks get the same
weights (HF default init, converted). jaxrlhf runs the whole update as one jitted
program; TRL's time per update is measured between its `on_step_end` callbacks, in a
subprocess with `torch.set_num_threads(2)`.

Differences that remain (documented, not hidden): TRL 0.19's PPO loop does not apply
`max_grad_norm` (jaxrlhf clips policy and value gradients, each to norm 1); TRL uses one
AdamW over policy + value, jaxrlhf one per model with the same settings; TRL treats a
sampled token 0 (= pad id) as the end of a response.
Writes benchmarks/results/ppo.json (or --out).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _common  # noqa: E402

NEW_TOKENS = 64
BATCH = 16
LR = 3e-6


def _hf_models():
    policy = _common.hf_llama(seed=0)
    reward = _common.hf_llama(seed=1, cls_name="LlamaForSequenceClassification", num_labels=1)
    value = _common.hf_llama(seed=2, cls_name="LlamaForSequenceClassification", num_labels=1)
    return policy, reward, value


# --------------------------------------------------------------------------------------
# jaxrlhf


def run_jaxrlhf(prompts: np.ndarray, epochs: int, warmup: int, repeats: int) -> dict:
    import jax
    import jax.numpy as jnp

    from jaxrlhf.algorithms import common, ppo
    from jaxrlhf.algorithms.experience import SamplingConfig
    from jaxrlhf.models import load_pretrained

    policy, reward, value = _hf_models()
    with tempfile.TemporaryDirectory() as tmp:
        loaded = []
        for name, m in (("policy", policy), ("reward", reward), ("value", value)):
            m.save_pretrained(f"{tmp}/{name}", safe_serialization=True)
            loaded.append(load_pretrained(f"{tmp}/{name}"))
    (actor, actor_params), (rm, rm_params), (critic, critic_params) = loaded
    assert actor.head == "lm" and rm.head == "score" and critic.head == "score"

    cfg = ppo.PPOConfig(sampling=SamplingConfig(max_new_tokens=NEW_TOKENS, temperature=1.0, top_k=0, top_p=1.0,
                                                eos_id=None),
                        kl_estimator="k1", beta=0.05, gamma=1.0, lam=0.95, whiten_advantages=True,
                        clip_low=0.2, vf_clip=0.2, vf_coef=0.1, num_ppo_epochs=epochs, num_minibatches=1,
                        critic="separate")
    optim = common.OptimConfig(lr=LR, schedule="linear", total_steps=(warmup + repeats) * epochs, max_grad_norm=1.0)
    tx, sched = common.make_optimizer(optim)
    state = ppo.init_state(cfg, actor, actor_params, tx, critic_model=critic, critic_params=critic_params,
                           tx_critic=tx, reward=(rm, rm_params))
    iteration = ppo.make_iteration(actor, critic, rm, tx, tx, cfg, lr_schedule=sched, time_split=False)
    p_ids, p_mask = jnp.asarray(prompts), jnp.ones(prompts.shape, bool)
    rng = jax.random.key(0)
    box = {"state": state, "metrics": None}

    def one():
        box["state"], m = iteration(box["state"], p_ids, p_mask, rng)
        box["metrics"] = jax.block_until_ready(m)

    start = time.perf_counter()
    one()
    first = time.perf_counter() - start
    with _common.CpuWatch() as watch:
        t = _common.timed(one, warmup=max(warmup - 1, 0), repeats=repeats)
    m = {k: float(v) for k, v in jax.device_get(box["metrics"]).items()}
    t.update(watch.result(), impl="jaxrlhf", epochs=epochs, first_call_s=first,
             last_metrics={k: m[k] for k in ("reward/mean", "kl/k1", "clipfrac", "approx_kl", "value_loss",
                                            "response_length/mean", "first/ratio_max", "finite")})
    return t


# --------------------------------------------------------------------------------------
# TRL (subprocess)


def trl_worker(prompts: np.ndarray, epochs: int, warmup: int, repeats: int) -> dict:
    import torch

    torch.set_num_threads(2)
    import trl
    from datasets import Dataset
    from transformers import TrainerCallback

    try:
        from trl import PPOConfig, PPOTrainer
    except ImportError:
        from trl.experimental.ppo import PPOConfig, PPOTrainer  # TRL 0.20–0.2x

    policy, reward, value = _hf_models()
    ref = _common.hf_llama(seed=0)  # the same init as the policy: an exact copy
    for m in (policy, ref):
        m.generation_config.eos_token_id = None  # no stop: EOS is an ordinary token here
        m.config.eos_token_id = None
    tokenizer = _common.word_tokenizer()
    updates = warmup + repeats
    ds = Dataset.from_dict({"input_ids": [list(map(int, r)) for r in prompts]})
    with tempfile.TemporaryDirectory() as tmp:
        args = PPOConfig(output_dir=tmp, per_device_train_batch_size=BATCH, gradient_accumulation_steps=1,
                         num_mini_batches=1, num_ppo_epochs=epochs, response_length=NEW_TOKENS, temperature=1.0,
                         kl_coef=0.05, kl_estimator="k1", gamma=1.0, lam=0.95, cliprange=0.2, cliprange_value=0.2,
                         vf_coef=0.1, whiten_rewards=False, learning_rate=LR, lr_scheduler_type="linear",
                         max_grad_norm=1.0, total_episodes=BATCH * updates, num_sample_generations=0,
                         stop_token=None, stop_token_id=None, missing_eos_penalty=None,
                         local_rollout_forward_batch_size=BATCH, report_to=[], save_strategy="no",
                         logging_steps=10_000, bf16=False, fp16=False, use_cpu=True, seed=0,
                         dataloader_num_workers=0)
        stamps = []

        class Stamp(TrainerCallback):
            def on_train_begin(self, *a, **k):
                stamps.append(time.perf_counter())

            def on_step_end(self, *a, **k):
                stamps.append(time.perf_counter())

        trainer = PPOTrainer(args=args, processing_class=tokenizer, model=policy, ref_model=ref, reward_model=reward,
                             value_model=value, train_dataset=ds, callbacks=[Stamp()])
        with _common.CpuWatch() as watch:
            trainer.train()
    times = np.diff(stamps)
    timed = times[warmup:]
    return {"impl": f"trl {trl.__version__} PPOTrainer", "epochs": epochs, **_common.summary(timed),
            "first_call_s": float(times[0]), **watch.result(), "peak_rss_mib": _common.peak_rss_mib(),
            "torch": torch.__version__}


def run_trl(args, epochs: int, warmup: int, repeats: int) -> dict:
    env = dict(os.environ)
    if args.trl_path:
        env["PYTHONPATH"] = os.pathsep.join([args.trl_path, env.get("PYTHONPATH", "")])
    cmd = [sys.executable, __file__, "--trl-worker", "--epochs", str(epochs), "--warmup", str(warmup),
           "--repeats", str(repeats)] + (["--prompts", args.prompts] if args.prompts else [])
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("TRL_RESULT ")]
    if proc.returncode or not lines:
        tail = (proc.stderr or proc.stdout).strip().splitlines()[-3:]
        return {"impl": "trl", "epochs": epochs, "error": " | ".join(tail)}
    return json.loads(lines[-1][len("TRL_RESULT "):])


# --------------------------------------------------------------------------------------


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true",
                    help="1 warm-up + 2 timed updates (TRL: 1 + 1); default 1 + 6 for both")
    ap.add_argument("--prompts", default=None, help="workload_prompts.json (default: benchmarks/workload_prompts.json)")
    ap.add_argument("--out", default=None)
    ap.add_argument("--epochs", type=int, nargs="+", default=[4, 1])
    ap.add_argument("--skip-trl", action="store_true")
    ap.add_argument("--trl-path", default=None, help="a folder with a TRL that has PPOTrainer (see docstring)")
    ap.add_argument("--trl-worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--warmup", type=int, default=None, help=argparse.SUPPRESS)
    ap.add_argument("--repeats", type=int, default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    warmup, repeats = (1, 2) if args.quick else (1, 6)
    warmup = args.warmup if args.warmup is not None else warmup
    repeats = args.repeats if args.repeats is not None else repeats
    prompts = np.asarray(_common.load_workload(args.prompts)["prompts"], np.int32)[:BATCH]

    if args.trl_worker:
        print("TRL_RESULT " + json.dumps(trl_worker(prompts, args.epochs[0], warmup, repeats)))
        return

    import jax

    results = {"workload": "reference workload, measurement 4", "date": datetime.datetime.now(datetime.timezone.utc).isoformat(),
               "machine": platform.processor() or platform.machine(), "jax": jax.__version__,
               "quick": args.quick, "runs": []}
    for k in args.epochs:
        results["runs"].append(run_jaxrlhf(prompts, k, warmup, repeats))
        if not args.skip_trl:
            results["runs"].append(run_trl(args, k, warmup, 1 if args.quick else repeats))
    results["peak_rss_mib_jaxrlhf_process"] = _common.peak_rss_mib()

    contended = any(r.get("contended") for r in results["runs"])
    print(f"PPO update (reference workload, measurement 4){' — CONTENDED machine, not valid timings' if contended else ''}\n")
    print("| epochs | impl | median s/update | min s | max s | first call s | others' cores |")
    print("|---|---|---|---|---|---|---|")
    for r in results["runs"]:
        if "error" in r:
            print(f"| {r['epochs']} | {r['impl']} | not run: {r['error'][:150]} | | | | |")
            continue
        print(f"| {r['epochs']} | {r['impl']} | {r['median_s']:.3f} | {r['min_s']:.3f} | {r['max_s']:.3f} | "
              f"{r['first_call_s']:.1f} | {r['others_cores']} |")
    for k in args.epochs:
        ours = next(r for r in results["runs"] if r["epochs"] == k and r["impl"] == "jaxrlhf")
        theirs = [r for r in results["runs"] if r["epochs"] == k and r["impl"] != "jaxrlhf" and "error" not in r]
        if theirs:
            results[f"speedup_vs_trl_epochs{k}"] = theirs[0]["median_s"] / ours["median_s"]
            print(f"\n{k} epochs: TRL / jaxrlhf seconds per update = {results[f'speedup_vs_trl_epochs{k}']:.2f}x")
    print(f"peak RSS (jaxrlhf process) {results['peak_rss_mib_jaxrlhf_process']:.0f} MiB")
    print("wrote", _common.write_json(args.out, "ppo.json", results))
    print(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
