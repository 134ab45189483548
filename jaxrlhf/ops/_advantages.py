"""Advantage estimators: GAE, group-relative baselines, whitening, GDPO's multi-reward
advantages and on-policy distillation's (docs/concepts.md#advantages-token-level-or-sequence-level)."""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jaxrlhf.ops import _checks, _masked

GAE_METHODS = ("auto", "scan", "associative", "blocked")
GROUP_METHODS = ("grpo", "dr_grpo", "rloo")


class GAEOutput(NamedTuple):
    """`advantages` and `returns` (the critic's targets), both `[B, T]` float32."""

    advantages: jax.Array
    returns: jax.Array


def _gae_scan(delta_TxB: jax.Array, decay_TxB: jax.Array) -> jax.Array:
    def step(next_adv, inputs):
        delta, decay = inputs
        adv = delta + decay * next_adv
        return adv, adv

    _, adv = lax.scan(step, jnp.zeros_like(delta_TxB[0]), (delta_TxB, decay_TxB), reverse=True)
    return adv


def _gae_associative(delta_TxB: jax.Array, decay_TxB: jax.Array) -> jax.Array:
    # A_t = f_t(A_{t+1}) with the affine map f_t(a) = δ_t + c_t·a, and A_t is the
    # composition f_t ∘ … ∘ f_{T−1} applied to 0. Composition is associative: for a
    # suffix map `later` = (c', δ') and `earlier` = (c, δ), earlier ∘ later =
    # (c·c', δ + c·δ'). With reverse=True the scan hands `fn` (later, earlier).
    def compose(later, earlier):
        c_later, d_later = later
        c_earlier, d_earlier = earlier
        return c_earlier * c_later, d_earlier + c_earlier * d_later

    _, adv = lax.associative_scan(compose, (decay_TxB, delta_TxB), reverse=True, axis=0)
    return adv


def _gae_holes_scan(
    rewards_TxB: jax.Array, values_TxB: jax.Array, mask_TxB: jax.Array, gamma: jax.Array,
    decay: float | jax.Array,
) -> jax.Array:
    """GAE over the policy tokens (`mask_TxB`) of each column, in one sequential pass.

    The carry is the advantage and the value of the next policy token; a policy token
    replaces it with its own, anything else passes it on unchanged. Rewards and values must
    be 0 off the mask; the output is the advantage on policy tokens, anything elsewhere.
    """

    def step(carry, inputs):
        next_adv, next_value = carry
        reward, value, policy = inputs
        adv = (reward + gamma * next_value - value) + decay * next_adv
        carry = (jnp.where(policy, adv, next_adv), jnp.where(policy, value, next_value))
        return carry, adv

    zeros = jnp.zeros_like(rewards_TxB[0])
    _, adv = lax.scan(step, (zeros, zeros), (rewards_TxB, values_TxB, mask_TxB), reverse=True)
    return adv


def _gae_holes_associative(
    rewards_TxB: jax.Array, values_TxB: jax.Array, mask_TxB: jax.Array, gamma: jax.Array,
    decay: float | jax.Array,
) -> jax.Array:
    """`_gae_holes_scan` in two associative scans (same inputs, same output).

    The first carries the value of the next policy token back over everything else:
    `W_t = m_t·V_t + (1 − m_t)·W_{t+1}` (exact: every step keeps one operand whole). The
    second is the affine recurrence with decay `γλ` on policy tokens and 1 elsewhere, so
    that a policy token's `A_{t_i}` reads `A_{t_{i+1}}` across any environment tokens.
    """
    policy = mask_TxB.astype(jnp.float32)
    at_or_after = _gae_associative(values_TxB, 1.0 - policy)
    next_value = jnp.pad(at_or_after[1:], ((0, 1), (0, 0)))
    delta = jnp.where(mask_TxB, rewards_TxB + gamma * next_value - values_TxB, 0.0)
    return _gae_associative(delta, jnp.where(mask_TxB, decay, 1.0))


_BLOCK = 32  # block length of the "blocked" form; 16 and 64 measured slower on CPU


