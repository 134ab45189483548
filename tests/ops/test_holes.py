"""Environment tokens contribute nothing (docs/concepts.md#gae-over-a-mask-with-holes).

An episode's response holds the policy's tokens with environment tokens (tool results,
template glue) between them, mask 0. Every masked primitive must give, on such a mask, what
it gives on the same rows with the environment tokens deleted (each row's policy tokens
moved to the front, padding after them): the same scalars and per-sequence values, the same
per-token outputs on the policy tokens and 0 on the holes, and the same gradients there
with exactly 0 on the holes, whatever the holes hold (inf, NaN, 1e30).
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from jaxrlhf import ops
from . import inputs

B, T = 5, 12
SCORES = np.array([1.0, -2.0, 0.5, 3.0, -0.25], np.float32)


def _aggregate(mode):
    return {"mode": mode, "norm_len": T} if mode == "seq-mean-token-sum-norm" else {"mode": mode}


def _loss_agg(mode):
    return {"agg": mode, "norm_len": T} if mode == "seq-mean-token-sum-norm" else {"agg": mode}


# name -> (number of [B, T] float inputs, function of (*inputs, mask), whether the holes may
# hold non-finite garbage). `ops.kl` is unmasked by contract (aggregate it with the mask),
# so under the gradient its holes hold finite garbage: d kl/d logp at NaN is NaN, and
# 0·NaN is NaN.
CASES = {
    **{f"gae[{m}]": (2, lambda r, v, mk, m=m: ops.gae(r, v, mk, gamma=0.9, lam=0.8, method=m), True)
       for m in ("scan", "associative", "blocked")},
    "whiten": (1, lambda x, m: ops.whiten(x, m), True),
    "whiten[no shift]": (1, lambda x, m: ops.whiten(x, m, shift_mean=False), True),
    "shape_rewards": (1, lambda k, m: ops.shape_rewards(SCORES, k, m, 0.1), True),
    "broadcast_sequence": (0, lambda m: ops.broadcast_sequence(SCORES, m), True),
    "distillation_advantages": (2, ops.distillation_advantages, True),
    "approx_kl": (2, ops.approx_kl, True),
    "sequence_logprobs": (1, ops.sequence_logprobs, True),
    "masked_sum": (1, ops.masked_sum, True),
    "masked_sum[axis=1]": (1, lambda x, m: ops.masked_sum(x, m, axis=1), True),
    "masked_mean": (1, ops.masked_mean, True),
    "masked_mean[axis=1]": (1, lambda x, m: ops.masked_mean(x, m, axis=1), True),
    "masked_var": (1, ops.masked_var, True),
    "masked_var[axis=1]": (1, lambda x, m: ops.masked_var(x, m, axis=1), True),
    **{f"aggregate[{mode}]": (1, lambda x, m, mode=mode: ops.aggregate(x, m, **_aggregate(mode)), True)
       for mode in ops.AGGREGATE_MODES},
    **{f"kl[{est}]+aggregate[{mode}]": (
        2, lambda lp, ref, m, est=est, mode=mode: ops.aggregate(ops.kl(lp, ref, est), m, **_aggregate(mode)),
        False) for est in ops.KL_ESTIMATORS for mode in ops.AGGREGATE_MODES},
    **{f"policy_loss[{mode}]": (
        3, lambda lp, old, a, m, mode=mode: ops.policy_loss(lp, old, a, m, clip_high=0.3, dual_clip=2.0,
                                                            **_loss_agg(mode)), True)
       for mode in ops.AGGREGATE_MODES},
    "policy_loss[is_weights]": (
        4, lambda lp, old, a, w, m: ops.policy_loss(lp, old, a, m, is_weights=jnp.exp(w)), True),
    **{f"cispo_loss[{mode}]": (
        3, lambda lp, old, a, m, mode=mode: ops.cispo_loss(lp, old, a, m, clip_low=0.2, clip_high=0.3,
                                                           **_loss_agg(mode)), True)
       for mode in ops.AGGREGATE_MODES},
    **{f"value_loss[{mode}]": (
        3, lambda v, old, r, m, mode=mode: ops.value_loss(v, old, r, m, clip=0.2, **_loss_agg(mode)), True)
       for mode in ops.AGGREGATE_MODES},
    **{f"importance_weights[{mode},{level}]": (
        2, lambda p, b, m, mode=mode, level=level: ops.importance_weights(p, b, m, mode=mode, level=level,
                                                                          low=0.2, high=5.0), True)
       for mode in ops.IS_MODES for level in ops.IS_LEVELS},
}
_JITTED = {name: jax.jit(fn) for name, (_, fn, _) in CASES.items()}


def _weighted_total(out, weights, row_weights):
    """A scalar of every output leaf: `[B, T]` and `[B]` leaves weighted, scalars as they are."""
    total = 0.0
    for leaf in jax.tree.leaves(out):
        if leaf.ndim == 2:
            total = total + jnp.sum(weights * leaf)
        elif leaf.ndim == 1:
            total = total + jnp.sum(row_weights * leaf)
        else:
            total = total + leaf
    return total


_GRADS = {}


def _grad(name):
    """The jitted gradient of `_weighted_total` with respect to the case's inputs."""
    if name not in _GRADS:
        fn = CASES[name][1]
        _GRADS[name] = jax.jit(jax.grad(lambda xs, m, w, rw: _weighted_total(fn(*xs, m), w, rw)))
    return _GRADS[name]


