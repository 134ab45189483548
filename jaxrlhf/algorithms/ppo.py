"""RLHF-PPO with four models, as pure functions (docs/concepts.md#rlhf-ppo).

Actor (trained, LM head), critic (trained: its own "score"-head `Transformer`, or a value
head on the actor's trunk, `head="lm_value"`), reference (frozen copy of the starting
actor) and reward (a `rewards.Reward`: a frozen reward-model `Transformer`, whose params
the state holds, or JAX reward functions; see `scoring.compiled_reward`).

With LoRA (`models.lora`) the four roles are one frozen base plus small trained parts:
actor params with adapters train only those (and a shared critic's value head); the
reference is the actor's base without them (`ref_params=None`, `reference_params`); a
separate critic, and a reward model, may hold only their adapters and score head
(`lora.is_part`), which run on the actor's base (`on_actor`): no copy of the base.
One iteration:

    prompts → sample (actor) → score_rollout: old logp, ref logp, values, RM score
            → process_scores: missing-EOS penalty, whitening, clipping
            → compute_advantages: KL (k1/k2/k3) → shape_rewards(β) → GAE(γ, λ) → whiten
            → update: K epochs × M shuffled minibatches (× micro-batches) in one lax.scan,
              loss = clipped policy loss + vf_coef·clipped value loss − entropy_coef·entropy
            → KL controller step (β for the next iteration)

An iteration is `rollout` (sampling) → `score` (the reward, forward passes, shaping, GAE,
the KL controller) → `train` (the K epochs). `make_iteration` runs them as three timed
programs (`timing.run_split`: `time/rollout_s`, `time/scoring_s`, `time/update_s`,
tokens/s), a reward's host (text) components scored between the first two, as GRPO does;
with `time_split=False` and a pure-JAX reward the iteration is one XLA program. The rollout side (`score_rollout`, `process_scores`, `compute_advantages`,
`rollout_metrics`) is in `ppo_rollout`, the score shaping and reward plumbing PPO shares
with the GRPO family in `scoring`; this module re-exports them.

Shapes: `B` prompts, `N = B·G` sequences (G = `sampling.num_samples`, usually 1 for PPO),
`P` prompt length (left-padded), `T = sampling.max_new_tokens` (right-padded).

    cfg = PPOConfig(sampling=SamplingConfig(max_new_tokens=64, eos_id=2))
    state = init_state(cfg, actor_model, actor_params, tx_actor, critic_model=critic_model,
                       critic_params=critic_params, tx_critic=tx_critic,
                       reward=(rm_model, rm_params))
    iteration = make_iteration(actor_model, critic_model, rm_model, tx_actor, tx_critic, cfg)
    state, metrics = iteration(state, prompt_ids, prompt_mask, rng)
"""

from __future__ import annotations

import functools
from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp
import optax

from jaxrlhf import rewards
from jaxrlhf.algorithms import common, kl_controller, offpolicy, scoring, timing
from jaxrlhf.algorithms.common import (
    TrainState,
    accumulate_gradients,
    apply_if_finite,
    dropout_key,
    jit_keeping_frozen,
    minibatch_scan,
    summarize_steps,
    tree_finite,
)
from jaxrlhf.algorithms.experience import sample_responses
from jaxrlhf.algorithms.ppo_config import CRITIC_MODES, MISSING_EOS_MODES, REWARD_WHITENING, PPOConfig, PPOState
from jaxrlhf.algorithms.ppo_loss import loss_fn, ppo_loss
from jaxrlhf.algorithms.ppo_rollout import (
    Advantages,
    Batch,
    Rollout,
    compute_advantages,
    on_actor,
    process_scores,
    reference_params,
    rollout_metrics,
    score_rollout,
)
from jaxrlhf.models import lora
from jaxrlhf.algorithms.scoring import RunningMoments
from jaxrlhf.models.transformer import Transformer
from jaxrlhf.rollout.sampler import SampleOutput

PyTree = Any

# --------------------------------------------------------------------------------------
# Models


