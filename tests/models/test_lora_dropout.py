"""LoRA adapter dropout (`LoraConfig.dropout`): on only with a "dropout" rng, on the
adapter's input only, inverted scaling; p = 0 threads no key; a training step with p > 0
updates only the adapters; a bad p is refused naming the field."""

from __future__ import annotations

import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from jaxrlhf import data
from jaxrlhf.algorithms import sft
from jaxrlhf.models import ModelConfig, Transformer, init_params, lora
from jaxrlhf.models.projection import Projection
from jaxrlhf.runs import config_base

CFG = ModelConfig(vocab_size=40, hidden_size=32, intermediate_size=48, num_layers=2, num_heads=4, num_kv_heads=2,
                  head_dim=8, tie_word_embeddings=False)
TARGETS = ("q_proj", "v_proj", "o_proj", "up_proj", "down_proj")
IDS = jnp.asarray(np.random.default_rng(0).integers(0, 40, (2, 7)), jnp.int32)


def _model(p: float, scan: bool = False) -> Transformer:
    return Transformer(CFG.replace(scan_layers=scan, lora=lora.LoraConfig(rank=4, targets=TARGETS, dropout=p)))


@functools.lru_cache(maxsize=None)
def _params(scan: bool):
    """Base params with small random (trained-looking, B != 0) adapters, in the stack's
    layout: small, so that the model is near-linear in the adapter term."""
    model = _model(0.0, scan)
    params = init_params(model, jax.random.key(0))
    rng = np.random.default_rng(1)
    return lora.with_trainable(params, jax.tree_util.tree_map_with_path(
        lambda path, x: x + jnp.asarray(0.005 * rng.standard_normal(x.shape), x.dtype)
        if path[-1].key == "lora_b" else x, lora.adapters(params)))


@functools.partial(jax.jit, static_argnums=0)
def _logits(model, params, key=None):
    """Logits `[B, L, V]`; with `key` adapter dropout is on (a training forward)."""
    return model.apply({"params": params}, IDS, rngs=None if key is None else {"dropout": key}).logits


def _relative_error(got, want, base) -> float:
    """`|got − want| / |want − base|` in L2: how far `got` is, in units of the adapter term."""
    return float(jnp.linalg.norm(got - want) / jnp.linalg.norm(want - base))


def test_projection_dropout_is_inverted_and_on_the_adapter_path_only():
    """One adapted projection: with a key, `y = x W + s (drop(x) A) B` exactly (the base
    term undropped), and the mean over keys of the adapter term is the undropped one (without
    the 1/(1 − p) scale it would be off by p = 0.5 of it)."""
    proj = Projection((8, 6), ("embed", "mlp"), lora=lora.LoraConfig(rank=2, dropout=0.5))
    x = jnp.asarray(np.random.default_rng(0).standard_normal((3, 8)), jnp.float32)
    params = nn.unbox(proj.init(jax.random.key(0), x)["params"])
    apply = jax.jit(jax.vmap(lambda p, k: proj.apply({"params": p}, x, rngs={"dropout": k}), in_axes=(None, 0)))
    keys = jax.random.split(jax.random.key(2), 4096)
    base = x @ params["kernel"]
    np.testing.assert_array_equal(apply(params, keys[:4]), jnp.broadcast_to(base, (4, 3, 6)))  # B = 0: base only
    params = dict(params, lora_b=jnp.asarray(np.random.default_rng(1).standard_normal((2, 6)), jnp.float32))
    undropped = proj.apply({"params": params}, x)
    dropped = apply(params, keys)
    assert _relative_error(dropped[0], undropped, base) > 0.3
    assert _relative_error(jnp.mean(dropped, axis=0), undropped, base) < 0.1


@pytest.mark.parametrize("scan", [False, pytest.param(True, marks=pytest.mark.heavy)], ids=["unrolled", "scanned"])
def test_dropout_only_with_a_key_and_unbiased(scan):
    """Without a key (sampling, scoring, the reference, eval) p > 0 is the undropped model
    exactly. With a key the output changes per key, and its mean over
    many keys is the undropped one up to sampling noise and the (small) curvature of the
    model (without the 1/(1 − p) scale it would be off by p = 0.5 of the adapter term)."""
    params = _params(scan)
    undropped = _logits(_model(0.0, scan), params)
    base = _logits(_model(0.0, scan), lora.without_adapters(params))
    np.testing.assert_array_equal(_logits(_model(0.5, scan), params), undropped)

    model = _model(0.5, scan)
    keys = jax.random.split(jax.random.key(7), 256)
    dropped = jax.vmap(lambda k: _logits(model, params, k))(keys)
    assert _relative_error(dropped[0], undropped, base) > 0.3
    assert _relative_error(dropped[0], dropped[1], base) > 0.3
    assert _relative_error(jnp.mean(dropped, axis=0), undropped, base) < 0.25


def _sft_batch():
    rng = np.random.default_rng(0)
    prompts = [list(rng.integers(4, 40, 3)) for _ in range(4)]
    answers = [list(rng.integers(4, 40, 4)) for _ in range(4)]
    out = data.sft_batch(prompts, answers, prompt_len=3, response_len=5)
    return {k: jnp.asarray(out[k]) for k in sft.BATCH_KEYS}


def test_sft_step_with_dropout_trains_only_adapters_and_p0_threads_no_key():
    """An SFT step (2 micro-batches) with p > 0 runs, leaves every base weight as it was
    and moves the adapters, and its update depends on the dropout key; with p = 0 the
    compiled step draws no random bits at all (no key reaches the model)."""
    tx = optax.adam(1e-2)
    cfg = sft.SFTConfig(num_microbatches=2)
    params, batch = _params(False), _sft_batch()
    step = jax.jit(sft.make_train_step(_model(0.3), tx, cfg))
    state = sft.init_state(params, tx)
    new, metrics = step(state, batch, jax.random.key(0))
    other, _ = step(state, batch, jax.random.key(1))
    assert bool(metrics["finite"])
    base_before, base_after = lora.without_adapters(params), lora.without_adapters(new.params)
    jax.tree.map(np.testing.assert_array_equal, base_before, base_after)
    moved = jax.tree.map(lambda a, b: bool(jnp.any(a != b)), lora.adapters(params), lora.adapters(new.params))
    assert all(jax.tree.leaves(moved))
    assert not np.allclose(metrics["loss"], step(state, batch, jax.random.key(1))[1]["loss"])
    assert any(jax.tree.leaves(jax.tree.map(lambda a, b: bool(jnp.any(a != b)), new.params, other.params)))

    def lowered(p):
        return jax.jit(sft.make_train_step(_model(p), tx, cfg)).lower(state, batch, jax.random.key(0)).as_text()

    assert "threefry" not in lowered(0.0) and "threefry" in lowered(0.3)


@pytest.mark.parametrize("p", [-0.1, 1.0, 1.5])
def test_bad_dropout_is_refused_naming_the_field(p):
    with pytest.raises(ValueError, match=r"model\.lora\.dropout"):
        lora.LoraConfig(rank=4, dropout=p)
    with pytest.raises(ValueError, match=r"model\.lora\.dropout"):
        lora.from_section(config_base.lora(rank=4, dropout=p))
