"""Where the KL to the reference enters the objective: in the reward or in the loss.

Both RL families take `kl_in` ("reward" | "loss"), any estimator of `ops.KL_ESTIMATORS`
and a fixed or adaptive β (`kl_controller`). With `kl_NxT` the per-token estimate
`ops.kl(logp, ref_logp, estimator)` and `m` the response mask:

- in the loss (GRPO's default, arXiv:2402.03300; PPO's `kl_in="loss"`): `loss_term`,
  `β·agg(kl)` added to the policy loss, with the gradient flowing through `logp`;
- in the reward, per token (PPO's default, Ziegler et al. 2019): `−β·kl_t` on every
  token's reward (`ops.shape_rewards`, then GAE);
- in the reward of a sequence-level advantage (GRPO's `kl_in="reward"`):
  `sequence_reward`, each response's score less `β·Σ_t kl_t` before the group baseline.
  This is verl's `algorithm.use_kl_in_reward` (`apply_kl_penalty` makes token rewards
  `score_t − β·kl_t`, then `compute_grpo_outcome_advantage` sums them per response before
  normalising within the group). OpenRLHF's GRPO instead normalises the scores first and
  subtracts the KL's reward-to-go per token (its docs recommend the KL in the loss for GRPO).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxrlhf import ops

KL_PLACEMENTS = ("loss", "reward")


def sequence_kl(kl_NxT: jax.Array, mask_NxT: jax.Array) -> jax.Array:
    """`[N]` KL of each response in nats, `Σ_t m_t·kl_t`: the adaptive controller's unit
    (its mean over responses) and what a sequence-level reward pays."""
    return jnp.sum(jnp.where(mask_NxT.astype(bool), kl_NxT, 0.0), axis=1)


def sequence_reward(scores_N: jax.Array, kl_NxT: jax.Array, mask_NxT: jax.Array,
                    beta: float | jax.Array) -> jax.Array:
    """KL in the reward of a sequence-level advantage (GRPO family), `[N]`:

        s'_i = s_i − β·Σ_t m_it·kl_it

    so that the group baseline and normalisation see the penalised scores (verl's
    `use_kl_in_reward` for GRPO). The KL carries no gradient here: it is a reward."""
    kl_N = jax.lax.stop_gradient(sequence_kl(kl_NxT, mask_NxT))
    return jnp.asarray(scores_N, jnp.float32) - beta * kl_N


def loss_term(kl_NxT: jax.Array, mask_NxT: jax.Array, beta: float | jax.Array, *, agg: str,
              norm_len: int | None = None) -> jax.Array:
    """KL in the loss, a scalar: `β·agg(kl)` with `ops.aggregate`'s mode `agg` over the
    valid tokens, to be added to the policy loss (GRPO's term; PPO's with `kl_in="loss"`).
    Its gradient flows through the policy log-probs inside `kl_NxT`."""
    return beta * ops.aggregate(kl_NxT, mask_NxT, mode=agg, norm_len=norm_len)


__all__ = ["KL_PLACEMENTS", "loss_term", "sequence_kl", "sequence_reward"]
