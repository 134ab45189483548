"""Importance weights for a sampler that is not the policy, against the loop reference and
hand values (docs/concepts.md#importance-weights-when-the-sampler-is-not-the-policy)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxrlhf import ops
from . import inputs, reference

B, T = 6, 7
METRICS = ["is_weight_mean", "is_weight_max", "is_frac_truncated", "mismatch_kl", "max_abs_logp_diff"]


def _logps(seed, scale=0.7):
    rng = np.random.default_rng(seed)
    behaviour = (-1.0 + rng.standard_normal((B, T))).astype(np.float32)
    proximal = (behaviour + scale * rng.standard_normal((B, T))).astype(np.float32)
    return proximal, behaviour, inputs.random_mask(rng, B, T)


@pytest.mark.parametrize("level", ops.IS_LEVELS)
@pytest.mark.parametrize("mode, kwargs", [("tis", {}), ("tis", {"cap": 1.2}), ("mis", {}),
                                          ("mis", {"low": 0.8, "high": 1.5}), ("none", {})])
def test_importance_weights_match_reference(level, mode, kwargs):
    proximal, behaviour, mask = _logps(0)
    weights, metrics = ops.importance_weights(proximal, behaviour, mask, mode=mode, level=level, **kwargs)
    want, want_metrics = reference.importance_weights(proximal, behaviour, mask, mode, level=level, **kwargs)
    np.testing.assert_allclose(weights, want, rtol=1e-5, atol=1e-6)
    assert set(metrics) == set(METRICS)
    for name in METRICS:
        np.testing.assert_allclose(metrics[name], want_metrics[name], rtol=1e-5, atol=1e-6, err_msg=name)
    # jit = eager; a float mask is a bool mask; the padding's garbage changes nothing.
    jitted = jax.jit(lambda p, b, m: ops.importance_weights(p, b, m, mode=mode, level=level, **kwargs))
    jax.tree.map(lambda g, w: np.testing.assert_allclose(g, w, rtol=1e-6, atol=1e-6),
                 jitted(proximal, behaviour, mask.astype(np.float32)), (weights, metrics))
    rng = np.random.default_rng(1)
    padded = jitted(inputs.pad_right(proximal, 3, rng), inputs.pad_right(behaviour, 3, rng),
                    inputs.pad_mask(mask, 3))
    np.testing.assert_allclose(padded[0][:, :T], weights, rtol=1e-6, atol=1e-6)
    np.testing.assert_array_equal(padded[0][:, T:], 0.0)
    jax.tree.map(lambda g, w: np.testing.assert_allclose(g, w, rtol=1e-6, atol=1e-6), padded[1], metrics)


def test_importance_weights_hand_values():
    # Δ = [log 3, log 0.25, 0 (padding)]. token/tis cap 2: [2, 0.25]; token/mis [0.5, 5]:
    # [3, 0] (0.25 < 0.5 is masked); sequence: exp(log 0.75) = 0.75 on both tokens;
    # geometric: exp(log(0.75)/2) = sqrt(0.75).
    proximal = jnp.log(jnp.array([[3.0, 0.25, 9.0]]))
    behaviour = jnp.zeros((1, 3))
    mask = jnp.array([[1, 1, 0]])
    w, m = ops.importance_weights(proximal, behaviour, mask)
    np.testing.assert_allclose(w, [[2.0, 0.25, 0.0]], rtol=1e-6)
    np.testing.assert_allclose([m["is_frac_truncated"], m["is_weight_max"]], [0.5, 2.0])
    np.testing.assert_allclose(m["max_abs_logp_diff"], np.log(4.0), rtol=1e-6)
    # mismatch k3 with d = −Δ: exp(Δ) − 1 − Δ = (3 − 1 − log 3 + 0.25 − 1 − log 0.25)/2.
    want_kl = (3 - 1 - np.log(3) + 0.25 - 1 - np.log(0.25)) / 2
    np.testing.assert_allclose(m["mismatch_kl"], want_kl, rtol=1e-5)
    w, m = ops.importance_weights(proximal, behaviour, mask, mode="mis")
    np.testing.assert_allclose(w, [[3.0, 0.0, 0.0]], rtol=1e-6)
    np.testing.assert_allclose(m["is_frac_truncated"], 0.5)
    w, _ = ops.importance_weights(proximal, behaviour, mask, level="sequence")
    np.testing.assert_allclose(w, [[0.75, 0.75, 0.0]], rtol=1e-6)
    w, _ = ops.importance_weights(proximal, behaviour, mask, level="geometric")
    np.testing.assert_allclose(w, [[np.sqrt(0.75)] * 2 + [0.0]], rtol=1e-6)
    w, m = ops.importance_weights(proximal, behaviour, mask, mode="none")
    np.testing.assert_array_equal(w, [[1.0, 1.0, 0.0]])
    assert float(m["is_frac_truncated"]) == 0.0


def test_importance_weights_extremes_stay_finite():
    # A sequence log-ratio of 300 is clipped to 20 before exp; a token ratio of e^300 is inf
    # in float32 and is truncated (tis) or masked (mis), never NaN. No valid token: all 0.
    proximal = jnp.array([[100.0, 100.0, 100.0], [0.0, 0.0, 0.0]])
    behaviour = jnp.zeros((2, 3))
    mask = jnp.array([[1, 1, 1], [0, 0, 0]])
    w, _ = ops.importance_weights(proximal, behaviour, mask, mode="mis", level="sequence", high=1e9)
    np.testing.assert_allclose(w[0], np.exp(20.0), rtol=1e-5)
    for mode in ("tis", "mis"):
        w, m = ops.importance_weights(proximal * 3, behaviour, mask, mode=mode)
        assert np.all(np.isfinite(w)) and np.all(np.isfinite(m["is_weight_mean"]))
    w, m = ops.importance_weights(proximal, behaviour, jnp.zeros((2, 3)))
    np.testing.assert_array_equal(w, 0.0)
    assert all(float(v) == 0.0 for v in m.values())


def test_importance_weights_are_constants():
    proximal, behaviour, mask = _logps(2)
    grads = jax.grad(lambda p, b: jnp.sum(ops.importance_weights(p, b, mask)[0]), argnums=(0, 1))(
        proximal, behaviour)
    for g in grads:
        np.testing.assert_array_equal(g, 0.0)


def test_bf16_inputs_compute_in_float32():
    proximal, behaviour, mask = _logps(3)
    low = [jnp.asarray(x, jnp.bfloat16) for x in (proximal, behaviour)]
    w, m = ops.importance_weights(*low, mask, level="geometric")
    assert w.dtype == jnp.float32 and all(v.dtype == jnp.float32 for v in m.values())
    want = ops.importance_weights(*[x.astype(jnp.float32) for x in low], mask, level="geometric")
    jax.tree.map(lambda g, x: np.testing.assert_allclose(g, x, rtol=1e-6, atol=1e-6), (w, m), want)


def test_importance_weights_bad_arguments():
    x = np.zeros((B, T))
    with pytest.raises(ValueError, match="importance_weights: unknown mode 'cispo'; valid choices are 'tis'"):
        ops.importance_weights(x, x, x, mode="cispo")
    with pytest.raises(ValueError, match="importance_weights: unknown level 'seq'"):
        ops.importance_weights(x, x, x, level="seq")
    with pytest.raises(ValueError, match="importance_weights: `cap` must be > 0"):
        ops.importance_weights(x, x, x, cap=0.0)
    with pytest.raises(ValueError, match="importance_weights: `low` must be < `high`"):
        ops.importance_weights(x, x, x, mode="mis", low=2.0, high=1.0)
    with pytest.raises(ValueError, match="importance_weights: `low` must be >= 0"):
        ops.importance_weights(x, x, x, mode="mis", low=-1.0)
    with pytest.raises(ValueError, match=r"`behaviour_logp` must have shape \[B, T\] = \(6, 7\) like `proximal_logp`"):
        ops.importance_weights(x, x[:, 1:], x)
    with pytest.raises(ValueError, match=r"importance_weights: `mask` must have shape"):
        ops.importance_weights(x, x, x[:2])
