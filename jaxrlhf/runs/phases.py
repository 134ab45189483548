"""The phases a run is made of, each a `loop.run_phase` over one algorithm's step.

`sft_phase` (the warm start of the built-in task, or a whole SFT run), `reward_model_phase`
(Bradley–Terry on preference pairs), `dpo_phase`, `grpo_phase` and `ppo_phase`. Every phase
checkpoints under `workdir/<name>/` and resumes from there.
"""

from __future__ import annotations

import functools
import logging

import jax
import jax.numpy as jnp
import numpy as np

from jaxrlhf import data
from jaxrlhf.algorithms import dpo, grpo, ppo, reward_model, sft
from jaxrlhf.models.transformer import Transformer
from jaxrlhf.monitor import HealthMonitor, MonitorConfig
from jaxrlhf.runs import setup
from jaxrlhf.runs.loop import ArrayBatches, PhaseConfig, run_phase
from jaxrlhf.runs.tasks import Task, host_extras

log = logging.getLogger("jaxrlhf")


def _batches(arrays: dict, batch_size: int, seed: int) -> ArrayBatches:
    n = next(iter(arrays.values())).shape[0]
    if batch_size > n:
        raise ValueError(f"batch_size {batch_size} is larger than the {n} examples of the task")
    return ArrayBatches(arrays, data.BatchIterator(n, batch_size, seed=seed, process_index=jax.process_index(),
                                                   process_count=jax.process_count()))


def _phase(name, cfg, train, **kw) -> PhaseConfig:
    return PhaseConfig(name=name, num_steps=cfg.steps, log_every=train.log_every, eval_every=train.eval_every,
                       checkpoint_every=train.checkpoint_every, keep_checkpoints=train.keep_checkpoints,
                       progress=train.progress, **kw)


def _with_lr(step_fn, schedule):
    def step(state, batch, rng):
        state, metrics = step_fn(state, batch, rng)
        return state, {**metrics, "lr": schedule(state.step - 1)}
    return step


def sft_phase(cfg, train, *, model, params, task: Task, workdir, writer, rng, eval_fn=None, should_stop=None):
    """Masked cross-entropy on the task's SFT arrays; returns `(params, last_metrics)`."""
    tx, schedule = setup.build_optimizer(cfg.optim, total_steps=cfg.steps)
    step = jax.jit(sft.make_train_step(model, tx, sft.SFTConfig(prompt_len=task.prompt_len)), donate_argnums=0)
    batch_keys = sft.BATCH_KEYS
    arrays = {k: task.sft[k] for k in batch_keys}
    state, last = run_phase(
        _phase("sft", cfg, train, show=("loss", "token_accuracy")), workdir=workdir,
        state=sft.init_state(params, tx), step_fn=_with_lr(step, schedule), batches=_batches(arrays, cfg.batch_size,
                                                                                                cfg.seed),
        rng=rng, writer=writer, eval_fn=(lambda s: eval_fn(s.params)) if eval_fn else None, should_stop=should_stop)
    return state.params, last


def grpo_config(cfg, task: Task) -> grpo.GRPOConfig:
    sampling = setup.build_sampling(cfg.sampling, eos_id=task.eos_id, pad_id=task.pad_id)
    return grpo.GRPOConfig(
        sampling=sampling, advantage=cfg.advantage, adv_eps=cfg.adv_eps, beta=cfg.beta,
        kl_estimator=cfg.kl_estimator, clip_low=cfg.clip_low, clip_high=cfg.clip_high if cfg.clip_high > 0 else None,
        dual_clip=cfg.dual_clip if cfg.dual_clip > 0 else None, agg=cfg.agg,
        norm_len=cfg.norm_len if cfg.norm_len > 0 else None, entropy_coef=cfg.entropy_coef,
        num_iterations=cfg.num_iterations, num_minibatches=cfg.num_minibatches,
        num_microbatches=cfg.num_microbatches, ratio_level=cfg.ratio_level, dynamic_sampling=cfg.dynamic_sampling,
        prompts_per_step=cfg.prompts_per_step if cfg.dynamic_sampling and cfg.prompts_per_step > 0 else None,
        overlong_max_len=cfg.overlong_max_len if cfg.overlong_max_len > 0 else None,
        overlong_cache=cfg.overlong_cache)


