"""Reference workload, measurement 3 (GRPO step) with Google's Tunix (`tunix.rl.grpo.GRPOLearner` on an `RLCluster`).

The workload: docs/benchmarks.md#the-reference-workload.

Run by `bench_grpo.py --tunix-python PY` in a separate environment that has `google-tunix`
(see benchmarks/README.md); standalone:

    /tmp/venv_tunix/bin/python benchmarks/tunix_grpo_worker.py --warmup 2 --steps 6 [--ckpt HF_DIR]

Prints one JSON line: the seconds of each optimizer step after warm-up, the generation time
within each step, peak RSS (`ru_maxrss` as `peak_rss_mib`, and `vm_hwm_mib`, the process's
own high-water mark from /proc/self/status: `ru_maxrss` of a subprocess also counts its
parent's peak at spawn time), and the settings actually used.

What runs: Tunix's own `Llama3` at the workload's sizes (vocab 512, hidden 256, intermediate
688, 4 layers, 4/2 heads, head_dim 64, RMSNorm eps 1e-6, untied lm_head) in float32, with
the weights of `--ckpt` (a HF `LlamaForCausalLM` safetensors directory, read by Tunix's
`llama3.params.create_model_from_safe_tensors`; `bench_grpo.py` passes the same torch init
its other sides use) or Tunix's own random init without it (whose MLP kernels are zeros).
RoPE: Tunix 0.1.7's Llama3 attention never passes `ModelConfig.rope_theta` to `apply_rope`,
whose default θ = 1e6 is then always used; this worker sets that default to the workload's
10000 (`--tunix-rope` keeps 1e6), which changes a constant, not the work. With it the
model's logits match the HF model's to ~1e-6 (`probe_logits`, compared by bench_grpo.py as
`same_model_max_abs_logit_diff`). One `RLCluster`
(actor = rollout on one 1x1 ("fsdp", "tp") CPU mesh, no reference model) and a
`GRPOLearner` with:

  * per step 2 prompts (32 tokens, from the 64 workload prompts in the order
    `numpy.random.default_rng(0).permutation(64)`, as bench_grpo.py's jaxrlhf side) given as
    word-level text `"t17 t300 ..."` (no BOS; checked to tokenize to the 32 ids) x
    `num_generations` 8 = 16 completions, one `generate` call of 16 rows;
  * exactly 64 new tokens, temperature 1, top_p 1.0 (Tunix's sampler needs top_p set to
    sample at all; 1.0 = off), no top-k;
  * reward = fraction of the 64 completion tokens equal to id 7 (counted on the decoded
    text, where id 7 is the word "t7"); advantages = Tunix's "grpo" estimator;
  * loss = Tunix's "grpo" policy loss with `loss_agg_mode="token-mean"` (the sum over all
    completion tokens of the batch / their count, i.e. TRL's "dapo"), clip ε 0.2,
    β = 0 (Tunix then computes no reference log-probs and needs no reference model),
    num_iterations μ = 1 (old log-probs = stop_gradient of the current ones);
  * optax `chain(clip_by_global_norm(1.0), adamw(linear_schedule(1e-6 -> 0 over the
    warmup + steps optimizer steps), b1 0.9, b2 0.999, eps 1e-8, weight_decay 0))`, the
    same optax chain jaxrlhf's `make_optimizer` builds.

Differences from bench_grpo.py's jaxrlhf / TRL settings (all recorded under "differences"):

  * EOS (id 2) and pad (id 0) are forbidden tokens in sampling. Tunix's `RolloutConfig` has
    no min-new-tokens / forbidden-token knob, so the rollout engine is `VanillaRollout` with
    `generate` re-written to pass `forbidden_tokens=[0, 2]` to Tunix's `Sampler` (as
    tunix_rollout_worker.py does for EOS). Pad must go too: Tunix takes a sampled pad id
    for padding (it is masked out of attention while decoding and out of the loss), so a
    completion could have fewer than 64 real tokens. Our side masks EOS (TRL:
    min_new_tokens) or treats it as an ordinary token (jaxrlhf, eos_id=None) and never
    treats a sampled 0 as padding; removing 2/512 of the probability mass does not change
    the work done.
  * The sampler gets seed = the step index (Tunix's default is the same key every step).
  * Group advantages divide by (std_group + 1e-6), Tunix's fixed ε; ours and TRL's use
    1e-4 (both: unbiased std). No effect on the work done.
  * Tunix's loss also computes the per-token entropy of the logits (for logging) and its
    KV cache holds 96 = 32 + 64 positions (the least it accepts).

Timing: one optimizer step = generate (16 x 64) + reward + advantages + the actor update
(forward/backward on [16, 96] + AdamW) + whatever Tunix's loop does in between (weight
sync when the rollout model does not share the actor's arrays, metric buffering). Step
`i` is the wall time between the end of optimizer step `i - 1` and the end of step `i`
(step 0 starts when the learner fetches its first batch); an end is taken after
`RLCluster.update_actor` returns and the actor's parameters are ready. The first
`--warmup` steps (compile) are dropped. Generation time is the time of the rollout's
`generate` call in each step (its tokens are host arrays, so it is complete).
"""