def _check_models(actor_model: Transformer, critic_model: Transformer | None, cfg: PPOConfig):
    if cfg.shared:
        if actor_model.head != "lm_value":
            raise ValueError(f"critic='shared' needs the actor Transformer with head='lm_value', "
                             f"got head={actor_model.head!r}")
        if critic_model is not None:
            raise ValueError("critic='shared': pass critic_model=None (the value head is on the actor)")
    else:
        if actor_model.head not in ("lm", "lm_value"):
            raise ValueError(f"the actor needs an LM head, got head={actor_model.head!r}")
        if critic_model is None:
            raise ValueError("critic='separate' needs a critic_model (Transformer with head='score')")
        if critic_model.head != "score":
            raise ValueError(f"the critic must be a Transformer with head='score', got head={critic_model.head!r}")
        scoring.check_vocab(actor_model.config.vocab_size, critic_model.config.vocab_size, "critic")


_FROZEN = ("ref_params", "reward_params")  # never donated nor copied by the compiled iteration


def init_state(
    cfg: PPOConfig,
    actor_model: Transformer,
    actor_params: PyTree,
    tx_actor: optax.GradientTransformation,
    *,
    critic_model: Transformer | None = None,
    critic_params: PyTree = None,
    tx_critic: optax.GradientTransformation | None = None,
    reward: Any = None,
    reward_params: PyTree = None,
    ref_params: PyTree = None,
) -> PPOState:
    """Builds the PPO state; checks models, heads and vocabularies.

    reward: any form `scoring.compiled_reward` accepts (its params, if any, are stored
      frozen); `reward_params` overrides/gives them. ref_params: defaults to a copy of
      actor_params, or, when those hold LoRA adapters, to none: the reference is their
      base (`reference_params`, no copy).
    critic_params / reward_params may be a LoRA part alone (`lora.is_part`: adapters and
      score head), run on the actor's base (`on_actor`).

    The state holds `actor_params` / `critic_params` themselves (no copy): `make_iteration`
    donates the trained part of the state by default, after which those arrays are
    deleted. Pass copies (or `donate=False`) if you keep using them. The reward params are
    never donated.
    """
    _check_models(actor_model, critic_model, cfg)
    if reward is not None:
        spec, params_from_reward = scoring.compiled_reward(reward)
        scoring.check_reward_vocab(actor_model.config.vocab_size, spec)
        if reward_params is None:
            reward_params = params_from_reward
    copy = lambda tree: jax.tree.map(jnp.array, tree)  # own buffers: the state may be donated
    critic = None
    if not cfg.shared:
        if critic_params is None or tx_critic is None:
            raise ValueError("critic='separate' needs critic_params and tx_critic")
        if lora.has_adapters(critic_params) != lora.has_adapters(actor_params):
            raise ValueError("critic_params: give LoRA adapters to both the actor and the critic or to neither "
                             "(a LoRA critic trains its adapters and score head on a frozen base)")
        critic = TrainState.create(critic_params, tx_critic)
    return PPOState(
        actor=TrainState.create(actor_params, tx_actor),
        critic=critic,
        ref_params=ref_params if ref_params is not None else (
            None if lora.has_adapters(actor_params) else copy(actor_params)),
        reward_params=reward_params,
        kl_ctl=kl_controller.init(cfg.kl_config),
        reward_stats=RunningMoments.create(),
        step=jnp.zeros((), jnp.int32),
    )


# --------------------------------------------------------------------------------------
# Loss and update


_FIRST = ("ratio_min", "ratio_max", "ratio_mean", "approx_kl", "clipfrac")