def grpo_phase(cfg, train, *, model, params, task: Task, workdir, writer, rng, eval_fn=None, should_stop=None):
    """GRPO (or a variant) on the task's prompts and reward; returns `(params, last_metrics)`."""
    gcfg = grpo_config(cfg, task)
    tx, schedule = setup.build_optimizer(cfg.optim, total_steps=cfg.steps)
    iteration = grpo.make_iteration(model, tx, gcfg, task.reward, schedule=schedule, donate=True)
    keys = task.extra_keys
    pool = cfg.pool_size if cfg.dynamic_sampling and cfg.pool_size > 0 else cfg.prompts_per_step

    def step(state, batch, rng):
        return iteration(state, batch["prompt_ids"], batch["prompt_mask"], host_extras(batch, keys), rng)

    ref = jax.tree.map(jnp.copy, params) if gcfg.beta > 0 else None
    monitor = HealthMonitor(MonitorConfig(clip=gcfg.clip_low))
    state, last = run_phase(
        _phase("grpo", cfg, train, show=("reward/mean", "kl", "response_length/mean", "eval/accuracy")),
        workdir=workdir, state=grpo.init_state(params, tx, ref_params=ref), step_fn=step,
        batches=_batches({k: task.prompts[k] for k in ("prompt_ids", "prompt_mask", *keys)}, pool, cfg.seed),
        rng=rng, writer=writer, monitor=monitor, eval_fn=(lambda s: eval_fn(s.policy.params)) if eval_fn else None,
        should_stop=should_stop)
    return state.policy.params, last


def _pair_eval(eval_step, pairs: dict, keys, batch_size: int = 256):
    """Held-out pair metrics, averaged over fixed-size batches (the tail re-uses rows)."""
    step = jax.jit(eval_step)
    n = pairs["prompt_ids"].shape[0]
    sums, count = {}, 0
    for start in range(0, n, batch_size):
        idx = np.arange(start, min(start + batch_size, n))
        m = step({k: pairs[k][idx] for k in keys})
        for k, v in m.items():
            if k != "weight":  # the eval steps' own batch weight, not a metric
                sums[k] = sums.get(k, 0.0) + float(np.mean(v)) * len(idx)
        count += len(idx)
    return {k: v / count for k, v in sums.items()}


def reward_model_phase(cfg, train, *, policy_model, policy_params, task: Task, workdir, writer, rng, should_stop=None):
    """Bradley–Terry on the task's preference pairs, starting from the policy's trunk.

    Returns `(model, params, held-out metrics)`; the held-out `accuracy` is the fraction
    of pairs the reward model orders correctly.
    """
    if task.pairs is None:
        raise ValueError(f"task {task.name!r} has no preference pairs: set task.num_pairs > 0")
    model, params = reward_model.init_from_policy(policy_model, policy_params, seed=cfg.seed)
    rcfg = reward_model.RewardModelConfig(num_microbatches=cfg.num_microbatches)
    tx, schedule = setup.build_optimizer(cfg.optim, total_steps=cfg.steps)
    step = jax.jit(reward_model.make_train_step(model, tx, rcfg), donate_argnums=0)
    keys = dpo.PAIR_KEYS
    eval_step = reward_model.make_eval_step(model, rcfg)
    evaluate = lambda p: _pair_eval(functools.partial(eval_step, p), task.test_pairs, keys)
    state, _ = run_phase(
        _phase("reward_model", cfg, train, show=("loss", "accuracy", "eval/accuracy")), workdir=workdir,
        state=reward_model.init_state(params, tx), step_fn=_with_lr(step, schedule),
        batches=_batches({k: task.pairs[k] for k in keys}, cfg.batch_size, cfg.seed), rng=rng, writer=writer,
        eval_fn=lambda s: evaluate(s.params), should_stop=should_stop)
    return model, state.params, evaluate(state.params)


def dpo_phase(cfg, train, *, model, params, task: Task, workdir, writer, rng, eval_fn=None, should_stop=None):
    """DPO on the task's preference pairs against the starting policy as reference.

    Returns `(params, held-out metrics)` with the held-out `reward_accuracy` before and after.
    """
    if task.pairs is None:
        raise ValueError(f"task {task.name!r} has no preference pairs: set task.num_pairs > 0")
    dcfg = dpo.DPOConfig(beta=cfg.beta, loss_type=cfg.loss_type, label_smoothing=cfg.label_smoothing,
                         num_microbatches=cfg.num_microbatches)
    train_pairs = dpo.precompute_reference_logprobs(model, params, task.pairs)
    test_pairs = dpo.precompute_reference_logprobs(model, params, task.test_pairs)
    keys = dpo.PAIR_KEYS + dpo.REF_KEYS
    tx, schedule = setup.build_optimizer(cfg.optim, total_steps=cfg.steps)
    step = jax.jit(dpo.make_train_step(model, tx, dcfg), donate_argnums=0)
    eval_step = dpo.make_eval_step(model, dcfg)
    pair_eval = lambda p: _pair_eval(functools.partial(eval_step, p), test_pairs, keys)

    def evaluate(state):
        out = {f"pairs/{k}": v for k, v in pair_eval(state.params).items()}
        return {**out, **(eval_fn(state.params) if eval_fn else {})}

    state, _ = run_phase(
        _phase("dpo", cfg, train, show=("loss", "reward_accuracy", "eval/accuracy")), workdir=workdir,
        state=dpo.init_state(params, tx), step_fn=_with_lr(step, schedule),
        batches=_batches({k: train_pairs[k] for k in keys}, cfg.batch_size, cfg.seed), rng=rng, writer=writer,
        eval_fn=evaluate, should_stop=should_stop)
    return state.params, pair_eval(state.params)


