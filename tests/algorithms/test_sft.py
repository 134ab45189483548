"""SFT step: gradient parity with a hand-written shifted cross-entropy, accumulation,
padding invariance, bf16, the NaN guard, learning on the addition task, input errors."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from jaxrlhf import data
from jaxrlhf.algorithms import common, sft
from jaxrlhf.models import ModelConfig, Transformer, init_params

CFG = ModelConfig(vocab_size=21, hidden_size=16, intermediate_size=24, num_layers=1, num_heads=2,
                  num_kv_heads=1, head_dim=8)
MODEL = Transformer(CFG, head="lm")
PARAMS = init_params(MODEL, jax.random.key(0))
SGD = optax.sgd(1.0)  # new params = params − grads: the step's gradient can be read back
RNG = jax.random.key(0)
EVAL = jax.jit(sft.make_eval_step(MODEL, sft.SFTConfig()))


def _batch(rng, b=8, p=4, t=5, extra_prompt_pad=0, extra_response_pad=0):
    """Random prompts/responses of random lengths through `data.sft_batch`."""
    prompts = [list(rng.integers(4, 21, rng.integers(1, p + 1))) for _ in range(b)]
    answers = [list(rng.integers(4, 21, rng.integers(0, t))) for _ in range(b)]
    out = data.sft_batch(prompts, answers, prompt_len=p + extra_prompt_pad, response_len=t + extra_response_pad)
    return {k: jnp.asarray(out[k]) for k in sft.BATCH_KEYS}


def _hand_loss(params, batch, mode):
    """Full-sequence logits, explicit shift, log-softmax and gather: no ops, no common."""
    logits = MODEL.apply({"params": params}, batch["tokens"], batch["input_mask"]).logits
    logp_all = jax.nn.log_softmax(logits[:, :-1].astype(jnp.float32), axis=-1)
    targets = batch["tokens"][:, 1:]
    nll = -jnp.take_along_axis(logp_all, targets[..., None], axis=-1)[..., 0]
    m = batch["loss_mask"][:, 1:].astype(jnp.float32)
    if mode == "token-mean":
        return jnp.sum(nll * m) / jnp.sum(m)
    per_seq = jnp.sum(nll * m, axis=1) / jnp.maximum(jnp.sum(m, axis=1), 1.0)
    return jnp.mean(per_seq)  # seq-mean-token-mean


@pytest.fixture(scope="module")
def steps():
    """Compiled steps shared by the tests (compilation dominates the runtime)."""
    out = {}
    for mode in ("token-mean", "seq-mean-token-mean"):
        for n in (1, 4):
            out[mode, n] = jax.jit(sft.make_train_step(MODEL, SGD, sft.SFTConfig(agg=mode, num_microbatches=n)))
    return out


@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-mean"])
def test_step_gradient_equals_hand_composed_cross_entropy(steps, mode):
    batch = _batch(np.random.default_rng(0))
    state = sft.init_state(PARAMS, SGD)
    new_state, metrics = steps[mode, 1](state, batch, RNG)
    want_loss, want_grads = jax.jit(jax.value_and_grad(_hand_loss), static_argnums=2)(PARAMS, batch, mode)
    np.testing.assert_allclose(metrics["loss"], want_loss, rtol=1e-5)
    got_grads = jax.tree.map(lambda a, b: a - b, PARAMS, new_state.params)
    for g, w in zip(jax.tree.leaves(got_grads), jax.tree.leaves(want_grads)):
        np.testing.assert_allclose(g, w, rtol=1e-3, atol=2e-6)
    np.testing.assert_allclose(metrics["grad_norm"], optax.tree.norm(want_grads), rtol=1e-4)
    assert bool(metrics["finite"]) and int(new_state.step) == 1


def test_chunked_head_step_equals_plain_step(steps):
    """The step with the fused head (`logprobs_head="chunked"`): same loss, token accuracy
    (its greedy tokens) and gradients as the plain head's."""
    model = Transformer(CFG.replace(logprobs_head="chunked"), head="lm")
    chunked = jax.jit(sft.make_train_step(model, SGD, sft.SFTConfig(agg="token-mean")))
    batch = _batch(np.random.default_rng(5))
    want_state, want = steps["token-mean", 1](sft.init_state(PARAMS, SGD), batch, RNG)
    got_state, got = chunked(sft.init_state(PARAMS, SGD), batch, RNG)
    for k in ("loss", "nll", "token_accuracy", "num_tokens", "grad_norm"):
        np.testing.assert_allclose(got[k], want[k], rtol=1e-5, err_msg=k)
    for g, w in zip(jax.tree.leaves(got_state.params), jax.tree.leaves(want_state.params)):
        np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("mode", ["token-mean", pytest.param("seq-mean-token-mean", marks=pytest.mark.heavy)])
def test_accumulation_4x4_equals_1x16(steps, mode):
    batch = _batch(np.random.default_rng(1), b=16)
    state = sft.init_state(PARAMS, SGD)
    s1, m1 = steps[mode, 1](state, batch, RNG)
    s4, m4 = steps[mode, 4](state, batch, RNG)
    np.testing.assert_allclose(m4["loss"], m1["loss"], rtol=1e-5)
    np.testing.assert_allclose(m4["token_accuracy"], m1["token_accuracy"], rtol=1e-6)
    np.testing.assert_allclose(m4["num_tokens"], m1["num_tokens"])
    np.testing.assert_allclose(m4["grad_norm"], m1["grad_norm"], rtol=1e-4)
    for a, b in zip(jax.tree.leaves(s1.params), jax.tree.leaves(s4.params)):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=5e-6)