def update(
    state: PPOState,
    batch: Batch,
    rng: jax.Array,
    *,
    actor_model: Transformer,
    critic_model: Transformer | None,
    tx_actor: optax.GradientTransformation,
    tx_critic: optax.GradientTransformation | None,
    cfg: PPOConfig,
) -> tuple[PPOState, dict]:
    """K epochs × M shuffled minibatches (× micro-batches), one `lax.scan` of K·M steps.

    Each epoch draws a fresh permutation of the N rows. A minibatch whose gradients (or
    loss) are not finite is skipped: params and optimizer state stay as they were, and the
    metric `finite` turns False. Metrics are means over minibatches, except `ratio_min/max`
    (min/max) and `first/*` (the first minibatch of the first epoch, where the ratio must
    be 1: a mismatch means old log-probs do not match the trainer's forward pass).
    """
    n = batch.response_mask.shape[0]
    m = cfg.num_minibatches
    if n % m:
        raise ValueError(f"{n} sequences do not split into num_minibatches={m}")
    mb_size = n // m
    if mb_size % cfg.num_microbatches:
        raise ValueError(f"minibatch of {mb_size} does not split into num_microbatches={cfg.num_microbatches}")

    def step(carry, mb):
        actor, critic = carry
        total_tokens = jnp.sum(mb.response_mask, dtype=jnp.float32)
        lf = functools.partial(loss_fn, actor_model=actor_model, critic_model=critic_model, cfg=cfg,
                               total_tokens=total_tokens, total_seqs=common.nonempty_rows(mb.response_mask),
                               beta=state.kl_ctl.beta)
        params = {"actor": actor.params, "critic": None if critic is None else critic.params}

        def keys(i):  # each role's LoRA dropout key for micro-batch i (None: off)
            critic_key = None if cfg.shared else dropout_key(critic_model.config, rng, actor.step, i, role=1)
            return dict(actor_dropout_rng=dropout_key(actor_model.config, rng, actor.step, i),
                        critic_dropout_rng=critic_key)

        loss, metrics, grads = accumulate_gradients(lambda p, b, i: lf(p, b, **keys(i)), params, mb,
                                                    num_microbatches=cfg.num_microbatches)
        finite = tree_finite(grads) & jnp.isfinite(loss)
        new_actor, _ = apply_if_finite(actor, grads["actor"], tx_actor, loss, finite)
        new_critic = None
        metrics = dict(metrics, finite=finite, grad_norm=optax.tree.norm(grads["actor"]))
        if critic is not None:
            new_critic, _ = apply_if_finite(critic, grads["critic"], tx_critic, loss, finite)
            metrics["grad_norm_critic"] = optax.tree.norm(grads["critic"])
        return (new_actor, new_critic), metrics

    (actor, critic), per_step = minibatch_scan(step, (state.actor, state.critic), batch, rng,
                                               passes=cfg.num_ppo_epochs, minibatches=m)
    metrics = summarize_steps(per_step, skipped="skipped_steps", first={f"first/{key}": key for key in _FIRST})
    return state.replace(actor=actor, critic=critic), metrics


# --------------------------------------------------------------------------------------
# One iteration


def _keys(rng, state: PPOState):
    """(sampling key, update key) of the iteration `state.step`."""
    return jax.random.split(jax.random.fold_in(rng, state.step))


def rollout(state: PPOState, prompt_ids, prompt_mask, rng, *, actor_model: Transformer,
            cfg: PPOConfig) -> SampleOutput:
    """Samples `sampling.num_samples` responses per prompt: a `SampleOutput` of `N = B·G` rows."""
    return sample_responses(actor_model, state.actor.params, prompt_ids, prompt_mask, _keys(rng, state)[0],
                            cfg.sampling)


class Scored(NamedTuple):
    """What `score` hands `train`: the training batch (`update`'s `Batch`), the state's new
    running score moments and KL controller, and whether the rollout's metrics are finite."""

    batch: Batch
    reward_stats: RunningMoments
    kl_ctl: kl_controller.KLControllerState
    finite: jax.Array


