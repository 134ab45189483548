"""Incremental decoding with the KV cache reproduces the full forward pass."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxrlhf.models import init_cache, load_pretrained

from .conftest import PAD, VOCAB


def _left_padded(seed=0, prompt_lengths=(7, 4, 1), prompt_len=7, new_tokens=5):
    """Prompts left-padded to `prompt_len`, followed by `new_tokens` tokens on every row."""
    rng = np.random.default_rng(seed)
    b = len(prompt_lengths)
    ids = rng.integers(3, VOCAB, (b, prompt_len + new_tokens))
    mask = np.ones_like(ids)
    for row, n in enumerate(prompt_lengths):
        mask[row, :prompt_len - n] = 0
    ids[mask == 0] = PAD
    return ids, mask, prompt_len


@pytest.mark.parametrize("family", ["llama3", "qwen3"])
def test_cached_decoding_matches_full_forward(hf_store, family):
    model, params = load_pretrained(hf_store.get(family)[0])
    ids, mask, p = _left_padded()
    b, s = ids.shape
    ids, mask = jnp.asarray(ids), jnp.asarray(mask)
    forward = jax.jit(lambda ids, mask: model.apply({"params": params}, ids, mask).logits)
    full = np.asarray(forward(ids, mask))

    @functools.partial(jax.jit, donate_argnums=1)
    def step(params, cache, ids_BxL, cache_index):
        out = model.apply({"params": params}, ids_BxL, mask, cache=cache, cache_index=cache_index)
        return out.logits, out.cache

    cache = init_cache(model.config, b, s)
    logits, cache = step(params, cache, ids[:, :p], 0)  # prefill the whole (padded) prompt
    got = [np.asarray(logits)]
    for t in range(p, s):  # then one token at a time; one compiled step for every index
        logits, cache = step(params, cache, ids[:, t:t + 1], t)
        got.append(np.asarray(logits))
    got = np.concatenate(got, axis=1)
    valid = np.asarray(mask, bool)
    np.testing.assert_allclose(got[valid], full[valid], atol=1e-5, rtol=0)
    # A left-padded row's first real token sits at position 0, like an unpadded prompt.
    short = jax.jit(lambda ids: model.apply({"params": params}, ids, None).logits)(ids[2:, p - 1:])
    np.testing.assert_allclose(np.asarray(short)[0], full[2, p - 1:], atol=1e-5, rtol=0)


@pytest.mark.parametrize("remat", [False, True])
def test_last_position_only_fills_the_same_cache_and_last_position(hf_store, remat):
    import dataclasses

    from jaxrlhf.models import Transformer

    model, params = load_pretrained(hf_store.get("llama3")[0])
    model = Transformer(dataclasses.replace(model.config, remat=remat), head=model.head)
    ids, mask, p = _left_padded()
    b, s = ids.shape
    ids, mask = jnp.asarray(ids[:, :p]), jnp.asarray(mask)
    apply = jax.jit(functools.partial(model.apply, {"params": params}), static_argnames="last_position_only")
    cache = init_cache(model.config, b, s)
    whole = apply(ids, mask, cache=cache, cache_index=0)
    last = apply(ids, mask, cache=cache, cache_index=0, last_position_only=True)
    assert last.logits.shape == (b, 1, whole.logits.shape[-1]) and last.hidden.shape[1] == 1
    np.testing.assert_allclose(np.asarray(last.logits[:, 0]), np.asarray(whole.logits[:, -1]), atol=1e-5, rtol=0)
    for got, want in zip(jax.tree.leaves(last.cache), jax.tree.leaves(whole.cache)):
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    # Without a cache too (a scoring pass that needs only the next token's logits).
    full, tail = apply(ids, mask[:, :p]), apply(ids, mask[:, :p], last_position_only=True)
    np.testing.assert_allclose(np.asarray(tail.logits[:, 0]), np.asarray(full.logits[:, -1]), atol=1e-5, rtol=0)


def test_bfloat16_cache_with_float32_params(hf_store):
    """`cache_dtype="bfloat16"`: the cache is stored in bf16 (half the bytes), the params and
    compute stay float32, and cached decoding stays within bf16 rounding of the full pass."""
    path = hf_store.get("llama3")[0]
    model, params = load_pretrained(path, cache_dtype="bfloat16")
    ids, mask, p = _left_padded()
    ids, mask = jnp.asarray(ids), jnp.asarray(mask)
    cache = init_cache(model.config, ids.shape[0], ids.shape[1])
    assert all(x.dtype == jnp.bfloat16 for x in jax.tree.leaves(cache))
    forward = jax.jit(lambda ids, mask: model.apply({"params": params}, ids, mask).logits)
    full = np.asarray(forward(ids, mask))
    step = jax.jit(lambda cache, x, i: model.apply({"params": params}, x, mask, cache=cache, cache_index=i))
    out = step(cache, ids[:, :p], 0)
    got = [np.asarray(out.logits)]
    for t in range(p, ids.shape[1]):
        out = step(out.cache, ids[:, t:t + 1], t)
        got.append(np.asarray(out.logits))
    got, valid = np.concatenate(got, axis=1), np.asarray(mask, bool)
    assert out.logits.dtype == jnp.float32
    np.testing.assert_allclose(got[valid], full[valid], atol=0.05 * np.abs(full).max())
    assert np.abs(got[valid] - full[valid]).max() > 0  # the cache really is rounded


def test_bfloat16_matmuls_take_the_bf16_kernels_as_stored(hf_store):
    """`matmul_dtype="bfloat16"` with bf16 params and float32 compute: every layer projection
    is one bf16 x bf16 dot accumulating in float32 (no float32 copy of a kernel), equal to
    the float64 product of its bf16-rounded input; the logits stay within bf16 rounding of
    the float32 model's."""
    from jaxrlhf.models import ModelConfig
    from jaxrlhf.models.projection import Projection

    proj = Projection((8, 5), ("embed", "mlp"), None, jnp.float32, jnp.bfloat16, matmul_dtype=jnp.bfloat16)
    x = jax.random.normal(jax.random.key(0), (3, 8))
    p = proj.init(jax.random.key(1), x)
    y = proj.apply(p, x)
    w = np.asarray(p["params"]["kernel"].value if hasattr(p["params"]["kernel"], "value") else p["params"]["kernel"],
                   np.float64)
    want = np.asarray(x.astype(jnp.bfloat16), np.float64) @ w
    assert y.dtype == jnp.float32
    np.testing.assert_allclose(np.asarray(y), want, rtol=1e-6, atol=1e-6)

    path = hf_store.get("llama3")[0]
    model, params = load_pretrained(path, param_dtype="bfloat16", dtype="float32", matmul_dtype="bfloat16")
    ids, mask, _ = _left_padded()
    ids, mask = jnp.asarray(ids), jnp.asarray(mask)
    forward = lambda m, prm: m.apply({"params": prm}, ids, mask).logits
    jaxpr = str(jax.make_jaxpr(functools.partial(forward, model))(params))
    n = model.config.num_layers * 7  # q, k, v, o, gate, up, down
    assert jaxpr.count("preferred_element_type=float32") >= n, jaxpr.count("preferred_element_type=float32")
    model32, params32 = load_pretrained(path)
    got, full = np.asarray(jax.jit(forward, static_argnums=0)(model, params)), np.asarray(forward(model32, params32))
    valid = np.asarray(mask, bool)
    assert got.dtype == np.float32
    np.testing.assert_allclose(got[valid], full[valid], atol=0.05 * np.abs(full).max())
    with pytest.raises(ValueError, match="matmul_dtype='int8'"):
        ModelConfig(vocab_size=8, hidden_size=8, intermediate_size=8, num_layers=1, num_heads=1, num_kv_heads=1,
                    head_dim=8, matmul_dtype="int8")


