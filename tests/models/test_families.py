"""Mistral, Gemma, Gemma 2 and Gemma 3 text against transformers beyond the logits
(`test_hf_parity` has those for every family and head): left-padded prompts longer than the
sliding window, greedy decoding past the window token for token against `generate`, the
save → load round trip, the value head, GRPO and DPO steps on Gemma 2 and Gemma 3, PPO with
a Gemma reward model, and the refusals."""

from __future__ import annotations

import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from jaxrlhf.models import UnsupportedConfigError, from_hf_config, load_pretrained, save_pretrained

from .conftest import PAD, VOCAB, WINDOW, hf_forward, right_padded_batch, torch, transformers

ATOL = 1e-4


def _left_padded_prompts(seed=0, lengths=(9, 6, 2), width=9):
    rng = np.random.default_rng(seed)
    ids = rng.integers(3, VOCAB, (len(lengths), width))
    mask = (np.arange(width)[None] >= width - np.asarray(lengths)[:, None]).astype(np.int64)
    return np.where(mask == 1, ids, PAD), mask


@pytest.mark.parametrize("family, scan", [("mistral", False), ("gemma2", False), ("gemma3", True)])
def test_left_padded_logits_and_greedy_decoding_past_the_window(hf_store, family, scan):
    """Left-padded prompts of up to 9 tokens (window 5) score like transformers, and 8 greedy
    tokens from the KV cache equal `generate`'s (local layers attend to their window of the
    cache). Gemma 3 runs as a scanned stack: local and global layers in one `lax.scan`."""
    from jaxrlhf.rollout import generate

    path, hf_model = hf_store.get(family)
    model, params = load_pretrained(path, scan_layers=scan)
    ids, mask = _left_padded_prompts()
    assert ids.shape[1] > WINDOW
    positions = np.maximum(np.cumsum(mask, axis=1) - 1, 0)
    with torch.no_grad():
        ref = hf_model(input_ids=torch.as_tensor(ids), attention_mask=torch.as_tensor(mask),
                       position_ids=torch.as_tensor(positions)).logits.numpy()
    logits = np.asarray(jax.jit(model.apply)({"params": params}, jnp.asarray(ids), jnp.asarray(mask)).logits)
    valid = mask.astype(bool)
    np.testing.assert_allclose(logits[valid], ref[valid], atol=ATOL, rtol=0)

    new = 8
    hf_model.generation_config.eos_token_id = None  # never stop early: compare all 8 tokens
    with torch.no_grad():
        want = hf_model.generate(input_ids=torch.as_tensor(ids), attention_mask=torch.as_tensor(mask),
                                 max_new_tokens=new, min_new_tokens=new, do_sample=False,
                                 pad_token_id=PAD).numpy()[:, ids.shape[1]:]
    got = generate(model, params, jnp.asarray(ids), jnp.asarray(mask), jax.random.key(0), max_new_tokens=new,
                   temperature=0.0).response_ids
    np.testing.assert_array_equal(np.asarray(got), want)


@pytest.mark.parametrize("family", ["mistral", "gemma", "gemma2", "gemma3"])
@pytest.mark.parametrize("kind", ["causal", "score"])
def test_save_load_round_trip_through_transformers(hf_store, tmp_path, family, kind):
    """load_pretrained → save_pretrained gives a folder transformers loads into the same class
    with the same config and weights (so the same logits)."""
    path, hf_model = hf_store.get(family, kind)
    model, params = load_pretrained(path)
    out = save_pretrained(model, params, tmp_path / "saved")
    auto = transformers.AutoModelForCausalLM if kind == "causal" else transformers.AutoModelForSequenceClassification
    reloaded = auto.from_pretrained(out).eval()
    assert type(reloaded) is type(hf_model)
    for field in ("model_type", "sliding_window", "layer_types", "query_pre_attn_scalar", "attn_logit_softcapping",
                  "final_logit_softcapping", "rope_parameters", "tie_word_embeddings", "hidden_activation",
                  "hidden_act"):
        assert getattr(reloaded.config, field, None) == getattr(hf_model.config, field, None), field
    want, got = hf_model.state_dict(), reloaded.state_dict()
    assert sorted(got) == sorted(want)
    for name in want:
        np.testing.assert_array_equal(got[name].numpy(), want[name].numpy(), err_msg=name)