def ppo_config(cfg, task: Task) -> ppo.PPOConfig:
    sampling = setup.build_sampling(cfg.sampling, eos_id=task.eos_id, pad_id=task.pad_id)
    opt = lambda v: v if v > 0 else None
    return ppo.PPOConfig(
        sampling=sampling, kl_estimator=cfg.kl_estimator, kl_coef=cfg.kl_coef, kl_target=opt(cfg.kl_target),
        kl_horizon=cfg.kl_horizon, missing_eos_penalty=opt(cfg.missing_eos_penalty),
        reward_whitening=cfg.reward_whitening or None, reward_clip=opt(cfg.reward_clip), gamma=cfg.gamma,
        lam=cfg.lam, whiten_advantages=cfg.whiten_advantages, clip=cfg.clip, vf_clip=opt(cfg.vf_clip),
        vf_coef=cfg.vf_coef, ent_coef=cfg.ent_coef, agg=cfg.agg, num_ppo_epochs=cfg.num_ppo_epochs,
        num_minibatches=cfg.num_minibatches, num_microbatches=cfg.num_microbatches, critic=cfg.critic)


def ppo_phase(cfg, train, *, model, params, reward_model_and_params, task: Task, workdir, writer, rng,
              eval_fn=None, should_stop=None):
    """RLHF-PPO: actor `params`, frozen reference (a copy), critic on the policy's trunk
    (or shared), and the frozen reward model. The held-out exact-match accuracy (the true
    reward, `eval/accuracy`) is logged beside the reward-model score (`score_mean`): the
    score going up is not the same as getting better.
    """
    pcfg = ppo_config(cfg, task)
    tx_actor, schedule = setup.build_optimizer(cfg.optim, total_steps=cfg.steps)
    rm_model, rm_params = reward_model_and_params
    critic_model = critic_params = tx_critic = None
    actor_model = model
    if pcfg.shared:
        actor_model = Transformer(model.config, head="lm_value")
        d = model.config.hidden_size
        params = dict(params, value_head={"kernel": jnp.zeros((d, 1), jnp.dtype(model.config.param_dtype))})
    else:
        critic_model, critic_params = reward_model.init_from_policy(model, params, seed=cfg.seed + 1)
        tx_critic, _ = setup.build_optimizer(cfg.critic_optim, total_steps=cfg.steps)
    state = ppo.init_state(pcfg, actor_model, params, tx_actor, critic_model=critic_model,
                           critic_params=critic_params, tx_critic=tx_critic, reward=(rm_model, rm_params))
    iteration = ppo.make_iteration(actor_model, critic_model, rm_model, tx_actor, tx_critic, pcfg,
                                   lr_schedule=schedule)
    def step(state, batch, rng):
        return iteration(state, batch["prompt_ids"], batch["prompt_mask"], rng)

    def evaluate(state):
        return eval_fn(state.actor.params) if eval_fn else {}

    state, last = run_phase(
        _phase("ppo", cfg, train, show=("score_mean", "kl_k1", "eval/accuracy")), workdir=workdir, state=state,
        step_fn=step, batches=_batches({k: task.prompts[k] for k in ("prompt_ids", "prompt_mask")},
                                       cfg.prompts_per_step, cfg.seed),
        rng=rng, writer=writer, monitor=HealthMonitor(MonitorConfig(clip=pcfg.clip)), eval_fn=evaluate,
        should_stop=should_stop)
    params = state.actor.params
    if pcfg.shared:
        params = {k: v for k, v in params.items() if k != "value_head"}
    return params, last


__all__ = ["dpo_phase", "grpo_config", "grpo_phase", "ppo_config", "ppo_phase", "reward_model_phase", "sft_phase"]