from __future__ import annotations

import argparse
import json
import resource
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _common  # noqa: E402
from bench_grpo import G, PROMPTS_PER_STEP, T_NEW, TARGET  # noqa: E402

PROMPT_LEN = 32
PAD, EOS = 0, 2
FORBIDDEN = (PAD, EOS)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--prompts", default=None, help="workload_prompts.json (default: benchmarks/workload_prompts.json)")
    ap.add_argument("--ckpt", default=None, help="HF safetensors dir with the workload's weights (default: Tunix init)")
    ap.add_argument("--tunix-rope", action="store_true",
                    help="keep Tunix 0.1.7's RoPE theta 1e6 (its Llama3 ignores ModelConfig.rope_theta)")
    args = ap.parse_args()
    total = args.warmup + args.steps

    import jax
    import optax
    import tunix
    from flax import nnx
    from tunix.rl import rl_cluster as rl_cluster_lib
    from tunix.rl.grpo import grpo_learner
    from tunix.rl.rollout import base_rollout, vanilla_rollout

    t_setup = time.perf_counter()
    mesh = jax.sharding.Mesh(np.asarray(jax.devices()[:1]).reshape(1, 1), ("fsdp", "tp"))
    model, cfg, model_settings = tunix_llama(args.ckpt, mesh=mesh, tunix_rope=args.tunix_rope)
    before = {k: np.array(v) for k, v in flat_params(model).items()}
    tokenizer = word_tokenizer()

    prompts = np.asarray(_common.load_workload(args.prompts)["prompts"])
    assert prompts.shape == (64, PROMPT_LEN), prompts.shape
    probe = probe_logits(model, prompts[0])
    order = np.random.default_rng(0).permutation(len(prompts))  # bench_grpo.py's order
    texts = [" ".join(f"t{int(t)}" for t in row) for row in prompts]
    assert tokenizer(texts[0])["input_ids"] == prompts[0].tolist(), "prompt must be the 32 workload ids, no BOS"

    gen_log = []  # per generate call: seconds, completion lengths, fraction of id 7 from the token ids

    class FixedLengthRollout(vanilla_rollout.VanillaRollout):
        """Tunix's VanillaRollout, but EOS and pad are forbidden tokens: exactly 64 new tokens per row."""

        def __init__(self, rollout_actor, tokenizer, mesh, rollout_config):
            super().__init__(rollout_actor, tokenizer, base_rollout.CacheConfig(
                cache_size=rollout_config.kv_cache_size, num_layers=cfg.num_layers,
                num_kv_heads=cfg.num_kv_heads, head_dim=cfg.head_dim))

        def generate(self, prompts, rollout_config, **kwargs):
            t0 = time.perf_counter()
            out = self._sampler(
                input_strings=prompts, max_generation_steps=rollout_config.max_tokens_to_generate,
                max_prompt_length=rollout_config.max_prompt_length, echo=False,
                temperature=rollout_config.temperature, top_p=rollout_config.top_p, top_k=rollout_config.top_k,
                seed=len(gen_log), pad_output=False, eos_tokens=rollout_config.eos_tokens,
                forbidden_tokens=FORBIDDEN, return_logprobs=rollout_config.return_logprobs)
            seconds = time.perf_counter() - t0
            gen_log.append(dict(seconds=seconds, rows=len(out.tokens), lengths=[int(len(t)) for t in out.tokens],
                                frac7=[float(np.mean(np.asarray(t) == TARGET)) for t in out.tokens],
                                prompt_width=int(np.asarray(out.padded_prompt_tokens).shape[1])))
            return base_rollout.RolloutOutput(text=out.text, logits=out.logits, tokens=out.tokens,
                                              left_padded_prompt_tokens=out.padded_prompt_tokens,
                                              logprobs=out.logprobs)

    rewards_log = []

    def frac7(prompts, completions, **kwargs):
        r = [sum(w == f"t{TARGET}" for w in c.split()) / T_NEW for c in completions]
        rewards_log.append(r)
        return r

    tx = optax.chain(optax.clip_by_global_norm(1.0),
                     optax.adamw(optax.linear_schedule(1e-6, 0.0, total), b1=0.9, b2=0.999, eps=1e-8,
                                 weight_decay=0.0))
    rollout_cfg = base_rollout.RolloutConfig(
        max_tokens_to_generate=T_NEW, max_prompt_length=PROMPT_LEN, kv_cache_size=PROMPT_LEN + T_NEW,
        temperature=1.0, top_p=1.0, top_k=None)
    cluster = rl_cluster_lib.RLCluster(
        actor=model, reference=None, tokenizer=tokenizer,
        cluster_config=rl_cluster_lib.ClusterConfig(
            role_to_mesh={rl_cluster_lib.Role.ACTOR: mesh, rl_cluster_lib.Role.REFERENCE: mesh,
                          rl_cluster_lib.Role.ROLLOUT: mesh},
            rollout_engine=FixedLengthRollout, offload_to_cpu=False, rollout_config=rollout_cfg,
            training_config=rl_cluster_lib.RLTrainingConfig(
                actor_optimizer=tx, eval_every_n_steps=10**9, max_steps=total, pbar_description=None)))
    algo = grpo_learner.GRPOConfig(num_generations=G, num_iterations=1, beta=0.0, epsilon=0.2,
                                   loss_agg_mode="token-mean", advantage_estimator="grpo", policy_loss_fn="grpo",
                                   loss_algo="grpo")
    learner = grpo_learner.GRPOLearner(rl_cluster=cluster, algo_config=algo, reward_fns=frac7)
    setup_s = time.perf_counter() - t_setup

    fetch_times, step_ends = [], []

    def batches():
        for i in range(total):
            rows = order[(PROMPTS_PER_STEP * i + np.arange(PROMPTS_PER_STEP)) % len(order)]
            fetch_times.append(time.perf_counter())
            yield {"prompts": np.asarray([texts[r] for r in rows])}

    update_actor = cluster.update_actor

    def timed_update_actor(*a, **kw):
        out = update_actor(*a, **kw)
        jax.block_until_ready(jax.tree.leaves(nnx.state(cluster.actor_trainer.model, nnx.Param)))
        step_ends.append(time.perf_counter())
        return out

    cluster.update_actor = timed_update_actor
    with _common.CpuWatch() as watch:
        learner.train(batches())
    train_steps = cluster.actor_trainer.train_steps
    assert len(step_ends) == total == train_steps, (len(step_ends), total, train_steps)
    assert len(gen_log) == total and len(rewards_log) == total, (len(gen_log), len(rewards_log))

    starts = [fetch_times[0]] + step_ends[:-1]
    all_steps = [e - s for s, e in zip(starts, step_ends)]
    gen_s = [g["seconds"] for g in gen_log]
    lengths = sorted({n for g in gen_log for n in g["lengths"]})
    rows = sorted({g["rows"] for g in gen_log})
    reward_from_ids_equal = all(np.allclose(r, g["frac7"]) for r, g in zip(rewards_log, gen_log))
    after = flat_params(cluster.actor_trainer.model)
    changed = {k: float(np.max(np.abs(np.asarray(after[k]) - before[k]))) for k in before}
    try:
        losses = [float(x) for x in cluster.actor_trainer.metrics_logger.get_metric_history("actor", "loss", "train")]
    except Exception:  # noqa: BLE001 - metric names are Tunix internals; the timing does not need them
        losses = None

    print(json.dumps({
        "impl": "tunix", "warmup": args.warmup, "steps": args.steps,
        "step_times": all_steps[args.warmup:], "generation_times": gen_s[args.warmup:],
        "warmup_step_times": all_steps[:args.warmup], "first_call_s": all_steps[0], "setup_s": setup_s,
        **peak_rss(),
        "cpu_watch": watch.result(detail=True),
        "checks": {
            "optimizer_steps": train_steps, "completions_per_step": rows, "new_tokens_per_completion": lengths,
            "prompt_tokens": sorted({g["prompt_width"] for g in gen_log}),
            "reward_text_equals_token_ids": bool(reward_from_ids_equal),
            "params_changed": sum(v > 0 for v in changed.values()), "params_total": len(changed),
            "max_abs_param_change": max(changed.values()),
            "steps_with_nonconstant_group_reward": sum(
                any(len(set(r[g * G:(g + 1) * G])) > 1 for g in range(PROMPTS_PER_STEP)) for r in rewards_log),
            "rollout_shares_actor_weights": not learner.should_sync_weights,
        },
        "first_step": {"reward_mean": float(np.mean(rewards_log[0])),
                       "completion_length": float(np.mean(gen_log[0]["lengths"]))},
        "last_reward_mean": float(np.mean(rewards_log[-1])), "reward_means": [float(np.mean(r)) for r in rewards_log],
        "actor_losses": losses,
        "probe_logits": probe,
        "settings": {
            **model_settings, "prompts_per_step": PROMPTS_PER_STEP, "num_generations": G,
            "prompt_len": PROMPT_LEN, "max_tokens_to_generate": T_NEW, "forbidden_tokens": list(FORBIDDEN),
            "temperature": 1.0, "top_p": 1.0, "top_k": None, "kv_cache_size": PROMPT_LEN + T_NEW,
            "reward": f"fraction of the {T_NEW} completion tokens equal to id {TARGET}",
            "advantage_estimator": "grpo: (r - mean_g) / (std_g(ddof=1) + 1e-6)", "policy_loss_fn": "grpo",
            "loss_agg_mode": "token-mean", "epsilon": 0.2, "beta": 0.0, "reference_model": None,
            "num_iterations": 1,
            "optimizer": "optax.chain(clip_by_global_norm(1.0), adamw(linear_schedule(1e-6, 0, warmup+steps), "
                         "b1=0.9, b2=0.999, eps=1e-8, weight_decay=0))",
            "mesh": "1x1 ('fsdp', 'tp') on " + jax.devices()[0].platform,
            "tunix": tunix.__version__, "jax": jax.__version__, "optax": optax.__version__,
        },
        "differences": [
            "EOS (2) and pad (0) are forbidden in sampling (VanillaRollout.generate re-written to pass "
            "forbidden_tokens to Tunix's Sampler); jaxrlhf samples all 512 ids (eos_id=None), TRL all but EOS",
            "advantage epsilon 1e-6 (Tunix's fixed value) instead of 1e-4",
            "sampler seed = step index (Tunix's default would reuse one key every step)",
            "Tunix's grpo loss also computes per-token entropy (logged only); KV cache 96 positions",
            "RoPE theta: Tunix's apply_rope default patched to 10000 (Tunix 0.1.7 ignores ModelConfig.rope_theta)"
            if not args.tunix_rope else "RoPE theta 1e6 (Tunix 0.1.7 ignores ModelConfig.rope_theta), not 10000",
        ],
        "timing": "step i = end of optimizer step i-1 -> end of step i (after update_actor returns and the actor "
                  "params are ready); generation = the rollout's generate() call within the step",
    }))


