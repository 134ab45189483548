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

The same workload with another algorithm on both sides (docs/benchmarks.md#cispo-gdpo-and-on-policy-distillation-against-trl):

    python benchmarks/bench_grpo.py --policy-loss cispo --minibatches 2   # CISPO
    python benchmarks/bench_grpo.py --advantage gdpo                      # GDPO, two rewards
    python benchmarks/bench_grpo.py --opd                                 # OPD against TRL's GKDTrainer

`--policy-loss cispo`: jaxrlhf's `policy_loss="cispo"` (clip_low 1: no lower bound,
clip_high 4: ρ ≤ 5) against TRL's `loss_type="cispo"` with `epsilon_high=5.0` (TRL clamps ρ
at epsilon_high itself). `--minibatches N`: N optimizer steps per generation of the 16
completions (jaxrlhf `num_minibatches`, TRL `steps_per_generation` with 16 / N rows a step,
old log-probs from a separate forward on both sides): a step's time is the generation and
all N updates, TRL's summed over its N optimizer steps. With one minibatch CISPO's ratio is
exactly 1 on both sides (REINFORCE). `--advantage gdpo`: two rewards of very different
scales, `frac7` and `even_count` (the number of even ids among the 64 tokens), weight 1 each,
jaxrlhf's `advantage="gdpo"` against TRL's `multi_objective_aggregation="normalize_then_sum"`.
`--opd`: on-policy distillation from a frozen teacher (HF init after `torch.manual_seed(1)`,
the student's shapes with `--teacher-layers` layers, by default twice the student's), the
same weights on both sides: jaxrlhf's `opd.split` step (the student samples; per-token
advantage teacher_logp − student_logp; GRPO's loss, clip 0.2, μ = 1) against TRL's
`GKDTrainer` with `lmbda=1` (always the student's samples) and `beta=1` (reverse KL over the
full vocabulary at each completion token), τ = 1, exactly 64 new tokens, its dataset the same
2 prompts × 8 copies a step, read in order; rows "trl gkd (grad ckpt on/off)" (TRL's GKD
generates without a KV cache when gradient checkpointing is on). `--rounds K` runs the sides
K times alternating (jaxrlhf, TRL, jaxrlhf, ...): rows of round k > 1 are tagged
" [round k]", each compared with its own round's jaxrlhf row, then all rounds pooled.

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
ROWS = PROMPTS_PER_STEP * G  # completions per step
CISPO_EPS_HIGH = 4.0  # jaxrlhf's CISPO preset: ρ clipped to [0, 1 + 4] (TRL: epsilon_high=5.0, its ScaleRL ε_max)


# --------------------------------------------------------------------------- the algorithm, both sides


def step_rows(order, i):
    """The rows of the 64 prompts that step `i` trains on (`PROMPTS_PER_STEP`, from `order`)."""
    return order[(PROMPTS_PER_STEP * i + np.arange(PROMPTS_PER_STEP)) % len(order)]


# The rewards, on a completion's token ids: jaxrlhf's JAX form (`jax_reward`) and TRL's
# Python form (`TRL_REWARDS`) of the same numbers. `frac7` is the workload's; GDPO adds
# `even_count`, on a scale ~10,000x frac7's (mean ~32 against ~0.002).
def frac7(completion_ids) -> float:
    """The fraction of the completion's tokens equal to `TARGET` (the workload's reward)."""
    return sum(1 for t in completion_ids if t == TARGET) / max(len(completion_ids), 1)


def even_count(completion_ids) -> float:
    """The number of even token ids in the completion (0..64: GDPO's second reward)."""
    return float(sum(1 for t in completion_ids if t % 2 == 0))


def _trl_reward(fn):
    def reward(prompts, completions, completion_ids, **kwargs):
        return [fn(ids) for ids in completion_ids]

    reward.__name__ = fn.__name__  # TRL logs each reward under its function's name
    return reward


TRL_REWARDS = {"frac7": _trl_reward(frac7), "even_count": _trl_reward(even_count)}


def jax_reward(names):
    """jaxrlhf's reward of the components `names` (weight 1 each; one name: that reward alone)."""
    import jax.numpy as jnp

    from jaxrlhf import rewards

    def even(ids_NxT, mask_NxT, extras):
        return jnp.sum((ids_NxT % 2 == 0) & mask_NxT.astype(bool), axis=1).astype(jnp.float32)

    make = {"frac7": lambda: _common.token_fraction_reward(TARGET, name="frac7"),
            "even_count": lambda: rewards.jax_reward(even, name="even_count")}
    if len(names) == 1:
        return make[names[0]]()
    return rewards.combine([(1.0, make[n]()) for n in names])


