"""GAE, group advantages and whitening against loop references and hand values."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from jaxrlhf import ops
from . import inputs, reference

B, T = 5, 8
METHODS = ["scan", "associative", "blocked", "auto"]


def _rewards_values(seed):
    rng = np.random.default_rng(seed)
    rewards, values = rng.standard_normal((2, B, T)).astype(np.float32)
    return rewards, values, inputs.random_mask(rng, B, T)


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("gamma, lam", [(1.0, 0.95), (0.9, 0.8), (1.0, 1.0), (0.99, 0.0)])
def test_gae_matches_reference(method, gamma, lam):
    rewards, values, mask = _rewards_values(0)
    out = ops.gae(rewards, values, mask, gamma=gamma, lam=lam, method=method)
    adv, ret = reference.gae(rewards, values, mask, gamma, lam)
    assert isinstance(out, ops.GAEOutput)
    np.testing.assert_allclose(out.advantages, adv, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(out.returns, ret, rtol=1e-5, atol=1e-5)


def test_gae_hand_values():
    # One valid token (then padding with a value that must be ignored):
    #   δ_0 = r_0 + γ·V_1·m_1 − V_0 = 1 + 1·5·0 − 0.25 = 0.75;  A_0 = δ_0 = 0.75;
    #   R_0 = A_0 + V_0 = 1.0.
    adv, ret = ops.gae(jnp.array([[1.0, 2.0]]), jnp.array([[0.25, 5.0]]), jnp.array([[1, 0]]))
    np.testing.assert_allclose(adv, [[0.75, 0.0]])
    np.testing.assert_allclose(ret, [[1.0, 0.0]])
    # Two tokens, γ = 1, λ = 0.5, r = [0, 1], V = [0.5, 0.25]:
    #   δ_1 = 1 − 0.25 = 0.75 (no bootstrap after the last token), A_1 = 0.75;
    #   δ_0 = 0 + 0.25 − 0.5 = −0.25, A_0 = −0.25 + 0.5·0.75 = 0.125.
    adv, ret = ops.gae(jnp.array([[0.0, 1.0]]), jnp.array([[0.5, 0.25]]), jnp.ones((1, 2)), lam=0.5)
    np.testing.assert_allclose(adv, [[0.125, 0.75]])
    np.testing.assert_allclose(ret, [[0.625, 1.0]])


def test_gae_methods_agree_on_long_sequences():
    rng = np.random.default_rng(1)
    rewards, values = rng.standard_normal((2, 3, 200)).astype(np.float32)
    mask = inputs.prefix_mask([0, 150, 200], 200)
    scan = jax.jit(lambda *a: ops.gae(*a, method="scan"))(rewards, values, mask)
    for method in ("associative", "blocked"):
        other = jax.jit(lambda *a: ops.gae(*a, method=method))(rewards, values, mask)
        np.testing.assert_allclose(other.advantages, scan.advantages, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("traced", [False, True], ids=["float-decay", "traced-decay"])
def test_blocked_gae_over_several_blocks_matches_reference(traced):
    # 70 tokens: two full blocks and a ragged third. Python-float γ, λ build the power
    # matrices as constants; traced ones (γ, λ as jit arguments) build them in the program.
    rng = np.random.default_rng(2)
    rewards, values = rng.standard_normal((2, 4, 70)).astype(np.float32)
    mask = inputs.prefix_mask([0, 1, 33, 70], 70)
    gamma, lam = 0.99, 0.9
    if traced:
        fn = jax.jit(lambda r, v, m, g, l: ops.gae(r, v, m, g, l, method="blocked"))
        out = fn(rewards, values, mask, jnp.float32(gamma), jnp.float32(lam))
    else:
        out = ops.gae(rewards, values, mask, gamma, lam, method="blocked")
    adv, ret = reference.gae(rewards, values, mask, gamma, lam)
    np.testing.assert_allclose(out.advantages, adv, rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(out.returns, ret, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("method", METHODS)
def test_gae_masks_with_holes_follow_the_formula(method):
    # Holes in the mask are an episode's environment tokens: GAE runs over the policy tokens
    # t_1 < … < t_n alone (docs/concepts.md#gae-over-a-mask-with-holes), whatever the method.
    rewards, values, mask = _rewards_values(5)
    mask[:, 0] = True
    mask[:, 3] = False
    out = ops.gae(rewards, values, mask, method=method)
    adv, ret = reference.gae_policy_tokens(rewards, values, mask)
    np.testing.assert_allclose(out.advantages, adv, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(out.returns, ret, rtol=1e-5, atol=1e-5)
    jitted = jax.jit(lambda *a: ops.gae(*a, method=method))(rewards, values, mask)
    _assert_trees_close(jitted, out, rtol=1e-6, atol=1e-6)


def test_gae_hand_values_with_holes():
    # test_gae_hand_values' second case with an environment token (garbage reward and value)
    # between the two policy tokens: nothing changes, and the hole gets 0.
    #   δ_2 = 1 − 0.25 = 0.75, A_2 = 0.75;  δ_0 = 0 + V_2 − V_0 = −0.25, A_0 = −0.25 + 0.5·0.75.
    for method in METHODS:
        adv, ret = ops.gae(jnp.array([[0.0, 9.0, 1.0]]), jnp.array([[0.5, jnp.nan, 0.25]]),
                           jnp.array([[1, 0, 1]]), lam=0.5, method=method)
        np.testing.assert_allclose(adv, [[0.125, 0.0, 0.75]])
        np.testing.assert_allclose(ret, [[0.625, 0.0, 1.0]])


def test_policy_token_reference_is_the_per_position_form_on_prefix_masks():
    rng = np.random.default_rng(6)
    rewards, values = rng.standard_normal((2, 6, 40))
    mask = inputs.random_mask(rng, 6, 40)
    for got, want in zip(reference.gae_policy_tokens(rewards, values, mask, 0.9, 0.8),
                         reference.gae(rewards, values, mask, 0.9, 0.8)):
        np.testing.assert_allclose(got, want, rtol=1e-12, atol=1e-12)


# Compiled once per shape (γ, λ traced): a few shapes, shared by all examples. 45 tokens
# span two blocks of "blocked"; "auto" is one of the three on any backend.
_HOLES_SHAPES = [(1, 1), (3, 8), (4, 45)]
_HOLES_PAD = 5
_jitted_gae = {m: jax.jit(lambda r, v, mk, g, l, m=m: ops.gae(r, v, mk, g, l, method=m))
               for m in ("scan", "associative", "blocked")}


def _assert_trees_close(got, want, **tol):
    jax.tree.map(lambda g, w: np.testing.assert_allclose(g, w, **tol), got, want)


@settings(max_examples=20, deadline=None)
@given(
    st.sampled_from(_HOLES_SHAPES),
    st.integers(0, 2**32 - 1),
    st.sampled_from([0.0, 0.3, 0.7]),
    st.sampled_from([(1.0, 0.95), (0.9, 0.8), (1.0, 1.0), (0.99, 0.0)]),
)
def test_gae_random_masks_with_holes(shape, seed, hole_p, gamma_lam):
    """Random masks with holes (hole_p = 0: contiguous prefixes), every method: the float64
    policy-token loop, padding invariance, and on a prefix mask the per-position form."""
    b, t = shape
    gamma, lam = gamma_lam
    rng = np.random.default_rng(seed)
    rewards, values = rng.standard_normal((2, b, t)).astype(np.float32)
    mask = inputs.holes_mask(rng, b, t, hole_p)
    adv, ret = reference.gae_policy_tokens(rewards, values, mask, gamma, lam)
    if hole_p == 0.0:
        old_adv, old_ret = reference.gae(rewards, values, mask, gamma, lam)
        np.testing.assert_allclose(adv, old_adv, rtol=1e-12, atol=1e-12)
        np.testing.assert_allclose(ret, old_ret, rtol=1e-12, atol=1e-12)
    padded = [inputs.pad_right(x, _HOLES_PAD, rng) for x in (rewards, values)]
    for method, jitted in _jitted_gae.items():
        out = jitted(rewards, values, mask, jnp.float32(gamma), jnp.float32(lam))
        np.testing.assert_allclose(out.advantages, adv, rtol=1e-4, atol=1e-4, err_msg=method)
        np.testing.assert_allclose(out.returns, ret, rtol=1e-4, atol=1e-4, err_msg=method)
        far = jitted(*padded, inputs.pad_mask(mask, _HOLES_PAD), jnp.float32(gamma), jnp.float32(lam))
        np.testing.assert_array_equal(np.asarray(far.advantages)[:, t:], 0.0)
        np.testing.assert_array_equal(np.asarray(far.returns)[:, t:], 0.0)
        np.testing.assert_allclose(far.advantages[:, :t], out.advantages, rtol=1e-6, atol=1e-6)
        np.testing.assert_allclose(far.returns[:, :t], out.returns, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("method", METHODS)
def test_gae_with_holes_gradients_finite_and_zero_off_the_policy(method):
    # Environment tokens and padding hold garbage (inf, NaN, 1e30): the gradients with
    # respect to rewards and values are finite, exactly 0 there, and those of the loop's
    # compacted rows on the policy tokens.
    rng = np.random.default_rng(7)
    rewards, values = rng.standard_normal((2, B, T)).astype(np.float32)
    mask = inputs.holes_mask(rng, B, T)
    garbage = rng.choice([1e30, -np.inf, np.nan, 7.0], size=(B, T)).astype(np.float32)
    rewards_g, values_g = (np.where(mask, x, garbage) for x in (rewards, values))
    weights = rng.standard_normal((2, B, T)).astype(np.float32)

    def total(fn, r, v, m):
        out = fn(r, v, m, gamma=0.9, lam=0.8, method=method)
        return jnp.sum(weights[0] * out.advantages) + jnp.sum(weights[1] * out.returns)

    grads = jax.jit(jax.grad(lambda r, v: total(ops.gae, r, v, mask), argnums=(0, 1)))(rewards_g, values_g)
    (r_c, m_c), (v_c, _) = inputs.compact(rewards, mask), inputs.compact(values, mask)
    weights = np.stack([inputs.compact(w, mask)[0] for w in weights])
    want = jax.grad(lambda r, v: total(ops.gae, r, v, m_c), argnums=(0, 1))(r_c, v_c)
    for g, w in zip(grads, want):
        assert np.all(np.isfinite(g))
        np.testing.assert_array_equal(np.asarray(g)[~mask], 0.0)
        np.testing.assert_allclose(g, inputs.expand(np.asarray(w), mask), rtol=1e-5, atol=1e-5)


def test_gae_vmap_mixes_prefix_and_hole_masks():
    # Under vmap the prefix check is per slice (both forms run, one is selected).
    rng = np.random.default_rng(9)
    rewards, values = rng.standard_normal((2, 2, B, T)).astype(np.float32)
    masks = np.stack([inputs.random_mask(rng, B, T), inputs.holes_mask(rng, B, T)])
    for method in ("scan", "associative", "blocked"):
        out = jax.jit(jax.vmap(lambda r, v, m: ops.gae(r, v, m, 0.9, 0.8, method=method)))(rewards, values, masks)
        for i in range(2):
            adv, ret = reference.gae_policy_tokens(rewards[i], values[i], masks[i], 0.9, 0.8)
            np.testing.assert_allclose(out.advantages[i], adv, rtol=1e-5, atol=1e-5)
            np.testing.assert_allclose(out.returns[i], ret, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("method", ["grpo", "dr_grpo", "rloo"])
def test_group_advantages_match_reference(method):
    scores = np.random.default_rng(2).standard_normal(12).astype(np.float32)
    got = ops.group_advantages(scores, 4, method=method)
    want = reference.group_advantages(scores, 4, method)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


def test_group_advantages_hand_values():
    # Group [1, 2, 3]: mean 2, unbiased std sqrt((1 + 0 + 1)/2) = 1.
    # grpo: [−1, 0, 1]/(1 + ε); dr_grpo: [−1, 0, 1]; rloo: 1 − (2+3)/2 = −1.5, 0, 1.5.
    s = jnp.array([1.0, 2.0, 3.0])
    np.testing.assert_allclose(ops.group_advantages(s, 3), [-1.0, 0.0, 1.0], rtol=1e-5)
    np.testing.assert_allclose(ops.group_advantages(s, 3, method="dr_grpo"), [-1.0, 0.0, 1.0])
    np.testing.assert_allclose(ops.group_advantages(s, 3, method="rloo"), [-1.5, 0.0, 1.5])



@pytest.mark.parametrize("method", ["grpo", "dr_grpo", "rloo"])
def test_masked_group_advantages_match_reference(method):
    # Groups of G = 4 with 4, 3, 2, 1 and 0 scored rows (the last two: no baseline, all 0).
    scores = np.random.default_rng(3).standard_normal(20).astype(np.float32)
    mask = np.array([1, 1, 1, 1, 1, 0, 1, 1, 0, 1, 0, 1, 0, 0, 1, 0, 0, 0, 0, 0], bool)
    want = reference.masked_group_advantages(scores, mask, 4, method)
    eager = ops.group_advantages(scores, 4, method=method, mask=mask)
    np.testing.assert_allclose(eager, want, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(_group_adv(scores, group_size=4, method=method, mask=mask), eager, rtol=1e-6,
                               atol=1e-6)  # jit = eager up to XLA's fused float32 rounding
    # An unscored row's score is ignored; a mask of ones is the unmasked form.
    np.testing.assert_array_equal(ops.group_advantages(np.where(mask, scores, 1e3), 4, method=method, mask=mask),
                                  eager)
    np.testing.assert_allclose(ops.group_advantages(scores, 4, method=method, mask=np.ones(20)),
                               ops.group_advantages(scores, 4, method=method), rtol=1e-6, atol=1e-6)
    grad = jax.grad(lambda s: jnp.sum(_group_adv(s, group_size=4, method=method, mask=mask) ** 2))(scores)
    assert np.all(np.isfinite(grad)) and np.all(grad[~mask] == 0)


def test_masked_group_advantages_hand_values():
    # Group [1, 5, 2, 3] with row 1 unscored: the group [1, 2, 3] of the hand values above.
    s, m = jnp.array([1.0, 5.0, 2.0, 3.0]), jnp.array([True, False, True, True])
    np.testing.assert_allclose(ops.group_advantages(s, 4, mask=m), [-1.0, 0.0, 0.0, 1.0], rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(ops.group_advantages(s, 4, method="rloo", mask=m), [-1.5, 0.0, 0.0, 1.5])
    with pytest.raises(ValueError, match=r"`mask` must have shape"):
        ops.group_advantages(s, 4, mask=jnp.ones(3))

_group_adv = jax.jit(ops.group_advantages, static_argnames=("group_size", "method"))


@settings(max_examples=25, deadline=None)
@given(
    st.lists(st.floats(-1e3, 1e3, width=32), min_size=3, max_size=3),
    st.sampled_from(["grpo", "dr_grpo", "rloo"]),
)
def test_equal_scores_give_zero_never_nan(group_values, method):
    # Three groups of G = 4, each group with one repeated score.
    scores = np.repeat(np.asarray(group_values, np.float32), 4)
    adv = _group_adv(scores, group_size=4, method=method)
    np.testing.assert_array_equal(adv, np.zeros(12))
    grad = jax.grad(lambda s: jnp.sum(_group_adv(s, group_size=4, method=method) ** 2))(scores)
    assert np.all(np.isfinite(grad))


def test_group_advantages_bad_arguments():
    with pytest.raises(ValueError, match="N = 7 entries, not a multiple of group_size = 2"):
        ops.group_advantages(jnp.zeros(7), 2)
    with pytest.raises(ValueError, match="`group_size` must be an int >= 2"):
        ops.group_advantages(jnp.zeros(4), 1)
    with pytest.raises(ValueError, match="valid choices are 'grpo', 'dr_grpo', 'rloo'"):
        ops.group_advantages(jnp.zeros(4), 2, method="ppo")
    with pytest.raises(ValueError, match=r"`scores` must have shape \[N\]"):
        ops.group_advantages(jnp.zeros((2, 2)), 2)


@pytest.mark.parametrize("shift_mean", [True, False])
def test_whiten_matches_reference(shift_mean):
    rng = np.random.default_rng(3)
    x = (3.0 + 2.0 * rng.standard_normal((B, T))).astype(np.float32)
    mask = inputs.random_mask(rng, B, T)
    got = ops.whiten(x, mask, shift_mean=shift_mean)
    np.testing.assert_allclose(got, reference.whiten(x, mask, shift_mean), rtol=1e-5, atol=1e-5)


def test_whiten_hand_values_and_empty_batch():
    # Valid [1, 3]: μ = 2, σ² = 1 → [−1, 1]/sqrt(1 + 1e-8); padding comes out 0.
    got = ops.whiten(jnp.array([[1.0, 3.0, 100.0]]), jnp.array([[1, 1, 0]]))
    np.testing.assert_allclose(got, [[-1.0, 1.0, 0.0]], rtol=1e-6)
    np.testing.assert_array_equal(ops.whiten(jnp.ones((2, 3)), jnp.zeros((2, 3))), 0.0)


def test_broadcast_sequence():
    got = ops.broadcast_sequence(jnp.array([2.0, -1.0]), jnp.array([[1, 1, 0], [1, 0, 0]]))
    np.testing.assert_array_equal(got, [[2.0, 2.0, 0.0], [-1.0, 0.0, 0.0]])


def test_gae_bad_arguments():
    rewards, values, mask = _rewards_values(4)
    with pytest.raises(ValueError, match=r"gae: `values` must have shape \[B, T\] = \(5, 8\) like `rewards`, got \(5, 7\)"):
        ops.gae(rewards, values[:, :-1], mask)
    with pytest.raises(ValueError, match="`mask` must have shape"):
        ops.gae(rewards, values, mask[:1])
    with pytest.raises(ValueError, match=r"`rewards` must have shape \[B, T\] \(rank 2\)"):
        ops.gae(rewards[0], values[0], mask[0])
    with pytest.raises(ValueError, match="valid choices are 'auto', 'scan', 'associative', 'blocked'"):
        ops.gae(rewards, values, mask, method="loop")


_gdpo = jax.jit(ops.gdpo_advantages, static_argnames=("group_size",))
# Groups of G = 4 with 4, 3, 2, 1 and 0 scored rows.
GDPO_MASK = np.array([1, 1, 1, 1, 1, 0, 1, 1, 0, 1, 0, 1, 0, 0, 1, 0, 0, 0, 0, 0], bool)


@pytest.mark.parametrize("weights", [None, [1.0, 0.5, 2.0]])
@pytest.mark.parametrize("masked", [False, True], ids=["all-scored", "mask"])
def test_gdpo_advantages_match_reference(weights, masked):
    rng = np.random.default_rng(6)
    # Component 0 binary (equal-score groups happen), 1 continuous, 2 on another scale.
    scores = np.stack([rng.integers(0, 2, 20), rng.standard_normal(20), 100 * rng.standard_normal(20)],
                      axis=1).astype(np.float32)
    scores[4:8, 0] = 1.0  # one group all correct on component 0
    mask = GDPO_MASK if masked else None
    want = reference.gdpo_advantages(scores, 4, weights, mask=mask)
    eager = ops.gdpo_advantages(scores, 4, weights=weights, mask=mask)
    np.testing.assert_allclose(eager, want, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(_gdpo(scores, group_size=4, weights=weights, mask=mask), eager, rtol=1e-5, atol=1e-6)
    if masked:
        # An unscored row's scores are ignored and it gets 0; a float mask is a bool mask.
        np.testing.assert_array_equal(eager[~GDPO_MASK], 0.0)
        garbage = np.where(GDPO_MASK[:, None], scores, np.nan)
        np.testing.assert_array_equal(ops.gdpo_advantages(garbage, 4, weights=weights, mask=mask), eager)
        np.testing.assert_array_equal(
            ops.gdpo_advantages(scores, 4, weights=weights, mask=GDPO_MASK.astype(np.float32)), eager)
    grad = jax.grad(lambda s: jnp.sum(_gdpo(s, group_size=4, weights=weights, mask=mask) ** 3))(scores)
    assert np.all(np.isfinite(grad))
    if masked:
        np.testing.assert_array_equal(grad[~GDPO_MASK], 0.0)
    # bf16 in, float32 math on the rounded numbers.
    low = jnp.asarray(scores, jnp.bfloat16)
    out = ops.gdpo_advantages(low, 4, weights=weights, mask=mask)
    assert out.dtype == jnp.float32
    np.testing.assert_allclose(out, ops.gdpo_advantages(low.astype(jnp.float32), 4, weights=weights, mask=mask),
                               rtol=1e-6, atol=1e-6)


def test_gdpo_advantages_hand_values():
    # One group of G = 2, K = 2: component 0 = [1, 0]: mean 0.5, std 0.5 → z ≈ [1, −1];
    # component 1 = [3, 3] (equal) → 0. a = [1, −1] (w = 1); batch mean 0, std 1 → [1, −1].
    got = ops.gdpo_advantages(jnp.array([[1.0, 3.0], [0.0, 3.0]]), 2)
    np.testing.assert_allclose(got, [1.0, -1.0], rtol=1e-5)
    # Equal scores everywhere: exactly 0, never NaN, with a finite gradient.
    scores = jnp.full((8, 3), 0.3)
    np.testing.assert_array_equal(ops.gdpo_advantages(scores, 4), 0.0)
    assert np.all(np.isfinite(jax.grad(lambda s: jnp.sum(ops.gdpo_advantages(s, 4) ** 2))(scores)))
    # Group [(1, 0), (0, 1), (0, 0), (1, 1)], w = [2, 1]: z_0 = [1, −1, −1, 1],
    # z_1 = [−1, 1, −1, 1], a = 2·z_0 + z_1 = [1, −1, −3, 3]: (1, 0) and (0, 1) stay apart.
    got = ops.gdpo_advantages(jnp.array([[1.0, 0.0], [0.0, 1.0], [0.0, 0.0], [1.0, 1.0]]), 4, weights=[2.0, 1.0])
    assert got[0] > got[1] > got[2] and got[3] > got[0]


def test_gdpo_advantages_bad_arguments():
    with pytest.raises(ValueError, match=r"gdpo_advantages: `scores` must have shape \[N, K\]"):
        ops.gdpo_advantages(jnp.zeros(8), 4)
    with pytest.raises(ValueError, match="gdpo_advantages: `scores` has N = 7 entries, not a multiple"):
        ops.gdpo_advantages(jnp.zeros((7, 2)), 2)
    with pytest.raises(ValueError, match="gdpo_advantages: `group_size` must be an int >= 2"):
        ops.gdpo_advantages(jnp.zeros((8, 2)), 1)
    with pytest.raises(ValueError, match=r"gdpo_advantages: `weights` must have shape \[K\] = \(2,\)"):
        ops.gdpo_advantages(jnp.zeros((8, 2)), 4, weights=[1.0, 2.0, 3.0])
    with pytest.raises(ValueError, match=r"gdpo_advantages: `mask` must have shape \[N\] = \(8,\)"):
        ops.gdpo_advantages(jnp.zeros((8, 2)), 4, mask=jnp.ones(4))


def test_distillation_advantages():
    rng = np.random.default_rng(7)
    teacher, old = (-1.0 + rng.standard_normal((2, B, T))).astype(np.float32)
    mask = inputs.random_mask(rng, B, T)
    want = reference.distillation_advantages(teacher, old, mask)
    got = ops.distillation_advantages(teacher, old, mask)
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(jax.jit(ops.distillation_advantages)(teacher, old, mask.astype(np.float32)), got,
                               rtol=1e-6, atol=1e-6)
    grads = jax.grad(lambda t, o: jnp.sum(ops.distillation_advantages(t, o, mask)), argnums=(0, 1))(teacher, old)
    for g in grads:  # a stop-gradient advantage
        np.testing.assert_array_equal(g, 0.0)
    np.testing.assert_allclose(
        ops.distillation_advantages(jnp.array([[-0.5, -2.0, np.nan]]), jnp.array([[-1.5, -1.0, 3.0]]),
                                    jnp.array([[1, 1, 0]])), [[1.0, -1.0, 0.0]])
    with pytest.raises(ValueError, match=r"distillation_advantages: `old_logp` must have shape \[B, T\]"):
        ops.distillation_advantages(teacher, old[:, 1:], mask)


@pytest.mark.parametrize("scored", [None, "some"])
def test_reinforce_pp_baseline_matches_reference(scored):
    # The registered GRPO-family estimator (algorithms.advantages): group mean out, then
    # whitening over the valid tokens of the scored rows.
    from types import SimpleNamespace

    from jaxrlhf.algorithms import advantages

    rng = np.random.default_rng(8)
    scores = rng.standard_normal(12).astype(np.float32)
    mask = inputs.random_mask(rng, 12, T).astype(np.float32)
    if scored is not None:
        scored = np.array([1, 1, 1, 0, 1, 0, 1, 1, 1, 1, 1, 1], bool)
    cfg = SimpleNamespace(group_size=4, adv_eps=1e-6)
    got = advantages.estimate("reinforce_pp_baseline", scores, mask, cfg, scored)
    want = reference.reinforce_pp_baseline(scores, mask, 4, scored)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    if scored is not None:
        np.testing.assert_array_equal(np.asarray(got)[~scored], 0.0)
        # Calling the estimator itself, unscored rows' tokens still in the mask: the same.
        direct = advantages.ADVANTAGE_ESTIMATORS["reinforce_pp_baseline"](scores, mask, cfg, scored)
        np.testing.assert_allclose(direct, got, rtol=1e-6, atol=1e-6)
    assert "reinforce_pp_baseline" in advantages.GROUPED
