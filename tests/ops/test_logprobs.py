"""Token log-probs, entropies and the response shift against loop references."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxrlhf import ops
from . import reference

B, T, V = 2, 5, 7


def _logits(seed, dtype=np.float32):
    rng = np.random.default_rng(seed)
    logits = (3.0 * rng.standard_normal((B, T, V))).astype(dtype)
    targets = rng.integers(0, V, size=(B, T))
    return logits, targets


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_token_logprobs_matches_reference(temperature):
    logits, targets = _logits(0)
    got = ops.token_logprobs(logits, targets, temperature=temperature)
    want = reference.token_logprobs(logits, targets, temperature)
    assert got.dtype == jnp.float32 and got.shape == (B, T)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


def test_token_logprobs_equals_log_softmax_gather():
    logits, targets = _logits(1)
    tau = 0.5
    naive = jnp.take_along_axis(jax.nn.log_softmax(logits / tau), targets[..., None], -1)[..., 0]
    np.testing.assert_allclose(
        ops.token_logprobs(logits, targets, temperature=tau), naive, rtol=1e-6, atol=1e-6
    )


@pytest.mark.parametrize("chunk_size", [None, 1, 2, 5])  # 2 leaves a remainder of 1
def test_entropy_matches_reference(chunk_size):
    logits, _ = _logits(2)
    got = ops.entropy(logits, temperature=0.8, chunk_size=chunk_size)
    np.testing.assert_allclose(got, reference.entropy(logits, 0.8), rtol=1e-5, atol=1e-5)


def test_entropy_hand_values():
    # Uniform over V=4: H = log 4. One logit at +inf-ish margin: H ≈ 0.
    # A −inf logit is an impossible token: [0, 0, −inf] has H = log 2, and a finite gradient.
    entropy = jax.jit(ops.entropy)
    logits = jnp.array([[[0.0, 0.0, 0.0, 0.0], [100.0, 0.0, 0.0, 0.0]]])
    np.testing.assert_allclose(entropy(logits), [[np.log(4.0), 0.0]], atol=1e-6)
    with_inf = jnp.array([[[0.0, 0.0, -jnp.inf]]])
    np.testing.assert_allclose(entropy(with_inf), [[np.log(2.0)]], rtol=1e-6)
    grad = jax.jit(jax.grad(lambda x: ops.entropy(x).sum()))(with_inf)
    assert np.all(np.isfinite(grad))


def test_gradients_match_naive_and_do_not_depend_on_chunks():
    logits, targets = _logits(3)

    def loss(x, chunk):
        lp = ops.token_logprobs(x, targets)
        return jnp.sum(lp * jnp.arange(T)) + jnp.sum(ops.entropy(x, chunk_size=chunk))

    def naive(x):
        lp = jnp.take_along_axis(jax.nn.log_softmax(x), targets[..., None], -1)[..., 0]
        ent = -jnp.sum(jax.nn.softmax(x) * jax.nn.log_softmax(x), -1)
        return jnp.sum(lp * jnp.arange(T)) + jnp.sum(ent)

    grad = jax.jit(jax.grad(loss), static_argnums=1)
    g_full = grad(logits, T)
    g_chunked = grad(logits, 2)
    np.testing.assert_allclose(g_full, jax.jit(jax.grad(naive))(logits), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(g_chunked, g_full, rtol=1e-5, atol=1e-6)


def test_bf16_logits_give_float32_close_to_float32():
    logits, targets = _logits(4)
    low = jnp.asarray(logits, jnp.bfloat16)
    lp = ops.token_logprobs(low, targets)
    ent = ops.entropy(low, chunk_size=2)
    assert lp.dtype == ent.dtype == jnp.float32
    exact = np.asarray(low.astype(jnp.float32))  # the same numbers, upcast before the math
    np.testing.assert_allclose(lp, reference.token_logprobs(exact, targets), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(ent, reference.entropy(exact), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(lp, ops.token_logprobs(logits, targets), atol=0.1)


def test_jit_and_vmap():
    logits, targets = _logits(5)
    f = jax.jit(ops.token_logprobs)
    np.testing.assert_allclose(f(logits, targets), ops.token_logprobs(logits, targets), atol=1e-6)
    stacked = jax.vmap(f)(np.stack([logits, logits[::-1]]), np.stack([targets, targets[::-1]]))
    np.testing.assert_allclose(stacked[1], f(logits[::-1], targets[::-1]), atol=1e-6)
    ent = jax.vmap(jax.jit(lambda x: ops.entropy(x, chunk_size=2)))(np.stack([logits] * 2))
    np.testing.assert_allclose(ent[0], ops.entropy(logits), atol=1e-6)


def test_shift_logits_for_response():
    # Sequence s = [p0, p1, y0, y1, y2] (P = 2, T = 3): y0 is predicted at position 1,
    # y2 at position 3; position 4 predicts nothing in the response.
    positions = jnp.arange(5.0)[None, :, None]  # "logits" that record their position
    shifted = ops.shift_logits_for_response(positions, 2)
    np.testing.assert_array_equal(shifted[0, :, 0], [1.0, 2.0, 3.0])
    values = jnp.arange(5.0)[None]
    np.testing.assert_array_equal(ops.shift_logits_for_response(values, 2), [[1.0, 2.0, 3.0]])
    with pytest.raises(ValueError, match="prompt_len"):
        ops.shift_logits_for_response(positions, 0)


def test_sequence_logprobs():
    logp = np.array([[-1.0, -2.0, np.nan], [-0.5, -0.25, -0.125]])
    mask = np.array([[1, 1, 0], [1, 1, 1]])
    # -1 - 2 = -3 (the NaN is padding); -0.5 - 0.25 - 0.125 = -0.875
    np.testing.assert_allclose(ops.sequence_logprobs(logp, mask), [-3.0, -0.875])


def test_bad_arguments():
    logits, targets = _logits(6)
    with pytest.raises(ValueError, match="`targets` must have shape"):
        ops.token_logprobs(logits, targets[:, :-1])
    with pytest.raises(ValueError, match="`targets` must be an integer"):
        ops.token_logprobs(logits, targets.astype(np.float32))
    with pytest.raises(ValueError, match=r"`logits` must be a float array of shape \[B, T, V\]"):
        ops.entropy(logits[0])
    with pytest.raises(ValueError, match="temperature"):
        ops.token_logprobs(logits, targets, temperature=0.0)
    with pytest.raises(ValueError, match="chunk_size"):
        ops.entropy(logits, chunk_size=0)