def test_padding_never_changes_the_loss_or_gradient():
    grad = jax.jit(jax.value_and_grad(lambda p, b: sft.loss_fn(p, b, model=MODEL, cfg=sft.SFTConfig()),
                                      has_aux=True))
    base = _batch(np.random.default_rng(2))
    padded = _batch(np.random.default_rng(2), extra_prompt_pad=3, extra_response_pad=2)
    assert padded["tokens"].shape[1] == base["tokens"].shape[1] + 5
    ((l0, m0), g0), ((l1, m1), g1) = grad(PARAMS, base), grad(PARAMS, padded)
    np.testing.assert_allclose(l1, l0, rtol=1e-5)
    for k in ("nll", "token_accuracy", "num_tokens"):
        np.testing.assert_allclose(m1[k], m0[k], rtol=1e-5, err_msg=k)
    for a, b in zip(jax.tree.leaves(g0), jax.tree.leaves(g1)):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-7)


def test_prompt_len_skips_prompt_logits_without_changing_the_loss():
    batch = _batch(np.random.default_rng(3), p=4)
    full = EVAL(PARAMS, batch)
    skip = jax.jit(sft.make_eval_step(MODEL, sft.SFTConfig(prompt_len=4)))(PARAMS, batch)
    np.testing.assert_allclose(skip["loss"], full["loss"], rtol=1e-6)
    np.testing.assert_allclose(skip["token_accuracy"], full["token_accuracy"])


@pytest.mark.heavy  # bf16 compute: models/test_precision.py
def test_bf16_compute_path_is_finite():
    model = Transformer(CFG.replace(dtype="bfloat16", param_dtype="float32"))
    tx, _ = common.make_optimizer(common.OptimConfig(lr=1e-3))
    state = sft.init_state(PARAMS, tx)
    step = jax.jit(sft.make_train_step(model, tx, sft.SFTConfig()))
    state, metrics = step(state, _batch(np.random.default_rng(4)), RNG)
    assert bool(metrics["finite"]) and np.isfinite(metrics["loss"]) and metrics["loss"] > 0
    assert jax.tree.leaves(state.params)[0].dtype == jnp.float32


def test_non_finite_gradient_skips_the_update(steps):
    bad = jax.tree.map(lambda x: x, PARAMS)
    bad["lm_head"]["kernel"] = bad["lm_head"]["kernel"].at[0, 0].set(jnp.nan)
    state = sft.init_state(bad, SGD)
    new_state, metrics = steps["token-mean", 1](state, _batch(np.random.default_rng(5)), RNG)
    assert not bool(metrics["finite"])
    assert int(new_state.step) == 0
    for a, b in zip(jax.tree.leaves(new_state), jax.tree.leaves(state)):
        np.testing.assert_array_equal(a, b)


def test_learns_addition_quickly():
    task = data.AdditionTask(num_digits=2, reverse_answer=True, zero_pad=True)
    train = data.sft_arrays(task, data.make_problems(task, 512, split="train", seed=0))
    test = data.sft_arrays(task, data.make_problems(task, 128, split="test", seed=0))
    test = {k: jnp.asarray(test[k]) for k in sft.BATCH_KEYS}
    cfg = sft.SFTConfig(prompt_len=task.prompt_len)
    model = Transformer(CFG.replace(hidden_size=32, intermediate_size=64, num_heads=4, num_kv_heads=2))
    params = init_params(model, jax.random.key(1))
    tx, _ = common.make_optimizer(common.OptimConfig(lr=3e-3))
    step = sft.jit_train_step(model, tx, cfg)
    evaluate = jax.jit(sft.make_eval_step(model, cfg))
    before = evaluate(params, test)
    state = sft.init_state(params, tx)
    it = data.BatchIterator(512, 64, seed=0)
    for _ in range(80):
        idx = next(it)
        state, metrics = step(state, {k: train[k][idx] for k in sft.BATCH_KEYS}, RNG)
        assert bool(metrics["finite"])
    after = evaluate(state.params, test)
    # Uniform over 21 tokens is log 21 ≈ 3.04 nats; digits-only guessing is log 10 ≈ 2.3.
    assert float(after["loss"]) < 0.6 * float(before["loss"])
    assert float(after["loss"]) < 1.8
    assert float(after["token_accuracy"]) > float(before["token_accuracy"]) + 0.2


def test_bad_input_gives_clear_errors(steps):
    with pytest.raises(ValueError, match="agg"):
        sft.SFTConfig(agg="mean")
    with pytest.raises(ValueError, match="norm_len"):
        sft.SFTConfig(agg="seq-mean-token-sum-norm")
    with pytest.raises(ValueError, match="num_microbatches"):
        sft.SFTConfig(num_microbatches=0)
    state = sft.init_state(PARAMS, SGD)
    batch = _batch(np.random.default_rng(6), b=6)
    with pytest.raises(ValueError, match="does not split into num_microbatches=4"):
        steps["token-mean", 4](state, batch, RNG)
    with pytest.raises(ValueError, match="loss_mask has shape"):
        steps["token-mean", 1](state, dict(batch, loss_mask=batch["loss_mask"][:, 1:]), RNG)
    with pytest.raises(ValueError, match="missing"):
        steps["token-mean", 1](state, {"tokens": batch["tokens"]}, RNG)
