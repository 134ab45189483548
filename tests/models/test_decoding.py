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
    full = np.asarray(model.apply({"params": params}, ids, mask).logits)

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
    short = model.apply({"params": params}, ids[2:, p - 1:], None).logits
    np.testing.assert_allclose(np.asarray(short)[0], full[2, p - 1:], atol=1e-5, rtol=0)
