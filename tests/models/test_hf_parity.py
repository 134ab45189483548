"""Logits and reward scores match transformers' PyTorch models on loaded checkpoints."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from jaxrlhf.models import Transformer, load_pretrained, score_at_last_token

from .conftest import FAMILIES, PAD, hf_forward, right_padded_batch

ATOL = 1e-4  # float32 on both sides; observed differences are ~1e-6


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_causal_lm_logits_match_transformers(hf_store, family):
    path, hf_model = hf_store.get(family)
    model, params = load_pretrained(path)
    assert isinstance(model, Transformer) and model.head == "lm"
    assert model.config.tie_word_embeddings == hf_model.config.tie_word_embeddings
    assert ("lm_head" in params) == (not model.config.tie_word_embeddings)
    ids, mask = right_padded_batch(seed=1)
    ref = hf_forward(hf_model, ids, mask)
    logits = np.asarray(model.apply({"params": params}, jnp.asarray(ids), jnp.asarray(mask)).logits)
    assert logits.shape == ref.shape
    valid = mask.astype(bool)
    assert np.abs(ref[valid]).max() > 0.5  # the weights are large enough for the test to bite
    np.testing.assert_allclose(logits[valid], ref[valid], atol=ATOL, rtol=0)


@pytest.mark.parametrize("family", ["llama3", "qwen2", "qwen3", "mistral", "gemma", "gemma2", "gemma3"])
def test_reward_score_matches_sequence_classification(hf_store, family):
    path, hf_model = hf_store.get(family, "score")
    model, params = load_pretrained(path)
    assert model.head == "score" and set(params["score"]) == {"kernel"}
    ids, mask = right_padded_batch(seed=2)
    assert not np.any(ids[mask.astype(bool)] == PAD)  # HF finds the last token by `ids != pad`
    ref = hf_forward(hf_model, ids, mask)[:, 0]
    values = model.apply({"params": params}, jnp.asarray(ids), jnp.asarray(mask)).values
    score = np.asarray(score_at_last_token(values, jnp.asarray(mask)))
    np.testing.assert_allclose(score, ref, atol=ATOL, rtol=0)