def algorithm(policy_loss="clip", advantage="grpo", minibatches=1, cispo_eps_high=CISPO_EPS_HIGH,
              opd=False) -> dict:
    """One algorithm on both sides: `jax` (fields of jaxrlhf's `GRPOConfig`), `trl` (fields
    of TRL's `GRPOConfig`), `rewards` (names, weight 1 each) and `name`.

    The default is the reference workload's GRPO. `policy_loss="cispo"`: jaxrlhf's CISPO
    with no lower bound (clip_low 1) and ρ ≤ 1 + `cispo_eps_high`; TRL's `loss_type="cispo"`
    clamps ρ at `epsilon_high` itself, so it gets 1 + `cispo_eps_high`. `advantage="gdpo"`:
    frac7 and even_count, jaxrlhf's "gdpo" against TRL's
    `multi_objective_aggregation="normalize_then_sum"`. `minibatches` N: N optimizer steps
    per generation of 16 completions (jaxrlhf `num_minibatches`; TRL `steps_per_generation`
    with 16 / N rows a step). `opd`: the settings of jaxrlhf's OPD step (GRPO's loss on the
    distillation advantage), whose TRL side is `GKDTrainer` (`run_trl_gkd`), not these."""
    if ROWS % minibatches:
        raise ValueError(f"minibatches must divide the step's {ROWS} completions, got {minibatches}")
    jax_cfg = dict(advantage="grpo", adv_eps=1e-4, beta=0.0, clip_low=0.2, agg="token-mean", num_iterations=1,
                   num_minibatches=minibatches)
    trl_cfg = dict(per_device_train_batch_size=ROWS // minibatches, steps_per_generation=minibatches, beta=0.0,
                   loss_type="dapo", scale_rewards="group", epsilon=0.2, num_iterations=1)
    names, reward_names = [], ("frac7",)
    if policy_loss == "cispo":
        jax_cfg.update(policy_loss="cispo", clip_low=1.0, clip_high=cispo_eps_high)
        trl_cfg.update(loss_type="cispo", epsilon_high=1.0 + cispo_eps_high)
        names.append(f"cispo (rho <= {1.0 + cispo_eps_high:g})")
    elif policy_loss != "clip":
        raise ValueError(f"policy_loss: 'clip' or 'cispo', got {policy_loss!r}")
    if advantage == "gdpo":
        reward_names = ("frac7", "even_count")
        jax_cfg.update(advantage="gdpo")
        trl_cfg.update(multi_objective_aggregation="normalize_then_sum", reward_weights=[1.0] * len(reward_names))
        names.append("gdpo (frac7 + even_count)")
    elif advantage != "grpo":
        raise ValueError(f"advantage: 'grpo' or 'gdpo', got {advantage!r}")
    if opd:
        if names or minibatches != 1:
            raise ValueError("opd runs OPD's own step (GRPO's loss, one minibatch): no cispo, gdpo or minibatches")
        names.append("opd")
        # TRL's side is GKDTrainer: fully on-policy (lmbda 1), reverse KL (beta 1), τ = 1.
        trl_cfg = dict(per_device_train_batch_size=ROWS, lmbda=1.0, beta=1.0, temperature=1.0, max_new_tokens=T_NEW)
    if minibatches > 1:
        names.append(f"{minibatches} minibatches")
    return dict(jax=jax_cfg, trl=trl_cfg, rewards=reward_names, name=", ".join(names) or "grpo")


def group_steps(times, n):
    """TRL's per-optimizer-step `(seconds, generation seconds)` summed over each run of `n`
    steps: the time of one generation and its `n` optimizer steps (what one jaxrlhf
    iteration with `num_minibatches = n` does)."""
    if len(times) % n:
        raise ValueError(f"{len(times)} optimizer steps do not split into iterations of {n}")
    return [tuple(sum(x) for x in zip(*times[k:k + n])) for k in range(0, len(times), n)]


# --------------------------------------------------------------------------- jaxrlhf


