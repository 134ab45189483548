"""The phases a run is made of, each a `loop.run_phase` over one algorithm's step.

`sft_phase` (the warm start of the built-in task, or a whole SFT run), `reward_model_phase`
(Bradley–Terry on preference pairs), `dpo_phase`, `grpo_phase` and `ppo_phase`. Every phase
checkpoints under `workdir/<name>/` and resumes from there.
"""

from __future__ import annotations

import logging

import jax
import jax.numpy as jnp

from jaxrlhf import data
from jaxrlhf.algorithms import dpo, grpo, ppo, reward_model, sft
from jaxrlhf.monitor import HealthMonitor, MonitorConfig
from jaxrlhf.runs import setup
from jaxrlhf.runs.loop import ArrayBatches, PhaseConfig, run_phase
from jaxrlhf.runs.tasks import Task

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
        return iteration(state, batch["prompt_ids"], batch["prompt_mask"], {k: batch[k] for k in keys}, rng)

    ref = jax.tree.map(jnp.copy, params) if gcfg.beta > 0 else None
    monitor = HealthMonitor(MonitorConfig(clip=gcfg.clip_low))
    state, last = run_phase(
        _phase("grpo", cfg, train, show=("reward/mean", "kl", "response_length/mean", "eval/accuracy")),
        workdir=workdir, state=grpo.init_state(params, tx, ref_params=ref), step_fn=step,
        batches=_batches({k: task.prompts[k] for k in ("prompt_ids", "prompt_mask", *keys)}, pool, cfg.seed),
        rng=rng, writer=writer, monitor=monitor, eval_fn=(lambda s: eval_fn(s.policy.params)) if eval_fn else None,
        should_stop=should_stop)
    return state.policy.params, last


__all__ = ["grpo_config", "grpo_phase", "sft_phase"]
del dpo, ppo, reward_model  # used by the phases added below
