"""bfloat16 parameters and compute, and rematerialisation."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxrlhf.models import load_pretrained

from .conftest import right_padded_batch


@pytest.fixture(scope="module")
def batch():
    ids, mask = right_padded_batch(seed=8)
    return jnp.asarray(ids), jnp.asarray(mask)


def _loss(model):
    def loss(params, ids_BxL, mask_BxL):
        logits_BxLxV = model.apply({"params": params}, ids_BxL, mask_BxL).logits.astype(jnp.float32)
        logp_BxT = jax.nn.log_softmax(logits_BxLxV[:, :-1])
        tgt_BxT = jnp.take_along_axis(logp_BxT, ids_BxL[:, 1:, None], axis=-1)[..., 0]
        m_BxT = mask_BxL[:, 1:].astype(jnp.float32)
        return -jnp.sum(tgt_BxT * m_BxT) / jnp.sum(m_BxT)
    return loss


def test_bf16_close_to_float32(hf_store, batch):
    path = hf_store.get("llama3")[0]
    ids, mask = batch
    m32, p32 = load_pretrained(path)
    m16, p16 = load_pretrained(path, dtype="bfloat16", param_dtype="bfloat16")
    assert all(x.dtype == jnp.bfloat16 for x in jax.tree.leaves(p16))
    l32 = np.asarray(m32.apply({"params": p32}, ids, mask).logits)
    out16 = m16.apply({"params": p16}, ids, mask)
    assert out16.logits.dtype == jnp.bfloat16
    l16 = np.asarray(out16.logits, np.float32)
    valid = np.asarray(mask, bool)
    scale = np.abs(l32[valid]).max()
    # bf16 keeps 8 mantissa bits (relative step 2^-8 = 0.4%); through 3 layers the logits
    # drift by a few percent of their range, far below what a mapping bug would cause.
    assert np.abs(l16[valid] - l32[valid]).max() < 0.05 * scale
    assert np.mean(np.argmax(l16[valid], -1) == np.argmax(l32[valid], -1)) > 0.9
    # float32 storage with bfloat16 compute (the usual mixed-precision setup) runs too.
    mmix, pmix = load_pretrained(path, dtype="bfloat16")
    assert pmix["norm"]["scale"].dtype == jnp.float32
    lmix = np.asarray(mmix.apply({"params": pmix}, ids, mask).logits, np.float32)
    assert np.abs(lmix[valid] - l32[valid]).max() < 0.05 * scale


def test_remat_same_logits_and_gradients(hf_store, batch):
    path = hf_store.get("qwen3")[0]
    ids, mask = batch
    model, params = load_pretrained(path)
    model_r, params_r = load_pretrained(path, remat=True)
    assert model_r.config.remat == "full" and model.config.remat == "none"  # True/False read as names
    loss, grads = jax.jit(jax.value_and_grad(_loss(model)))(params, ids, mask)
    loss_r, grads_r = jax.jit(jax.value_and_grad(_loss(model_r)))(params_r, ids, mask)
    np.testing.assert_allclose(float(loss_r), float(loss), rtol=1e-6)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, atol=1e-6, rtol=1e-5), grads_r, grads)
    assert float(jnp.abs(grads["layers_0"]["self_attn"]["q_norm"]["scale"]).max()) > 0