def run_jax(ckpt_dir, prompts_64x32, order, warmup, steps, lora_rank=0, time_split=False, algo=None,
            teacher_ckpt=None):
    """jaxrlhf's step (`algo`: `algorithm(...)`, by default the workload's GRPO); with
    `teacher_ckpt` (an HF folder) OPD's step distilling that teacher."""
    import jax
    import jax.numpy as jnp

    from jaxrlhf.algorithms import common, grpo
    from jaxrlhf.algorithms.experience import SamplingConfig
    from jaxrlhf.models import Transformer, load_pretrained, lora

    algo = algo or algorithm()
    model, params = load_pretrained(ckpt_dir)
    if lora_rank:
        model = Transformer(model.config.replace(lora=lora.LoraConfig(rank=lora_rank, alpha=2.0 * lora_rank)),
                            head=model.head)
        params = lora.add_adapters(model, params, jax.random.key(1))
    total = warmup + steps
    cfg = grpo.GRPOConfig(
        sampling=SamplingConfig(max_new_tokens=T_NEW, temperature=1.0, top_k=0, top_p=1.0, eos_id=None, pad_id=0,
                                num_samples=G),
        **algo["jax"])
    tx, schedule = common.make_optimizer(common.OptimConfig(
        lr=1e-6, schedule="linear", total_steps=total * cfg.updates_per_iteration, b1=0.9, b2=0.999, eps=1e-8,
        weight_decay=0.0, max_grad_norm=1.0))

    reward = jax_reward(algo["rewards"])
    if teacher_ckpt is None:
        # prompt_buckets=None: the prompts keep the length the peers run them at.
        iteration = grpo.make_iteration(model, tx, cfg, reward, schedule=schedule, donate=True, prompt_buckets=None,
                                        time_split=time_split)
        state = grpo.init_state(params, tx)
    else:
        from jaxrlhf.algorithms import opd

        teacher, teacher_params = load_pretrained(teacher_ckpt)
        iteration = _opd_iteration(model, teacher, tx, cfg, reward, schedule, time_split)
        state = opd.init_state(params, tx, teacher_params)
    rollout = jax.jit(functools.partial(grpo.rollout, model=model, cfg=cfg))
    box = {"state": state}
    rng = jax.random.key(0)

    def batch(i):
        ids = jnp.asarray(prompts_64x32[step_rows(order, i)], jnp.int32)
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
    first_keys = dict(reward_mean="reward/mean", ratio_max="ratio_max", clipfrac="clipfrac", grad_norm="grad_norm",
                      response_length_mean="response_length/mean", reverse_kl="distill/reverse_kl")
    scoring = "reward + teacher log-probs + advantages" if teacher_ckpt else "reward + advantages"
    return dict(
        stats=_common.summary(step_times, count_key="n"), step_times=step_times, generation_times=gen_times,
        generation_share=statistics.median(gen_times) / statistics.median(step_times), time_split=split,
        first_call_s=compile_s, rollout_first_call_s=rollout_compile_s, algorithm=algo["name"],
        first_step={k: float(first[m]) for k, m in first_keys.items() if m in first},
        last_reward_mean=float(history[-1]["reward/mean"]), cpu_watch=watch.result(detail=True),
        note=f"three timed programs per step (rollout; {scoring}; update), state donated; generation "
             "is the step's own rollout time" if time_split else
             f"one jitted program per step (rollout + {scoring} + update, state donated); generation "
             "timed separately as the jitted rollout alone")


def _opd_iteration(model, teacher, tx, cfg, reward, schedule, time_split):
    """OPD's step as `iteration(state, ids, mask, extras, rng) -> (state, metrics)`, built as
    `grpo.make_iteration` builds GRPO's (without prompt buckets): one jitted program of
    `opd.split(...).fused`, state donated, or with `time_split` its three programs through
    `timing.run_split`."""
    import jax

    from jaxrlhf.algorithms import opd, timing

    parts = opd.split(model, teacher, tx, cfg, opd.OPDConfig(), reward, schedule=schedule)
    if not time_split:
        return jax.jit(parts.fused, donate_argnums=(0,))
    programs = (jax.jit(parts.rollout), jax.jit(parts.score), jax.jit(parts.train, donate_argnums=(0,)))
    return lambda state, ids, mask, extras, rng: timing.run_split(*programs, state, ids, mask, extras, rng)


# --------------------------------------------------------------------------- TRL


def step_timer(transformers, gen_times: list, step_times: list):
    """A `transformers.TrainerCallback` that appends, per optimizer step, `(the step's
    seconds, the seconds of the generations `gen_times` recorded within it)` to `step_times`."""
    class StepTimer(transformers.TrainerCallback):
        def on_step_begin(self, args, state, control, **kw):
            self.t0 = time.perf_counter()
            self.gen_before = len(gen_times)

        def on_step_end(self, args, state, control, **kw):
            step_times.append((time.perf_counter() - self.t0, sum(gen_times[self.gen_before:])))

    return StepTimer()


