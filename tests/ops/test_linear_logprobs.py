"""The fused LM head `ops.linear_logprobs` against the plain `h @ W -> token_logprobs /
entropy` path and the float64 loop references, values and gradients."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxrlhf import ops
from . import reference

B, T, D, V = 2, 5, 6, 13  # B·T = 10 rows and V = 13: no chunk size below divides both
TAU = 0.7


def _inputs(seed, dtype=np.float32):
    rng = np.random.default_rng(seed)
    h = rng.standard_normal((B, T, D)).astype(dtype)
    w = (0.8 * rng.standard_normal((D, V))).astype(dtype)
    return h, w, rng.integers(0, V, (B, T))


def _loss(logp, ent):
    # Distinct weights per position, so that a gradient routed to the wrong row shows.
    return jnp.sum(logp * jnp.arange(1.0, T + 1)) + jnp.sum(ent * jnp.arange(1.0, B + 1)[:, None])


def _plain(h, w, y, tau):
    logits = jnp.einsum("btd,dv->btv", h, w)
    return ops.token_logprobs(logits, y, tau), ops.entropy(logits, tau), jnp.argmax(logits, -1)


def _fused(h, w, y, tau, chunk, vocab_chunk):
    out = ops.linear_logprobs(h, w, y, temperature=tau, with_entropy=True, with_argmax=True,
                              chunk_size=chunk, vocab_chunk_size=vocab_chunk)
    return out.logp, out.entropy, out.argmax


def _value_and_grads(head, h, w, y, tau, tied=False):
    """`((logp, entropy, argmax), (d/dh, d/dW))` of `_loss`; tied: W is passed as `E.T` and
    differentiated as E `[V, D]`."""
    def f(h, w):
        out = head(h, w.T if tied else w, y, tau)
        return _loss(out[0], out[1]), out

    (_, out), grads = jax.value_and_grad(f, argnums=(0, 1), has_aux=True)(h, w)
    return out, grads


def _close_to_max(got, want, rtol):
    """Every entry within `rtol` of the largest |entry| (the scale of a gradient)."""
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    np.testing.assert_allclose(got, want, rtol=rtol, atol=rtol * np.max(np.abs(want)))


_plain_vg = jax.jit(functools.partial(_value_and_grads, _plain), static_argnames="tied")


# (chunk_size, vocab_chunk_size): defaults (one chunk, one block here); 1 row and 1 column
# at a time; 3 rows and 4 columns (10 = 3·3 + 1 rows, 13 = 3·4 + 1 columns: the last block
# is clamped to columns 9..12 and overlaps the previous one); all 10 rows (≥ T) in blocks
# larger than V.
@pytest.mark.parametrize("chunk,vocab_chunk", [(None, None), (1, 1), (3, 4), (10, 64)])
def test_values_and_gradients_equal_the_plain_path(chunk, vocab_chunk):
    h, w, y = _inputs(0)
    fused = jax.jit(functools.partial(_value_and_grads, functools.partial(_fused, chunk=chunk, vocab_chunk=vocab_chunk)))
    (logp, ent, best), (dh, dw) = fused(h, w, y, TAU)
    (logp0, ent0, best0), (dh0, dw0) = _plain_vg(h, w, y, TAU)
    assert logp.dtype == ent.dtype == jnp.float32 and logp.shape == ent.shape == (B, T)
    assert best.dtype == jnp.int32
    logits = np.asarray(h, np.float64) @ np.asarray(w, np.float64)
    np.testing.assert_allclose(logp, reference.token_logprobs(logits, y, TAU), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(ent, reference.entropy(logits, TAU), rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(best, np.argmax(logits, -1))
    np.testing.assert_allclose(logp, logp0, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(ent, ent0, rtol=1e-5, atol=1e-6)
    np.testing.assert_array_equal(best, best0)
    _close_to_max(dh, dh0, 1e-5)
    _close_to_max(dw, dw0, 1e-5)


@pytest.mark.parametrize("tied", [False, True])
def test_gradient_of_tied_embeddings(tied):
    # Tied: the head is embedding.T; the gradient w.r.t. the [V, D] embedding is dW.T.
    h, w, y = _inputs(1)
    param = np.ascontiguousarray(w.T) if tied else w
    head = functools.partial(_fused, chunk=4, vocab_chunk=5)
    (logp, _, _), (dh, dp) = jax.jit(_value_and_grads, static_argnums=(0, 5))(head, h, param, y, 1.0, tied)
    (logp0, _, _), (dh0, dp0) = _plain_vg(h, param, y, 1.0, tied=tied)
    assert dp.shape == param.shape
    np.testing.assert_allclose(logp, logp0, rtol=1e-5, atol=1e-6)
    _close_to_max(dh, dh0, 1e-5)
    _close_to_max(dp, dp0, 1e-5)


def test_hand_values_at_zero_weights():
    # W = 0: every logit is 0, p = 1/V. logp = −log V, H = log V, the greedy token is 0
    # (the first of V ties), and with loss Σ c_t·logp_t the gradient is
    # dW[:, v] = Σ_rows c·h·(1[v = y] − 1/V)/τ, dh = dz·Wᵀ = 0; the entropy's gradient
    # −p·(log p + H) = −(1/V)(−log V + log V) = 0 adds nothing.
    h, _, y = _inputs(2)
    w = np.zeros((D, V), np.float32)
    fused = jax.jit(functools.partial(_value_and_grads, functools.partial(_fused, chunk=3, vocab_chunk=4)))
    (logp, ent, best), (dh, dw) = fused(h, w, y, TAU)
    np.testing.assert_allclose(logp, np.full((B, T), -np.log(V)), rtol=1e-6)
    np.testing.assert_allclose(ent, np.full((B, T), np.log(V)), rtol=1e-6)
    np.testing.assert_array_equal(best, np.zeros((B, T)))
    np.testing.assert_array_equal(dh, np.zeros_like(h))
    c = np.broadcast_to(np.arange(1.0, T + 1), (B, T)).reshape(-1)
    dz = c[:, None] * (np.eye(V)[y.reshape(-1)] - 1.0 / V) / TAU
    np.testing.assert_allclose(dw, h.reshape(-1, D).astype(np.float64).T @ dz, rtol=1e-5, atol=1e-5)


def test_jit_equals_eager_and_traced_temperature():
    h, w, y = _inputs(3)
    f = functools.partial(ops.linear_logprobs, with_entropy=True, chunk_size=4, vocab_chunk_size=5)
    eager = f(h, w, y, temperature=TAU)
    jitted = jax.jit(lambda h, w, y, tau: f(h, w, y, temperature=tau))(h, w, y, jnp.float32(TAU))
    np.testing.assert_allclose(jitted.logp, eager.logp, rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(jitted.entropy, eager.entropy, rtol=1e-6, atol=1e-6)
    assert eager.argmax is None and ops.linear_logprobs(h, w, y).entropy is None
    # The temperature is held constant: no gradient flows to it.
    grad_tau = jax.grad(lambda tau: jnp.sum(f(h, w, y, temperature=tau).logp))(jnp.float32(TAU))
    assert grad_tau == 0.0


def test_bf16_inputs():
    # bf16 h and W: the matmul runs in bf16, so a logit may carry a rounding error of half a
    # bf16 ulp, ε ≤ 2**-8·max|z| (whether XLA rounds the product or keeps it in float32 is
    # its choice). logp = z_y − lse moves by at most 2ε; H by Σ_v |∂H/∂z_v|·ε =
    # Σ p|log p + H|·ε ≤ 2H·ε ≤ 2·log V·ε. Both paths must be that close to the float64
    # values of the exact product of the bf16 inputs.
    h, w, y = _inputs(4)
    hb, wb = jnp.asarray(h, jnp.bfloat16), jnp.asarray(w, jnp.bfloat16)
    fused = jax.jit(functools.partial(_value_and_grads, functools.partial(_fused, chunk=3, vocab_chunk=4)))
    (logp, ent, _), (dh, dw) = fused(hb, wb, y, TAU)
    (logp0, ent0, _), (dh0, dw0) = _plain_vg(hb, wb, y, TAU)
    assert logp.dtype == ent.dtype == jnp.float32 and dh.dtype == dw.dtype == jnp.bfloat16
    logits = np.asarray(hb, np.float64) @ np.asarray(wb, np.float64)
    eps = 2.0**-8 * np.max(np.abs(logits)) / TAU
    for lp, en in ((logp, ent), (logp0, ent0)):
        np.testing.assert_allclose(lp, reference.token_logprobs(logits, y, TAU), rtol=0, atol=2 * eps)
        np.testing.assert_allclose(en, reference.entropy(logits, TAU), rtol=0, atol=2 * np.log(V) * eps)
    # Gradients: against float32 at the same (bf16-rounded) inputs, both paths are within
    # two bf16 ulps (2**-7) of the largest entry; the fused one rounds dz to bf16 for its
    # matmuls but accumulates dh over vocabulary blocks and dW over row chunks in float32.
    _, (dh32, dw32) = _plain_vg(jnp.asarray(hb, jnp.float32), jnp.asarray(wb, jnp.float32), y, TAU)
    for g, g32 in ((dh, dh32), (dw, dw32), (dh0, dh32), (dw0, dw32)):
        _close_to_max(g.astype(jnp.float32), g32, 2**-7)


def test_bad_arguments():
    h, w, y = _inputs(5)
    with pytest.raises(ValueError, match=r"`hidden` must be a float array of shape \[B, T, D\]"):
        ops.linear_logprobs(h[0], w, y)
    with pytest.raises(ValueError, match=r"`w` must have shape \[D, V\] with D = 6"):
        ops.linear_logprobs(h, w.T, y)
    with pytest.raises(ValueError, match="one dtype"):
        ops.linear_logprobs(h, w.astype(jnp.bfloat16), y)
    with pytest.raises(ValueError, match="`targets` must have shape"):
        ops.linear_logprobs(h, w, y[:, :-1])
    with pytest.raises(ValueError, match="`targets` must be an integer"):
        ops.linear_logprobs(h, w, y.astype(np.float32))
    with pytest.raises(ValueError, match="temperature"):
        ops.linear_logprobs(h, w, y, temperature=0.0)
    with pytest.raises(ValueError, match="chunk_size"):
        ops.linear_logprobs(h, w, y, chunk_size=0)
    with pytest.raises(ValueError, match="vocab_chunk_size"):
        ops.linear_logprobs(h, w, y, vocab_chunk_size=2.5)


def test_soft_cap_equals_the_plain_path_on_capped_logits():
    """`soft_cap=c` (Gemma 2's final-logit cap): the plain path on `c·tanh(h @ W / c)`, in
    values and gradients, over several vocabulary blocks (the last one clamped)."""
    h, w, y = _inputs(4)
    cap = 1.5  # |h @ W| reaches ~6: the cap bites

    def plain(h, w, y, tau):
        logits = cap * jnp.tanh(jnp.einsum("btd,dv->btv", h, w) / cap)
        return ops.token_logprobs(logits, y, tau), ops.entropy(logits, tau), jnp.argmax(logits, -1)

    def fused(h, w, y, tau):
        out = ops.linear_logprobs(h, w, y, temperature=tau, with_entropy=True, with_argmax=True, chunk_size=4,
                                  vocab_chunk_size=5, soft_cap=cap)
        return out.logp, out.entropy, out.argmax

    want, want_g = jax.jit(functools.partial(_value_and_grads, plain))(h, w, y, TAU)
    got, got_g = jax.jit(functools.partial(_value_and_grads, fused))(h, w, y, TAU)
    for a, b in zip(got[:2] + got_g, want[:2] + want_g):
        _close_to_max(a, b, 1e-5)
    np.testing.assert_array_equal(np.asarray(got[2]), np.asarray(want[2]))
    uncapped = _fused(jnp.asarray(h), jnp.asarray(w), jnp.asarray(y), TAU, 4, 5)[0]
    assert np.abs(np.asarray(uncapped) - np.asarray(got[0])).max() > 0.1
