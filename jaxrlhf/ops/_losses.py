"""Policy, value, preference and reward-model losses (docs/concepts.md#the-clipped-losses,
docs/concepts.md#cispo, docs/concepts.md#preference-losses).

Each loss returns `(loss, metrics)`: a float32 scalar to differentiate and a dict of float32
scalar diagnostics. The dict's keys depend only on static arguments.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxrlhf.ops import _checks, _kl, _masked

DPO_LOSS_TYPES = ("sigmoid", "ipo", "hinge")


def _ratio_inputs(fn, logp, old_logp, advantages, mask, agg, is_weights):
    """The checked `[B, T]` inputs of a ratio loss (`fn` names it in errors), padding zeroed
    before the exp (garbage there must not reach the ratio or its gradient), and the ratio
    `exp(logp − old_logp)`: `(logp, old_logp, advantages, mask, is_weights, ratio)`."""
    logp = _checks.float_array(fn, "logp", logp, ("B", "T"))
    shape = logp.shape
    old_logp = _checks.float_like(fn, "old_logp", old_logp, ("B", "T"), "logp", shape)
    advantages = _checks.float_like(fn, "advantages", advantages, ("B", "T"), "logp", shape)
    mask = _checks.mask_like(fn, mask, ("B", "T"), "logp", shape)
    _checks.choice(fn, "agg", agg, _masked.AGGREGATE_MODES)
    if is_weights is not None:
        is_weights = _weights(fn, is_weights, mask)
    logp = jnp.where(mask, logp, 0.0)
    old_logp = jnp.where(mask, old_logp, 0.0)
    advantages = jnp.where(mask, advantages, 0.0)
    return logp, old_logp, advantages, mask, is_weights, jnp.exp(logp - old_logp)


def policy_loss(
    logp: jax.Array,
    old_logp: jax.Array,
    advantages: jax.Array,
    mask: jax.Array,
    clip_low: float = 0.2,
    clip_high: float | None = None,
    dual_clip: float | None = None,
    agg: str = "token-mean",
    norm_len: int | float | jax.Array | None = None,
    *,
    is_weights: jax.Array | None = None,
) -> tuple[jax.Array, dict[str, jax.Array]]:
    """PPO clipped surrogate (Schulman et al. 2017, arXiv:1707.06347), per token:

        ρ_t = exp(logp_t − old_logp_t)
        l_t = max(−A_t·ρ_t, −A_t·clip(ρ_t, 1 − ε_low, 1 + ε_high))
        l_t = min(l_t, −c·A_t)   where A_t < 0   (dual clip, Ye et al. 2020, arXiv:1912.09729)

    then `aggregate(l, mask, mode=agg, norm_len=norm_len)`. `ε_high > ε_low` is DAPO's
    clip-higher (arXiv:2503.14476). Where a clip is active the loss is constant in `logp`,
    so those tokens get exactly zero gradient. With `is_weights` `w` (e.g.
    `importance_weights`; constants, no gradient flows into them) each token's `l_t`
    becomes `w_t·l_t` before the aggregation
    (docs/concepts.md#importance-weights-when-the-sampler-is-not-the-policy).

    Args:
      logp: `[B, T]` response-aligned log-probs under the policy being trained.
      old_logp: `[B, T]` log-probs under the rollout policy (constants).
      advantages: `[B, T]` per-token advantages (broadcast sequence advantages yourself).
      mask: `[B, T]` bool or float, 1 on valid response tokens.
      clip_low: ε_low.
      clip_high: ε_high; None means ε_high = ε_low.
      dual_clip: c > 1, or None for no dual clip.
      agg: aggregation mode, see `aggregate`.
      norm_len: the constant of `agg="seq-mean-token-sum-norm"`.
      is_weights: `[B, T]` per-token weights, or None (no weighting: the same numbers, bit
        for bit, as without the argument).

    Returns:
      `(loss, metrics)` with metrics, all masked over valid tokens:
      `clipfrac` (fraction of tokens where the clipped term is strictly the larger),
      `approx_kl` (k3 estimate of KL(old‖new): mean of `ρ − 1 − log ρ`),
      `ratio_mean`, `ratio_min`, `ratio_max`, and with `dual_clip` also
      `dual_clipfrac` (fraction where the dual clip bound is strictly active).
    """
    fn = "policy_loss"
    if clip_high is None:
        clip_high = clip_low
    if dual_clip is not None:
        _checks.positive(fn, "dual_clip", dual_clip, above=1.0)
    logp, old_logp, advantages, mask, is_weights, ratio = _ratio_inputs(fn, logp, old_logp, advantages, mask, agg,
                                                                        is_weights)
    unclipped = -advantages * ratio
    clipped = -advantages * jnp.clip(ratio, 1.0 - clip_low, 1.0 + clip_high)
    per_token = jnp.maximum(unclipped, clipped)
    metrics = {"clipfrac": _masked.masked_mean(clipped > unclipped, mask)}
    if dual_clip is not None:
        bound = -dual_clip * advantages
        dual_active = (advantages < 0) & (bound < per_token)
        per_token = jnp.where(dual_active, bound, per_token)
        metrics["dual_clipfrac"] = _masked.masked_mean(dual_active, mask)
    if is_weights is not None:
        per_token = per_token * is_weights

    loss = _masked.aggregate(per_token, mask, mode=agg, norm_len=norm_len)
    metrics.update(_ratio_metrics(logp, old_logp, ratio, mask))
    return loss, jax.lax.stop_gradient(metrics)


def _weights(fn: str, is_weights, mask: jax.Array) -> jax.Array:
    """`is_weights` `[B, T]` as float32 constants, 0 on padding."""
    w = _checks.float_like(fn, "is_weights", is_weights, ("B", "T"), "logp", mask.shape)
    return jnp.where(mask, jax.lax.stop_gradient(w), 0.0)


def _ratio_metrics(logp, old_logp, ratio, mask) -> dict[str, jax.Array]:
    """approx_kl and the ratio's mean, min and max over the valid tokens (0 when none)."""
    any_valid = jnp.any(mask)
    ratio = jax.lax.stop_gradient(ratio)
    return dict(
        approx_kl=_kl.approx_kl(logp, old_logp, mask),
        ratio_mean=_masked.masked_mean(ratio, mask),
        ratio_min=jnp.where(any_valid, jnp.min(jnp.where(mask, ratio, jnp.inf)), 0.0),
        ratio_max=jnp.where(any_valid, jnp.max(jnp.where(mask, ratio, -jnp.inf)), 0.0),
    )


def cispo_loss(
    logp: jax.Array,
    old_logp: jax.Array,
    advantages: jax.Array,
    mask: jax.Array,
    *,
    clip_low: float = 1.0,
    clip_high: float = 4.0,
    is_weights: jax.Array | None = None,
    agg: str = "token-mean",
    norm_len: int | float | jax.Array | None = None,
) -> tuple[jax.Array, dict[str, jax.Array]]:
    """CISPO (MiniMax-M1, arXiv:2506.13585): REINFORCE with a clipped, stop-gradient
    importance weight, so that no token's gradient is dropped (docs/concepts.md#cispo), per
    token:

        ρ_t = exp(logp_t − old_logp_t)
        l_t = −w_t · sg(clip(ρ_t, 1 − ε_low, 1 + ε_high)) · A_t · logp_t

    then `aggregate(l, mask, mode=agg, norm_len=norm_len)`; `w` is `is_weights` (1 when
    None). The gradient is `−w_t·sg(clip(ρ_t))·A_t·∇logp_t` on every valid token, clipped or
    not; `ε_low = 1` (the default) means no lower bound (ρ ≥ 0).

    Args:
      logp: `[B, T]` response-aligned log-probs under the policy being trained.
      old_logp: `[B, T]` log-probs under the rollout policy (constants).
      advantages: `[B, T]` per-token advantages.
      mask: `[B, T]` bool or float, 1 on valid response tokens.
      clip_low: ε_low > 0 (1 or more: no lower bound).
      clip_high: ε_high > 0.
      is_weights: `[B, T]` per-token weights (e.g. `importance_weights`; constants), or None.
      agg: aggregation mode, see `aggregate`.
      norm_len: the constant of `agg="seq-mean-token-sum-norm"`.

    Returns:
      `(loss, metrics)` with metrics masked over valid tokens: `clipfrac` (fraction of
      tokens whose ratio lies outside `[1 − ε_low, 1 + ε_high]`), `approx_kl`,
      `ratio_mean`, `ratio_min`, `ratio_max` (as in `policy_loss`).
    """
    fn = "cispo_loss"
    _checks.positive(fn, "clip_low", clip_low)
    _checks.positive(fn, "clip_high", clip_high)
    logp, old_logp, advantages, mask, is_weights, ratio = _ratio_inputs(fn, logp, old_logp, advantages, mask, agg,
                                                                        is_weights)
    lower, upper = 1.0 - clip_low, 1.0 + clip_high
    coef = jax.lax.stop_gradient(jnp.clip(ratio, lower, upper)) * advantages
    if is_weights is not None:
        coef = coef * is_weights
    per_token = -coef * logp
    loss = _masked.aggregate(per_token, mask, mode=agg, norm_len=norm_len)
    metrics = {"clipfrac": _masked.masked_mean((ratio < lower) | (ratio > upper), mask)}
    metrics.update(_ratio_metrics(logp, old_logp, ratio, mask))
    return loss, jax.lax.stop_gradient(metrics)


def value_loss(
    values: jax.Array,
    old_values: jax.Array,
    returns: jax.Array,
    mask: jax.Array,
    clip: float | None = 0.2,
    agg: str = "token-mean",
    norm_len: int | float | jax.Array | None = None,
) -> tuple[jax.Array, dict[str, jax.Array]]:
    """Clipped value loss (as in OpenAI baselines' PPO2 and RLHF-PPO), per token:

        V_clip = V_old + clip(V − V_old, −ε_v, ε_v)
        l_t = ½·max((V − R)², (V_clip − R)²)        (½·(V − R)² when clip is None)

    then `aggregate(l, mask, mode=agg, norm_len=norm_len)`.

    Args:
      values: `[B, T]` response-aligned values from the critic being trained.
      old_values: `[B, T]` values at rollout time.
      returns: `[B, T]` targets `R` (e.g. `gae(...).returns`).
      mask: `[B, T]` bool or float, 1 on valid response tokens.
      clip: ε_v, or None to turn clipping off.
      agg: aggregation mode, see `aggregate`.
      norm_len: the constant of `agg="seq-mean-token-sum-norm"`.

    Returns:
      `(loss, metrics)`; metrics `clipfrac` (fraction of valid tokens where the clipped
      error is strictly the larger; 0 without clipping) and `value_mean`.
    """
    fn = "value_loss"
    values = _checks.float_array(fn, "values", values, ("B", "T"))
    shape = values.shape
    old_values = _checks.float_like(fn, "old_values", old_values, ("B", "T"), "values", shape)
    returns = _checks.float_like(fn, "returns", returns, ("B", "T"), "values", shape)
    mask = _checks.mask_like(fn, mask, ("B", "T"), "values", shape)
    _checks.choice(fn, "agg", agg, _masked.AGGREGATE_MODES)
    if clip is not None:
        _checks.positive(fn, "clip", clip)

    values = jnp.where(mask, values, 0.0)
    old_values = jnp.where(mask, old_values, 0.0)
    returns = jnp.where(mask, returns, 0.0)

    error = jnp.square(values - returns)
    if clip is None:
        per_token = 0.5 * error
        clipfrac = jnp.zeros((), jnp.float32)
    else:
        # V_old + clip(V − V_old) as a select: where the clip is inactive it is V itself,
        # bit for bit, so rounding in (V − V_old) + V_old can never count as clipping.
        step = values - old_values
        clipped_values = jnp.where(jnp.abs(step) > clip, old_values + jnp.clip(step, -clip, clip), values)
        clipped_error = jnp.square(clipped_values - returns)
        per_token = 0.5 * jnp.maximum(error, clipped_error)
        clipfrac = _masked.masked_mean(clipped_error > error, mask)
    loss = _masked.aggregate(per_token, mask, mode=agg, norm_len=norm_len)
    metrics = {"clipfrac": clipfrac, "value_mean": _masked.masked_mean(values, mask)}
    return loss, jax.lax.stop_gradient(metrics)


def dpo_loss(
    chosen_logp: jax.Array,
    rejected_logp: jax.Array,
    ref_chosen_logp: jax.Array,
    ref_rejected_logp: jax.Array,
    beta: float | jax.Array = 0.1,
    loss_type: str = "sigmoid",
    label_smoothing: float = 0.0,
) -> tuple[jax.Array, dict[str, jax.Array]]:
    """Direct Preference Optimization loss on sequence log-probs, mean over pairs.

        z = β·((π_c − ref_c) − (π_r − ref_r))
        sigmoid (Rafailov et al. 2023, arXiv:2305.18290; label smoothing ls as in cDPO):
            −(1 − ls)·log σ(z) − ls·log σ(−z)
        ipo (Azar et al. 2023, arXiv:2310.12036):  (z/β − 1/(2β))²
        hinge (SLiC, Zhao et al. 2023, arXiv:2305.10425):  max(0, 1 − z)

    Args:
      chosen_logp: `[B]` sequence log-probs of the chosen responses under the policy
        (`sequence_logprobs`: the sum over response tokens).
      rejected_logp: `[B]` the same for the rejected responses.
      ref_chosen_logp: `[B]` chosen, under the frozen reference.
      ref_rejected_logp: `[B]` rejected, under the frozen reference.
      beta: β > 0.
      loss_type: "sigmoid", "ipo" or "hinge".
      label_smoothing: ls in [0, 0.5), the assumed label-flip rate; "sigmoid" only.

    Returns:
      `(loss, metrics)`; metrics (means over pairs): `chosen_reward` = β(π_c − ref_c),
      `rejected_reward` = β(π_r − ref_r), `margin` = their difference (z) and
      `reward_accuracy` = fraction of pairs with z > 0.
    """
    fn = "dpo_loss"
    _checks.choice(fn, "loss_type", loss_type, DPO_LOSS_TYPES)
    _checks.positive(fn, "beta", beta)
    if loss_type != "sigmoid" and isinstance(label_smoothing, (int, float)) and label_smoothing:
        raise ValueError(f"{fn}: `label_smoothing` applies to loss_type 'sigmoid' only")
    chosen_logp = _checks.float_array(fn, "chosen_logp", chosen_logp, ("B",))
    shape = chosen_logp.shape
    rejected_logp = _checks.float_like(
        fn, "rejected_logp", rejected_logp, ("B",), "chosen_logp", shape
    )
    ref_chosen_logp = _checks.float_like(
        fn, "ref_chosen_logp", ref_chosen_logp, ("B",), "chosen_logp", shape
    )
    ref_rejected_logp = _checks.float_like(
        fn, "ref_rejected_logp", ref_rejected_logp, ("B",), "chosen_logp", shape
    )

    beta = jnp.asarray(beta, jnp.float32)
    chosen_reward = beta * (chosen_logp - ref_chosen_logp)
    rejected_reward = beta * (rejected_logp - ref_rejected_logp)
    z = chosen_reward - rejected_reward
    if loss_type == "sigmoid":
        ls = label_smoothing
        per_pair = -(1.0 - ls) * jax.nn.log_sigmoid(z) - ls * jax.nn.log_sigmoid(-z)
    elif loss_type == "ipo":
        per_pair = jnp.square(z / beta - 1.0 / (2.0 * beta))
    else:
        per_pair = jax.nn.relu(1.0 - z)
    metrics = {
        "chosen_reward": jnp.mean(chosen_reward),
        "rejected_reward": jnp.mean(rejected_reward),
        "margin": jnp.mean(z),
        "reward_accuracy": jnp.mean(z > 0),
    }
    return jnp.mean(per_pair), jax.lax.stop_gradient(metrics)


def reward_model_loss(
    chosen_scores: jax.Array, rejected_scores: jax.Array, margin: jax.Array | None = None
) -> tuple[jax.Array, dict[str, jax.Array]]:
    """Bradley–Terry pairwise loss, mean over pairs (Ouyang et al. 2022, arXiv:2203.02155;
    the optional margin as in Llama 2, arXiv:2307.09288):

        l = −log σ(s_c − s_r − margin)       (computed with log_sigmoid: no overflow)

    Args:
      chosen_scores: `[B]` scalar scores of the preferred responses (read at the last
        valid token of prompt + response).
      rejected_scores: `[B]` scores of the other responses.
      margin: None, a scalar, or `[B]` per-pair margins.

    Returns:
      `(loss, metrics)`; metrics `accuracy` (fraction with s_c > s_r) and `score_gap`
      (mean of s_c − s_r).
    """
    fn = "reward_model_loss"
    chosen_scores = _checks.float_array(fn, "chosen_scores", chosen_scores, ("B",))
    shape = chosen_scores.shape
    rejected_scores = _checks.float_like(
        fn, "rejected_scores", rejected_scores, ("B",), "chosen_scores", shape
    )
    gap = chosen_scores - rejected_scores
    logits = gap
    if margin is not None:
        margin = jnp.asarray(margin, jnp.float32)
        if margin.ndim != 0:
            margin = _checks.float_like(fn, "margin", margin, ("B",), "chosen_scores", shape)
        logits = gap - margin
    metrics = {"accuracy": jnp.mean(gap > 0), "score_gap": jnp.mean(gap)}
    return -jnp.mean(jax.nn.log_sigmoid(logits)), jax.lax.stop_gradient(metrics)