def run_trl(tm_state_dict, prompts_64x32, warmup, steps, gradient_checkpointing, lora_rank=0, shape="workload",
            algo=None):
    """TRL's `GRPOTrainer` on the workload (`algo`: `algorithm(...)`, by default its GRPO)."""
    import datasets
    import transformers
    from trl import GRPOConfig, GRPOTrainer

    model = transformers.LlamaForCausalLM(_common.hf_llama_config(shape, attn_implementation="sdpa"))
    model.load_state_dict(tm_state_dict)
    tokenizer = _common.word_tokenizer(padding_side="left", vocab_size=model.config.vocab_size)
    prompts = [" ".join(f"t{int(t)}" for t in row) for row in prompts_64x32]
    assert tokenizer(prompts[0])["input_ids"] == [int(t) for t in prompts_64x32[0]]
    dataset = datasets.Dataset.from_dict({"prompt": prompts})
    algo = algo or algorithm()
    per_generation = algo["trl"]["steps_per_generation"]  # optimizer steps per generation

    gen_times = []

    class Timed(GRPOTrainer):
        def _generate_single_turn(self, *args, **kwargs):
            t0 = time.perf_counter()
            out = super()._generate_single_turn(*args, **kwargs)
            gen_times.append(time.perf_counter() - t0)
            return out

    step_times = []

    total = warmup + steps
    with tempfile.TemporaryDirectory() as out_dir:
        args = GRPOConfig(
            output_dir=out_dir, gradient_accumulation_steps=1, num_generations=G, max_completion_length=T_NEW,
            generation_kwargs={"min_new_tokens": T_NEW}, temperature=1.0, top_k=0, top_p=1.0, learning_rate=1e-6,
            lr_scheduler_type="linear", weight_decay=0.0, max_grad_norm=1.0, optim="adamw_torch_fused",
            bf16=False, gradient_checkpointing=gradient_checkpointing, use_cpu=True,
            max_steps=total * per_generation, logging_steps=1, save_strategy="no", report_to="none", seed=0,
            log_completions=False, disable_tqdm=True, **algo["trl"])
        peft_config = None
        if lora_rank:
            import peft

            peft_config = peft.LoraConfig(r=lora_rank, lora_alpha=2 * lora_rank, lora_dropout=0.0, bias="none",
                                          task_type="CAUSAL_LM", target_modules=["q_proj", "k_proj", "v_proj", "o_proj",
                                                                                 "gate_proj", "up_proj", "down_proj"])
        trainer = Timed(model=model, reward_funcs=[TRL_REWARDS[n] for n in algo["rewards"]], args=args,
                        train_dataset=dataset, processing_class=tokenizer,
                        callbacks=[step_timer(transformers, gen_times, step_times)], peft_config=peft_config)
        trainer.remove_callback(transformers.PrinterCallback)  # keep stdout for the table
        with _common.CpuWatch() as watch:
            trainer.train()
        logs = [h for h in trainer.state.log_history if "reward" in h]
    timed = group_steps(step_times, per_generation)[warmup:]
    times = [s for s, _ in timed]
    gens = [g for _, g in timed]
    return dict(
        stats=_common.summary(times, count_key="n"), step_times=times, generation_times=gens,
        generation_share=statistics.median(gens) / statistics.median(times), algorithm=algo["name"],
        first_step=dict(reward_mean=logs[0].get("reward") if logs else None,
                        completion_length=logs[0].get("completions/mean_length") if logs else None),
        last_reward_mean=logs[-1].get("reward") if logs else None, cpu_watch=watch.result(detail=True),
        note=f"GRPOTrainer, gradient_checkpointing={gradient_checkpointing}"
             + (f", PEFT LoRA rank {lora_rank}" if lora_rank else "")
             + (f", {algo['name']}: {algo['trl']}" if algo["name"] != "grpo" else "")
             + (f"; a step is one generation and its {per_generation} optimizer steps" if per_generation > 1 else "")
             + f"; cpu_watch covers all {total} steps including warm-up")


def gkd_rows(order, steps):
    """The prompt rows GKD's dataset holds, in the order it trains on them: for each step
    the rows `step_rows` gives jaxrlhf, each repeated G times (GKD samples one completion
    per row, so G copies of a prompt are its G samples)."""
    return np.concatenate([np.repeat(step_rows(order, i), G) for i in range(steps)])


