"""KL estimators and KL-in-the-reward shaping
(docs/concepts.md#kl-to-the-reference-in-the-reward-or-in-the-loss).

Estimators follow J. Schulman, "Approximating KL Divergence" (2020): with samples from π
and `d = log π − log ref`, `k1 = d`, `k2 = d²/2`, `k3 = exp(−d) − 1 + d`.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxrlhf.ops import _checks, _masked

KL_ESTIMATORS = ("k1", "k2", "k3")


def kl(logp: jax.Array, ref_logp: jax.Array, estimator: str = "k3") -> jax.Array:
    """Per-token estimate of KL(π‖ref) from tokens sampled from π.

    With `d = logp − ref_logp` (policy minus reference: the other sign rewards drifting):

    - `k1 = d`: unbiased, can be negative, high variance;
    - `k2 = d²/2`: biased, low variance;
    - `k3 = exp(−d) − 1 + d`: unbiased and non-negative (the GRPO loss term,
      arXiv:2402.03300), computed as `expm1(−d) + d` so it stays ≥ 0 in float32.

    Args:
      logp: `[B, T]` response-aligned log-probs of the sampled tokens under π.
      ref_logp: `[B, T]` log-probs of the same tokens under the reference policy.
      estimator: "k1", "k2" or "k3".

    Returns:
      `[B, T]` float32; padding positions are not masked (aggregate with the mask).
    """
    fn = "kl"
    _checks.choice(fn, "estimator", estimator, KL_ESTIMATORS)
    logp = _checks.float_array(fn, "logp", logp, ("B", "T"))
    ref_logp = _checks.float_like(fn, "ref_logp", ref_logp, ("B", "T"), "logp", logp.shape)
    d = logp - ref_logp
    if estimator == "k1":
        return d
    if estimator == "k2":
        return 0.5 * jnp.square(d)
    return jnp.expm1(-d) + d


def approx_kl(logp: jax.Array, old_logp: jax.Array, mask: jax.Array) -> jax.Array:
    """Masked mean of the k3 estimate of KL(old‖new), the PPO "approx_kl" diagnostic.

    Tokens were sampled from the old (rollout) policy, so with `ρ = exp(logp − old_logp)`
    the k3 estimator is `ρ − 1 − log ρ ≥ 0` (`kl(old_logp, logp, estimator="k3")`).

    Args:
      logp: `[B, T]` log-probs under the current policy.
      old_logp: `[B, T]` log-probs under the rollout policy.
      mask: `[B, T]` bool or float, 1 on valid response tokens.

    Returns:
      A float32 scalar (0 when there is no valid token).
    """
    fn = "approx_kl"
    logp = _checks.float_array(fn, "logp", logp, ("B", "T"))
    old_logp = _checks.float_like(fn, "old_logp", old_logp, ("B", "T"), "logp", logp.shape)
    mask = _checks.mask_like(fn, mask, ("B", "T"), "logp", logp.shape)
    # Zero the padding first so garbage there cannot turn the gradient into NaN.
    logp = jnp.where(mask, logp, 0.0)
    old_logp = jnp.where(mask, old_logp, 0.0)
    return _masked.masked_mean(kl(old_logp, logp, estimator="k3"), mask)


def shape_rewards(
    scores: jax.Array, kl: jax.Array, mask: jax.Array, beta: float | jax.Array
) -> jax.Array:
    """Per-token RLHF-PPO reward: KL penalty on every token, score on the last one.

        r[b, t] = −β · kl[b, t] · m[b, t] + [t = last_b] · scores[b]
        last_b = max{t : m[b, t] = 1}        (len_b − 1 for a contiguous prefix)

    (Ziegler et al. 2019, arXiv:1909.08593; Ouyang et al. 2022). The last token is the last
    one the mask marks, so a mask with holes (an episode's environment tokens between the
    policy's) puts the score on the policy's last token. A sequence with no valid token gets
    an all-zero row: its score is dropped, since there is no token to carry it.

    Args:
      scores: `[B]` reward-model (or rule) scores.
      kl: `[B, T]` response-aligned per-token KL estimate (e.g. `ops.kl(..., "k1")`).
      mask: `[B, T]` bool or float, 1 on the policy's tokens (a contiguous prefix, or
        with holes).
      beta: KL coefficient β (a float, or a traced scalar for an adaptive controller).

    Returns:
      `[B, T]` float32 rewards, 0 on padding.
    """
    fn = "shape_rewards"
    kl = _checks.float_array(fn, "kl", kl, ("B", "T"))
    scores = _checks.float_like(fn, "scores", scores, ("B",), "kl[:, 0]", kl.shape[:1])
    mask = _checks.mask_like(fn, mask, ("B", "T"), "kl", kl.shape)
    position = jnp.arange(kl.shape[1])
    last = jnp.max(jnp.where(mask, position, -1), axis=1)  # −1 for an empty row
    is_last = position[None, :] == last[:, None]  # never for an empty row
    penalty = -jnp.asarray(beta, jnp.float32) * jnp.where(mask, kl, 0.0)
    return jnp.where(mask, penalty, 0.0) + jnp.where(is_last, scores[:, None], 0.0)
