"""The phases on preference pairs: the Bradley–Terry reward model (one, or an ensemble of
K members) and DPO, each a `phases.update_phase`-style loop of one update per batch of
pairs, evaluated on the task's held-out pairs."""

from __future__ import annotations

import dataclasses
import functools

import jax
import numpy as np

from jaxrlhf.algorithms import dpo, reward_model
from jaxrlhf.models import lora
from jaxrlhf.runs import policy_pairs, setup
from jaxrlhf.runs.loop import run_phase
from jaxrlhf.runs.phases import (array_batches, library_config, optimizer, phase_config, sharded_step, stopping_options,
                                 timed_update)
from jaxrlhf.runs.sharding import Placement, pad_rows
from jaxrlhf.runs.stopping import EarlyStop
from jaxrlhf.runs.tasks import Task


def _pair_eval(eval_step, params, pairs: dict, keys, placement: Placement, batch_size: int = 256):
    """Held-out pair metrics, averaged over batches of up to `batch_size` pairs. A batch
    whose rows do not split over the mesh's batch shards is padded with weight-0 rows; the
    metrics come back replicated, the same on every process."""
    step = jax.jit(eval_step, out_shardings=placement.replicated)
    n = pairs["prompt_ids"].shape[0]
    sums, count = {}, 0
    for start in range(0, n, batch_size):
        idx = np.arange(start, min(start + batch_size, n))
        batch = {k: pairs[k][idx] for k in keys}
        rows = placement.padded_rows(len(idx))
        if rows != len(idx):
            batch = dict(pad_rows(batch, rows), weight=(np.arange(rows) < len(idx)).astype(np.float32))
        m = placement.fetch(step(params, placement.put_rows(batch)))
        for k, v in m.items():
            if k != "weight":  # the eval steps' own batch weight, not a metric
                sums[k] = sums.get(k, 0.0) + float(np.mean(v)) * len(idx)
        count += len(idx)
    return {k: v / count for k, v in sums.items()}


def _reference_logprobs(model, params, pairs: dict, placement: Placement, batch_size: int = 64) -> dict:
    """`dpo.precompute_reference_logprobs` on the mesh: batches of `batch_size` rounded up
    to the batch shards, results read back on every process."""
    fn = jax.jit(functools.partial(dpo.pair_logprobs, model), out_shardings=placement.replicated)
    return dpo.precompute_reference_logprobs(
        model, params, pairs, batch_size=placement.padded_rows(batch_size),
        score_fn=lambda p, batch: placement.fetch(fn(p, placement.put_rows(batch))))


def reward_model_phase(cfg, train, *, policy_model, policy_params, task: Task, workdir, writer, rng,
                       placement: Placement | None = None, should_stop=None,
                       early_stop: EarlyStop | None = None, trunk_params=None):
    """Bradley–Terry on preference pairs, starting from the policy's trunk (or from
    `trunk_params`, the reward model's own: `reward_model.sft_steps`; the on-policy pairs
    are the policy's samples all the same).

    The pairs (`cfg.pairs`): the task's synthetic ones ("task"), the policy's own samples
    ranked by the task's reward ("policy", `runs.policy_pairs`), or both. Returns `(model,
    params, held-out metrics)`; the held-out `accuracy` is the fraction of the task's
    synthetic test pairs the reward model orders correctly, `policy_pairs/accuracy` that of
    on-policy pairs from the held-out prompts, and `policy_pairs/{train,test}_*` count the
    on-policy pairs and the prompts they came from.

    An ensemble (`cfg.ensemble` = K > 1): K members trained on the same pairs, member k
    with its own score head and batch order from `cfg.seed + k` (checkpoints and metrics
    under `reward_model`, then `reward_model_<k>`; `early_stop` rules member 0, a fresh
    copy of it each other member). The params returned are the members stacked
    (`reward_model.stack_members`); the held-out metrics are those of the ensemble's
    `cfg.ensemble_reduce` score, each member's beside them as `member<k>/<metric>`. K = 1
    is the single reward model, unstacked.

    With LoRA in `policy_model`'s config (`setup.lora_model`) the trunk (a copy: the train
    state is donated each step) is frozen and fresh adapters plus the score head are trained.
    """
    placement = placement or Placement.local()
    pairs, held_out, stats = policy_pairs.phase_pairs(cfg, train, policy_model=policy_model,
                                                      policy_params=policy_params, task=task, rng=rng,
                                                      placement=placement)
    rcfg = library_config("reward_model", cfg, task)
    keys = dpo.PAIR_KEYS
    size = cfg.ensemble
    reduce = reward_model.check_reduce(cfg.ensemble_reduce) if size > 1 else None

    def evaluate(eval_step, p):
        return {prefix + k: v for prefix, test in held_out.items()
                for k, v in _pair_eval(eval_step, p, test, keys, placement).items()}

    # Each member's own copy of the rule, taken before member 0's run records its bests in it.
    stops = [early_stop] + [None if early_stop is None else dataclasses.replace(early_stop) for _ in range(1, size)]
    members, member_evals = [], {}
    for k, stop in enumerate(stops):
        model, params = _reward_model_member(cfg, train, k, pairs=pairs, rcfg=rcfg, evaluate=evaluate,
                                             policy_model=policy_model,
                                             policy_params=policy_params if trunk_params is None else trunk_params,
                                             workdir=workdir, writer=writer, rng=rng, placement=placement,
                                             should_stop=should_stop, early_stop=stop)
        members.append(params)
        if size > 1:
            member_evals.update({f"member{k}/{m}": v
                                 for m, v in evaluate(reward_model.make_eval_step(model, rcfg), params).items()})
    if size == 1:
        return model, members[0], {**evaluate(reward_model.make_eval_step(model, rcfg), members[0]), **stats}
    params = reward_model.stack_members(members)
    del members
    ensemble = evaluate(reward_model.make_eval_step(model, rcfg, reduce=reduce), params)
    return model, params, {**ensemble, **member_evals, **stats}


