"""DPO step: gradient parity with a hand-written DPO loss on full-sequence logits, reference
precomputation, accumulation, padding invariance, bf16, learning on addition pairs, errors."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from jaxrlhf import data
from jaxrlhf.algorithms import common, dpo, sft
from jaxrlhf.models import ModelConfig, Transformer, init_params, lora

CFG = ModelConfig(vocab_size=21, hidden_size=16, intermediate_size=24, num_layers=1, num_heads=2,
                  num_kv_heads=1, head_dim=8)
MODEL = Transformer(CFG, head="lm")
PARAMS = init_params(MODEL, jax.random.key(0))
REF_PARAMS = init_params(MODEL, jax.random.key(1))
SGD = optax.sgd(1.0)  # new params = params − grads
RNG = jax.random.key(0)
EVAL = jax.jit(dpo.make_eval_step(MODEL, dpo.DPOConfig(beta=0.5)))


def _pairs(rng, b=8, p=4, t=5, extra_prompt_pad=0, extra_response_pad=0):
    prompts = [list(rng.integers(4, 21, rng.integers(1, p + 1))) for _ in range(b)]
    chosen = [list(rng.integers(4, 21, rng.integers(0, t))) for _ in range(b)]
    rejected = [list(rng.integers(4, 21, rng.integers(0, t))) for _ in range(b)]
    out = data.preference_batch(prompts, chosen, rejected, prompt_len=p + extra_prompt_pad,
                                response_len=t + extra_response_pad)
    return dpo.precompute_reference_logprobs(MODEL, REF_PARAMS, out, batch_size=4)


def _hand_seq_logp(params, prompt_ids, prompt_mask, ids, mask):
    """Σ_t log π(y_t | x, y_<t) from full-sequence logits, shifted by hand."""
    seq = jnp.concatenate([prompt_ids, ids], axis=1)
    attn = jnp.concatenate([prompt_mask, mask], axis=1)
    logits = MODEL.apply({"params": params}, seq, attn).logits
    logp_all = jax.nn.log_softmax(logits[:, :-1].astype(jnp.float32), axis=-1)
    tok_logp = jnp.take_along_axis(logp_all, seq[:, 1:, None], axis=-1)[..., 0]
    p = prompt_ids.shape[1]
    return jnp.sum(tok_logp[:, p - 1:] * mask, axis=1)


_hand_seq_logp_jit = jax.jit(_hand_seq_logp)


def _hand_loss(params, batch, beta, loss_type, ls, nll_coef=0.0):
    c = _hand_seq_logp(params, batch["prompt_ids"], batch["prompt_mask"], batch["chosen_ids"], batch["chosen_mask"])
    r = _hand_seq_logp(params, batch["prompt_ids"], batch["prompt_mask"], batch["rejected_ids"], batch["rejected_mask"])
    z = beta * ((c - batch["ref_chosen_logp"]) - (r - batch["ref_rejected_logp"]))
    if loss_type == "sigmoid":
        per = -(1 - ls) * jax.nn.log_sigmoid(z) - ls * jax.nn.log_sigmoid(-z)
    elif loss_type == "ipo":
        per = (z / beta - 1 / (2 * beta)) ** 2
    else:
        per = jnp.maximum(0.0, 1 - z)
    nll = -c / jnp.maximum(jnp.sum(batch["chosen_mask"], axis=1), 1)  # RPO: per-token NLL of the chosen
    return jnp.mean(per) + nll_coef * jnp.mean(nll), jnp.mean(z > 0)


def test_reference_logprobs_are_precomputed_once_per_dataset():
    batch = _pairs(np.random.default_rng(0), b=10)  # 10 rows in batches of 4: a padded tail
    assert batch["ref_chosen_logp"].shape == (10,) and batch["ref_chosen_logp"].dtype == np.float32
    want_c = _hand_seq_logp_jit(REF_PARAMS, batch["prompt_ids"], batch["prompt_mask"], batch["chosen_ids"],
                            batch["chosen_mask"])
    want_r = _hand_seq_logp_jit(REF_PARAMS, batch["prompt_ids"], batch["prompt_mask"], batch["rejected_ids"],
                            batch["rejected_mask"])
    np.testing.assert_allclose(batch["ref_chosen_logp"], want_c, rtol=1e-5)
    np.testing.assert_allclose(batch["ref_rejected_logp"], want_r, rtol=1e-5)


@pytest.mark.parametrize("loss_type,ls,nll_coef", [("sigmoid", 0.2, 0.0), ("ipo", 0.0, 0.0), ("hinge", 0.0, 0.0),
                                                     ("sigmoid", 0.0, 0.7)])
def test_step_gradient_equals_hand_composed_dpo(loss_type, ls, nll_coef):
    beta = 0.5
    batch = {k: jnp.asarray(v) for k, v in _pairs(np.random.default_rng(1)).items()}
    step = jax.jit(dpo.make_train_step(MODEL, SGD, dpo.DPOConfig(beta=beta, loss_type=loss_type, label_smoothing=ls,
                                                                 nll_coef=nll_coef)))
    new_state, metrics = step(dpo.init_state(PARAMS, SGD), batch, RNG)
    (want_loss, want_acc), want_grads = jax.jit(jax.value_and_grad(_hand_loss, has_aux=True),
                                                static_argnums=(2, 3, 4, 5))(PARAMS, batch, beta, loss_type, ls, nll_coef)
    np.testing.assert_allclose(metrics["loss"], want_loss, rtol=1e-5)
    np.testing.assert_allclose(metrics["reward_accuracy"], want_acc)
    got_grads = jax.tree.map(lambda a, b: a - b, PARAMS, new_state.params)
    for g, w in zip(jax.tree.leaves(got_grads), jax.tree.leaves(want_grads)):
        np.testing.assert_allclose(g, w, rtol=1e-3, atol=2e-6)
    assert bool(metrics["finite"])
    for k in ("margin", "chosen_reward", "rejected_reward", "chosen_logp", "rejected_logp", "grad_norm"):
        assert np.isfinite(metrics[k]), k


def test_accumulation_4x4_equals_1x16():
    batch = _pairs(np.random.default_rng(2), b=16)
    state = dpo.init_state(PARAMS, SGD)
    s1, m1 = jax.jit(dpo.make_train_step(MODEL, SGD, dpo.DPOConfig(beta=0.5)))(state, batch, RNG)
    s4, m4 = jax.jit(dpo.make_train_step(MODEL, SGD, dpo.DPOConfig(beta=0.5, num_microbatches=4)))(state, batch, RNG)
    for k in ("loss", "reward_accuracy", "margin", "chosen_reward", "grad_norm"):
        np.testing.assert_allclose(m4[k], m1[k], rtol=1e-4, atol=1e-7, err_msg=k)
    for a, b in zip(jax.tree.leaves(s1.params), jax.tree.leaves(s4.params)):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=5e-6)


def test_padding_never_changes_the_loss():
    evaluate = EVAL
    base = _pairs(np.random.default_rng(3))
    padded = _pairs(np.random.default_rng(3), extra_prompt_pad=3, extra_response_pad=2)
    # Chosen and rejected of different widths are padded to a common T inside the step.
    ragged = dict(padded, rejected_ids=padded["rejected_ids"][:, :5], rejected_mask=padded["rejected_mask"][:, :5])
    m0 = evaluate(PARAMS, base)
    for other in (padded, ragged):
        np.testing.assert_allclose(other["ref_chosen_logp"], base["ref_chosen_logp"], rtol=1e-5)
        m1 = evaluate(PARAMS, other)
        for k in ("loss", "reward_accuracy", "margin", "chosen_reward", "rejected_reward"):
            np.testing.assert_allclose(m1[k], m0[k], rtol=1e-5, atol=1e-6, err_msg=k)


def test_eval_weights_select_rows():
    evaluate = EVAL
    batch = _pairs(np.random.default_rng(4))
    head = {k: v[:5] for k, v in batch.items()}
    weight = (np.arange(8) < 5).astype(np.float32)
    m_head, m_weighted = evaluate(PARAMS, head), evaluate(PARAMS, dict(batch, weight=weight))
    assert float(m_weighted["weight"]) == 5.0
    for k in ("loss", "reward_accuracy", "margin"):
        np.testing.assert_allclose(m_weighted[k], m_head[k], rtol=1e-5, atol=1e-7, err_msg=k)


@pytest.mark.heavy  # bf16 compute: models/test_precision.py
def test_bf16_compute_path_is_finite():
    model = Transformer(CFG.replace(dtype="bfloat16", param_dtype="float32"))
    tx, _ = common.make_optimizer(common.OptimConfig(lr=1e-3))
    batch = _pairs(np.random.default_rng(5))  # float32 reference columns: any constants will do
    state, metrics = jax.jit(dpo.make_train_step(model, tx, dpo.DPOConfig()))(dpo.init_state(PARAMS, tx), batch, RNG)
    assert bool(metrics["finite"]) and np.isfinite(metrics["loss"])
    assert jax.tree.leaves(state.params)[0].dtype == jnp.float32


@pytest.mark.heavy  # a learning run; the DPO step and loss are tested quick
def test_dpo_raises_held_out_preference_accuracy():
    """A briefly SFT-ed policy is the reference; DPO on train pairs must generalise."""
    task = data.AdditionTask(num_digits=2, reverse_answer=True, zero_pad=True)
    train_problems = data.make_problems(task, 1024, split="train", seed=0)
    model = Transformer(CFG.replace(hidden_size=32, intermediate_size=64, num_heads=4, num_kv_heads=2))
    params = init_params(model, jax.random.key(2))
    # Warm start: SFT 150 steps (an imperfect policy, so preferences are still to learn).
    sft_arrays = data.sft_arrays(task, train_problems)
    tx, _ = common.make_optimizer(common.OptimConfig(lr=3e-3))
    sft_step = sft.jit_train_step(model, tx, sft.SFTConfig(prompt_len=task.prompt_len))
    state = sft.init_state(params, tx)
    it = data.BatchIterator(1024, 64, seed=0)
    for _ in range(150):
        idx = next(it)
        state, _ = sft_step(state, {k: sft_arrays[k][idx] for k in sft.BATCH_KEYS}, RNG)
    ref = state.params

    train = data.preference_arrays(task, data.make_preference_pairs(task, train_problems, seed=0))
    test = data.preference_arrays(task, data.make_preference_pairs(
        task, data.make_problems(task, 256, split="test", seed=0), seed=1))
    train = dpo.precompute_reference_logprobs(model, ref, train, batch_size=256)
    test = dpo.precompute_reference_logprobs(model, ref, test, batch_size=256)
    cfg = dpo.DPOConfig(beta=0.1)
    tx, _ = common.make_optimizer(common.OptimConfig(lr=1e-3))
    step = dpo.jit_train_step(model, tx, cfg)
    evaluate = jax.jit(dpo.make_eval_step(model, cfg))
    # Policy = reference: every margin is 0 up to float rounding, hence accuracy near 0.
    before = float(evaluate(ref, test)["reward_accuracy"])
    state = dpo.init_state(jax.tree.map(jnp.array, ref), tx)
    it = data.BatchIterator(1024, 64, seed=1)
    for _ in range(150):
        idx = next(it)
        state, metrics = step(state, {k: v[idx] for k, v in train.items()}, RNG)
        assert bool(metrics["finite"])
    after = float(evaluate(state.params, test)["reward_accuracy"])
    print("DPO held-out preference accuracy", before, "->", after)
    assert after > 0.75 and after > before + 0.25, (before, after)


@pytest.mark.heavy  # learning; DPO learning: this file, LoRA steps: models/test_lora.py
def test_dpo_with_lora_raises_held_out_preference_accuracy():
    """Rank-8 adapters on a fresh model, the base as reference: DPO learns which answer of
    an addition pair is correct (no warm start needed to rank the pairs)."""
    task = data.AdditionTask(num_digits=2, reverse_answer=True, zero_pad=True)
    config = CFG.replace(vocab_size=data.CharTokenizer().vocab_size, hidden_size=32, intermediate_size=64,
                         num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16)
    model = Transformer(config.replace(lora=lora.LoraConfig(rank=8)))
    params = lora.add_adapters(model, init_params(Transformer(config), jax.random.key(2)), jax.random.key(3))
    pairs = lambda n, split, seed: data.preference_arrays(task, data.make_preference_pairs(
        task, data.make_problems(task, n, split=split, seed=0), seed=seed))
    base = lora.without_adapters(params)
    train = dpo.precompute_reference_logprobs(model, base, pairs(1024, "train", 0), batch_size=256)
    test = dpo.precompute_reference_logprobs(model, base, pairs(256, "test", 1), batch_size=256)
    cfg = dpo.DPOConfig(beta=0.1)
    tx, _ = common.make_optimizer(common.OptimConfig(lr=3e-3))
    step = dpo.jit_train_step(model, tx, cfg)
    evaluate = jax.jit(dpo.make_eval_step(model, cfg))
    before = float(evaluate(params, test)["reward_accuracy"])  # B = 0: the policy is its reference, margins 0
    base = jax.tree.map(np.asarray, base)  # host copies: the step donates the state's buffers
    state = dpo.init_state(params, tx)
    it = data.BatchIterator(1024, 64, seed=1)
    for _ in range(40):
        idx = next(it)
        state, metrics = step(state, {k: v[idx] for k, v in train.items()}, RNG)
    assert all(np.array_equal(a, b) for a, b in zip(
        jax.tree.leaves(lora.without_adapters(state.params)), jax.tree.leaves(base)))  # only adapters trained
    after = float(evaluate(state.params, test)["reward_accuracy"])
    print("DPO with LoRA held-out preference accuracy", before, "->", after)
    assert after > 0.6 and after > before + 0.5, (before, after)  # measured 0 -> 0.70 (25 steps)


def test_bad_input_gives_clear_errors():
    with pytest.raises(ValueError, match="beta"):
        dpo.DPOConfig(beta=0.0)
    with pytest.raises(ValueError, match="loss_type"):
        dpo.DPOConfig(loss_type="kto")
    with pytest.raises(ValueError, match="sigmoid"):
        dpo.DPOConfig(loss_type="ipo", label_smoothing=0.1)
    with pytest.raises(ValueError, match="label_smoothing"):
        dpo.DPOConfig(label_smoothing=0.5)
    with pytest.raises(ValueError, match="nll_coef=-0.1 is impossible: it must be >= 0"):
        dpo.DPOConfig(nll_coef=-0.1)
    batch = _pairs(np.random.default_rng(6), b=6)
    state = dpo.init_state(PARAMS, SGD)
    step = dpo.make_train_step(MODEL, SGD, dpo.DPOConfig(num_microbatches=4))
    with pytest.raises(ValueError, match="does not split into num_microbatches=4"):
        step(state, batch, RNG)
    step = dpo.make_train_step(MODEL, SGD, dpo.DPOConfig())
    with pytest.raises(ValueError, match="precompute_reference_logprobs"):
        step(state, {k: v for k, v in batch.items() if not k.startswith("ref_")}, RNG)
    with pytest.raises(ValueError, match="chosen_mask has shape"):
        step(state, dict(batch, chosen_mask=batch["chosen_mask"][:, :-1]), RNG)
    with pytest.raises(ValueError, match=r"rejected_ids must be \[B, T\] with B = 6"):
        step(state, dict(batch, rejected_ids=batch["rejected_ids"][:4], rejected_mask=batch["rejected_mask"][:4]), RNG)
    with pytest.raises(ValueError, match=r"ref_chosen_logp must be \[B\]"):
        step(state, dict(batch, ref_chosen_logp=batch["ref_chosen_logp"][:3]), RNG)


def test_shared_prompt_equals_two_full_forward_passes():
    batch = {k: jnp.asarray(v) for k, v in _pairs(np.random.default_rng(5), extra_prompt_pad=2).items()}

    def total(params, share):
        c, r = dpo.pair_logprobs(MODEL, params, batch, share_prompt=share)
        return jnp.sum(c) - 0.5 * jnp.sum(r), (c, r)

    grad_fn = jax.jit(jax.value_and_grad(total, has_aux=True), static_argnums=1)
    (l1, (c1, r1)), g1 = grad_fn(PARAMS, False)
    (l2, (c2, r2)), g2 = grad_fn(PARAMS, True)
    np.testing.assert_allclose(c2, c1, rtol=1e-5)
    np.testing.assert_allclose(r2, r1, rtol=1e-5)
    for a, b in zip(jax.tree.leaves(g1), jax.tree.leaves(g2)):
        np.testing.assert_allclose(b, a, rtol=1e-4, atol=1e-6)