# --------------------------------------------------------------------------- shared with tunix_dpo_worker.py

TUNIX_ROPE_THETA = 1_000_000  # apply_rope's default in tunix/models/llama3/model.py (0.1.7)


def tunix_llama(ckpt: str | None, mesh=None, tunix_rope: bool = False):
    """Tunix's `Llama3` at the workload's sizes in float32: `(model, config, settings dict)`.

    Weights from the HF safetensors directory `ckpt` (Tunix's own loader), else Tunix's
    random init. Tunix 0.1.7's attention calls `apply_rope(x, positions, head_dim=...)`
    without `rope_theta`, so `ModelConfig.rope_theta` is ignored and θ = 1e6 is used; unless
    `tunix_rope`, apply_rope's default is set to the workload's 10000, after which the
    model's logits equal the HF model's (checked by the callers' `probe_logits`).
    """
    import jax
    import jax.numpy as jnp
    from flax import nnx
    from tunix.models.llama3 import model as llama3
    from tunix.models.llama3 import params as llama3_params

    theta = 10_000
    if llama3.apply_rope.__defaults__ not in ((TUNIX_ROPE_THETA,), (theta,)):
        raise RuntimeError(f"tunix apply_rope defaults {llama3.apply_rope.__defaults__}: not the 0.1.7 code")
    llama3.apply_rope.__defaults__ = (TUNIX_ROPE_THETA if tunix_rope else theta,)
    cfg = llama3.ModelConfig(num_layers=4, vocab_size=512, embed_dim=256, hidden_dim=688, num_heads=4, head_dim=64,
                             num_kv_heads=2, rope_theta=theta, norm_eps=1e-6)
    if ckpt:
        model = llama3_params.create_model_from_safe_tensors(ckpt, cfg, mesh=mesh, dtype=jnp.float32)
    else:
        model = llama3.Llama3(cfg, rngs=nnx.Rngs(params=0))
    leaves = jax.tree.leaves(nnx.state(model, nnx.Param))
    settings = {
        "model": "tunix.models.llama3.Llama3 (vocab 512, embed 256, hidden 688, 4 layers, 4/2 heads, head_dim 64, "
                 "RMSNorm eps 1e-6, untied lm_head)",
        "weights": f"HF safetensors via llama3.params.create_model_from_safe_tensors ({ckpt})" if ckpt
                   else "Tunix random init (nnx.Rngs(params=0); its MLP kernels init to zero)",
        "rope_theta_used": TUNIX_ROPE_THETA if tunix_rope else theta,
        "rope_note": "Tunix 0.1.7's Llama3 ignores ModelConfig.rope_theta (apply_rope default 1e6); "
                     + ("kept as shipped" if tunix_rope else "apply_rope's default set to 10000 in this process"),
        "params": int(sum(x.size for x in leaves)), "param_dtypes": sorted({str(x.dtype) for x in leaves}),
    }
    return model, cfg, settings


