"""PPO's rollout side, from the sampled sequences to the training batch (docs/concepts.md#rlhf-ppo):

    score_rollout       old logp (actor), ref logp (reference), values (critic or the
                        actor's value head), the reward's total of its components' scores
    process_scores      missing-EOS penalty → whitening → clipping of the scores
    compute_advantages  KL (k1/k2/k3) → shape_rewards(β) → GAE(γ, λ) → whiten
    rollout_metrics     what the rollout looked like (scores, KL, lengths, advantages)
    Batch               the update batch `ppo.score` builds from them and `ppo.update` trains on

Pure functions of the arrays, a `PPOConfig` and (for `score_rollout`) a `PPOState`, all
re-exported by `ppo`, whose iteration composes them. With LoRA the roles share the actor's
frozen base: `reference_params` (the base without the actor's adapters) and `on_actor`
(a critic's or reward model's adapters and head on that base) give their params, no copy.
"""

from __future__ import annotations

from typing import Any, Mapping, NamedTuple

import jax
import jax.numpy as jnp

from jaxrlhf import ops, rewards
from jaxrlhf.algorithms import scoring
from jaxrlhf.algorithms.common import response_hidden, response_logprobs
from jaxrlhf.algorithms.scoring import RunningMoments
from jaxrlhf.algorithms.ppo_config import PPOConfig, PPOState
from jaxrlhf.models import lora
from jaxrlhf.models.transformer import Transformer
from jaxrlhf.rollout.sampler import finished


class Rollout(NamedTuple):
    """A scored rollout batch, `N` rows.

    sequences, attention_mask `[N, P+T]`; response_ids, response_mask `[N, T]`;
    old_logp, ref_logp, sampler_logp `[N, T]` (τ-scaled); values `[N, T]` (V_t of the state
    that predicts y_t); scores `[N]` raw reward (before `process_scores`).
    """

    sequences: jax.Array
    attention_mask: jax.Array
    response_ids: jax.Array
    response_mask: jax.Array
    old_logp: jax.Array
    ref_logp: jax.Array
    sampler_logp: jax.Array
    values: jax.Array
    scores: jax.Array
    reward_metrics: dict


class Batch(NamedTuple):
    """PPO's update batch, `N` rows (prompt length P, left-padded; response length T):
    what `ppo.score` builds from a `Rollout` and its `Advantages`, and what `ppo.update`
    cuts into minibatches (any leading row count `n` in `ppo_loss`).

    sequences, attention_mask: `[N, P+T]` prompt ⧺ response.
    response_mask: `[N, T]`, 1 on valid response tokens.
    old_logp: `[N, T]` the rollout actor's log-probs (τ-scaled; `Rollout.old_logp`).
    old_values: `[N, T]` the critic's values at rollout time (`Rollout.values`).
    advantages: `[N, T]` float32 (`Advantages.advantages`: whitened if configured).
    returns: `[N, T]` float32, the critic's targets (`Advantages.returns`).
    ref_logp: `[N, T]` the reference's log-probs with `kl_in="loss"` (the loss's KL term);
      None with `kl_in="reward"`, where the KL is already in the advantages.
    is_weights: `[N, T]` the off-policy correction's importance weights of `old_logp`
      against the sampler's (`offpolicy.correction`), or None (`correction.mode="none"`).
    """

    sequences: jax.Array
    attention_mask: jax.Array
    response_mask: jax.Array
    old_logp: jax.Array
    old_values: jax.Array
    advantages: jax.Array
    returns: jax.Array
    ref_logp: jax.Array | None = None
    is_weights: jax.Array | None = None


def reference_params(state: PPOState) -> Any:
    """The reference policy's params: `state.ref_params`, or when there are none and the
    actor has LoRA adapters, the actor's base without them (`lora.without_adapters`: the
    same arrays, no copy)."""
    if state.ref_params is None and lora.has_adapters(state.actor.params):
        return lora.without_adapters(state.actor.params)
    return state.ref_params


def on_actor(actor_params: Any, params: Any) -> Any:
    """A role's full params (the critic's, the reward model's): `params` themselves, or when
    they are a trained part alone (`lora.is_part`: a LoRA critic's or reward model's
    adapters and score head), that part on the actor's frozen base (`lora.on_base`, no copy)."""
    return lora.on_base(actor_params, params) if params is not None and lora.is_part(params) else params


