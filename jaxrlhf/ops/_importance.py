"""Importance weights that correct for a sampler that is not the trained policy
(docs/concepts.md#importance-weights-when-the-sampler-is-not-the-policy).

The rollout engine's log-probs `behaviour_logp` (μ) differ from the trainer's recomputed
`proximal_logp` (π_prox) by numerics, or by staleness in asynchronous training; these
weights reweight each token's loss by `π_prox / μ`, truncated or masked so their variance
stays bounded. They are constants (stop-gradient): pass them to `policy_loss` /
`cispo_loss` as `is_weights`.
"""

from __future__ import annotations

import numbers

import jax
import jax.numpy as jnp
from jax import lax

from jaxrlhf.ops import _checks, _kl, _masked

IS_MODES = ("tis", "mis", "none")
IS_LEVELS = ("token", "sequence", "geometric")
_SEQUENCE_LOG_CLIP = 20.0  # |Σ_t Δ_t| is clipped before exp at the sequence level


def importance_weights(
    proximal_logp: jax.Array,
    behaviour_logp: jax.Array,
    mask: jax.Array,
    *,
    mode: str = "tis",
    cap: float = 2.0,
    low: float = 0.5,
    high: float = 5.0,
    level: str = "token",
) -> tuple[jax.Array, dict[str, jax.Array]]:
    """Per-token importance weights `w ≈ π_prox / μ` of the sampled tokens, stop-gradient
    (docs/concepts.md#importance-weights-when-the-sampler-is-not-the-policy).

    With `Δ_t = proximal_logp_t − behaviour_logp_t` and `m` the mask, the ratio `r_t` is

    - `level="token"`: `r_t = exp(Δ_t)`;
    - `level="sequence"`: `r_t = exp(clip(Σ_s m_s·Δ_s, −20, 20))`, the same for every token
      of the sequence;
    - `level="geometric"`: `r_t = exp(Σ_s m_s·Δ_s / Σ_s m_s)` (the per-token geometric mean);

    and the weight is

    - `mode="tis"` (truncated IS): `w_t = min(r_t, cap)`;
    - `mode="mis"` (masked IS, IcePop): `w_t = r_t` where `low ≤ r_t ≤ high`, else 0 (the
      token stays in the loss's denominator with weight 0);
    - `mode="none"`: `w_t = 1`.

    Padding gets 0.

    Args:
      proximal_logp: `[B, T]` log-probs of the sampled tokens under the policy the loss's
        ratio starts from (the trainer's recomputed `old_logp`).
      behaviour_logp: `[B, T]` log-probs of the same tokens under the sampler μ (e.g. the
        inference engine's).
      mask: `[B, T]` bool or float, 1 on valid response tokens.
      mode: "tis", "mis" or "none".
      cap: the truncation `cap > 0` of "tis".
      low: the lower bound `0 ≤ low < high` of "mis".
      high: the upper bound of "mis".
      level: "token", "sequence" or "geometric".

    Returns:
      `(weights, metrics)`: `weights` `[B, T]` float32 (no gradient), and float32 scalar
      metrics over the valid tokens (0 when there is none): `is_weight_mean`,
      `is_weight_max`, `is_frac_truncated` (fraction of tokens whose ratio was truncated,
      `r > cap`, or masked, `r` outside `[low, high]`; 0 for "none"), `mismatch_kl` (the k3
      estimate of KL(μ‖π_prox) on the sampled tokens, `exp(−d) − 1 + d` with
      `d = behaviour_logp − proximal_logp`, token-mean) and `max_abs_logp_diff` (max |Δ_t|).
    """
    fn = "importance_weights"
    _checks.choice(fn, "mode", mode, IS_MODES)
    _checks.choice(fn, "level", level, IS_LEVELS)
    proximal_logp = _checks.float_array(fn, "proximal_logp", proximal_logp, ("B", "T"))
    shape = proximal_logp.shape
    behaviour_logp = _checks.float_like(
        fn, "behaviour_logp", behaviour_logp, ("B", "T"), "proximal_logp", shape
    )
    mask = _checks.mask_like(fn, mask, ("B", "T"), "proximal_logp", shape)
    if mode == "tis":
        _checks.positive(fn, "cap", cap)
    if mode == "mis":
        _bounds(fn, low, high)

    # Constants: no gradient flows into either log-prob. Padding is zeroed before any
    # arithmetic, so garbage there reaches neither the sums nor the metrics.
    proximal_logp = jnp.where(mask, lax.stop_gradient(proximal_logp), 0.0)
    behaviour_logp = jnp.where(mask, lax.stop_gradient(behaviour_logp), 0.0)
    delta = proximal_logp - behaviour_logp

    if level == "token":
        log_ratio = delta
    elif level == "sequence":
        total = jnp.sum(delta, axis=1, keepdims=True)
        log_ratio = jnp.clip(total, -_SEQUENCE_LOG_CLIP, _SEQUENCE_LOG_CLIP)
    else:
        length = jnp.sum(mask, axis=1, keepdims=True, dtype=jnp.float32)
        log_ratio = _masked._safe_div(jnp.sum(delta, axis=1, keepdims=True), length)
    ratio = jnp.broadcast_to(jnp.exp(log_ratio), shape)

    if mode == "tis":
        outside = ratio > cap
        weights = jnp.minimum(ratio, cap)
    elif mode == "mis":
        outside = (ratio < low) | (ratio > high)
        weights = jnp.where(outside, 0.0, ratio)
    else:
        outside = jnp.zeros(shape, jnp.bool_)
        weights = jnp.ones(shape, jnp.float32)
    weights = jnp.where(mask, weights, 0.0)

    any_valid = jnp.any(mask)
    metrics = {
        "is_weight_mean": _masked.masked_mean(weights, mask),
        "is_weight_max": jnp.where(any_valid, jnp.max(jnp.where(mask, weights, -jnp.inf)), 0.0),
        "is_frac_truncated": _masked.masked_mean(outside, mask),
        "mismatch_kl": _masked.masked_mean(_kl.kl(behaviour_logp, proximal_logp, "k3"), mask),
        "max_abs_logp_diff": jnp.max(jnp.abs(delta)),  # 0 on padding, so no masking needed
    }
    return lax.stop_gradient(weights), lax.stop_gradient(metrics)


def _bounds(fn: str, low, high) -> None:
    """`0 ≤ low < high` when both are Python numbers (traced values pass through)."""
    if isinstance(low, numbers.Real) and not low >= 0:
        raise ValueError(f"{fn}: `low` must be >= 0, got {low}")
    _checks.positive(fn, "high", high)
    if isinstance(low, numbers.Real) and isinstance(high, numbers.Real) and not low < high:
        raise ValueError(f"{fn}: `low` must be < `high`, got low={low}, high={high}")