@pytest.mark.parametrize("tied, soft_cap, lora_head", [(True, None, False), (False, 30.0, False), (False, None, True)])
def test_vocab_major_logits_equal_the_heads_logits(tied, soft_cap, lora_head):
    from jaxrlhf.models import ModelConfig, Transformer, init_params, lm_head_rows, project_logits, vocab_major_logits
    from jaxrlhf.models.lora import LoraConfig

    cfg = ModelConfig(vocab_size=41, hidden_size=16, intermediate_size=24, num_layers=1, num_heads=2, num_kv_heads=1,
                      head_dim=8, max_position_embeddings=32, tie_word_embeddings=tied,
                      final_logit_softcapping=soft_cap,
                      lora=LoraConfig(rank=2, targets=("lm_head",)) if lora_head else None)
    params = init_params(Transformer(cfg), jax.random.key(0))
    if lora_head:  # a trained adapter (B = 0 at init would add exactly nothing)
        params["lm_head"]["lora_b"] = jax.random.normal(jax.random.key(1), params["lm_head"]["lora_b"].shape)
    hidden = jax.random.normal(jax.random.key(2), (5, 16))
    got = jax.jit(lambda p, h: vocab_major_logits(cfg, lm_head_rows(cfg, p), h))(params, hidden)
    want = jax.jit(lambda p, h: project_logits(cfg, p, h))(params, hidden)
    assert got.shape == (5, 41)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=1e-5, rtol=1e-5)
    full = Transformer(cfg).apply({"params": params}, jnp.ones((1, 3), jnp.int32))  # the model's own head
    head_of_hidden = vocab_major_logits(cfg, lm_head_rows(cfg, params), full.hidden[0])
    np.testing.assert_allclose(np.asarray(head_of_hidden), np.asarray(full.logits[0]), atol=1e-5, rtol=1e-5)