def test_heads_of_a_soft_capped_model(hf_store):
    """Gemma 2: head="lm_value" keeps the causal LM's soft-capped logits and adds a fresh value
    head; `project_logits` (the sampler's head) and the trainer's plain and fused
    (`ops.linear_logprobs`) log-prob heads all apply the final soft cap."""
    from jaxrlhf import ops
    from jaxrlhf.algorithms import common
    from jaxrlhf.models import project_logits

    path, hf_model = hf_store.get("gemma2")
    both, params = load_pretrained(path, head="lm_value")
    ids, mask = right_padded_batch(seed=4)
    out = jax.jit(both.apply)({"params": params}, jnp.asarray(ids), jnp.asarray(mask))
    valid = mask.astype(bool)
    np.testing.assert_allclose(np.asarray(out.logits)[valid], hf_forward(hf_model, ids, mask)[valid], atol=ATOL,
                               rtol=0)
    assert out.values.shape == ids.shape and np.all(np.isfinite(np.asarray(out.values)))
    c = both.config
    np.testing.assert_allclose(np.asarray(project_logits(c, params, out.hidden)), np.asarray(out.logits), atol=1e-6)
    want = np.asarray(ops.token_logprobs(out.logits, jnp.asarray(ids), 0.7))
    for head in ("plain", "chunked"):
        got = common.head_logprobs(c.replace(logprobs_head=head), params, out.hidden, jnp.asarray(ids),
                                   temperature=0.7).logp
        np.testing.assert_allclose(np.asarray(got), want, atol=1e-5, err_msg=head)


def _all_moved(new, old) -> bool:
    return all(jax.tree.leaves(jax.tree.map(lambda a, b: bool(np.any(np.asarray(a) != np.asarray(b))), new, old)))


@pytest.mark.parametrize("family, scan", [pytest.param("gemma2", False, marks=pytest.mark.heavy), ("gemma3", True)])
def test_grpo_update(hf_store, family, scan):
    """A GRPO update on tiny Gemma 2 (soft-capped attention and logits, local and global
    layers) and Gemma 3 as a scanned stack (local and global layers under `lax.cond`,
    differentiated): a finite loss, and every parameter moves. (Their sampling with the
    cache is checked against `generate` above.)"""
    from jaxrlhf.algorithms import grpo
    from jaxrlhf.algorithms.experience import SamplingConfig

    model, params = load_pretrained(hf_store.get(family)[0], scan_layers=scan)
    tx = optax.sgd(0.1)
    prompt, prompt_mask = _left_padded_prompts(2, lengths=(7, 3, 5, 1), width=7)
    response, response_mask = right_padded_batch(seed=5, lengths=(4, 2, 1, 3), max_len=4)
    cfg = grpo.GRPOConfig(sampling=SamplingConfig(max_new_tokens=4, num_samples=2), beta=0.0)
    advantages = np.where(response_mask, np.array([1.0, -1.0, 0.5, -0.5])[:, None], 0.0).astype(np.float32)
    batch = grpo.Batch(jnp.asarray(np.concatenate([prompt, response], 1)),
                       jnp.asarray(np.concatenate([prompt_mask, response_mask], 1)), jnp.asarray(response_mask),
                       jnp.asarray(advantages))
    update = jax.jit(lambda state, batch: grpo.update(state, batch, jax.random.key(0), model=model, tx=tx, cfg=cfg))
    state, metrics = update(grpo.init_state(params, tx), batch)
    assert np.isfinite(float(metrics["loss"])) and _all_moved(state.policy.params, params), metrics


@pytest.mark.parametrize("family, scan", [
    pytest.param("gemma2", False, marks=pytest.mark.heavy), pytest.param("gemma3", True, marks=pytest.mark.heavy)])
