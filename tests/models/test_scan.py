"""The scanned layer stack (`scan_layers=True`) against the unrolled one, and remat policies.

`random_init` draws the same values for both layouts (the scanned one stacked), so every
comparison below is between two programs over the same weights: the forward pass and the
gradients of each head, left-padded rows, the KV-cache prefill and greedy decoding, and the
Hugging Face round trip. Tiny sizes and few compilations: the suite runs on 2 cores.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxrlhf.algorithms.common import response_logprobs
from jaxrlhf.models import (
    HEADS,
    REMAT_POLICIES,
    KVCache,
    ModelConfig,
    Transformer,
    init_cache,
    load_pretrained,
    logical_axes,
    random_init,
    save_pretrained,
    stack_layers,
    unstack_layers,
)
from jaxrlhf.rollout import generate

CFG = ModelConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_layers=2, num_heads=4, num_kv_heads=2,
                  head_dim=8, qkv_bias=True, o_bias=True, max_position_embeddings=64)
SCAN = CFG.replace(scan_layers=True)


def _batch(seed=0, b=3, length=9):
    """Random ids with left padding on rows 1 (3 pads) and 2 (one real token only)."""
    rng = np.random.default_rng(seed)
    ids = rng.integers(3, CFG.vocab_size, (b, length)).astype(np.int32)
    mask = np.ones((b, length), bool)
    mask[1, :3] = False
    mask[2, :-1] = False
    ids[~mask] = 0
    return jnp.asarray(ids), jnp.asarray(mask)


def _close(got, want, what, atol=1e-5):
    for (path, g), w in zip(jax.tree_util.tree_flatten_with_path(got)[0], jax.tree.leaves(want)):
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), atol=atol, rtol=0,
                                   err_msg=f"{what} {jax.tree_util.keystr(path)}")


@functools.lru_cache(maxsize=None)
def _loss_and_grads(config: ModelConfig, head: str):
    """(loss, outputs, grads) of a loss that weighs every logit and value, on `_batch()`;
    divided by the token count so that gradients are O(1) and 1e-5 is a tight tolerance."""
    model, params = random_init(config, head=head, seed=1)
    ids, mask = _batch()
    w = jax.random.normal(jax.random.key(2), (*ids.shape, config.vocab_size))

    def loss(params):
        out = model.apply({"params": params}, ids, mask)
        total = 0.0
        if out.logits is not None:
            total += jnp.sum(jnp.where(mask[..., None], out.logits * w, 0.0))
        if out.values is not None:
            total += jnp.sum(jnp.where(mask, out.values, 0.0))
        return total / ids.size, (out.logits, out.values)

    (value, outs), grads = jax.jit(jax.value_and_grad(loss, has_aux=True))(params)
    return value, outs, grads


def test_random_init_and_init_give_the_stacked_layout():
    _, unrolled = random_init(CFG, seed=3)
    model, scanned = random_init(SCAN, seed=3)
    assert "layers" in scanned and not any(k.startswith("layers_") for k in scanned)
    jax.tree.map(np.testing.assert_array_equal, scanned, stack_layers(unrolled))
    jax.tree.map(np.testing.assert_array_equal, unstack_layers(scanned), unrolled)
    # model.init builds the same tree, its stacked leaves named ("layers", ...).
    axes = logical_axes(model)
    shapes = jax.eval_shape(lambda: model.init(jax.random.key(0), jnp.zeros((1, 2), jnp.int32)))["params"]
    assert jax.tree.structure(jax.tree.map(lambda x: 0, axes, is_leaf=lambda x: isinstance(x, tuple))) == \
        jax.tree.structure(scanned)
    assert axes["layers"]["self_attn"]["q_proj"]["kernel"] == ("layers", "embed", "q_heads", "head_dim")
    assert axes["embed_tokens"]["embedding"] == ("vocab", "embed")
    q = shapes["layers"]["self_attn"]["q_proj"]["kernel"]
    assert q.value.shape == (2, 32, 4, 8)
    assert scanned["layers"]["mlp"]["down_proj"]["kernel"].shape == (2, 48, 32)


@pytest.mark.parametrize("head", HEADS)
def test_scanned_equals_unrolled_outputs_and_gradients(head):
    loss_u, (logits_u, values_u), grads_u = _loss_and_grads(CFG, head)
    loss_s, (logits_s, values_s), grads_s = _loss_and_grads(SCAN, head)
    assert (logits_u is None) == (head == "score") and (values_u is None) == (head == "lm")
    mask = np.asarray(_batch()[1])
    if logits_u is not None:
        np.testing.assert_allclose(np.asarray(logits_s)[mask], np.asarray(logits_u)[mask], atol=1e-5, rtol=0)
    if values_u is not None:
        np.testing.assert_allclose(np.asarray(values_s)[mask], np.asarray(values_u)[mask], atol=1e-5, rtol=0)
    # The loss is a mean of logits × N(0, 1) weights, near 0 (-8e-4 here): an absolute bound,
    # as for the logits (a relative 1e-5 of it was 3e-8, below float32 summation noise).
    np.testing.assert_allclose(float(loss_s), float(loss_u), atol=1e-6, rtol=0)
    assert float(jnp.abs(grads_s["layers"]["self_attn"]["q_proj"]["bias"]).max()) > 0
    _close(grads_s, stack_layers(grads_u), "gradient", atol=1e-5)


@pytest.mark.parametrize("policy", [pytest.param(p, marks=pytest.mark.heavy) if p == "offload" else p for p in REMAT_POLICIES if p != "none"])
def test_remat_policies_give_the_gradients_of_none(policy):
    # The unrolled stack under "full" (`remat=True`) is also checked in test_precision.py.
    for config in (SCAN,) if policy == "full" else (CFG, SCAN):
        _, (logits, values), grads = _loss_and_grads(config.replace(remat=policy), "lm_value")
        _, (logits0, values0), grads0 = _loss_and_grads(config, "lm_value")
        np.testing.assert_allclose(np.asarray(logits), np.asarray(logits0), atol=1e-5, rtol=0)
        _close(grads, grads0, f"{policy} scan_layers={config.scan_layers} gradient", atol=1e-5)


def test_remat_names_and_the_old_booleans():
    assert CFG.remat == "none" and CFG.replace(remat=True).remat == "full" and CFG.replace(remat=False).remat == "none"
    for bad in ("dot", "True", None):
        with pytest.raises(ValueError, match=r"remat=.*expected one of \['none', 'full', 'dots', 'offload'\]"):
            CFG.replace(remat=bad)
    with pytest.raises(ValueError, match="scan_layers"):
        CFG.replace(scan_layers="yes")


def test_prefill_cache_and_last_position_match_unrolled():
    """A left-padded prefill into the cache, whole and `last_position_only`, then one step."""
    _, p_u = random_init(CFG, seed=4)
    _, p_s = random_init(SCAN, seed=4)
    ids, mask = _batch(1)
    b, p = ids.shape
    slots = jnp.concatenate([mask, jnp.zeros((b, 2), bool)], axis=1)
    cache_s = init_cache(SCAN, b, p + 2)
    assert isinstance(cache_s, KVCache) and cache_s.k.shape == (b, 2, 2, 8, p + 2)
    assert cache_s.v.shape == (b, 2, 2, p + 2, 8)

    @functools.partial(jax.jit, static_argnums=(0, 4))
    def prefill(config, params, cache, ids, last):
        return Transformer(config).apply({"params": params}, ids, slots, cache=cache, cache_index=0,
                                         last_position_only=last)

    want = prefill(CFG, p_u, init_cache(CFG, b, p + 2), ids, False)
    for last in (False, True):
        got = prefill(SCAN, p_s, cache_s, ids, last)
        np.testing.assert_allclose(np.asarray(got.logits[:, -1]), np.asarray(want.logits[:, -1]), atol=1e-5, rtol=0)
        assert got.logits.shape[1] == (1 if last else p)
        for i, kv in enumerate(want.cache):
            np.testing.assert_allclose(np.asarray(got.cache.k[:, i]), np.asarray(kv.k), atol=1e-6, rtol=0)
            np.testing.assert_allclose(np.asarray(got.cache.v[:, i]), np.asarray(kv.v), atol=1e-6, rtol=0)
    with pytest.raises(ValueError, match="scan_layers=True"):
        Transformer(SCAN).apply({"params": p_s}, ids, slots, cache=init_cache(CFG, b, p + 2), cache_index=0)


def test_greedy_generate_and_shared_prompt_logprobs_match_unrolled():
    """The sampler (prefill with last_position_only, a cache repeated per sample, the decode
    loop) and GRPO's shared-prompt forward both map over the stacked cache by rows."""
    _, p_u = random_init(CFG, seed=5)
    _, p_s = random_init(SCAN, seed=5)
    ids, mask = _batch(2)
    kw = dict(max_new_tokens=6, temperature=0.0, num_samples=2, cpu_threads=1)
    out_u = generate(Transformer(CFG), p_u, ids, mask, jax.random.key(0), **kw)
    out_s = generate(Transformer(SCAN), p_s, ids, mask, jax.random.key(0), **kw)
    assert len(set(np.asarray(out_u.response_ids).ravel().tolist())) > 1
    np.testing.assert_array_equal(np.asarray(out_s.response_ids), np.asarray(out_u.response_ids))
    np.testing.assert_allclose(np.asarray(out_s.logprobs), np.asarray(out_u.logprobs), atol=1e-5, rtol=0)

    logp = jax.jit(lambda config, params: response_logprobs(
        Transformer(config), params, out_u.sequences, out_u.attention_mask, ids.shape[1], group_size=2)[0],
        static_argnums=0)
    np.testing.assert_allclose(np.asarray(logp(SCAN, p_s)), np.asarray(logp(CFG, p_u)), atol=1e-5, rtol=0)


def test_hf_round_trip_through_the_stacked_layout(hf_store, tmp_path):
    from safetensors.numpy import load_file

    path, _ = hf_store.get("llama3")
    model_u, params_u = load_pretrained(path)
    model_s, params_s = load_pretrained(path, scan_layers=True)
    assert model_s.config.scan_layers and not model_u.config.scan_layers
    jax.tree.map(np.testing.assert_array_equal, params_s, stack_layers(params_u))
    out = save_pretrained(model_s, params_s, tmp_path / "saved")
    original, saved = load_file(f"{path}/model.safetensors"), load_file(f"{out}/model.safetensors")
    assert sorted(saved) == sorted(original) and "model.layers.2.mlp.down_proj.weight" in saved
    for name, w in original.items():
        np.testing.assert_array_equal(saved[name], w, err_msg=name)
    _, back = load_pretrained(out)
    jax.tree.map(np.testing.assert_array_equal, back, params_u)
