"""Properties every masked primitive must have (docs/concepts.md#shapes-masks-and-the-one-shift,
docs/concepts.md#the-primitives-api).

For each function of `[B, T]` response-aligned inputs and a mask: extra right-padding with
garbage changes nothing; jit equals eager; vmap over an extra leading axis equals a loop;
gradients are finite and exactly zero on padding; bf16 inputs give float32 outputs equal
to the float32 computation on the same numbers; a float mask equals a bool mask.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxrlhf import ops
from . import inputs

B, T, PAD = 4, 6, 3
SCORES = np.array([1.0, -2.0, 0.5, 3.0], np.float32)

# name -> (number of [B, T] float inputs, function of (*inputs, mask))
CASES = {
    "gae[scan]": (2, lambda r, v, m: ops.gae(r, v, m, gamma=0.9, method="scan")),
    "gae[associative]": (2, lambda r, v, m: ops.gae(r, v, m, gamma=0.9, method="associative")),
    "gae[blocked]": (2, lambda r, v, m: ops.gae(r, v, m, gamma=0.9, method="blocked")),
    "whiten": (1, lambda x, m: ops.whiten(x, m)),
    "whiten[no shift]": (1, lambda x, m: ops.whiten(x, m, shift_mean=False)),
    "shape_rewards": (1, lambda k, m: ops.shape_rewards(SCORES, k, m, 0.1)),
    "approx_kl": (2, ops.approx_kl),
    "sequence_logprobs": (1, ops.sequence_logprobs),
    "masked_mean": (1, ops.masked_mean),
    "masked_var": (1, lambda x, m: ops.masked_var(x, m, axis=1)),
    "aggregate[seq-mean-token-mean]": (
        1, lambda x, m: ops.aggregate(x, m, mode="seq-mean-token-mean")
    ),
    "aggregate[seq-mean-token-sum-norm]": (
        1, lambda x, m: ops.aggregate(x, m, mode="seq-mean-token-sum-norm", norm_len=T)
    ),
    "policy_loss": (
        3, lambda lp, old, a, m: ops.policy_loss(lp, old, a, m, clip_high=0.3, dual_clip=2.0)
    ),
    "value_loss": (3, lambda v, old, r, m: ops.value_loss(v, old, r, m, clip=0.2)),
    "policy_loss[is_weights]": (
        4, lambda lp, old, a, w, m: ops.policy_loss(lp, old, a, m, dual_clip=2.0, is_weights=jnp.exp(w))
    ),
    "cispo_loss": (3, lambda lp, old, a, m: ops.cispo_loss(lp, old, a, m, clip_low=0.2, clip_high=0.3)),
    "cispo_loss[is_weights]": (
        4, lambda lp, old, a, w, m: ops.cispo_loss(lp, old, a, m, is_weights=jnp.exp(w), agg="seq-mean-token-mean")
    ),
    "importance_weights[tis]": (2, lambda p, b, m: ops.importance_weights(p, b, m)),
    "importance_weights[mis,sequence]": (
        2, lambda p, b, m: ops.importance_weights(p, b, m, mode="mis", low=1e-3, high=1e3, level="sequence")
    ),
    "importance_weights[tis,geometric]": (2, lambda p, b, m: ops.importance_weights(p, b, m, level="geometric")),
    "distillation_advantages": (2, ops.distillation_advantages),
}


def _unpad(tree, t):
    """Drops the padding columns of `[B, T + PAD]` outputs; scalars pass through."""
    return jax.tree.map(lambda x: x[:, :t] if x.ndim == 2 else x, tree)


def _case_inputs(name, seed=0):
    n, fn = CASES[name]
    rng = np.random.default_rng(seed)
    xs = [rng.standard_normal((B, T)).astype(np.float32) for _ in range(n)]
    return fn, xs, inputs.random_mask(rng, B, T), rng


def _assert_trees_close(got, want, **tol):
    jax.tree.map(lambda g, w: np.testing.assert_allclose(g, w, **tol), got, want)


@pytest.mark.parametrize("name", CASES)
def test_properties(name):
    fn, xs, mask, rng = _case_inputs(name)
    jitted = jax.jit(fn)
    base = jitted(*xs, mask)

    # jit equals eager.
    _assert_trees_close(fn(*xs, mask), base, rtol=1e-6, atol=1e-6)

    # Right-padding with garbage (inf, NaN, 1e30) changes nothing; outputs are 0 there.
    padded = [inputs.pad_right(x, PAD, rng) for x in xs]
    out_padded = jitted(*padded, inputs.pad_mask(mask, PAD))
    _assert_trees_close(_unpad(out_padded, T), base, rtol=1e-6, atol=1e-6)
    for leaf in jax.tree.leaves(out_padded):
        if leaf.ndim == 2:
            np.testing.assert_array_equal(leaf[:, T:], 0.0)

    # A float (or int) mask is the same as a bool mask.
    _assert_trees_close(jitted(*xs, mask.astype(np.float32)), base, rtol=0, atol=0)

    # vmap over an extra leading axis equals calling on each slice.
    stacked = [np.stack([x, x[::-1]]) for x in xs]
    out_vmap = jax.vmap(jitted)(*stacked, np.stack([mask, mask[::-1]]))
    _assert_trees_close(jax.tree.map(lambda x: x[0], out_vmap), base, rtol=1e-6, atol=1e-6)
    flipped = jitted(*[x[::-1] for x in xs], mask[::-1])
    _assert_trees_close(jax.tree.map(lambda x: x[1], out_vmap), flipped, rtol=1e-6, atol=1e-6)

    # Gradients (of the sum of all outputs) are finite, and exactly 0 on padding even when
    # the padding holds inf and NaN.
    def total(*args):
        return sum(jnp.sum(leaf) for leaf in jax.tree.leaves(fn(*args)))

    grads = jax.jit(jax.grad(total, argnums=tuple(range(len(xs)))))(
        *padded, inputs.pad_mask(mask, PAD)
    )
    for g in grads:
        assert np.all(np.isfinite(g)), name
        np.testing.assert_array_equal(np.asarray(g)[~inputs.pad_mask(mask, PAD)], 0.0)

    # bf16 in, float32 out: the float32 math on the same (rounded) numbers.
    low = [jnp.asarray(x, jnp.bfloat16) for x in xs]
    out_low = jitted(*low, mask)
    for leaf in jax.tree.leaves(out_low):
        assert leaf.dtype == jnp.float32, name
    _assert_trees_close(
        out_low, jitted(*[x.astype(jnp.float32) for x in low], mask), rtol=1e-6, atol=1e-6
    )
    _assert_trees_close(out_low, base, rtol=0.05, atol=0.05)


@pytest.mark.parametrize("name", ["gae[scan]", "whiten", "policy_loss", "value_loss", "cispo_loss",
                                  "importance_weights[tis]", "distillation_advantages"])
def test_bad_mask_shape_names_the_argument(name):
    fn, xs, mask, _ = _case_inputs(name)
    with pytest.raises(ValueError, match=r"`mask` must have shape \[B, T\] = \(4, 6\)"):
        fn(*xs, mask[:, :-1])
