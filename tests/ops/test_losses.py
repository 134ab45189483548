"""Aggregation and the policy, value, DPO and reward-model losses."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxrlhf import ops
from . import inputs, reference

B, T = 5, 6
MODES = ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm"]


def _batch(seed, n_arrays):
    rng = np.random.default_rng(seed)
    arrays = (0.5 * rng.standard_normal((n_arrays, B, T))).astype(np.float32)
    return arrays, inputs.random_mask(rng, B, T)


@pytest.mark.parametrize("mode", MODES)
def test_aggregate_matches_reference(mode):
    (x,), mask = _batch(0, 1)
    got = ops.aggregate(x, mask, mode=mode, norm_len=T)
    np.testing.assert_allclose(got, reference.aggregate(x, mask, mode, T), rtol=1e-5)


def test_aggregate_hand_values():
    # x = [[1, 2, pad], [3, pad, pad], [pad, pad, pad]] (third sequence empty), L = 4:
    #   token-mean              = (1 + 2 + 3) / 3 = 2
    #   seq-mean-token-mean     = (1.5 + 3 + 0) / 3 = 1.5   (the empty one counts as 0)
    #   seq-mean-token-sum      = (3 + 3 + 0) / 3 = 2
    #   seq-mean-token-sum-norm = 6 / (3 · 4) = 0.5
    x = jnp.array([[1.0, 2.0, np.nan], [3.0, 5.0, 5.0], [7.0, 7.0, 7.0]])
    mask = inputs.prefix_mask([2, 1, 0], 3)
    expected = {MODES[0]: 2.0, MODES[1]: 1.5, MODES[2]: 2.0, MODES[3]: 0.5}
    for mode, value in expected.items():
        np.testing.assert_allclose(ops.aggregate(x, mask, mode=mode, norm_len=4), value)
    np.testing.assert_array_equal(ops.aggregate(x, np.zeros((3, 3)), mode="token-mean"), 0.0)


def test_aggregate_bad_arguments():
    x = np.zeros((B, T))
    with pytest.raises(ValueError, match="needs `norm_len`"):
        ops.aggregate(x, x, mode="seq-mean-token-sum-norm")
    with pytest.raises(ValueError, match="valid choices are 'token-mean', 'seq-mean-token-mean'"):
        ops.aggregate(x, x, mode="mean")


@pytest.mark.parametrize(
    "kwargs",
    [
        {},
        {"clip_low": 0.2, "clip_high": 0.28, "agg": "seq-mean-token-mean"},
        {"dual_clip": 3.0, "agg": "seq-mean-token-sum-norm", "norm_len": 8},
    ],
)
def test_policy_loss_matches_reference(kwargs):
    (logp, old, adv), mask = _batch(1, 3)
    adv = 4.0 * adv  # large advantages so that the dual clip binds somewhere
    loss, metrics = ops.policy_loss(logp, old, adv, mask, **kwargs)
    ref_loss, ref_metrics = reference.policy_loss(logp, old, adv, mask, **kwargs)
    np.testing.assert_allclose(loss, ref_loss, rtol=1e-5, atol=1e-6)
    for name, value in ref_metrics.items():
        np.testing.assert_allclose(metrics[name], value, rtol=1e-5, atol=1e-6, err_msg=name)
    assert ("dual_clipfrac" in metrics) == ("dual_clip" in kwargs)


def test_policy_loss_hand_values():
    # ε = 0.2. Token 0: A = 1, ρ = e^{0.5} = 1.65 > 1.2 → max(−1.65, −1.2) = −1.2 (clipped).
    # Token 1: A = −1, ρ = 1 → max(1, 1) = 1 (not clipped). token-mean = (−1.2 + 1)/2 = −0.1.
    loss, metrics = ops.policy_loss(
        jnp.array([[0.5, 0.0]]), jnp.zeros((1, 2)), jnp.array([[1.0, -1.0]]), jnp.ones((1, 2))
    )
    np.testing.assert_allclose(loss, -0.1, rtol=1e-6)
    np.testing.assert_allclose(metrics["clipfrac"], 0.5)
    # Dual clip c = 3: A = −1, ρ = e^{2} = 7.39: max(7.39, 1.2) = 7.39 → min(7.39, 3) = 3.
    loss, metrics = ops.policy_loss(
        jnp.array([[2.0]]), jnp.zeros((1, 1)), jnp.array([[-1.0]]), jnp.ones((1, 1)), dual_clip=3.0
    )
    np.testing.assert_allclose(loss, 3.0)
    np.testing.assert_allclose(metrics["dual_clipfrac"], 1.0)


def test_policy_loss_gradient_is_zero_where_clipped():
    (logp, old, adv), mask = _batch(2, 3)
    logp = old + 3.0 * (logp - old)  # spread the ratios well beyond the clip range
    adv = 4.0 * adv
    kwargs = {"clip_low": 0.2, "clip_high": 0.28, "dual_clip": 3.0}
    grad = jax.grad(lambda lp: ops.policy_loss(lp, old, adv, mask, **kwargs)[0])(logp)
    ratio = np.exp(logp.astype(np.float64) - old)
    unclipped = -adv * ratio
    clipped = -adv * np.clip(ratio, 0.8, 1.28)
    active = clipped > unclipped
    dual = (adv < 0) & (-3.0 * adv < np.maximum(unclipped, clipped))
    constant = mask & (active | dual)
    assert constant.any() and (mask & ~constant).any()
    np.testing.assert_array_equal(np.asarray(grad)[constant], 0.0)
    assert np.all(np.asarray(grad)[mask & ~constant & (adv != 0)] != 0.0)
    np.testing.assert_array_equal(np.asarray(grad)[~mask], 0.0)


@pytest.mark.parametrize("clip", [0.2, None])
@pytest.mark.parametrize("agg", ["token-mean", "seq-mean-token-sum"])
def test_value_loss_matches_reference(clip, agg):
    (values, old, returns), mask = _batch(3, 3)
    loss, metrics = ops.value_loss(values, old, returns, mask, clip=clip, agg=agg)
    ref_loss, ref_metrics = reference.value_loss(values, old, returns, mask, clip, agg)
    np.testing.assert_allclose(loss, ref_loss, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(metrics["clipfrac"], ref_metrics["clipfrac"], rtol=1e-6)


def test_value_loss_hand_values():
    # V = 1, V_old = 0, R = 2, ε = 0.2: V_clip = 0.2; ½·max((1 − 2)², (0.2 − 2)²) = ½·3.24.
    loss, metrics = ops.value_loss(jnp.ones((1, 1)), jnp.zeros((1, 1)), 2 * jnp.ones((1, 1)), jnp.ones((1, 1)))
    np.testing.assert_allclose(loss, 1.62, rtol=1e-6)
    np.testing.assert_allclose(metrics["clipfrac"], 1.0)


def test_value_clipfrac_is_zero_inside_the_clip_range_despite_rounding():
    # Values that moved by less than ε, some across 0: (V − V_old) + V_old is not always V
    # in float32, which must not count as a clipped token.
    rng = np.random.default_rng(7)
    old = (0.1 * rng.standard_normal((8, 64))).astype(np.float32)
    values = (old + rng.uniform(-0.19, 0.19, old.shape)).astype(np.float32)
    returns = (old + 5.0 * rng.standard_normal(old.shape)).astype(np.float32)
    mask = np.ones(old.shape, bool)
    assert np.any((old + (values - old)) != values)  # the rounding this test is about
    loss, metrics = ops.value_loss(values, old, returns, mask, clip=0.2)
    assert float(metrics["clipfrac"]) == 0.0
    np.testing.assert_allclose(loss, 0.5 * np.mean((values.astype(np.float64) - returns) ** 2), rtol=1e-5)


@pytest.mark.parametrize(
    "loss_type, label_smoothing", [("sigmoid", 0.0), ("sigmoid", 0.1), ("ipo", 0.0), ("hinge", 0.0)]
)
def test_dpo_loss_matches_reference(loss_type, label_smoothing):
    rng = np.random.default_rng(4)
    logps = (-20.0 + 5.0 * rng.standard_normal((4, 7))).astype(np.float32)
    loss, metrics = ops.dpo_loss(*logps, beta=0.5, loss_type=loss_type, label_smoothing=label_smoothing)
    ref_loss, ref_metrics = reference.dpo_loss(*logps, 0.5, loss_type, label_smoothing)
    np.testing.assert_allclose(loss, ref_loss, rtol=1e-5)
    for name, value in ref_metrics.items():
        np.testing.assert_allclose(metrics[name], value, rtol=1e-5, err_msg=name)


def test_dpo_loss_hand_values():
    # β = 0.1, (π_c − ref_c) − (π_r − ref_r) = (−10 + 12) − (−12 + 10) = 4 → z = 0.4.
    # sigmoid: −log σ(0.4) = log(1 + e^{−0.4}) = 0.5130; hinge: 1 − 0.4 = 0.6;
    # ipo: (0.4/0.1 − 1/0.2)² = (4 − 5)² = 1.
    args = [jnp.array([x]) for x in (-10.0, -12.0, -12.0, -10.0)]
    np.testing.assert_allclose(ops.dpo_loss(*args)[0], np.log1p(np.exp(-0.4)), rtol=1e-5)
    np.testing.assert_allclose(ops.dpo_loss(*args, loss_type="hinge")[0], 0.6, rtol=1e-5)
    np.testing.assert_allclose(ops.dpo_loss(*args, loss_type="ipo")[0], 1.0, rtol=1e-4)
    metrics = ops.dpo_loss(*args)[1]
    np.testing.assert_allclose([metrics["chosen_reward"], metrics["rejected_reward"]], [0.2, -0.2], rtol=1e-5)
    assert metrics["reward_accuracy"] == 1.0


@pytest.mark.parametrize("margin", [None, 0.5, "per-pair"])
def test_reward_model_loss_matches_reference(margin):
    rng = np.random.default_rng(5)
    chosen, rejected = (3.0 * rng.standard_normal((2, 6))).astype(np.float32)
    if margin == "per-pair":
        margin = rng.uniform(0, 1, 6).astype(np.float32)
    loss, metrics = ops.reward_model_loss(chosen, rejected, margin)
    ref_loss, ref_metrics = reference.reward_model_loss(chosen, rejected, margin)
    np.testing.assert_allclose(loss, ref_loss, rtol=1e-5)
    np.testing.assert_allclose(metrics["accuracy"], ref_metrics["accuracy"])


def test_reward_model_loss_is_stable_for_large_gaps():
    # −log σ(−200) = 200 (a naive log(sigmoid) would give inf); −log σ(200) ≈ 0.
    loss, _ = ops.reward_model_loss(jnp.array([-100.0, 100.0]), jnp.array([100.0, -100.0]))
    np.testing.assert_allclose(loss, 100.0, rtol=1e-6)
    grad = jax.grad(lambda c: ops.reward_model_loss(c, jnp.array([100.0, -100.0]))[0])(
        jnp.array([-100.0, 100.0])
    )
    assert np.all(np.isfinite(grad))


def test_loss_bad_arguments():
    x = np.zeros((B, T))
    with pytest.raises(ValueError, match="`dual_clip` must be > 1"):
        ops.policy_loss(x, x, x, x, dual_clip=1.0)
    with pytest.raises(ValueError, match=r"`advantages` must have shape \[B, T\] = \(5, 6\) like `logp`"):
        ops.policy_loss(x, x, x[:, :2], x)
    with pytest.raises(ValueError, match="valid choices are 'token-mean'"):
        ops.policy_loss(x, x, x, x, agg="sum")
    with pytest.raises(ValueError, match=r"`returns` must have shape"):
        ops.value_loss(x, x, x.T, x)
    with pytest.raises(ValueError, match="valid choices are 'sigmoid', 'ipo', 'hinge'"):
        ops.dpo_loss(x[0], x[0], x[0], x[0], loss_type="kto")
    with pytest.raises(ValueError, match=r"`ref_rejected_logp` must have shape \[B\]"):
        ops.dpo_loss(x[0], x[0], x[0], x[0, :2])
    with pytest.raises(ValueError, match="label_smoothing"):
        ops.dpo_loss(x[0], x[0], x[0], x[0], loss_type="ipo", label_smoothing=0.1)
    with pytest.raises(ValueError, match=r"`margin` must have shape \[B\]"):
        ops.reward_model_loss(x[0], x[0], x[0, :2])


@pytest.mark.parametrize(
    "kwargs",
    [{}, {"clip_high": 0.28, "dual_clip": 3.0, "agg": "seq-mean-token-mean"},
     {"agg": "seq-mean-token-sum-norm", "norm_len": 8}],
)
def test_policy_loss_with_is_weights_matches_reference(kwargs):
    (logp, old, adv, w), mask = _batch(8, 4)
    adv, w = 4.0 * adv, np.exp(w)
    loss, metrics = ops.policy_loss(logp, old, adv, mask, is_weights=w, **kwargs)
    ref_loss, ref_metrics = reference.policy_loss(logp, old, adv, mask, is_weights=w, **kwargs)
    np.testing.assert_allclose(loss, ref_loss, rtol=1e-5, atol=1e-6)
    for name, value in ref_metrics.items():
        np.testing.assert_allclose(metrics[name], value, rtol=1e-5, atol=1e-6, err_msg=name)
    # The gradient is the unweighted one times w, token by token; none flows into w.
    grad = jax.grad(lambda lp: ops.policy_loss(lp, old, adv, mask, is_weights=w, **kwargs)[0])(logp)
    plain = jax.grad(lambda lp: ops.policy_loss(lp, old, adv, mask, **kwargs)[0])(logp)
    np.testing.assert_allclose(grad, w * plain, rtol=1e-5, atol=1e-7)
    grad_w = jax.grad(lambda w: ops.policy_loss(logp, old, adv, mask, is_weights=w, **kwargs)[0])(w)
    np.testing.assert_array_equal(grad_w, 0.0)


def test_policy_loss_without_is_weights_is_unchanged_bit_for_bit():
    # None is today's loss exactly; weights of ones give the same numbers.
    (logp, old, adv), mask = _batch(9, 3)
    fn = jax.jit(lambda *a: ops.policy_loss(*a, clip_high=0.3, dual_clip=2.0))
    base = fn(logp, old, adv, mask)
    jax.tree.map(np.testing.assert_array_equal,
                 jax.jit(lambda *a: ops.policy_loss(*a, clip_high=0.3, dual_clip=2.0, is_weights=None))(
                     logp, old, adv, mask), base)
    ones = ops.policy_loss(logp, old, adv, mask, clip_high=0.3, dual_clip=2.0, is_weights=np.ones((B, T)))
    jax.tree.map(lambda g, w: np.testing.assert_allclose(g, w, rtol=1e-6, atol=1e-7), ones, base)


@pytest.mark.parametrize(
    "kwargs",
    [{}, {"clip_low": 0.2, "clip_high": 0.28}, {"is_weights": "random"},
     {"clip_low": 0.1, "clip_high": 0.1, "agg": "seq-mean-token-sum-norm", "norm_len": 8}],
)
def test_cispo_loss_matches_reference(kwargs):
    (logp, old, adv, w), mask = _batch(10, 4)
    if "is_weights" in kwargs:
        kwargs = {**kwargs, "is_weights": np.exp(w)}
    loss, metrics = ops.cispo_loss(logp, old, adv, mask, **kwargs)
    ref_loss, ref_metrics, ref_grad = reference.cispo_loss(logp, old, adv, mask, **kwargs)
    np.testing.assert_allclose(loss, ref_loss, rtol=1e-5, atol=1e-6)
    for name, value in ref_metrics.items():
        np.testing.assert_allclose(metrics[name], value, rtol=1e-5, atol=1e-6, err_msg=name)
    if kwargs.get("clip_low") == 0.2:
        assert 0 < float(metrics["clipfrac"]) < 1
    if kwargs.get("agg", "token-mean") == "token-mean":
        # Every valid token gets the REINFORCE gradient with the clipped ratio held constant,
        # clipped or not (PPO's clip would zero it); padding gets exactly 0.
        grad = jax.grad(lambda lp: ops.cispo_loss(lp, old, adv, mask, **kwargs)[0])(logp)
        np.testing.assert_allclose(grad, ref_grad, rtol=1e-5, atol=1e-7)
        assert np.all(np.asarray(grad)[mask & (adv != 0)] != 0.0)
        np.testing.assert_array_equal(np.asarray(grad)[~mask], 0.0)


def test_cispo_loss_hand_values():
    # ρ = e^{0.5} = 1.649 clipped to 1.2 (ε_high = 0.2), A = 2, logp = 0.5, w = 0.5:
    # l = −0.5·1.2·2·0.5 = −0.6. The default ε_low = 1 never clips from below: ρ = e^{−3}
    # stays, and with A = 1, logp = −3: l = −e^{−3}·1·(−3) = 3e^{−3}.
    loss, metrics = ops.cispo_loss(jnp.array([[0.5]]), jnp.zeros((1, 1)), jnp.array([[2.0]]), jnp.ones((1, 1)),
                                   clip_high=0.2, is_weights=jnp.array([[0.5]]))
    np.testing.assert_allclose(loss, -0.6, rtol=1e-6)
    np.testing.assert_allclose(metrics["clipfrac"], 1.0)
    loss, metrics = ops.cispo_loss(jnp.array([[-3.0]]), jnp.zeros((1, 1)), jnp.ones((1, 1)), jnp.ones((1, 1)))
    np.testing.assert_allclose(loss, 3.0 * np.exp(-3.0), rtol=1e-6)
    assert float(metrics["clipfrac"]) == 0.0


def test_new_loss_bad_arguments():
    x = np.zeros((B, T))
    with pytest.raises(ValueError, match=r"policy_loss: `is_weights` must have shape \[B, T\] = \(5, 6\) like `logp`"):
        ops.policy_loss(x, x, x, x, is_weights=x[:, :2])
    with pytest.raises(ValueError, match=r"cispo_loss: `is_weights` must have shape"):
        ops.cispo_loss(x, x, x, x, is_weights=x[0])
    with pytest.raises(ValueError, match="cispo_loss: `clip_high` must be > 0"):
        ops.cispo_loss(x, x, x, x, clip_high=0.0)
    with pytest.raises(ValueError, match="cispo_loss: `clip_low` must be > 0"):
        ops.cispo_loss(x, x, x, x, clip_low=-0.1)
    with pytest.raises(ValueError, match=r"cispo_loss: `advantages` must have shape"):
        ops.cispo_loss(x, x, x.T, x)
    with pytest.raises(ValueError, match="cispo_loss: unknown agg"):
        ops.cispo_loss(x, x, x, x, agg="sum")
    with pytest.raises(ValueError, match="needs `norm_len`"):
        ops.cispo_loss(x, x, x, x, agg="seq-mean-token-sum-norm")