def _decay_powers(decay: float | jax.Array, size: int, stride: int = 1) -> jax.Array:
    """Upper-triangular Toeplitz `P[s, t] = c^{stride·(s−t)}` for `s ≥ t`, else 0: `[size, size]`.

    A concrete decay (Python floats γ, λ: the usual case) gives a float64 NumPy constant,
    so nothing is computed per call; XLA:CPU does not fold `power` and spends a scalar libm
    call per entry. A traced decay takes `size` powers and a gather.
    """
    gap = np.arange(size)[:, None] - np.arange(size)[None, :]
    if isinstance(decay, float):
        return np.where(gap >= 0, decay ** (stride * np.maximum(gap, 0.0)), 0.0).astype(np.float32)
    vec = (decay**stride) ** jnp.arange(size, dtype=jnp.float32)
    return jnp.where(gap >= 0, vec[np.maximum(gap, 0)], 0.0)


def _gae_blocked(delta_BxT: jax.Array, decay: float | jax.Array) -> jax.Array:
    """`A_t = Σ_{s≥t} c^{s−t} δ_s` for a constant decay `c`, as two small matmuls.

    Valid when `m_{t+1}` in the decay only ever cuts at the end of the sequence, i.e. for
    a contiguous-prefix mask with δ = 0 on padding: then `c_t = γλ·m_{t+1}` may be replaced
    by the constant `γλ`, because everything after the last valid token is 0 anyway.
    Batch-major throughout: on XLA:CPU the two transposes of a time-major scan cost more
    than the recurrence itself (1.5 ms each at [256, 2048]).
    """
    b, t = delta_BxT.shape
    k = _BLOCK
    n = -(-t // k)
    delta = jnp.pad(delta_BxT, ((0, 0), (0, n * k - t))).reshape(b, n, k)
    hi = lax.Precision.HIGHEST  # f32 accumulation on TPU/GPU too (no bf16 / tf32 passes)

    # Within each block, as if the sequence ended at the block's last token.
    local = jnp.einsum("bns,st->bnt", delta, _decay_powers(decay, k), precision=hi)
    # Block j's true start value S_j = local_j[0] + c^K·S_{j+1}; what block j needs is
    # S_{j+1} = Σ_{i>j} c^{K(i−j−1)}·local_i[0]: one matmul with the shifted powers.
    xp = np if isinstance(decay, float) else jnp  # constants stay NumPy when they can
    shifted = xp.pad(_decay_powers(decay, n, k)[1:, 1:], ((1, 0), (0, 1)))
    next_start = jnp.einsum("bs,st->bt", local[:, :, 0], shifted, precision=hi)
    carry_in = (decay ** (k - xp.arange(k))).astype(xp.float32)  # c^{K−t} from block end
    adv = local + carry_in * next_start[:, :, None]
    return adv.reshape(b, n * k)[:, :t]


def _auto_method() -> str:
    # XLA:CPU, jit, float32, median ms of benchmarks/bench_ops.py (2026-11-30, idle
    # 2-core machine, 100 calls each):
    #   [B, T]        scan   associative  blocked   (rlax 0.050 / 0.190 / 2.53)
    #   (16, 64)      0.042  0.057        0.047
    #   (64, 512)     0.198  0.449        0.114
    #   (256, 2048)   2.49   6.50         0.796
    # The associative form's strided slices are slow on CPU; "blocked" wins where it
    # matters and ties elsewhere. On GPU/TPU a sequential scan pays one step per token,
    # so the log-depth form is chosen there (not measured: no accelerator here).
    return "blocked" if jax.default_backend() == "cpu" else "associative"


def gae(
    rewards: jax.Array,
    values: jax.Array,
    mask: jax.Array,
    gamma: float | jax.Array = 1.0,
    lam: float | jax.Array = 0.95,
    *,
    method: str = "auto",
) -> GAEOutput:
    """Generalized Advantage Estimation on the response axis (Schulman et al. 2016,
    arXiv:1506.02438) over each row's policy tokens, with no bootstrap after the last one.

    With `t_1 < … < t_n` the positions where `m = 1` (the tokens the policy sampled):

        δ_i = r_{t_i} + γ·V_{t_{i+1}} − V_{t_i}        (V_{t_{n+1}} = 0)
        A_{t_i} = δ_i + γλ·A_{t_{i+1}}                  (right to left, A_{t_{n+1}} = 0)
        R_{t_i} = A_{t_i} + V_{t_i}
        A_t = R_t = 0 where m_t = 0

    Positions with `m = 0` between policy tokens (an episode's environment tokens: tool
    results, template glue) are not the policy's actions: they neither discount nor cut the
    chain, and their rewards and values are ignored, like the padding's
    (docs/concepts.md#gae-over-a-mask-with-holes). For a contiguous-prefix mask (`t_i = i − 1`)
    this is the familiar

        δ_t = r_t + γ·V_{t+1}·m_{t+1} − V_t,   A_t = δ_t + γλ·m_{t+1}·A_{t+1}

    and every method gives what it gave before masks could have holes (under jit, the same
    bits).

    Args:
      rewards: `[B, T]` response-aligned per-token rewards (e.g. `shape_rewards`).
      values: `[B, T]` critic values `V_t` of the state that predicts `y_t`.
      mask: `[B, T]` bool or float, 1 on the policy's tokens: a contiguous prefix, or with
        holes where an episode put environment tokens between them.
      gamma: discount γ.
      lam: GAE λ.
      method: "scan" (sequential `lax.scan`, O(T) steps), "associative"
        (`lax.associative_scan`, O(log T) depth; a mask with holes takes two of them),
        "blocked" (blocks of 32 tokens as matmuls; a mask that is not a contiguous prefix
        takes "scan"), or "auto" (picked per backend from measurements, see
        `_auto_method`). All give the same numbers up to float rounding.

    Returns:
      `GAEOutput(advantages, returns)`, each `[B, T]` float32 (not whitened: see `whiten`).
    """
    fn = "gae"
    _checks.choice(fn, "method", method, GAE_METHODS)
    rewards = _checks.float_array(fn, "rewards", rewards, ("B", "T"))
    values = _checks.float_like(fn, "values", values, ("B", "T"), "rewards", rewards.shape)
    mask = _checks.mask_like(fn, mask, ("B", "T"), "rewards", rewards.shape)
    if method == "auto":
        method = _auto_method()

    # γλ as a Python float when both are concrete, so that the blocked form's power
    # matrices become compile-time constants.
    decay = _concrete_product(gamma, lam)
    gamma = jnp.asarray(gamma, jnp.float32)
    lam = jnp.asarray(lam, jnp.float32)
    if decay is None:
        decay = gamma * lam

    def prefix_delta(rewards, values):
        # With a contiguous-prefix mask, V_{t_{i+1}} is the next position's masked value (a
        # shift: no separate next-mask pass), δ is 0 on padding, and the decay γλ·m_{t+1}.
        masked_values = jnp.where(mask, values, 0.0)
        next_values = jnp.pad(masked_values[:, 1:], ((0, 0), (0, 1)))
        delta = jnp.where(mask, rewards, 0.0) + gamma * next_values - masked_values
        return delta if method == "blocked" else delta.T  # the scans walk the leading axis

    def contiguous(delta, rewards, values):
        if method == "blocked":  # δ = 0 on padding: no masking pass
            return _gae_blocked(delta, decay)
        next_mask = jnp.pad(mask[:, 1:], ((0, 0), (0, 1))).astype(jnp.float32)
        if method == "associative":
            return jnp.where(mask, _gae_associative(prefix_delta(rewards, values),
                                                    (decay * next_mask).T).T, 0.0)
        return jnp.where(mask, _gae_scan(delta, (decay * next_mask).T).T, 0.0)

    def holes(delta, rewards, values):  # any mask: the recurrence over the policy tokens
        solve = _gae_holes_associative if method == "associative" else _gae_holes_scan
        rewards, values = (jnp.where(mask, x, 0.0).T for x in (rewards, values))
        # Masked batch-major, after the transpose: the branch then returns the row-major
        # layout the other one does, where XLA would otherwise hand the transpose on as a
        # column-major result (two more copies of [B, T] around the blocked form).
        return jnp.where(mask, solve(rewards, values, mask.T, gamma, decay).T, 0.0)

    # A mask that is not a contiguous prefix takes the policy-token forms ("blocked" the
    # scan's), so the result never depends on the method. (Under vmap both branches run.)
    # The check is a max over uint8 rises 0 → 1: on XLA:CPU it stays one loop, where a
    # boolean `all` or a float sum over [B, T] costs 2–3× as much. δ is computed where XLA
    # then fuses and rounds it (FMA contraction) as it did before masks could have holes:
    # outside the branches for "scan" and "blocked", inside for "associative" (the same
    # bits under jit on XLA:CPU, checked against the previous code at γ = 0.9, 0.99, 1).
    delta = None if method == "associative" else prefix_delta(rewards, values)
    rises = (mask[:, 1:] > mask[:, :-1]).astype(jnp.uint8)
    adv = lax.cond(jnp.max(rises, initial=0) == 0, contiguous, holes, delta, rewards, values)
    # The returns take the unmasked values (A = 0 off the mask anyway): the masked values
    # then have δ as their only consumer, and XLA fuses them into it instead of writing
    # them out.
    return GAEOutput(advantages=adv, returns=jnp.where(mask, adv + values, 0.0))


def _concrete_product(gamma, lam) -> float | None:
    """`γ·λ` rounded as float32 arithmetic would, or None when either is traced."""
    if isinstance(gamma, jax.core.Tracer) or isinstance(lam, jax.core.Tracer):
        return None
    return float(np.float32(gamma) * np.float32(lam))


def whiten(
    x: jax.Array, mask: jax.Array, shift_mean: bool = True, eps: float = 1e-8
) -> jax.Array:
    """Normalises `x` with the mean and population variance of its valid tokens.

        μ = Σ m·x / Σ m,   σ² = Σ m·(x − μ)² / Σ m   (over the whole batch)
        out = (x − μ) / sqrt(σ² + ε)              (shift_mean=True)
        out = (x − μ) / sqrt(σ² + ε) + μ          (shift_mean=False: the mean is kept)

    Padding positions come out 0. With no valid token at all the output is all 0.

    Args:
      x: `[B, T]` response-aligned values (typically GAE advantages).
      mask: `[B, T]` bool or float, 1 on valid tokens.
      shift_mean: whether the output is centred.
      eps: ε added to the variance.

    Returns:
      `[B, T]` float32.
    """
    fn = "whiten"
    x = _checks.float_array(fn, "x", x, ("B", "T"))
    mask = _checks.mask_like(fn, mask, ("B", "T"), "x", x.shape)
    x = jnp.where(mask, x, 0.0)
    mean = _masked.masked_mean(x, mask)
    var = _masked.masked_var(x, mask)
    out = (x - mean) * lax.rsqrt(var + eps)
    if not shift_mean:
        out = out + mean
    return jnp.where(mask, out, 0.0)


def group_advantages(
    scores: jax.Array, group_size: int, method: str = "grpo", eps: float = 1e-6, *,
    mask: jax.Array | None = None,
) -> jax.Array:
    """Critic-free advantages from groups of `G` responses to the same prompt.

    `scores` `[N]`, `N = prompts·G`, groups contiguous. Per group `g`:

    - "grpo" (Shao et al. 2024, arXiv:2402.03300): `(s_i − mean_g) / (std_g + ε)` with the
      unbiased std (ddof = 1);
    - "dr_grpo" (Liu et al. 2025, arXiv:2503.20783): `s_i − mean_g`;
    - "rloo" (Ahmadian et al. 2024, arXiv:2402.14740): `s_i − (Σ_{j≠i} s_j)/(G − 1)`.

    A group whose scores are all equal gets 0 (never NaN) under every method.

    With a `mask` `m` (1 on the rows that have a score), each group's statistics are over
    its `n_g = Σ_{i∈g} m_i` scored rows only: `mean_g = Σ m_j s_j / n_g`,
    `std_g = sqrt(Σ m_j (s_j − mean_g)² / (n_g − 1))`, rloo's baseline
    `Σ_{j≠i} m_j s_j / (n_g − 1)`; an unscored row (its score is ignored) and every row of a
    group with `n_g < 2` get 0. A mask of ones gives the formulas above.

    Args:
      scores: `[N]` sequence scores.
      group_size: `G ≥ 2`, a static int dividing `N`.
      method: "grpo", "dr_grpo" or "rloo".
      eps: ε of "grpo".
      mask: `[N]` bool or float, 1 on the scored rows; None: every row is scored.

    Returns:
      `[N]` float32 sequence advantages (see `broadcast_sequence` for `[N, T]`).
    """
    fn = "group_advantages"
    _checks.choice(fn, "method", method, GROUP_METHODS)
    scores = _checks.float_array(fn, "scores", scores, ("N",))
    n = scores.shape[0]
    _check_groups(fn, group_size, n)
    if mask is not None:
        mask = _checks.mask_like(fn, mask, ("N",), "scores", scores.shape)
        return _masked_group_advantages(scores.reshape(n // group_size, group_size),
                                        mask.reshape(n // group_size, group_size), method, eps).reshape(n)
    s = scores.reshape(n // group_size, group_size)
    # Every formula is invariant to a per-group shift; subtracting the group's first score
    # makes an all-equal group exactly 0 before any division (XLA may divide by a constant
    # through its rounded reciprocal, and 1e3·(1 − 3·fl(1/3)) would then pass for signal).
    s = s - s[:, :1]
    total = jnp.sum(s, axis=1, keepdims=True)
    mean = total / group_size
    if method == "rloo":
        adv = s - (total - s) / (group_size - 1)
    elif method == "dr_grpo":
        adv = s - mean
    else:
        var = jnp.sum(jnp.square(s - mean), axis=1, keepdims=True) / (group_size - 1)
        # sqrt'(0) is inf: keep the equal-scores group out of it so gradients stay finite.
        std = jnp.where(var > 0, jnp.sqrt(jnp.where(var > 0, var, 1.0)), 0.0)
        adv = (s - mean) / (std + eps)
    return adv.reshape(n)


def _check_groups(fn: str, group_size, n: int) -> None:
    if not isinstance(group_size, int) or isinstance(group_size, bool) or group_size < 2:
        raise ValueError(f"{fn}: `group_size` must be an int >= 2, got {group_size!r}")
    if n % group_size:
        raise ValueError(
            f"{fn}: `scores` has N = {n} entries, not a multiple of group_size = {group_size} "
            "(groups must be complete and contiguous)"
        )


def _masked_group_advantages(s_KxG: jax.Array, mask_KxG: jax.Array, method: str, eps: float) -> jax.Array:
    """`group_advantages` over the scored rows (`mask_KxG`) of each group, `[K, G]`."""
    m = mask_KxG.astype(jnp.bool_)
    # The shift of the unmasked form, by the group's first scored row (any row when none is).
    first = jnp.argmax(m, axis=1)[:, None]
    s = jnp.where(m, s_KxG - jnp.take_along_axis(s_KxG, first, axis=1), 0.0)
    count = jnp.sum(m, axis=1, keepdims=True, dtype=jnp.float32)
    enough = count >= 2
    denom = jnp.where(enough, count, 2.0)  # no division by 0 or 1 reaches a kept value
    total = jnp.sum(s, axis=1, keepdims=True)
    mean = total / denom
    if method == "rloo":
        adv = s - (total - s) / (denom - 1)
    elif method == "dr_grpo":
        adv = s - mean
    else:
        var = jnp.sum(jnp.where(m, jnp.square(s - mean), 0.0), axis=1, keepdims=True) / (denom - 1)
        std = jnp.where(var > 0, jnp.sqrt(jnp.where(var > 0, var, 1.0)), 0.0)
        adv = (s - mean) / (std + eps)
    return jnp.where(m & enough, adv, 0.0)


def broadcast_sequence(x: jax.Array, mask: jax.Array) -> jax.Array:
    """Puts a per-sequence value on every valid token: `out[b, t] = m[b, t] · x[b]`.

    Args:
      x: `[B]` sequence values (e.g. `group_advantages`).
      mask: `[B, T]` bool or float, 1 on valid response tokens.

    Returns:
      `[B, T]` float32, 0 on padding.
    """
    fn = "broadcast_sequence"
    mask = _checks.array(fn, "mask", mask, ("B", "T")).astype(jnp.bool_)
    x = _checks.float_like(fn, "x", x, ("B",), "mask[:, 0]", mask.shape[:1])
    return jnp.where(mask, x[:, None], 0.0)


def gdpo_advantages(
    scores: jax.Array,
    group_size: int,
    *,
    weights: jax.Array | None = None,
    eps: float = 1e-6,
    mask: jax.Array | None = None,
) -> jax.Array:
    """GDPO (Liu et al. 2026, arXiv:2601.05242): group-relative advantages for several
    rewards, each reward normalised in its group before they are summed
    (docs/concepts.md#gdpo-several-rewards-normalised-apart).

    `scores` `[N, K]` holds `K` reward components of `N = prompts·G` responses, groups of
    `G` contiguous rows. With population statistics (ddof = 0):

        a_k,i = (s_k,i − mean_g(s_k)) / (std_g(s_k) + ε)      (per component, per group)
        a_i = Σ_k w_k · a_k,i
        A_i = (a_i − mean_N(a)) / (std_N(a) + ε)               (over the whole batch)

    A group whose scores of a component are all equal gets 0 for it (never NaN), and so does
    a batch whose `a` are all equal.

    With a `mask` `m` (1 on the rows that have a score), every statistic (group and batch)
    is over the scored rows only, and an unscored row (its scores are ignored) gets 0. A
    group with one scored row gives it `a = 0`, which still counts in the batch statistics.

    Args:
      scores: `[N, K]` reward components.
      group_size: `G ≥ 2`, a static int dividing `N`.
      weights: `[K]` component weights `w_k`; None: all 1.
      eps: ε of both normalisations.
      mask: `[N]` bool or float, 1 on the scored rows; None: every row is scored.

    Returns:
      `[N]` float32 sequence advantages (see `broadcast_sequence` for `[N, T]`).
    """
    fn = "gdpo_advantages"
    scores = _checks.float_array(fn, "scores", scores, ("N", "K"))
    n, k = scores.shape
    _check_groups(fn, group_size, n)
    if weights is None:
        weights = jnp.ones((k,), jnp.float32)
    else:
        weights = _checks.float_like(fn, "weights", weights, ("K",), "scores[0]", (k,))
    if mask is None:
        mask = jnp.ones((n,), jnp.bool_)
    else:
        mask = _checks.mask_like(fn, mask, ("N",), "scores[:, 0]", (n,))
    groups = n // group_size
    m = jnp.broadcast_to(mask.reshape(groups, group_size, 1), (groups, group_size, k))
    per_component = _standardise(scores.reshape(groups, group_size, k), m, 1, eps)
    combined = jnp.sum(per_component * weights, axis=-1).reshape(n)
    return _standardise(combined, mask, 0, eps)


def _standardise(x: jax.Array, m: jax.Array, axis: int, eps: float) -> jax.Array:
    """`(x − mean) / (std + ε)` over the entries `m` along `axis` (ddof = 0); 0 elsewhere."""
    # The shift of group_advantages: by the first valid entry, so that equal values are
    # exactly 0 before any division (and an equal group's output exactly 0).
    first = jnp.take_along_axis(x, jnp.argmax(m, axis=axis, keepdims=True), axis=axis)
    x = jnp.where(m, x - first, 0.0)
    count = jnp.maximum(jnp.sum(m, axis=axis, keepdims=True, dtype=jnp.float32), 1.0)
    centred = jnp.where(m, x - jnp.sum(x, axis=axis, keepdims=True) / count, 0.0)
    var = jnp.sum(jnp.square(centred), axis=axis, keepdims=True) / count
    # sqrt'(0) is inf: keep an equal group out of it so that gradients stay finite.
    std = jnp.where(var > 0, jnp.sqrt(jnp.where(var > 0, var, 1.0)), 0.0)
    return jnp.where(m, centred / (std + eps), 0.0)


def distillation_advantages(
    teacher_logp: jax.Array, old_logp: jax.Array, mask: jax.Array
) -> jax.Array:
    """On-policy distillation's per-token advantage (docs/concepts.md#on-policy-distillation):
    the student's own samples, each token rewarded by how much more the teacher likes it,

        A_t = sg(teacher_logp_t − old_logp_t)     on valid tokens, 0 on padding

    (the negative per-token reverse KL, log π_T − log π_old, of the sampled token; Agarwal et
    al. 2024, arXiv:2306.13649). Use it in place of (or added to) reward advantages in
    `policy_loss` or `cispo_loss`.

    Args:
      teacher_logp: `[B, T]` log-probs of the sampled tokens under the teacher.
      old_logp: `[B, T]` log-probs of the same tokens under the rollout (student) policy.
      mask: `[B, T]` bool or float, 1 on valid response tokens.

    Returns:
      `[B, T]` float32, no gradient, 0 on padding.
    """
    fn = "distillation_advantages"
    teacher_logp = _checks.float_array(fn, "teacher_logp", teacher_logp, ("B", "T"))
    old_logp = _checks.float_like(fn, "old_logp", old_logp, ("B", "T"), "teacher_logp",
                                  teacher_logp.shape)
    mask = _checks.mask_like(fn, mask, ("B", "T"), "teacher_logp", teacher_logp.shape)
    diff = jnp.where(mask, teacher_logp, 0.0) - jnp.where(mask, old_logp, 0.0)
    return jnp.where(mask, lax.stop_gradient(diff), 0.0)