def gkd_collator(prompt_len):
    """GKD's batch from rows `{"prompt_ids": [...]}`: the prompts (`prompts`,
    `prompt_attention_mask`) its on-policy generation starts from, and placeholder
    `input_ids` / `labels` of the prompt + `T_NEW` pad tokens that the generated sequence
    replaces (lmbda = 1). The placeholder's labels are valid on exactly the `T_NEW`
    completion positions, so the token count the Trainer reads from them
    (`num_items_in_batch`) is the generated tokens' count."""
    import torch

    def collate(rows):
        prompts = torch.tensor([r["prompt_ids"] for r in rows], dtype=torch.long)
        assert prompts.shape[1] == prompt_len, prompts.shape
        input_ids = torch.cat([prompts, torch.zeros(len(rows), T_NEW, dtype=torch.long)], dim=1)
        labels = input_ids.clone()
        labels[:, :prompt_len] = -100
        return dict(prompts=prompts, prompt_attention_mask=torch.ones_like(prompts), input_ids=input_ids,
                    attention_mask=torch.ones_like(input_ids), labels=labels)

    return collate


def run_trl_gkd(tm_state_dict, teacher_state_dict, prompts_64x32, order, warmup, steps, gradient_checkpointing,
                shape="workload", teacher_layers=None, algo=None):
    """TRL's `GKDTrainer` as on-policy distillation: lmbda = 1 (every step samples from the
    student), beta = 1 (the reverse KL(student ‖ teacher) over the full vocabulary at each
    completion token), temperature 1, exactly `T_NEW` new tokens; the same 2 prompts × G
    samples a step as jaxrlhf (`gkd_rows`, read in order), one optimizer step each."""
    import datasets
    import transformers

    try:
        from trl.experimental.gkd import GKDConfig, GKDTrainer
    except ImportError:  # TRL < 0.24 shipped it at the top level
        from trl import GKDConfig, GKDTrainer

    model = transformers.LlamaForCausalLM(_common.hf_llama_config(shape, attn_implementation="sdpa"))
    model.load_state_dict(tm_state_dict)
    teacher = transformers.LlamaForCausalLM(_common.hf_llama_config(
        shape, attn_implementation="sdpa", num_hidden_layers=teacher_layers or model.config.num_hidden_layers))
    teacher.load_state_dict(teacher_state_dict)
    tokenizer = _common.word_tokenizer(padding_side="left", vocab_size=model.config.vocab_size)
    algo = algo or algorithm(opd=True)
    total = warmup + steps
    dataset = datasets.Dataset.from_dict({"prompt_ids": prompts_64x32[gkd_rows(order, total)].tolist()})

    gen_times, step_times = [], []

    class Timed(GKDTrainer):
        @staticmethod
        def generate_on_policy_outputs(*args, **kwargs):
            t0 = time.perf_counter()
            out = GKDTrainer.generate_on_policy_outputs(*args, **kwargs)
            gen_times.append(time.perf_counter() - t0)
            return out

    with tempfile.TemporaryDirectory() as out_dir:
        args = GKDConfig(
            output_dir=out_dir, gradient_accumulation_steps=1, learning_rate=1e-6, lr_scheduler_type="linear",
            weight_decay=0.0, max_grad_norm=1.0, optim="adamw_torch_fused", bf16=False,
            gradient_checkpointing=gradient_checkpointing, use_cpu=True, max_steps=total, logging_steps=1,
            save_strategy="no", report_to="none", seed=0, disable_tqdm=True, train_sampling_strategy="sequential",
            **algo["trl"])
        trainer = Timed(model=model, teacher_model=teacher, args=args, train_dataset=dataset,
                        processing_class=tokenizer, data_collator=gkd_collator(prompts_64x32.shape[1]),
                        callbacks=[step_timer(transformers, gen_times, step_times)])
        # Exactly T_NEW tokens, as everywhere in the workload (EOS masked until then).
        trainer.generation_config.min_new_tokens = T_NEW
        trainer.generation_kwargs["min_new_tokens"] = T_NEW
        trainer.remove_callback(transformers.PrinterCallback)
        with _common.CpuWatch() as watch:
            trainer.train()
        logs = [h for h in trainer.state.log_history if "loss" in h]
    timed = step_times[warmup:]
    times = [t for t, _ in timed]
    gens = [g for _, g in timed]
    return dict(
        stats=_common.summary(times, count_key="n"), step_times=times, generation_times=gens,
        generation_share=statistics.median(gens) / statistics.median(times), algorithm="opd",
        first_step=dict(reward_mean=None, reverse_kl=logs[0]["loss"] if logs else None),
        last_reverse_kl=logs[-1]["loss"] if logs else None, cpu_watch=watch.result(detail=True),
        note=f"GKDTrainer (lmbda=1, beta=1: reverse KL over the full vocabulary), gradient_checkpointing="
             f"{gradient_checkpointing} (TRL then generates with use_cache={not gradient_checkpointing}); "
             f"cpu_watch covers all {total} steps including warm-up")


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
    ap.add_argument("--policy-loss", choices=("clip", "cispo"), default="clip",
                    help="cispo: CISPO on both sides (jaxrlhf policy_loss='cispo', TRL loss_type='cispo'), "
                         f"rho clipped to <= {1 + CISPO_EPS_HIGH:g}")
    ap.add_argument("--advantage", choices=("grpo", "gdpo"), default="grpo",
                    help="gdpo: GDPO on both sides with two rewards, frac7 and even_count (jaxrlhf advantage='gdpo', "
                         "TRL multi_objective_aggregation='normalize_then_sum')")
    ap.add_argument("--minibatches", type=int, choices=(1, 2, 4), default=1,
                    help="optimizer steps per generation of 16 completions (jaxrlhf num_minibatches, TRL "
                         "steps_per_generation); a step's time is the generation and all of them")
    ap.add_argument("--opd", action="store_true",
                    help="on-policy distillation instead of GRPO: jaxrlhf's OPD step against TRL's GKDTrainer "
                         "(lmbda=1, beta=1), a frozen random-init teacher")
    ap.add_argument("--teacher-layers", type=int, default=None,
                    help="with --opd: the teacher's layers (default: twice the student's), its other shapes the "
                         "student's")
    ap.add_argument("--rounds", type=int, default=1,
                    help="run the sides this many times, alternating (jaxrlhf, TRL, jaxrlhf, TRL, ...): rows of "
                         "round k > 1 are named '... [round k]'")
    args = ap.parse_args(argv)
    if args.tunix_python and args.shape != "workload":
        ap.error("--tunix-python runs the workload's shapes only (tunix_grpo_worker.py builds them)")
    grpo_variant = args.policy_loss != "clip" or args.advantage != "grpo" or args.minibatches != 1
    if args.tunix_python and (grpo_variant or args.opd):
        ap.error("--tunix-python runs the workload's GRPO only (tunix_grpo_worker.py)")
    if args.opd and (grpo_variant or args.lora):
        ap.error("--opd runs OPD against GKD: no --policy-loss, --advantage, --minibatches or --lora")
    if args.teacher_layers is not None and not args.opd:
        ap.error("--teacher-layers is the teacher's of --opd")
    if args.rounds < 1:
        ap.error("--rounds must be >= 1")
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

    algo = algorithm(args.policy_loss, args.advantage, args.minibatches, opd=args.opd)
    torch.manual_seed(0)
    tm = transformers.LlamaForCausalLM(_common.hf_llama_config(args.shape, attn_implementation="sdpa"))
    n_params = sum(p.numel() for p in tm.parameters())
    state_dict = {k: v.clone() for k, v in tm.state_dict().items()}
    teacher = teacher_state_dict = None
    if args.opd:  # the frozen teacher, the same weights on both sides: HF init after torch.manual_seed(1)
        args.teacher_layers = args.teacher_layers or 2 * tm.config.num_hidden_layers
        torch.manual_seed(1)
        teacher = transformers.LlamaForCausalLM(_common.hf_llama_config(
            args.shape, attn_implementation="sdpa", num_hidden_layers=args.teacher_layers))
        teacher_state_dict = {k: v.clone() for k, v in teacher.state_dict().items()}
    results, errors = {}, {}
    tunix_ckpt = tunix_probe = None
    if args.tunix_python:  # the same weights for Tunix, and the torch logits to check its model against
        tunix_ckpt = tempfile.TemporaryDirectory()
        tm.save_pretrained(tunix_ckpt.name, safe_serialization=True)
        with torch.no_grad():
            tunix_probe = tm(torch.as_tensor(prompts[:1])).logits[0, -1].double().numpy()
    ckpt, teacher_ckpt = tempfile.TemporaryDirectory(), tempfile.TemporaryDirectory()
    tm.save_pretrained(ckpt.name, safe_serialization=True)
    if teacher is not None:
        teacher.save_pretrained(teacher_ckpt.name, safe_serialization=True)
    del tm, teacher
    ckpt_modes = {"both": (True, False), "on": (True,), "off": (False,)}[args.trl_grad_ckpt]
    for k in range(1, args.rounds + 1):  # the sides alternate, round after round
        tag = f" [round {k}]" if k > 1 else ""
        if args.framework in ("both", "jax"):
            results["jaxrlhf" + tag] = run_jax(ckpt.name, prompts, order, args.warmup, args.steps,
                                               time_split=args.time_split, algo=algo,
                                               teacher_ckpt=teacher_ckpt.name if args.opd else None)
            if args.lora:
                results[f"jaxrlhf lora {args.lora}{tag}"] = run_jax(ckpt.name, prompts, order, args.warmup,
                                                                    args.steps, lora_rank=args.lora,
                                                                    time_split=args.time_split, algo=algo)
        if args.framework in ("both", "trl"):
            for rank, gc in [(r, gc) for r in ([0, args.lora] if args.lora else [0]) for gc in ckpt_modes]:
                name = (f"trl{' gkd' if args.opd else ''}{f' lora {rank}' if rank else ''} "
                        f"(grad ckpt {'on' if gc else 'off'}){tag}")
                try:
                    if args.opd:
                        results[name] = run_trl_gkd(state_dict, teacher_state_dict, prompts, order, args.warmup,
                                                    args.steps, gc, shape=args.shape,
                                                    teacher_layers=args.teacher_layers, algo=algo)
                    else:
                        results[name] = run_trl(state_dict, prompts, args.warmup, args.steps, gc, lora_rank=rank,
                                                shape=args.shape, algo=algo)
                except ImportError as e:  # TRL (or peft) not installed: report the rest
                    errors[name] = f"{type(e).__name__}: {e}"
    ckpt.cleanup()
    teacher_ckpt.cleanup()
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
    what = "GRPO step" if algo["name"] == "grpo" else f"its GRPO step's work with {algo['name']}"
    result = dict(
        workload=f"reference workload, measurement 3 ({what})", shape=args.shape, params=n_params,
        algorithm=algo["name"], algorithm_settings=dict(jax=algo["jax"], trl=algo["trl"], rewards=algo["rewards"]),
        teacher_layers=args.teacher_layers, rounds=args.rounds, results=results, errors=errors,
        quick=args.quick, warmup=args.warmup, steps=args.steps, peak_rss_mib=_common.peak_rss_mib(),
        peak_rss_note=f"whole process, frameworks run: {args.framework}"
        + (" (tunix ran in a subprocess: its own peak RSS is in its row)" if args.tunix_python else ""),
        versions=versions, nproc=os.cpu_count(), omp_wait_policy=os.environ.get("OMP_WAIT_POLICY"),
        contended=any(r["cpu_watch"]["contended"] for r in results.values()), ratios=ratios(results),
        total_s=time.perf_counter() - t_start)
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