def test_dpo_step(hf_store, family, scan):
    """A DPO step on tiny Gemma 2 and on Gemma 3 as a scanned stack: a finite loss, and
    every parameter moves."""
    from jaxrlhf import data
    from jaxrlhf.algorithms import dpo

    model, params = load_pretrained(hf_store.get(family)[0], scan_layers=scan)
    tx = optax.sgd(0.1)
    rng = np.random.default_rng(3)
    pairs = data.preference_batch([list(rng.integers(3, VOCAB, n)) for n in (6, 2)],
                                  [list(rng.integers(3, VOCAB, n)) for n in (3, 4)],
                                  [list(rng.integers(3, VOCAB, n)) for n in (4, 1)], prompt_len=6, response_len=5)
    pairs = {k: jnp.asarray(v) for k, v in pairs.items()}
    pairs.update(ref_chosen_logp=jnp.full((2,), -20.0), ref_rejected_logp=jnp.full((2,), -20.0))
    state, metrics = jax.jit(dpo.make_train_step(model, tx, dpo.DPOConfig(beta=0.5)))(
        dpo.init_state(params, tx), pairs, jax.random.key(0))
    assert np.isfinite(float(metrics["loss"])) and bool(metrics["finite"]) and _all_moved(state.params, params)


@pytest.mark.heavy  # end to end; Gemma's GRPO/DPO steps: this file
def test_ppo_with_a_gemma_reward_model(hf_store):
    """RLHF-PPO with every role a Gemma: a Gemma 2 actor with its value head (the critic on
    the shared trunk), its frozen reference, and a Gemma 3 reward model (its
    `Gemma3ForSequenceClassification` checkpoint): one iteration of rollout, scoring and
    update is finite and moves the actor."""
    from jaxrlhf.algorithms import ppo
    from jaxrlhf.algorithms.experience import SamplingConfig

    actor, params = load_pretrained(hf_store.get("gemma2")[0], head="lm_value")
    rm = load_pretrained(hf_store.get("gemma3", "score")[0])
    assert rm[0].head == "score"
    cfg = ppo.PPOConfig(sampling=SamplingConfig(max_new_tokens=4), critic="shared", beta=0.1,
                        num_ppo_epochs=1, num_minibatches=1)
    tx = optax.sgd(0.1)
    state = ppo.init_state(cfg, actor, jax.tree.map(jnp.copy, params), tx, reward=rm)
    prompt, prompt_mask = _left_padded_prompts(4, lengths=(7, 3, 5, 1), width=7)
    it = ppo.make_iteration(actor, None, rm[0], tx, None, cfg)
    state, metrics = it(state, jnp.asarray(prompt, jnp.int32), jnp.asarray(prompt_mask, bool), jax.random.key(1))
    assert bool(metrics["finite"]) and np.isfinite(float(metrics["loss"])), metrics
    assert _all_moved(state.actor.params["layers_0"], params["layers_0"])


def test_unsupported_variants_are_refused_naming_the_field(hf_store, tmp_path):
    """Gemma 3's multimodal checkpoint (model_type gemma3), remote code and bidirectional
    attention are refused, each naming the field."""
    with pytest.raises(UnsupportedConfigError, match=r"model_type='gemma3'.*Gemma3ForConditionalGeneration"):
        from_hf_config({"model_type": "gemma3", "architectures": ["Gemma3ForConditionalGeneration"]})
    gemma3 = hf_store.get("gemma3")[0]
    for name, change, error, pattern in [
            ("multimodal", dict(model_type="gemma3", architectures=["Gemma3ForConditionalGeneration"]),
             UnsupportedConfigError, r"config.json: model_type='gemma3'"),
            ("remote", dict(auto_map={"AutoModelForCausalLM": "modeling_x.X"}), ValueError, r"auto_map"),
            ("bidirectional", dict(use_bidirectional_attention=True), UnsupportedConfigError,
             r"use_bidirectional_attention")]:
        folder = tmp_path / name
        folder.mkdir()
        with open(os.path.join(gemma3, "config.json")) as f:
            raw = json.load(f)
        raw.update(change)
        (folder / "config.json").write_text(json.dumps(raw))
        os.symlink(os.path.join(gemma3, "model.safetensors"), folder / "model.safetensors")
        with pytest.raises(error, match=pattern):
            load_pretrained(folder)