def word_tokenizer():
    """The workload's word-level tokenizer (`"t17 t300"` <-> [17, 300]), without a BOS token."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<pad>": 0, "<bos>": 1, "<eos>": 2, "<unk>": 3, **{f"t{i}": i for i in range(4, 512)}}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>", unk_token="<unk>")


def probe_logits(model, prompt_ids) -> list[float]:
    """The model's 512 next-token logits after one prompt (full forward, no cache), to compare with HF's."""
    import jax.numpy as jnp
    from tunix.rl import common

    ids = jnp.asarray(np.asarray(prompt_ids)[None], jnp.int32)
    mask = jnp.ones(ids.shape, bool)
    logits, _ = model(ids, common.build_positions_from_mask(mask), None, common.make_causal_attn_mask(mask))
    return np.asarray(logits[0, -1], np.float64).tolist()


def peak_rss() -> dict:
    """Peak RSS in MiB: `ru_maxrss` (RUSAGE_SELF) and this process image's own high-water mark."""
    with open("/proc/self/status") as f:
        hwm_kib = next(int(line.split()[1]) for line in f if line.startswith("VmHWM:"))
    return {"peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, "vm_hwm_mib": hwm_kib / 1024,
            "peak_rss_note": "peak_rss_mib = ru_maxrss, which for a process started by subprocess also counts the "
                             "parent's peak RSS at spawn time (Linux carries the spawning process's high-water mark "
                             "over exec); vm_hwm_mib = VmHWM of /proc/self/status, this process's own peak"}


def flat_params(model) -> dict:
    import jax
    from flax import nnx

    state = nnx.state(model, nnx.Param)
    return {jax.tree_util.keystr(path): leaf for path, leaf in jax.tree_util.tree_leaves_with_path(state)}


if __name__ == "__main__":
    main()