def _round(name):
    """A row's name without its round tag, and the tag (`" [round k]"`; "" in round 1)."""
    base, sep, rest = name.partition(" [round ")
    return base, sep + rest


def ratios(results) -> list[dict]:
    """Every peer row's median step time over the jaxrlhf row it is compared with (the
    LoRA rows' with "jaxrlhf lora R", the others' with "jaxrlhf"; a round's rows with that
    round's), then, with more than one round, the same pooled: the median of all rounds'
    timed steps of each peer over that of all of jaxrlhf's."""
    out, pooled = [], {}
    for name, res in results.items():
        base, tag = _round(name)
        if base.startswith("jaxrlhf"):
            continue
        ours_base = next((_round(k)[0] for k in results if _round(k)[0].startswith("jaxrlhf lora")),
                         "jaxrlhf") if " lora " in base else "jaxrlhf"
        ours = ours_base + tag
        if ours not in results:
            continue
        out.append(dict(peer=name, ours=ours, peer_median_s=res["stats"]["median_s"],
                        ours_median_s=results[ours]["stats"]["median_s"],
                        ratio=res["stats"]["median_s"] / results[ours]["stats"]["median_s"]))
        pooled.setdefault((base, ours_base), []).append(tag)
    for (base, ours_base), tags in pooled.items():
        if len(tags) < 2:
            continue
        theirs = [t for tag in tags for t in results[base + tag]["step_times"]]
        ours = [t for tag in tags for t in results[ours_base + tag]["step_times"]]
        out.append(dict(peer=f"{base} [{len(tags)} rounds pooled]", ours=f"{ours_base} [{len(tags)} rounds pooled]",
                        peer_median_s=statistics.median(theirs), ours_median_s=statistics.median(ours),
                        ratio=statistics.median(theirs) / statistics.median(ours)))
    return out


