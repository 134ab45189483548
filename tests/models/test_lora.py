"""LoRA adapters (`jaxrlhf.models.lora`): step 0 is the base model, only adapters train,
the reference is the base, and the merged and PEFT exports equal the adapter forward."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from jaxrlhf.algorithms import common, grpo
from jaxrlhf.models import (ModelConfig, Transformer, init_params, load_pretrained, logical_axes, lora, peft_export,
                            save_pretrained)
from jaxrlhf.runs import config_base

from .conftest import right_padded_batch

CFG = ModelConfig(vocab_size=40, hidden_size=32, intermediate_size=48, num_layers=1, num_heads=4, num_kv_heads=2,
                  head_dim=8)
ALL = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "lm_head")
IDS = jnp.asarray(np.random.default_rng(0).integers(0, 40, (3, 9)), jnp.int32)


def _random_like(tree, seed: int, scale: float):
    """NumPy N(0, scale) arrays shaped like `tree` (no compiled init)."""
    rng = np.random.default_rng(seed)
    return jax.tree.map(lambda x: jnp.asarray(scale * rng.standard_normal(x.shape), x.dtype), tree)


def _moved(params):
    """`params` with every B random (a trained-looking adapter; fresh ones have B = 0)."""
    return lora.with_trainable(params, jax.tree_util.tree_map_with_path(
        lambda path, x: x + _random_like(x, len(path), 0.05) if path[-1].key == "lora_b" else x,
        lora.adapters(params)))


@functools.lru_cache(maxsize=None)
def _adapted(config: ModelConfig, targets=ALL, **kw):
    """(lora model, base params, fresh adapters (B = 0), moved adapters), once per argument set."""
    model = Transformer(config.replace(lora=lora.LoraConfig(rank=4, targets=targets, **kw)))
    base = _random_like(jax.eval_shape(functools.partial(init_params, Transformer(config)), jax.random.key(0)), 0, 0.1)
    params = lora.add_adapters(model, base, jax.random.key(1))
    return model, base, params, _moved(params)


@functools.partial(jax.jit, static_argnums=0)
def _forward(model, params, ids, mask):
    return model.apply({"params": params}, ids, mask).logits


def _logits(model, params, ids=IDS, mask=None):
    return _forward(model, params, ids, jnp.ones_like(ids) if mask is None else mask)


@pytest.mark.parametrize("scan", [False, pytest.param(True, marks=pytest.mark.heavy)], ids=["unrolled", "scanned"])
def test_step_zero_adapters_off_and_merged(scan):
    """Fresh adapters (B = 0) and dropped adapters give the base model exactly; merged ones
    (W + s A B) the adapter forward."""
    config = CFG.replace(scan_layers=scan)
    model, base, fresh, trained = _adapted(config)
    expected = _logits(Transformer(config), base)
    np.testing.assert_array_equal(_logits(model, fresh), expected)
    adapted = _logits(model, trained)
    assert not np.allclose(adapted, expected, atol=1e-3)  # the adapters act once B moves
    off = lora.without_adapters(trained)
    np.testing.assert_array_equal(_logits(model, off), expected)
    kept = [x for p, x in jax.tree_util.tree_flatten_with_path(trained)[0] if p[-1].key not in lora.ADAPTER_KEYS]
    assert all(a is b for a, b in zip(jax.tree.leaves(off), kept))  # the same arrays: no copy of the base
    merged = lora.merge(model.config, trained)
    assert not lora.has_adapters(merged)
    np.testing.assert_allclose(_logits(Transformer(config), merged), adapted, atol=1e-5, rtol=0)


def test_adapters_are_float32_with_their_kernels_axes_and_the_base_keeps_its_dtype():
    config = CFG.replace(param_dtype="bfloat16", dtype="bfloat16")
    model = Transformer(config.replace(lora=lora.LoraConfig(rank=4, targets=("q_proj", "o_proj", "lm_head"))))
    params = jax.eval_shape(functools.partial(init_params, model), jax.random.key(0))
    q, o = params["layers_0"]["self_attn"]["q_proj"], params["layers_0"]["self_attn"]["o_proj"]
    assert q["kernel"].dtype == jnp.bfloat16 and q["lora_a"].dtype == q["lora_b"].dtype == jnp.float32
    assert q["lora_a"].shape == (32, 4) and q["lora_b"].shape == (4, 4, 8)  # [D, r], [r, N, H]
    assert o["lora_a"].shape == (4, 8, 4) and o["lora_b"].shape == (4, 32)  # [N, H, r], [r, D]
    assert "lora_a" not in params["layers_0"]["self_attn"]["k_proj"]
    axes = logical_axes(model)["layers_0"]["self_attn"]
    assert axes["q_proj"]["lora_a"] == ("embed", None) and axes["q_proj"]["lora_b"] == (None, "q_heads", "head_dim")
    assert axes["o_proj"]["lora_a"] == ("q_heads", "head_dim", None) and axes["o_proj"]["lora_b"] == (None, "embed")
    assert logical_axes(model)["lm_head"]["lora_b"] == (None, "vocab")
    assert lora.LoraConfig(rank=4, alpha=8.0).scale == 2.0
    assert lora.parse_targets(config_base.lora().targets) == lora.DEFAULT_TARGETS  # the config's default
    assert lora.LoraConfig(rank=4, alpha=8.0, rslora=True).scale == 4.0


def test_gradients_and_updates_reach_only_the_adapters():
    model, _, params, trained = _adapted(CFG)
    loss = lambda p, ids, _: (jnp.mean(jax.nn.log_softmax(_logits(model, p, ids))[..., 0] ** 2), {})
    grad = jax.jit(lambda p: common.accumulate_gradients(loss, p, IDS, num_microbatches=1)[2])
    grads = grad(trained)
    assert jax.tree.structure(grads) == jax.tree.structure(lora.adapters(trained))
    assert all(float(jnp.abs(g).max()) > 0 for g in jax.tree.leaves(grads))  # A and B both get a gradient
    tx = optax.adam(1e-2)
    state = common.TrainState.create(trained, tx)
    assert jax.tree.structure(state.opt_state[0].mu) == jax.tree.structure(lora.adapters(trained))
    new = state.apply_gradients(grads, tx)
    for before, after in zip(jax.tree.leaves(lora.without_adapters(trained)),
                             jax.tree.leaves(lora.without_adapters(new.params))):
        assert after is before  # the base passes through, untouched
    moved = jax.tree.map(lambda a, b: bool(jnp.any(a != b)), lora.adapters(trained), lora.adapters(new.params))
    assert all(jax.tree.leaves(moved))


def test_grpo_reference_is_the_base_and_equals_a_separately_loaded_base(tmp_path):
    model, base, _, trained = _adapted(CFG)
    save_pretrained(Transformer(CFG), base, tmp_path / "base")
    _, loaded = load_pretrained(tmp_path / "base")
    state = grpo.init_state(trained, optax.sgd(0.1))  # no ref_params: the base is the reference
    assert state.ref_params is None
    reference = _logits(model, grpo.reference_params(state))
    np.testing.assert_array_equal(reference, _logits(Transformer(CFG), loaded))  # hence equal log-probs
    assert float(jnp.abs(_logits(model, state.policy.params) - reference).max()) > 1e-3  # not the policy


def test_exports_load_in_transformers_and_peft(hf_store, tmp_path):
    """A checkpoint's LoRA: the merged HF folder in `transformers`, and the PEFT folder on
    the checkpoint in `peft`, give the logits of the adapter forward."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    peft = pytest.importorskip("peft")
    path, _ = hf_store.get("llama3")  # untied head, q/k/v/o biases
    base_model, base = load_pretrained(path)
    model = Transformer(base_model.config.replace(lora=lora.LoraConfig(rank=4, alpha=8.0, targets=ALL)))
    params = _moved(lora.add_adapters(model, base, jax.random.key(0)))
    ids, mask = right_padded_batch(seed=3)
    expected = np.asarray(_logits(model, params, jnp.asarray(ids), jnp.asarray(mask)))
    valid = mask.astype(bool)

    save_pretrained(base_model, lora.merge(model.config, params), tmp_path / "merged")
    peft_export.save_peft(model.config, params, tmp_path / "peft", base_model_name_or_path=path)
    with torch.no_grad():
        hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "merged").eval()
        merged = hf(input_ids=torch.as_tensor(ids), attention_mask=torch.as_tensor(mask)).logits.numpy()
        hf_base = transformers.AutoModelForCausalLM.from_pretrained(path).eval()
        with_peft = peft.PeftModel.from_pretrained(hf_base, tmp_path / "peft").eval()
        adapted = with_peft(input_ids=torch.as_tensor(ids), attention_mask=torch.as_tensor(mask)).logits.numpy()
    assert np.abs(expected - np.asarray(_logits(base_model, base, jnp.asarray(ids), jnp.asarray(mask)))).max() > 1e-2
    np.testing.assert_allclose(merged[valid], expected[valid], atol=1e-4, rtol=0)  # the parity tests' bound
    np.testing.assert_allclose(adapted[valid], expected[valid], atol=1e-4, rtol=0)
    np.testing.assert_allclose(adapted[valid], merged[valid], atol=1e-5, rtol=0)


@pytest.mark.parametrize("kwargs, message", [
    (dict(rank=0), r"model.lora.rank=0: .*> 0"),
    (dict(rank=-2), r"model.lora.rank=-2"),
    (dict(rank=4, targets=("q_proj", "attn_qkv")), r"model.lora.targets: 'attn_qkv' matches no projection"),
    (dict(rank=4, targets="lm_head"), r"model.lora.targets: 'lm_head' .*ties it .*tie_word_embeddings"),
    (dict(rank=4, targets="q_proj,("), r"model.lora.targets: '\(' is not a regular expression"),
])
def test_bad_input_names_the_field(kwargs, message):
    with pytest.raises(ValueError, match=message):
        lora.check_targets(CFG.replace(tie_word_embeddings=True, lora=lora.LoraConfig(**kwargs)))