def _reward_model_member(cfg, train, k: int, *, pairs, rcfg, evaluate, policy_model, policy_params, workdir, writer,
                         rng, placement: Placement, should_stop, early_stop):
    """Member `k` of the reward-model phase (`reward_model_phase`): `(model, params)`."""
    seed = cfg.seed + k
    model, params = reward_model.init_from_policy(policy_model, policy_params, seed=seed)
    params = setup.start_adapters(model, params, fresh=True, seed=seed + 1)
    tx, schedule = optimizer(cfg.optim, "reward_model.optim", total_steps=cfg.steps)
    batches = array_batches({key: pairs[key] for key in dpo.PAIR_KEYS}, cfg.batch_size, seed, placement,
                            "reward_model.batch_size")
    p_sh = placement.param_shardings(model)
    state, state_sh = placement.init_state(lambda p: reward_model.init_state(p, tx), placement.place(params, p_sh),
                                           params_shardings=p_sh)
    step = sharded_step(reward_model.make_train_step(model, tx, rcfg), placement, state_sh, cfg.batch_size)
    eval_step = reward_model.make_eval_step(model, rcfg)
    name = "reward_model" if k == 0 else f"reward_model_{k}"
    state, _ = run_phase(
        phase_config(name, cfg, train, show=("loss", "accuracy", "eval/accuracy", "eval/policy_pairs/accuracy")),
        workdir=workdir, state=state, step_fn=timed_update(step, schedule), batches=batches,
        rng=rng if k == 0 else jax.random.fold_in(rng, k), writer=writer,
        eval_fn=lambda s: evaluate(eval_step, s.params), should_stop=should_stop, **stopping_options(early_stop))
    return model, state.params


def dpo_phase(cfg, train, *, model, params, task: Task, workdir, writer, rng, placement: Placement | None = None,
              eval_fn=None, should_stop=None, early_stop: EarlyStop | None = None):
    """DPO on the task's preference pairs against the starting policy as reference (with
    LoRA adapters in `params`: the base without them, the starting policy all the same).

    Returns `(params, held-out metrics)` with the held-out `reward_accuracy` before and after.
    """
    placement = placement or Placement.local()
    if task.pairs is None:
        raise ValueError(f"task {task.name!r} has no preference pairs: set task.num_pairs > 0 (addition) or "
                         "task.kind='pairs' (files: prompt, chosen, rejected)")
    dcfg = library_config("dpo", cfg, task)
    p_sh = placement.param_shardings(model)
    params = placement.place(params, p_sh)
    reference = lora.without_adapters(params)  # the starting policy (with LoRA: its base, the same arrays)
    train_pairs = _reference_logprobs(model, reference, task.pairs, placement)
    test_pairs = _reference_logprobs(model, reference, task.test_pairs, placement)
    keys = dpo.PAIR_KEYS + dpo.REF_KEYS
    tx, schedule = optimizer(cfg.optim, "dpo.optim", total_steps=cfg.steps)
    batches = array_batches({k: train_pairs[k] for k in keys}, cfg.batch_size, cfg.seed, placement, "dpo.batch_size")
    state, state_sh = placement.init_state(lambda p: dpo.init_state(p, tx), params, params_shardings=p_sh)
    step = sharded_step(dpo.make_train_step(model, tx, dcfg), placement, state_sh, cfg.batch_size)
    eval_step = dpo.make_eval_step(model, dcfg)
    pair_eval = lambda p: _pair_eval(eval_step, p, test_pairs, keys, placement)

    def evaluate(state):
        out = {f"pairs/{k}": v for k, v in pair_eval(state.params).items()}
        return {**out, **(eval_fn(state.params) if eval_fn else {})}

    state, _ = run_phase(
        phase_config("dpo", cfg, train, show=("loss", "reward_accuracy", "eval/accuracy")), workdir=workdir,
        state=state, step_fn=timed_update(step, schedule), batches=batches, rng=rng, writer=writer,
        eval_fn=evaluate, should_stop=should_stop, **stopping_options(early_stop))
    return state.params, pair_eval(state.params)


__all__ = ["dpo_phase", "reward_model_phase"]