def score_rollout(
    actor_model: Transformer,
    critic_model: Transformer | None,
    reward: rewards.Reward,
    state: PPOState,
    sequences: jax.Array,
    attention_mask: jax.Array,
    prompt_len: int,
    cfg: PPOConfig,
    scores: Mapping[str, Any],
    *,
    sampler_logp: jax.Array | None = None,
    response_mask: jax.Array | None = None,
) -> Rollout:
    """Forward passes over `prompt ⧺ response` `[N, P+T]`: old logp (current actor), ref
    logp, values (critic, or the actor's value head when shared — one pass), and the
    score: `reward`'s weighted total of `scores`, `{component: [N]}` for every component
    (the JAX ones from `ppo.score`, the host ones scored on the text). All without
    gradient.

    `response_mask` `[N, T]` (None: `attention_mask[:, P:]`): the policy's tokens, the
    rollout's mask for everything after the forward passes (KL, rewards, GAE, whitening,
    losses). A multi-turn episode's has holes at the environment's tokens, which the
    forward passes still see through `attention_mask` (docs/episodes.md#ppo-on-episodes);
    a plain rollout's equals `attention_mask[:, P:]`."""
    tau = cfg.sampling.temperature
    actor_params = jax.lax.stop_gradient(state.actor.params)
    old_logp, _, values = response_logprobs(actor_model, actor_params, sequences, attention_mask, prompt_len,
                                            temperature=tau)
    ref_logp, _, _ = response_logprobs(actor_model, jax.lax.stop_gradient(reference_params(state)), sequences,
                                       attention_mask, prompt_len, temperature=tau)
    if not cfg.shared:
        critic = on_actor(actor_params, jax.lax.stop_gradient(state.critic.params))
        _, values = response_hidden(critic_model, critic, sequences, attention_mask, prompt_len)
    inputs = rewards.RewardInput.from_sequences(sequences, attention_mask, prompt_len)
    response_ids = inputs.response_ids
    response_mask = inputs.response_mask if response_mask is None else jnp.asarray(response_mask).astype(bool)
    reward_metrics = reward.metrics(scores)
    total = jnp.asarray(reward.total(scores), jnp.float32).reshape(sequences.shape[0])
    if sampler_logp is None:
        sampler_logp = old_logp
    return Rollout(sequences, attention_mask, response_ids, response_mask, old_logp, ref_logp, sampler_logp,
                   values.astype(jnp.float32), jax.lax.stop_gradient(total),
                   jax.lax.stop_gradient(dict(reward_metrics)))


def process_scores(
    scores_N: jax.Array,
    response_ids_NxT: jax.Array,
    response_mask_NxT: jax.Array,
    stats: RunningMoments,
    cfg: PPOConfig,
    *,
    scored: jax.Array | None = None,
) -> tuple[jax.Array, RunningMoments]:
    """Raw scores → the scalars that go on the last token, in this order:

    1. missing-EOS penalty (`scoring.missing_eos_penalty`, mode `missing_eos_mode`);
    2. whitening: "batch" `(s − μ_batch)/sqrt(σ²_batch + 1e-8)`, or "running" with the
       running moments updated by this batch first;
    3. clipping to `[−reward_clip, reward_clip]`.

    `scored` `[N]` bool (None: all): the rows that have a score (`Reward.scored`); the
    others' values are ignored (the batch moments and the running ones are over the scored
    rows only) and come out 0.

    Returns `(scores [N], updated running moments)`.
    """
    s = scores_N.astype(jnp.float32)
    if scored is not None:
        s = jnp.where(scored, s, 0.0)
    if cfg.missing_eos_penalty is not None:
        s = scoring.missing_eos_penalty(s, response_ids_NxT, response_mask_NxT, eos_id=cfg.sampling.eos_id,
                                        penalty=cfg.missing_eos_penalty, mode=cfg.missing_eos_mode)
    if cfg.reward_whitening == "batch":
        s = (s - jnp.mean(s, where=scored)) / jnp.sqrt(jnp.var(s, where=scored) + 1e-8)
    elif cfg.reward_whitening == "running":
        stats = stats.update(s, scored)
        s = (s - stats.mean) / jnp.sqrt(stats.var + 1e-8)
    if cfg.reward_clip is not None:
        s = jnp.clip(s, -cfg.reward_clip, cfg.reward_clip)
    if scored is not None:
        s = jnp.where(scored, s, 0.0)
    return s, stats