def _compare(name, got, want, mask):
    """`got` on the mask with holes against `want` on the compacted rows."""
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        g, w = np.asarray(g), np.asarray(w)
        if g.ndim == 2:
            np.testing.assert_array_equal(g[~mask], 0.0, err_msg=name)
            w = inputs.expand(w, mask)
        np.testing.assert_allclose(g, w, rtol=2e-5, atol=2e-6, err_msg=name)


@pytest.mark.parametrize("name", CASES)
@settings(max_examples=6, deadline=None)
@given(st.integers(0, 2**32 - 1), st.sampled_from([0.2, 0.5, 0.8]))
def test_environment_tokens_contribute_nothing(name, seed, hole_p):
    n, _, nonfinite_ok = CASES[name]
    fn = _JITTED[name]
    rng = np.random.default_rng(seed)
    mask = inputs.holes_mask(rng, B, T, hole_p)
    xs = [rng.standard_normal((B, T)).astype(np.float32) for _ in range(n)]
    compacted = [inputs.compact(x, mask)[0] for x in xs]
    compact_mask = inputs.compact(xs[0] if xs else np.zeros((B, T), np.float32), mask)[1]
    if nonfinite_ok:
        garbage = rng.choice([1e30, -1e30, np.inf, -np.inf, np.nan, 7.0], size=(B, T))
    else:
        garbage = 3.0 * rng.standard_normal((B, T))
    holed = [np.where(mask, x, garbage).astype(np.float32) for x in xs]

    _compare(name, fn(*holed, mask), fn(*compacted, compact_mask), mask)
    # A float mask reads like the bool one.
    _compare(name, fn(*holed, mask.astype(np.float32)), fn(*compacted, compact_mask), mask)

    if n:
        weights, row_weights = rng.standard_normal((B, T)).astype(np.float32), rng.standard_normal(B)
        compact_weights = inputs.compact(weights, mask)[0]
        grad = _grad(name)
        got = grad(holed, mask, weights, row_weights)
        want = grad(compacted, compact_mask, compact_weights, row_weights)
        for g, w in zip(got, want):
            g = np.asarray(g)
            assert np.all(np.isfinite(g)), name
            np.testing.assert_array_equal(g[~mask], 0.0, err_msg=name)
            np.testing.assert_allclose(g, inputs.expand(np.asarray(w), mask), rtol=2e-5, atol=2e-6,
                                       err_msg=name)