def _markdown(r) -> str:
    lines = ["| framework | min s/step | median s/step | max s/step | generation share (median) | first reward | "
             "other cores busy |", "|---|---|---|---|---|---|---|"]
    for name, res in r["results"].items():
        s = res["stats"]
        lines.append(f"| {name} | {s['min_s']:.3f} | {s['median_s']:.3f} | {s['max_s']:.3f} | "
                     f"{res['generation_share']:.0%} | {res['first_step'].get('reward_mean')} | "
                     f"{res['cpu_watch']['others_cores']:.2f} |")
    extra = [f"shape {r['shape']}, params {r['params']:,}; {r['steps']} timed steps after {r['warmup']} warm-up"
             + (" (--quick: a smoke run, not a result)" if r["quick"] else "")
             + (f"; {r['rounds']} rounds, the sides alternating" if r.get("rounds", 1) > 1 else "")]
    if r.get("algorithm", "grpo") != "grpo":
        extra.append(f"algorithm: {r['algorithm']}; jaxrlhf {r['algorithm_settings']['jax']}; TRL "
                     f"{r['algorithm_settings']['trl']}; rewards {r['algorithm_settings']['rewards']}"
                     + (f"; teacher {r['teacher_layers']} layers" if r.get("teacher_layers") else ""))
    jx = r["results"].get("jaxrlhf")
    if jx:
        first = jx["first_step"]
        extra.append(f"jaxrlhf first call (compile + step) {jx['first_call_s']:.1f} s; first step ratio_max "
                     f"{first.get('ratio_max')}, clipfrac {first.get('clipfrac')}")
        for name, res in r["results"].items():
            if "reverse_kl" in res["first_step"]:
                how = ("k1 estimate on its samples" if name.startswith("jaxrlhf")
                       else "loss: exact, over the full vocabulary, on its samples")
                extra.append(f"{name}: first step's reverse KL(student || teacher) per token "
                             f"{res['first_step']['reverse_kl']:.4f} ({how})")
        for name, res in r["results"].items():
            if res.get("time_split"):
                extra.append(f"{name} time split (medians): " + ", ".join(
                    f"{part} {sec:.3f} s" for part, sec in res["time_split"].items()))
        for name, res in r["results"].items():
            if name.startswith("trl"):
                gen = statistics.median(res["generation_times"])
                rest = res["stats"]["median_s"] - gen
                extra.append(f"{name}: generation {gen:.3f} s, the rest of the step {rest:.3f} s (medians)")
        for q in r.get("ratios") or ratios(r["results"]):
            extra.append(f"{q['peer']} / {q['ours']} median step time: {q['ratio']:.2f}x "
                         f"({q['peer_median_s']:.3f} / {q['ours_median_s']:.3f} s)")
        for name, res in r["results"].items():
            base, tag = _round(name)
            if base.startswith("jaxrlhf lora") and "jaxrlhf" + tag in r["results"]:
                extra.append(f"{name} / jaxrlhf{tag} (all weights) median step time: "
                             f"{res['stats']['median_s'] / r['results']['jaxrlhf' + tag]['stats']['median_s']:.2f}x")
    tx = r["results"].get("tunix")
    if tx:
        extra.append(f"tunix: peak RSS {tx['peak_rss_mib']:.0f} MiB (its own process, VmHWM); first step "
                     f"(compile + step) {tx['first_call_s']:.1f} s; same model as torch: max |logit diff| "
                     f"{tx['same_model_max_abs_logit_diff']:.1e}; differs in: {'; '.join(tx['differences'])}")
    for name, err in r["errors"].items():
        extra.append(f"{name}: not run ({err})")
    if r.get("omp_wait_policy"):
        extra.append(f"OMP_WAIT_POLICY={r['omp_wait_policy']} (torch's OpenMP threads)")
    extra.append(f"peak RSS {r['peak_rss_mib']:.0f} MiB ({r['peak_rss_note']})")
    extra.append(f"contended: {r['contended']}")
    return "\n".join(lines + [""] + ["- " + e for e in extra])


if __name__ == "__main__":
    main()
