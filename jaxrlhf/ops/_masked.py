"""Masked reductions and the loss aggregation modes.

Padding may hold anything (garbage, inf, NaN): values are selected with `where`, never
multiplied by the mask, so neither the result nor its gradient can see them.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxrlhf.ops import _checks

AGGREGATE_MODES = (
    "token-mean",
    "seq-mean-token-mean",
    "seq-mean-token-sum",
    "seq-mean-token-sum-norm",
)


def _same_shape(fn: str, x, mask) -> tuple[jax.Array, jax.Array]:
    x = jnp.asarray(x)
    mask = jnp.asarray(mask)
    if x.shape != mask.shape:
        raise ValueError(f"{fn}: `mask` must have the shape of `x` = {x.shape}, got {mask.shape}")
    mask = mask.astype(jnp.bool_)
    # Zeroed before any arithmetic, so the gradient of e.g. (x − μ)² never sees inf·0.
    return jnp.where(mask, jnp.asarray(x, jnp.float32), 0.0), mask


def _safe_div(num: jax.Array, den: jax.Array) -> jax.Array:
    """`num / den`, and 0 where `den == 0` (no valid tokens), with a NaN-free gradient."""
    ok = den > 0
    return jnp.where(ok, num / jnp.where(ok, den, 1.0), 0.0)


def masked_sum(x: jax.Array, mask: jax.Array, axis=None) -> jax.Array:
    """`Σ m·x` over `axis` (all axes by default); `mask` has the shape of `x`."""
    x, mask = _same_shape("masked_sum", x, mask)
    return jnp.sum(x, axis=axis)


def masked_mean(x: jax.Array, mask: jax.Array, axis=None) -> jax.Array:
    """`Σ m·x / Σ m` over `axis`; 0 where there is no valid entry (not NaN)."""
    x, mask = _same_shape("masked_mean", x, mask)
    return _safe_div(jnp.sum(x, axis=axis), jnp.sum(mask, axis=axis))


def masked_var(x: jax.Array, mask: jax.Array, axis=None) -> jax.Array:
    """Population variance (ddof = 0) of the valid entries over `axis`; 0 if none."""
    x, mask = _same_shape("masked_var", x, mask)
    count = jnp.sum(mask, axis=axis, keepdims=True)
    mean = _safe_div(jnp.sum(x, axis=axis, keepdims=True), count)
    sq = jnp.where(mask, jnp.square(x - mean), 0.0)
    return _safe_div(jnp.sum(sq, axis=axis), jnp.sum(mask, axis=axis))


def aggregate(
    x: jax.Array,
    mask: jax.Array,
    mode: str = "token-mean",
    norm_len: int | float | jax.Array | None = None,
) -> jax.Array:
    """Reduces a per-token loss to a scalar (docs/concepts.md#aggregation-what-long-answers-weigh).

    With `m` the mask:

    - `token-mean`: `Σ_{b,t} m·x / Σ_{b,t} m` — every token weighs the same, so long
      responses weigh more (DAPO, arXiv:2503.14476).
    - `seq-mean-token-mean`: `(1/B) Σ_b (Σ_t m·x / Σ_t m)` — every sequence weighs the
      same (original PPO-for-LLM and GRPO, arXiv:2402.03300).
    - `seq-mean-token-sum`: `(1/B) Σ_b Σ_t m·x`.
    - `seq-mean-token-sum-norm`: `Σ_{b,t} m·x / (B·norm_len)` with a constant `norm_len`
      (e.g. the maximum response length; Dr. GRPO, arXiv:2503.20783).

    Empty sequences (no valid token) contribute 0 and still count in `B`; a batch with no
    valid token gives 0 in `token-mean`. No mode returns NaN for them.

    Args:
      x: `[B, T]` response-aligned per-token values (any float dtype; float32 math).
      mask: `[B, T]` bool or float, 1 on valid response tokens.
      mode: one of the four modes above.
      norm_len: the constant `L` of `seq-mean-token-sum-norm` (required there, unused
        otherwise).

    Returns:
      A float32 scalar.
    """
    fn = "aggregate"
    _checks.choice(fn, "mode", mode, AGGREGATE_MODES)
    x = _checks.float_array(fn, "x", x, ("B", "T"))
    mask = _checks.mask_like(fn, mask, ("B", "T"), "x", x.shape)
    xm = jnp.where(mask, x, 0.0)
    batch = x.shape[0]
    if mode == "token-mean":
        return _safe_div(jnp.sum(xm), jnp.sum(mask, dtype=jnp.float32))
    if mode == "seq-mean-token-mean":
        per_seq = _safe_div(jnp.sum(xm, axis=1), jnp.sum(mask, axis=1, dtype=jnp.float32))
        return jnp.sum(per_seq) / max(batch, 1)
    if mode == "seq-mean-token-sum":
        return jnp.sum(xm) / max(batch, 1)
    if norm_len is None:
        raise ValueError(f"{fn}: mode {mode!r} needs `norm_len` (e.g. the max response length)")
    _checks.positive(fn, "norm_len", norm_len)
    return jnp.sum(xm) / (max(batch, 1) * jnp.asarray(norm_len, jnp.float32))