class Advantages(NamedTuple):
    """All `[N, T]` float32, 0 on padding. `advantages` whitened if configured; `raw_advantages`
    before whitening; `returns` the critic's targets; `rewards` the shaped per-token
    rewards; `kl` the per-token KL of `cfg.kl_estimator`."""

    advantages: jax.Array
    raw_advantages: jax.Array
    returns: jax.Array
    rewards: jax.Array
    kl: jax.Array


def compute_advantages(
    scores_N: jax.Array,
    old_logp_NxT: jax.Array,
    ref_logp_NxT: jax.Array,
    values_NxT: jax.Array,
    mask_NxT: jax.Array,
    beta: float | jax.Array,
    cfg: PPOConfig,
) -> Advantages:
    """The KL-shaped rewards and GAE (docs/concepts.md#rlhf-ppo) composed from ops, nothing else:

        kl = ops.kl(old_logp, ref_logp, estimator)
        r  = ops.shape_rewards(scores, kl, mask, β)        (−β·kl every token, + score last;
                                                            β = 0 here with kl_in="loss")
        A, R = ops.gae(r, values, mask, γ, λ)
        A  = ops.whiten(A, mask)                            (if whiten_advantages)
    """
    kl = jnp.where(mask_NxT, ops.kl(old_logp_NxT, ref_logp_NxT, estimator=cfg.kl_estimator), 0.0)
    rewards = ops.shape_rewards(scores_N, kl, mask_NxT, beta if cfg.kl_in == "reward" else 0.0)
    adv, ret = ops.gae(rewards, values_NxT, mask_NxT, gamma=cfg.gamma, lam=cfg.lam)
    white = ops.whiten(adv, mask_NxT) if cfg.whiten_advantages else adv
    white = jnp.where(mask_NxT, white, 0.0)
    return Advantages(white, adv, ret, rewards, kl)


def rollout_metrics(roll: Rollout, adv: Advantages, raw_scores, scores, beta, cfg: PPOConfig, *,
                    scored: jax.Array | None = None) -> dict:
    """Rollout-side metrics (docs/concepts.md#what-a-run-shows; all float32 scalars).
    `scored` `[N]` bool (None: all): the rows the update trains on; the scores', KL's and
    token metrics are over those, the response lengths and `eos_frac` over every row."""
    length = jnp.sum(roll.response_mask, axis=1).astype(jnp.float32)
    mask = roll.response_mask if scored is None else roll.response_mask & scored[:, None]
    k1 = ops.kl(roll.old_logp, roll.ref_logp, estimator="k1")
    k3 = ops.kl(roll.old_logp, roll.ref_logp, estimator="k3")
    out = {
        "reward/mean": jnp.mean(raw_scores, where=scored), "reward/std": jnp.std(raw_scores, where=scored),
        "reward/processed_mean": jnp.mean(scores, where=scored),
        "reward/shaped_mean": jnp.mean(jnp.sum(adv.rewards, axis=1), where=scored),
        "kl/k1": ops.masked_mean(k1, mask), "kl/k3": ops.masked_mean(k3, mask),
        "kl/seq": jnp.mean(jnp.sum(adv.kl, axis=1), where=scored),  # nats per response, the controller's input
        "beta": jnp.asarray(beta, jnp.float32),
        "response_length/mean": jnp.mean(length), "response_length/max": jnp.max(length),
        "advantage/mean": ops.masked_mean(adv.raw_advantages, mask),
        "advantage/std": jnp.sqrt(ops.masked_var(adv.raw_advantages, mask)),
        "returns/mean": ops.masked_mean(adv.returns, mask),
        "value/mean": ops.masked_mean(roll.values, mask),
        "sampler_logp_diff_max": jnp.max(jnp.where(mask, jnp.abs(roll.sampler_logp - roll.old_logp), 0.0)),
        "num_tokens": jnp.sum(mask, dtype=jnp.float32),
        **roll.reward_metrics,
    }
    if cfg.sampling.eos_id is not None:
        has_eos = finished(roll.response_ids, roll.response_mask, cfg.sampling.eos_id)
        out["eos_frac"] = jnp.mean(has_eos.astype(jnp.float32))
    return out


__all__ = ["Advantages", "Batch", "Rollout", "compute_advantages", "process_scores", "rollout_metrics", "score_rollout"]
