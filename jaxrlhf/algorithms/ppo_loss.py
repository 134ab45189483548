"""RLHF-PPO's loss (`ppo_loss`) and its accumulation weighting (`loss_fn`); `algorithms.ppo`
runs them and re-exports both."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxrlhf import ops
from jaxrlhf.algorithms import kl_terms
from jaxrlhf.algorithms.common import accumulation_scale, response_hidden, response_logprobs
from jaxrlhf.algorithms.ppo_rollout import Batch, on_actor
from jaxrlhf.algorithms.ppo_config import PPOConfig
from jaxrlhf.models.transformer import Transformer


def ppo_loss(
    params: dict,
    batch: Batch,
    *,
    actor_model: Transformer,
    critic_model: Transformer | None,
    cfg: PPOConfig,
    beta: float | jax.Array = 0.0,
    actor_dropout_rng: jax.Array | None = None,
    critic_dropout_rng: jax.Array | None = None,
) -> tuple[jax.Array, dict]:
    """The PPO objective on one (mini/micro)batch, not yet weighted for accumulation:

        loss = policy_loss(logp, old_logp, A) + vf_coef·value_loss(V, V_old, R) − entropy_coef·agg(H)
               [+ β·agg(kl(logp, ref_logp))   with cfg.kl_in == "loss", `kl_terms.loss_term`]

    the policy loss's tokens weighted by `batch.is_weights` when the batch has them (the
    off-policy correction, `offpolicy.correction`).

    params: `{"actor": ..., "critic": ... or None}` (None when the trunk is shared).
    batch: a `Batch` of `n` rows: sequences, attention_mask `[n, P+T]`; response_mask,
      old_logp, old_values, advantages, returns `[n, T]`; ref_logp `[n, T]` with
      `kl_in="loss"` (None otherwise).
    beta: this iteration's β (the KL controller's), used only with `kl_in="loss"`.
    actor/critic_dropout_rng: that role's LoRA adapter dropout (`common.dropout_key`) or None.
    """
    if cfg.kl_in == "loss" and batch.ref_logp is None:
        raise ValueError("kl_in='loss' needs batch.ref_logp (None: the batch was built for kl_in='reward')")
    seq, attn, mask = batch.sequences, batch.attention_mask, batch.response_mask
    prompt_len = seq.shape[1] - mask.shape[1]
    logp, ent, values = response_logprobs(actor_model, params["actor"], seq, attn, prompt_len,
                                          temperature=cfg.sampling.temperature, with_entropy=True,
                                          dropout_rng=actor_dropout_rng)
    if not cfg.shared:
        _, values = response_hidden(critic_model, on_actor(params["actor"], params["critic"]), seq, attn, prompt_len,
                                    dropout_rng=critic_dropout_rng)
    pg, pm = ops.policy_loss(logp, batch.old_logp, batch.advantages, mask, clip_low=cfg.clip_low,
                             clip_high=cfg.clip_high, dual_clip=cfg.dual_clip, agg=cfg.agg, norm_len=cfg.norm_len,
                             is_weights=batch.is_weights)
    vl, vm = ops.value_loss(values.astype(jnp.float32), batch.old_values, batch.returns, mask,
                            clip=cfg.vf_clip, agg=cfg.agg, norm_len=cfg.norm_len)
    entropy = ops.aggregate(ent, mask, mode=cfg.agg, norm_len=cfg.norm_len)
    loss = pg + cfg.vf_coef * vl
    if cfg.entropy_coef:
        loss = loss - cfg.entropy_coef * entropy
    metrics = {"loss": loss, "policy_loss": pg, "value_loss": vl, "entropy": entropy, "clipfrac": pm["clipfrac"],
               "approx_kl": pm["approx_kl"], "ratio_mean": pm["ratio_mean"], "ratio_min": pm["ratio_min"],
               "ratio_max": pm["ratio_max"], "value/clipfrac": vm["clipfrac"], "value/pred_mean": vm["value_mean"]}
    if cfg.kl_in == "loss":
        kl_loss = kl_terms.loss_term(ops.kl(logp, batch.ref_logp, estimator=cfg.kl_estimator), mask, beta,
                                     agg=cfg.agg, norm_len=cfg.norm_len)
        loss = loss + kl_loss
        metrics.update(loss=loss, kl_loss=kl_loss)
    return loss, jax.lax.stop_gradient(metrics)


_LOSS_METRICS = ("loss", "policy_loss", "value_loss", "entropy", "kl_loss")
_TOKEN_METRICS = ("clipfrac", "approx_kl", "ratio_mean", "value/clipfrac", "value/pred_mean")


def loss_fn(params, batch: Batch, *, actor_model, critic_model, cfg, total_tokens, total_seqs, beta=0.0,
            **dropout_rngs):
    """`ppo_loss` weighted as this micro-batch's share of its minibatch (`accumulation_scale`).

    The metrics are weighted too, so that `accumulate_gradients`' plain mean over
    micro-batches gives the minibatch's values: losses by the same share as the loss,
    token means by the micro-batch's share of tokens. (`ratio_min/max` are extremes,
    which `accumulate_gradients` combines as such.)
    """
    loss, metrics = ppo_loss(params, batch, actor_model=actor_model, critic_model=critic_model, cfg=cfg, beta=beta,
                             **dropout_rngs)
    mask = batch.response_mask
    scale = accumulation_scale(mask, mode=cfg.agg, total_tokens=total_tokens, total_seqs=total_seqs)
    # With one micro-batch both shares are exactly 1, unless dropped rows (no sequence of a
    # `seq-mean-*` mode) make the loss's share the scored rows' fraction: weighted all the same.
    n = cfg.num_microbatches
    token_share = jnp.sum(mask, dtype=jnp.float32) / jnp.maximum(total_tokens, 1.0)
    metrics = {k: v * (scale * n if k in _LOSS_METRICS else token_share * n if k in _TOKEN_METRICS else 1.0)
               for k, v in metrics.items()}
    return loss * scale, metrics


__all__ = ["loss_fn", "ppo_loss"]
