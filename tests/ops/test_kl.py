"""KL estimators, approx_kl and reward shaping against loop references."""

import hypothesis.extra.numpy as hnp
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from jaxrlhf import ops
from . import inputs, reference

B, T = 4, 6


@pytest.mark.parametrize("estimator", ["k1", "k2", "k3"])
def test_kl_matches_reference(estimator):
    rng = np.random.default_rng(0)
    logp, ref = rng.standard_normal((2, B, T)).astype(np.float32)
    got = ops.kl(logp, ref, estimator=estimator)
    np.testing.assert_allclose(got, reference.kl(logp, ref, estimator), rtol=1e-5, atol=1e-6)


def test_kl_sign_convention():
    # π puts more mass on the sampled token than ref: d = log π − log ref = log 2 > 0.
    # k1 = log 2; k2 = (log 2)²/2; k3 = e^{−log 2} − 1 + log 2 = 0.5 − 1 + 0.693 = 0.193.
    d = np.log(2.0)
    logp, ref = jnp.array([[np.log(0.5)]]), jnp.array([[np.log(0.25)]])
    np.testing.assert_allclose(ops.kl(logp, ref, estimator="k1"), [[d]], rtol=1e-6)
    np.testing.assert_allclose(ops.kl(logp, ref, estimator="k2"), [[d * d / 2]], rtol=1e-6)
    np.testing.assert_allclose(ops.kl(logp, ref), [[0.5 - 1 + d]], rtol=1e-5)


@settings(max_examples=40, deadline=None)
@given(hnp.arrays(np.float32, (2, 1, 8), elements=st.floats(-30, 30, width=32)))
def test_k3_is_non_negative(pair):
    # k3 ≥ 0 for any d, including d ≈ 0 where the naive exp(−d) − 1 + d can round below 0.
    assert np.all(np.asarray(ops.kl(pair[0], pair[1], estimator="k3")) >= 0)


def test_approx_kl():
    rng = np.random.default_rng(1)
    logp, old = rng.standard_normal((2, B, T)).astype(np.float32)
    mask = inputs.random_mask(rng, B, T)
    _, metrics = reference.policy_loss(logp, old, np.zeros((B, T)), mask)
    np.testing.assert_allclose(ops.approx_kl(logp, old, mask), metrics["approx_kl"], rtol=1e-5)
    assert ops.approx_kl(logp, old, np.zeros((B, T), bool)) == 0.0


def test_shape_rewards_matches_reference():
    rng = np.random.default_rng(2)
    kl_bt = rng.standard_normal((B, T)).astype(np.float32)
    scores = rng.standard_normal(B).astype(np.float32)
    mask = inputs.random_mask(rng, B, T)
    got = ops.shape_rewards(scores, kl_bt, mask, 0.05)
    np.testing.assert_allclose(
        got, reference.shape_rewards(scores, kl_bt, mask, 0.05), rtol=1e-6, atol=1e-7
    )
    assert not np.any(got[0])  # length 0: the score is dropped, no NaN


def test_shape_rewards_hand_values():
    # len = 2, β = 0.5, kl = [0.2, 0.4, (pad)], score = 3:
    # r = [−0.5·0.2, −0.5·0.4 + 3, 0] = [−0.1, 2.8, 0].
    got = ops.shape_rewards(jnp.array([3.0]), jnp.array([[0.2, 0.4, 9.0]]), jnp.array([[1, 1, 0]]), 0.5)
    np.testing.assert_allclose(got, [[-0.1, 2.8, 0.0]], rtol=1e-6)
    # A mask with holes (environment tokens at 1 and 3): the score goes on the policy's last
    # token, t = 4, not on t = len − 1 = 2; the holes get nothing.
    got = ops.shape_rewards(jnp.array([3.0]), jnp.array([[0.2, 9.0, 0.4, 9.0, 0.6, 9.0]]),
                            jnp.array([[1, 0, 1, 0, 1, 0]]), 0.5)
    np.testing.assert_allclose(got, [[-0.1, 0.0, -0.2, 0.0, 2.7, 0.0]], rtol=1e-6)


def test_bad_arguments():
    x = np.zeros((B, T))
    with pytest.raises(ValueError, match="valid choices are 'k1', 'k2', 'k3'"):
        ops.kl(x, x, estimator="k4")
    with pytest.raises(ValueError, match=r"`ref_logp` must have shape \[B, T\] = \(4, 6\)"):
        ops.kl(x, x[:, :-1])
    with pytest.raises(ValueError, match=r"`scores` must have shape \[B\] = \(4,\)"):
        ops.shape_rewards(np.zeros(3), x, x, 0.1)
    with pytest.raises(ValueError, match="`mask` must have shape"):
        ops.shape_rewards(np.zeros(B), x, x.T, 0.1)