def score(state: PPOState, out: SampleOutput, extras, host_scores: dict, rng, *, actor_model: Transformer,
          critic_model: Transformer | None, reward: rewards.Reward, cfg: PPOConfig) -> tuple[Scored, dict]:
    """The reward's JAX components (the reward model on `state.reward_params`) given the
    prompts' `extras` (`[B, ...]` arrays, repeated per sample) beside the host ones'
    `host_scores`, then the forward passes (old/ref log-probs, values), score shaping,
    advantages and the KL controller's next β: `(Scored, rollout metrics)`.

    A row that every weighted reward leaves unscored (a host reward's None,
    `Reward.scored`) is dropped: response mask 0 in the batch (no policy, value, KL or
    entropy term, no token in any aggregation or in the advantage whitening), out of the
    score whitening (batch or running moments), the KL controller's input and the score
    metrics; `reward/dropped` counts them. Only a reward with a host component has such rows.

    The batch's mask is `out.response_mask`, the policy's tokens: a multi-turn episode's
    (`rollout.episodes`) has holes at the environment's tokens, which get no advantage and
    no loss while the forward passes run over `out.attention_mask`; a plain rollout's is
    `attention_mask[:, P:]` itself."""
    del rng
    g = cfg.sampling.num_samples
    extras_n = scoring.repeat_extras(extras, g, out.response_ids.shape[0] // g)
    reward_params = on_actor(state.actor.params, state.reward_params)
    scores = {**reward.device_scores(rewards.RewardInput.from_sample(out), extras_n, reward_params),
              **host_scores}
    p = out.sequences.shape[1] - out.response_ids.shape[1]
    roll = score_rollout(actor_model, critic_model, reward, state, out.sequences, out.attention_mask, p, cfg,
                         scores, sampler_logp=out.logprobs, response_mask=out.response_mask)
    if cfg.correction.bypass:  # the sampler's (behaviour) log-probs are old_logp (π_prox = μ): the clip bounds π_θ/μ
        roll = roll._replace(old_logp=out.behaviour)
    scored = None if reward.is_jax else reward.scored(scores)  # only a host reward leaves rows unscored
    processed, stats = process_scores(roll.scores, roll.response_ids, roll.response_mask, state.reward_stats, cfg,
                                      scored=scored)
    mask = roll.response_mask if scored is None else roll.response_mask & scored[:, None]
    beta = state.kl_ctl.beta
    adv = compute_advantages(processed, roll.old_logp, roll.ref_logp, roll.values, mask, beta, cfg)
    metrics = rollout_metrics(roll, adv, roll.scores, processed, beta, cfg, scored=scored)
    is_weights = None
    if not cfg.correction.bypass:  # π_prox = the learner's recomputed old_logp against μ = the sampler
        is_weights, is_metrics = offpolicy.correction(cfg.correction, roll.old_logp, out.behaviour, mask)
        metrics.update(is_metrics)
    n_rows = out.sequences.shape[0]
    if scored is not None:
        metrics["reward/dropped"] = jnp.sum(~scored)
        n_rows = jnp.sum(scored)
    batch = Batch(sequences=roll.sequences, attention_mask=roll.attention_mask, response_mask=mask,
                  old_logp=roll.old_logp, old_values=roll.values, advantages=adv.advantages, returns=adv.returns,
                  ref_logp=roll.ref_logp if cfg.kl_in == "loss" else None, is_weights=is_weights)
    kl_ctl = kl_controller.update(state.kl_ctl, metrics["kl/seq"], n_rows, cfg=cfg.kl_config)
    metrics["beta_next"] = kl_ctl.beta
    finite = jnp.all(jnp.stack([jnp.isfinite(v) for v in metrics.values()]))
    return Scored(batch, stats, kl_ctl, finite), metrics


def train(state: PPOState, scored: Scored, rng, *, actor_model: Transformer, critic_model: Transformer | None,
          tx_actor, tx_critic, cfg: PPOConfig, lr_schedule: optax.Schedule | None = None) -> tuple[PPOState, dict]:
    """The state takes `scored`'s score moments and KL controller, then `update` with the
    iteration's update key, then the step count. `finite`: the update's and the rollout's
    metrics all finite; `lr` when given the `lr_schedule`."""
    lr = {} if lr_schedule is None else {"lr": jnp.asarray(lr_schedule(state.actor.step), jnp.float32)}
    state = state.replace(reward_stats=scored.reward_stats, kl_ctl=scored.kl_ctl)
    state, metrics = update(state, scored.batch, _keys(rng, state)[1], actor_model=actor_model,
                            critic_model=critic_model, tx_actor=tx_actor, tx_critic=tx_critic, cfg=cfg)
    return state.replace(step=state.step + 1), {**metrics, **lr, "finite": metrics["finite"] & scored.finite}


def split(actor_model: Transformer, critic_model: Transformer | None, reward_model: Any,
          tx_actor: optax.GradientTransformation, tx_critic: optax.GradientTransformation | None, cfg: PPOConfig, *,
          lr_schedule: optax.Schedule | None = None) -> timing.Split:
    """The iteration as `timing.Split(rollout, score, train)` (pure functions, not jitted;
    `reward_model` in any form `scoring.compiled_reward` accepts): `make_iteration` and the
    command line's sharded step (`runs.phases`) jit them."""
    reward, _ = scoring.compiled_reward(reward_model)
    models = dict(actor_model=actor_model, critic_model=critic_model, cfg=cfg)
    return timing.Split(timing.count_tokens(functools.partial(rollout, actor_model=actor_model, cfg=cfg)),
                        functools.partial(score, reward=reward, **models),
                        functools.partial(train, tx_actor=tx_actor, tx_critic=tx_critic, lr_schedule=lr_schedule,
                                          **models))


def make_iteration(
    actor_model: Transformer,
    critic_model: Transformer | None,
    reward_model: Any,
    tx_actor: optax.GradientTransformation,
    tx_critic: optax.GradientTransformation | None,
    cfg: PPOConfig,
    *,
    lr_schedule: optax.Schedule | None = None,
    time_split: bool = True,
    donate: bool = True,
) -> Callable[..., tuple[PPOState, dict]]:
    """`iteration(state, prompt_ids [B, P], prompt_mask [B, P], rng, extras=None) -> (state, metrics)`.

    reward_model: any form `scoring.compiled_reward` accepts; a reward model's params are
      read from `state.reward_params` (a `(model, params)` tuple's params are NOT baked in:
      give them to `init_state`). extras: a dict of `[B, ...]` arrays handed to the JAX
      reward components (repeated for the G samples of a prompt); host components may also
      get non-array values such as lists of B strings.
    lr_schedule: the actor's schedule, to report `lr`.
    time_split=True: rollout, scoring (reward, old/ref log-probs, values, shaping, GAE) and
      the K epochs run as three jitted programs, each waited for (`timing.run_split`), and
      the metrics report their times: `time/rollout_s`, `time/scoring_s`, `time/update_s`,
      `time/tokens_per_s`, `time/step_tokens_per_s` (the time split,
      docs/concepts.md#what-a-run-shows).
      time_split=False: with a pure-JAX reward the whole iteration is ONE jitted program and
      reports no times. The results are the same either way (float rounding aside). Called
      inside the caller's own jit (traced arguments) the iteration is the fused one, untimed.
    donate: the trained part of the state (actor, critic and their optimizer states) is
      donated to the program that updates it; the frozen reference and reward params are
      never donated nor copied.
    A reward with host (text) components always runs the three programs, the host
      components scored between the rollout and the scoring program (`time/host_reward_s`,
      inside `time/scoring_s`), as GRPO does.

    The RNG of iteration `i` is `fold_in(rng, state.step)`: pass the same base key every time.
    """
    _check_models(actor_model, critic_model, cfg)
    reward, _ = scoring.compiled_reward(reward_model)
    scoring.check_reward_vocab(actor_model.config.vocab_size, reward)
    if not cfg.shared and tx_critic is None:
        raise ValueError("critic='separate' needs tx_critic")
    parts = split(actor_model, critic_model, reward, tx_actor, tx_critic, cfg, lr_schedule=lr_schedule)
    fused = jit_keeping_frozen(parts.fused, _FROZEN, donate=donate)
    programs = (jax.jit(parts.rollout), jax.jit(parts.score), jit_keeping_frozen(parts.train, _FROZEN, donate=donate))
    g = cfg.sampling.num_samples

    def iteration(state, prompt_ids, prompt_mask, rng, extras=None):
        arrays, _ = scoring.split_extras(extras)
        if isinstance(prompt_ids, jax.core.Tracer):  # inside the caller's jit: nothing to time
            if not reward.is_jax:
                raise ValueError("a PPO iteration with a host reward cannot run inside jit: call it eagerly")
            return parts.fused(state, prompt_ids, prompt_mask, arrays, rng)
        if reward.is_jax and not time_split:
            return fused(state, prompt_ids, prompt_mask, arrays, rng)
        host = None if reward.is_jax else (
            lambda out: scoring.host_scores(reward, jax.device_get(out), extras, g, eos_id=cfg.sampling.eos_id,
                                            drop_unscored=True))
        return timing.run_split(*programs, state, prompt_ids, prompt_mask, arrays, rng, host=host)

    return iteration


__all__ = ["CRITIC_MODES", "MISSING_EOS_MODES", "REWARD_WHITENING", "Advantages", "Batch", "PPOConfig", "PPOState",
           "Rollout", "RunningMoments", "Scored", "compute_advantages", "init_state", "loss_fn", "make_iteration",
           "on_actor", "ppo_loss", "process_scores", "reference_params", "rollout", "rollout_metrics", "score",
           "score_rollout", "split", "train", "update"]
