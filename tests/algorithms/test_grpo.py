"""GRPO family: loss against the ops it is made of, ratios, GSPO, DAPO options,
accumulation, errors, bf16, and a toy task it must learn within seconds."""

import dataclasses
import functools
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from jaxrlhf import ops, rewards
from jaxrlhf.algorithms import grpo, timing
from jaxrlhf.algorithms.experience import SamplingConfig, score_responses
from jaxrlhf.models import ModelConfig, Transformer, init_params

CFG = ModelConfig(vocab_size=16, hidden_size=32, intermediate_size=64, num_layers=1, num_heads=2, num_kv_heads=1,
                  head_dim=16, max_position_embeddings=32)
MODEL = Transformer(CFG)
PARAMS = init_params(MODEL, jax.random.key(0))
TARGET = 5
P, T = 3, 5


def target_fraction(ids, mask, extras):
    """Fraction of the valid response tokens equal to TARGET (WORKLOAD measurement 3's reward)."""
    mask = mask.astype(bool)
    return (jnp.sum((ids == TARGET) & mask, axis=1) / jnp.maximum(jnp.sum(mask, axis=1), 1)).astype(jnp.float32)


_score = jax.jit(lambda params, seq, attn: score_responses(MODEL, params, seq, attn, P, temperature=0.8))
_value_and_grad = jax.jit(jax.value_and_grad(grpo.loss_fn, has_aux=True), static_argnames=("cfg", "model",
                                                                                          "group_size"))


@functools.lru_cache(maxsize=None)
def _batch(seed=0, n=8, with_ref=True):
    """A fixed batch: left-padded prompts, right-padded responses, perturbed old/ref log-probs."""
    rng = np.random.default_rng(seed)
    seq = rng.integers(3, CFG.vocab_size, (n, P + T))
    plen = rng.integers(1, P + 1, n)
    rlen = rng.integers(1, T + 1, n)
    pmask = np.arange(P)[None] >= (P - plen)[:, None]
    rmask = np.arange(T)[None] < rlen[:, None]
    seq, attn = jnp.asarray(seq), jnp.asarray(np.concatenate([pmask, rmask], 1))
    logp0 = _score(PARAMS, seq, attn)
    old = logp0 + jnp.asarray(rng.normal(0, 0.3, (n, T)), jnp.float32)
    ref = logp0 + jnp.asarray(rng.normal(0, 0.3, (n, T)), jnp.float32) if with_ref else None
    adv = ops.broadcast_sequence(jnp.asarray(rng.standard_normal(n), jnp.float32), rmask)
    return grpo.Batch(seq, attn, jnp.asarray(rmask), adv, old, ref)


def _cfg(**kw):
    sampling = kw.pop("sampling", SamplingConfig(max_new_tokens=T, num_samples=4, temperature=0.8))
    return grpo.GRPOConfig(sampling=sampling, **kw)


# --------------------------------------------------------------------------- the loss

LOSS_CFG = _cfg(beta=0.1, entropy_coef=0.01, clip_low=0.2, clip_high=0.28, dual_clip=3.0, agg="seq-mean-token-mean")


def _grouped(batch: grpo.Batch, g: int) -> grpo.Batch:
    """The batch with each group of g rows given its first row's prompt (a rollout's layout)."""
    seq = batch.sequences.at[:, :P].set(jnp.repeat(batch.sequences[::g, :P], g, axis=0))
    attn = batch.attention_mask.at[:, :P].set(jnp.repeat(batch.attention_mask[::g, :P], g, axis=0))
    return batch._replace(sequences=seq, attention_mask=attn)


@pytest.mark.parametrize("group_size", [1, pytest.param(4, marks=pytest.mark.heavy)])
def test_loss_gradient_matches_hand_composed_ops(group_size):
    """Also with each group's prompt run once (`group_size=4`) against the full forward."""
    batch = _grouped(_batch(), 4)
    cfg = LOSS_CFG

    def reference(params):
        logits = MODEL.apply({"params": params}, batch.sequences, batch.attention_mask).logits
        logits = ops.shift_logits_for_response(logits, P)
        resp = batch.sequences[:, P:]
        logp = ops.token_logprobs(logits, resp, temperature=0.8)
        ent = ops.entropy(logits, temperature=0.8)
        m = batch.response_mask
        pg, _ = ops.policy_loss(logp, batch.old_logp, batch.advantages, m, clip_low=0.2, clip_high=0.28,
                                dual_clip=3.0, agg="seq-mean-token-mean")
        kl = ops.aggregate(ops.kl(logp, batch.ref_logp, estimator="k3"), m, mode="seq-mean-token-mean")
        return pg + 0.1 * kl - 0.01 * ops.aggregate(ent, m, mode="seq-mean-token-mean")

    (loss, metrics), grads = _value_and_grad(PARAMS, batch, cfg, model=MODEL, group_size=group_size)
    ref_loss, ref_grads = jax.jit(jax.value_and_grad(reference))(PARAMS)
    np.testing.assert_allclose(loss, ref_loss, rtol=1e-5)
    for g, r in zip(jax.tree.leaves(grads), jax.tree.leaves(ref_grads)):
        np.testing.assert_allclose(g, r, rtol=1e-4, atol=1e-7)
    assert 0 < metrics["clipfrac"] < 1 and metrics["kl/mean"] > 0


def test_track_kl_reports_the_kl_without_changing_the_loss():
    """β = 0 with `track_kl`: the same loss and gradients as without a reference, plus `kl`
    (the masked mean of the k3 estimator against the reference log-probs)."""
    batch = _batch()
    (loss, metrics), grads = _value_and_grad(PARAMS, batch, _cfg(track_kl=True), model=MODEL)
    (loss0, metrics0), grads0 = _value_and_grad(PARAMS, batch._replace(ref_logp=None), _cfg(), model=MODEL)
    np.testing.assert_array_equal(loss, loss0)
    for g, g0 in zip(jax.tree.leaves(grads), jax.tree.leaves(grads0)):
        np.testing.assert_array_equal(g, g0)
    assert "kl/mean" not in metrics0
    logp = _score(PARAMS, batch.sequences, batch.attention_mask)
    m = np.asarray(batch.response_mask, bool)
    d = np.asarray(batch.ref_logp, np.float64) - np.asarray(logp, np.float64)
    np.testing.assert_allclose(metrics["kl/mean"], (np.exp(d) - 1 - d)[m].mean(), rtol=1e-5)
    assert _cfg(track_kl=True).uses_reference and not _cfg().uses_reference


def test_gspo_sequence_ratio_matches_numpy():
    batch = _batch(seed=1)
    logp = _score(PARAMS, batch.sequences, batch.attention_mask)
    out = grpo.importance_logp(logp, batch.old_logp, batch.response_mask, level="sequence")
    lp, old, m = (np.asarray(x, np.float64) for x in (logp, batch.old_logp, batch.response_mask))
    ratio = np.exp(out - old)
    seq_ratios = []
    for b in range(lp.shape[0]):
        n_valid = int(m[b].sum())
        s_b = np.exp(np.mean(lp[b, :n_valid] - old[b, :n_valid]))  # exp(mean_t(logp − old_logp))
        np.testing.assert_allclose(ratio[b, :n_valid], s_b, rtol=1e-5)
        seq_ratios += [s_b] * n_valid
    # The loss's ratio metrics see the sequence ratio on every token, clipped at 1 ± ε.
    cfg = _cfg(ratio_level="sequence", clip_low=0.1)
    _, metrics = grpo.loss_fn(PARAMS, batch, cfg, model=MODEL)  # forward only: no compile needed
    np.testing.assert_allclose(metrics["ratio_mean"], np.mean(seq_ratios), rtol=1e-5)
    np.testing.assert_allclose(metrics["ratio_max"], np.max(seq_ratios), rtol=1e-5)
    adv = np.asarray(batch.advantages)
    s = np.asarray(seq_ratios)
    a = adv[m.astype(bool)]
    clipped = -a * np.clip(s, 0.9, 1.1) > -a * s
    np.testing.assert_allclose(metrics["clipfrac"], clipped.mean(), atol=1e-6)


@pytest.mark.heavy  # bf16 compute: models/test_precision.py
def test_bf16_compute_path_runs():
    bf16_model = Transformer(dataclasses.replace(CFG, dtype="bfloat16"))
    batch = _batch()
    cfg = LOSS_CFG  # the float32 loss below is then already compiled
    (loss, metrics), grads = _value_and_grad(PARAMS, batch, cfg, model=bf16_model)
    assert loss.dtype == jnp.float32 and np.isfinite(loss)
    assert all(g.dtype == jnp.float32 for g in jax.tree.leaves(grads))
    assert bool(grpo.common.tree_finite(grads))
    (f32_loss, _), _ = _value_and_grad(PARAMS, batch, cfg, model=MODEL)
    np.testing.assert_allclose(loss, f32_loss, atol=0.05)  # bf16 activations, float32 log-probs


# --------------------------------------------------------------------------- advantages and DAPO


def test_overlong_penalty_hand_values():
    # L_max = 10, L_cache = 4: free up to 10 − 4 = 6 tokens, then linear down to −1 at 10.
    lengths = jnp.array([0, 6, 7, 8, 10, 11])
    got = grpo.overlong_penalty(lengths, max_len=10, cache_len=4)
    # 7: (6 − 7)/4 = −0.25;  8: (6 − 8)/4 = −0.5;  10: (6 − 10)/4 = −1;  11 > L_max: −1.
    np.testing.assert_allclose(got, [0.0, 0.0, -0.25, -0.5, -1.0, -1.0])
    # cache 0: a hard cut, only beyond L_max.
    np.testing.assert_allclose(grpo.overlong_penalty(jnp.array([10, 11]), max_len=10, cache_len=0), [0.0, -1.0])


def test_advantage_methods():
    scores = jnp.array([1.0, 0.0, 0.0, 1.0, 2.0, 2.0, 2.0, 2.0])
    mask = jnp.arange(3)[None] < jnp.array([3, 2, 1, 3, 3, 2, 1, 3])[:, None]
    for method in ("grpo", "dr_grpo", "rloo"):
        cfg = _cfg(advantage=method, adv_eps=1e-4)
        want = ops.broadcast_sequence(ops.group_advantages(scores, 4, method=method, eps=1e-4), mask)
        np.testing.assert_allclose(grpo.compute_advantages(scores, cfg, mask), want)
    # grpo with ε = 1e-4: group 1 has mean 0.5 and unbiased std sqrt(1/3) = 0.57735.
    got = grpo.compute_advantages(scores, _cfg(adv_eps=1e-4), mask)
    np.testing.assert_allclose(got[0, 0], 0.5 / (0.57735027 + 1e-4), rtol=1e-6)
    np.testing.assert_array_equal(got[4:], 0.0)  # all-equal group: zero advantage
    cfg = _cfg(advantage="reinforce_pp", sampling=SamplingConfig(max_new_tokens=3, num_samples=1))
    pp = grpo.compute_advantages(scores, cfg, mask)
    np.testing.assert_allclose(pp, ops.whiten(ops.broadcast_sequence(scores, mask), mask))


def test_select_groups_keeps_the_batch_full():
    # 5 groups of G = 2; groups 1 and 3 have signal.
    scores = jnp.array([1.0, 1.0, 0.0, 1.0, 0.5, 0.5, 3.0, 2.0, 0.0, 0.0])
    sel = grpo.select_groups(scores, 2, 3)
    # signal groups first, then padding, the lowest scores first (group 4's 0 before group 2's 0.5)
    np.testing.assert_array_equal(sel.indices, [2, 3, 6, 7, 8, 9])
    np.testing.assert_array_equal(sel.has_signal, [True, True, False])
    np.testing.assert_allclose(sel.kept_fraction, 2 / 3)
    np.testing.assert_allclose(sel.signal_fraction, 2 / 5)
    sel = grpo.select_groups(scores, 2, 5)
    np.testing.assert_array_equal(sel.indices, [2, 3, 6, 7, 8, 9, 4, 5, 0, 1])
    sel = grpo.select_groups(scores, 2, 1)
    np.testing.assert_array_equal(sel.indices, [2, 3])
    # padding among equal scores keeps the pool's order
    np.testing.assert_array_equal(grpo.select_groups(jnp.array([1.0, 1.0, 0.0, 1.0, 1.0, 1.0]), 2, 3).indices,
                                  [2, 3, 0, 1, 4, 5])
    with pytest.raises(ValueError, match="prompt pool"):
        grpo.select_groups(scores, 2, 6)


# --------------------------------------------------------------------------- errors and config


def test_group_size_that_does_not_divide_the_batch_is_an_error():
    mask = jnp.ones((10, 3), bool)
    with pytest.raises(ValueError, match="groups of G = sampling.num_samples = 4"):
        grpo.compute_advantages(jnp.zeros(10), _cfg(), mask)
    batch = _batch(n=6)
    with pytest.raises(ValueError, match="num_minibatches=2 × num_microbatches=2"):
        grpo.update(grpo.init_state(PARAMS, optax.sgd(0.1)), batch, jax.random.key(0), model=MODEL,
                    tx=optax.sgd(0.1), cfg=_cfg(num_minibatches=2, num_microbatches=2))


def test_config_validation_and_presets():
    with pytest.raises(ValueError, match="num_samples"):
        _cfg(sampling=SamplingConfig(max_new_tokens=4, num_samples=1))
    with pytest.raises(ValueError, match="agg"):
        _cfg(agg="mean")
    with pytest.raises(ValueError, match="dynamic_sampling"):
        _cfg(prompts_per_step=2)
    with pytest.raises(ValueError, match="overlong_cache"):
        _cfg(overlong_max_len=4, overlong_cache=4)
    s = SamplingConfig(max_new_tokens=20, num_samples=4)
    for name in ("grpo", "dr_grpo", "dapo", "gspo", "rloo", "reinforce_pp"):
        assert isinstance(grpo.preset(name, s), grpo.GRPOConfig)
    dapo = grpo.preset("dapo", s, prompts_per_step=2)
    assert (dapo.clip_high, dapo.overlong_max_len, dapo.overlong_cache, dapo.prompts_per_step) == (0.28, 20, 4, 2)
    assert grpo.preset("dr_grpo", s).loss_norm_len == 20


def test_reward_with_wrong_shape_is_a_clear_error():
    bad = rewards.jax_reward(lambda ids, mask, ex: jnp.zeros((ids.shape[0], 1)), name="per_token_oops")
    it = grpo.make_iteration(MODEL, optax.sgd(0.1), _cfg(), bad)
    prompts = jnp.ones((2, P), jnp.int32)
    with pytest.raises(ValueError, match=r"reward 'per_token_oops' returned shape \(8, 1\)"):
        it(grpo.init_state(PARAMS, optax.sgd(0.1)), prompts, jnp.ones((2, P), bool), {}, jax.random.key(0))
    with pytest.raises(ValueError, match="reference model"):
        grpo.make_iteration(MODEL, optax.sgd(0.1), _cfg(beta=0.1), target_fraction)(
            grpo.init_state(PARAMS, optax.sgd(0.1)), prompts, jnp.ones((2, P), bool), {}, jax.random.key(0))


def test_reference_sharing_the_policys_buffers_is_copied_for_a_donating_iteration():
    """`init_state(params, tx, ref_params=params)` (docs/grpo.md's usage) gives the reference
    buffers of its own: a donating iteration used to fail with "Attempt to donate the same
    buffer twice". Distinct reference arrays are kept, not copied."""
    params = jax.tree.map(jnp.copy, PARAMS)  # the iteration donates (deletes) them
    state = grpo.init_state(params, optax.sgd(0.1), ref_params=params)
    pairs = zip(jax.tree.leaves(state.policy.params), jax.tree.leaves(state.ref_params))
    assert all(p is not r and p.unsafe_buffer_pointer() != r.unsafe_buffer_pointer() for p, r in pairs)
    donate = jax.jit(lambda s: jax.tree.map(lambda x: x + 1, s), donate_argnums=0)  # what a donating step does
    jax.block_until_ready(donate(state))
    ref = jax.tree.map(jnp.copy, PARAMS)
    assert jax.tree.leaves(grpo.init_state(PARAMS, optax.sgd(0.1), ref_params=ref).ref_params)[0] is (
        jax.tree.leaves(ref)[0])


# --------------------------------------------------------------------------- update


@pytest.fixture(scope="module")
def mu2_runs():
    """μ = 2 passes × 2 minibatches of 4, old log-probs recomputed; 1 and 2 micro-batches."""
    batch = _batch(seed=3, n=8)
    batch = batch._replace(old_logp=_score(PARAMS, batch.sequences, batch.attention_mask))
    tx = optax.sgd(0.5)
    runs = {}
    for k in (1, 2):
        cfg = _cfg(beta=0.05, num_iterations=2, num_minibatches=2, num_microbatches=k, clip_low=0.1)
        fn = jax.jit(lambda s, b, r, cfg=cfg: grpo.update(s, b, r, model=MODEL, tx=tx, cfg=cfg))
        runs[k] = fn(grpo.init_state(PARAMS, tx), batch, jax.random.key(7))
        if k == 1:
            runs["update"], runs["batch"] = fn, batch
    return runs


def test_accumulation_2_equals_1(mu2_runs):
    (s1, m1), (s2, m2) = mu2_runs[1], mu2_runs[2]
    assert int(s1.policy.step) == int(s2.policy.step) == 4  # μ·minibatches optimizer steps
    for a, b in zip(jax.tree.leaves(s1.policy.params), jax.tree.leaves(s2.policy.params)):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6)
    np.testing.assert_allclose(m1["loss"], m2["loss"], rtol=1e-4, atol=1e-7)
    np.testing.assert_allclose(m1["grad_norm"], m2["grad_norm"], rtol=1e-4)


def test_recomputed_old_logp_gives_ratio_one_on_the_first_minibatch(mu2_runs):
    _, m = mu2_runs[1]
    np.testing.assert_allclose([m["first/ratio_min"], m["first/ratio_max"]], 1.0, atol=1e-5)
    assert m["ratio_max"] > 1.0 + 1e-3 or m["ratio_min"] < 1.0 - 1e-3  # later minibatches moved
    assert bool(m["finite"]) and int(m["skipped_steps"]) == 0


def test_non_finite_gradient_skips_the_step(mu2_runs):
    batch, update = mu2_runs["batch"], mu2_runs["update"]
    batch = batch._replace(advantages=batch.advantages.at[:, 0].set(jnp.nan))  # every minibatch
    new, m = update(grpo.init_state(PARAMS, optax.sgd(0.5)), batch, jax.random.key(7))
    assert not bool(m["finite"]) and int(m["skipped_steps"]) == 4
    assert int(new.policy.step) == 0
    for a, b in zip(jax.tree.leaves(new.policy.params), jax.tree.leaves(PARAMS)):
        np.testing.assert_array_equal(a, b)


# --------------------------------------------------------------------------- iterations


LEARNING_CFG = _cfg(sampling=SamplingConfig(max_new_tokens=8, num_samples=8), adv_eps=1e-4)
LEARNING_PROMPTS = jnp.asarray(np.random.default_rng(0).integers(3, CFG.vocab_size, (4, 4)), jnp.int32)


@pytest.fixture(scope="module")
def learning_run():
    """GRPO on the toy task: 4 prompts × G = 8, 8 new tokens, reward = share of TARGET tokens;
    the iteration timed (three programs, the default). Each metrics row gets the call's own
    wall time under "wall_s"; `first_params` are the policy's after the first iteration."""
    tx = optax.adam(3e-3)
    it = grpo.make_iteration(MODEL, tx, LEARNING_CFG, rewards.jax_reward(target_fraction, name="target"))
    assert not it.is_single_program and len(it.compiled) == 3  # (rollout, score, train)
    state = grpo.init_state(PARAMS, tx)
    history = []
    for _ in range(25):
        t0 = time.perf_counter()
        state, metrics = it(state, LEARNING_PROMPTS, jnp.ones_like(LEARNING_PROMPTS, bool), {}, jax.random.key(1))
        history.append(dict(jax.device_get(metrics), wall_s=time.perf_counter() - t0))
        if len(history) == 1:
            first_params = jax.device_get(state.policy.params)
    return history, first_params


def test_first_step_ratio_is_exactly_one(learning_run):
    first = learning_run[0][0]
    assert first["ratio_min"] == first["ratio_max"] == 1.0
    assert first["clipfrac"] == 0.0 and first["approx_kl"] == 0.0
    assert first["logp_mismatch"] < 1e-4  # the sampler's log-probs match the trainer's
    assert first["response_length/mean"] == 8 and bool(first["finite"])


def test_grpo_raises_the_mean_reward_of_a_toy_task(learning_run):
    rewards_ = [float(m["reward/mean"]) for m in learning_run[0]]
    start, end = np.mean(rewards_[:3]), np.mean(rewards_[-3:])
    assert end > start + 0.25, rewards_  # from ~1/16 to most tokens on target within 25 steps


def test_the_timed_iteration_reports_where_its_time_went(learning_run):
    """Every name of the time split, finite and >= 0; the parts add up to no more than the
    call's own wall time; tokens/s is the valid tokens sampled over the rollout's seconds."""
    for m in learning_run[0]:
        times = {k: m[k] for k in timing.RL_STEP}
        assert all(np.isfinite(v) and v >= 0 for v in times.values()), times
        assert sum(m[k] for k in timing.PARTS) <= m["wall_s"], (times, m["wall_s"])
        np.testing.assert_allclose(m[timing.TOKENS_PER_S], m["response_tokens"] / m[timing.ROLLOUT_S], rtol=1e-6)
        np.testing.assert_allclose(m[timing.STEP_TOKENS_PER_S],
                                   m["response_tokens"] / sum(m[k] for k in timing.PARTS), rtol=1e-6)


def test_the_fused_iteration_equals_the_timed_one(learning_run):
    """`time_split=False`: one program, no times, the same new params and metrics."""
    tx = optax.adam(3e-3)
    it = grpo.make_iteration(MODEL, tx, LEARNING_CFG, rewards.jax_reward(target_fraction, name="target"),
                             time_split=False)
    assert it.is_single_program and len(it.compiled) == 1
    state, m = it(grpo.init_state(PARAMS, tx), LEARNING_PROMPTS, jnp.ones_like(LEARNING_PROMPTS, bool), {},
                  jax.random.key(1))
    history, first_params = learning_run
    assert not any(k in m for k in timing.RL_STEP)
    assert set(history[0]) == set(m) | set(timing.RL_STEP) | {"wall_s"}
    for k in set(m) - {timing.COMPILES}:
        np.testing.assert_allclose(m[k], history[0][k], rtol=1e-5, atol=1e-6, err_msg=k)
    for a, b in zip(jax.tree.leaves(state.policy.params), jax.tree.leaves(first_params)):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


class _WordTokenizer:
    """'t5 t7'-style text, as the workload's word-level tokenizer."""

    eos_id = None  # the toy policy has no EOS: never cut a response

    def decode(self, ids, skip_special_tokens=True):
        return " ".join(f"t{i}" for i in ids if not (skip_special_tokens and i < 4))


def test_dynamic_sampling_with_a_host_reward_keeps_the_batch_full():
    seen = []

    def host_target(prompts, responses, extras):
        assert len(prompts) == len(responses) == len(extras["tag"]) == 16
        scores = [r.split().count(f"t{TARGET}") / 4 for r in responses]
        seen.append(np.asarray(scores))
        return scores

    reward = rewards.combine([(1.0, rewards.host_reward(host_target, _WordTokenizer(), name="host_target")),
                              (0.0, rewards.jax_reward(target_fraction, name="jax_target"))])
    cfg = _cfg(sampling=SamplingConfig(max_new_tokens=4, num_samples=4), dynamic_sampling=True, prompts_per_step=2)
    tx = optax.adam(1e-3)
    it = grpo.make_iteration(MODEL, tx, cfg, reward)
    assert not it.is_single_program
    state = grpo.init_state(PARAMS, tx)
    prompts = jnp.asarray(np.random.default_rng(1).integers(4, CFG.vocab_size, (4, P)), jnp.int32)
    tags = ["a", "b", "c", "d"]
    for step in range(3):
        state, m = it(state, prompts, jnp.ones_like(prompts, bool), {"tag": tags}, jax.random.key(step))
        scores = seen[-1].reshape(4, 4)
        signal = scores.max(axis=1) > scores.min(axis=1)
        np.testing.assert_allclose(m["dynamic/signal_fraction"], signal.mean())
        np.testing.assert_allclose(m["dynamic/kept_fraction"], min(signal.sum(), 2) / 2)
        # Padding groups carry zero advantage; groups with signal never do.
        np.testing.assert_allclose(m["advantage/zero_group_fraction"], 1 - min(signal.sum(), 2) / 2)
        # The JAX component saw the same responses and agrees with the host one.
        np.testing.assert_allclose(m["reward/jax_target"], m["reward/host_target"], atol=1e-6)
        np.testing.assert_allclose(m["reward/mean"], scores.mean(), atol=1e-6)
        assert m["time/host_reward_s"] >= 0 and bool(m["finite"])
    assert int(state.step) == 3 and int(state.policy.step) == 3


def _slow_jax_part(response_ids, response_mask, extras):
    """A JAX reward component that takes ~1–3 s on CPU (a chain of 400 512² matmuls), scoring 0."""
    w = jnp.full((512, 512), 1e-3, jnp.float32)
    x = jax.lax.fori_loop(0, 400, lambda i, x: jnp.tanh(x @ w), jnp.ones((512, 512), jnp.float32))
    return jnp.zeros(response_ids.shape[0], jnp.float32) + 1e-30 * jnp.sum(x)


def test_host_reward_timer_measures_the_reward_alone():
    """`time/host_reward_s` is the host reward's own time, part of `time/scoring_s` but not
    the JAX reward's scoring program that follows it."""
    sleep = 0.05

    def sleepy(prompts, responses, extras):
        time.sleep(sleep)
        return [0.0] * len(responses)

    reward = rewards.combine([(1.0, rewards.host_reward(sleepy, _WordTokenizer(), name="sleepy")),
                              (1.0, rewards.jax_reward(_slow_jax_part, name="slow"))])
    cfg = _cfg(sampling=SamplingConfig(max_new_tokens=4, num_samples=2))
    it = grpo.make_iteration(MODEL, optax.sgd(0.0), cfg, reward, time_split=False)
    assert not it.is_single_program and len(it.compiled) == 3  # a host reward splits the iteration all the same
    prompts = jnp.asarray(np.random.default_rng(2).integers(4, CFG.vocab_size, (2, P)), jnp.int32)
    state = grpo.init_state(PARAMS, optax.sgd(0.0))
    args = (prompts, jnp.ones_like(prompts, bool), {}, jax.random.key(0))
    state, _ = it(state, *args)  # compiles
    _, m = it(state, *args)
    host, jax_part = m[timing.HOST_REWARD_S], m[timing.SCORING_S] - m[timing.HOST_REWARD_S]
    assert jax_part > 4 * sleep, f"the JAX scoring ({jax_part:.2f} s) must dwarf the reward for this test to mean anything"
    assert sleep <= host < sleep + jax_part / 2, (host, jax_part)


def test_compiled_is_a_tuple_of_programs():
    reward = rewards.jax_reward(target_fraction, name="target")
    for split, count in ((True, 3), (False, 1)):
        it = grpo.make_iteration(MODEL, optax.sgd(0.0), _cfg(), reward, time_split=split)
        assert it.is_single_program == (count == 1) and isinstance(it.compiled, tuple) and len(it.compiled) == count


def test_without_a_sampler_eos_the_host_reward_sees_what_the_loss_trains_on():
    """`eos_id=None`: generation never stops and the loss trains on every token; the text
    reward must not cut at its tokenizer's EOS either (`jaxrlhf.rewards`' rule)."""
    seen = []

    class EosTokenizer(_WordTokenizer):
        eos_id = TARGET  # a token the policy draws mid-response

    def record(prompts, responses, extras):
        seen.append((list(responses), np.asarray(extras["finished"])))
        return [0.0] * len(responses)

    cfg = _cfg(sampling=SamplingConfig(max_new_tokens=8, num_samples=4, eos_id=None))
    it = grpo.make_iteration(MODEL, optax.sgd(0.0), cfg, rewards.host_reward(record, EosTokenizer(), name="rec"))
    prompts = jnp.asarray(np.random.default_rng(3).integers(4, CFG.vocab_size, (4, P)), jnp.int32)
    state = grpo.init_state(PARAMS, optax.sgd(0.0))
    it(state, prompts, jnp.ones_like(prompts, bool), {}, jax.random.key(4))
    out, _ = it.compiled[0](state, prompts, jnp.ones_like(prompts, bool), jax.random.key(4))  # the rollout
    ids, mask = np.asarray(out.response_ids), np.asarray(out.response_mask)
    assert mask.all()  # nothing ended a response: the loss trains on all 8 tokens
    assert (ids[:, :-1] == TARGET).any(), "no EOS mid-response: the test means nothing"
    responses, finished = seen[-1]
    assert responses == [" ".join(f"t{i}" for i in row if i >= 4 and i != TARGET) for row in ids]
    assert not finished.any()


def test_prompts_of_five_lengths_compile_once_per_bucket_and_padding_changes_nothing():
    """Left-padded to buckets (8, 16), prompts of 3, 5, 7, 9 and 12 tokens compile two
    programs, not five (`time/compiles` counts them); the padded first batch gives the
    metrics the same batch gives unpadded (padding never changes a result)."""
    reward = rewards.jax_reward(target_fraction, name="target")
    rng = np.random.default_rng(5)
    batches = [jnp.asarray(rng.integers(4, CFG.vocab_size, (2, p)), jnp.int32) for p in (3, 5, 7, 9, 12)]
    mask0 = jnp.asarray([[False, True, True], [True, True, True]])  # left padding of its own, too
    masks = [mask0] + [jnp.ones_like(ids, bool) for ids in batches[1:]]
    state = grpo.init_state(PARAMS, optax.sgd(0.0))  # lr 0: every call sees the same policy

    # One program per bucket (time_split=False): the buckets are the point here, not the split.
    it = grpo.make_iteration(MODEL, optax.sgd(0.0), _cfg(), reward, prompt_buckets=(8, 16), time_split=False)
    metrics = [it(state, ids, mask, {}, jax.random.key(0))[1] for ids, mask in zip(batches, masks)]
    assert [m["time/compiles"] > 0 for m in metrics] == [True, False, False, True, False], metrics

    plain = grpo.make_iteration(MODEL, optax.sgd(0.0), _cfg(), reward, prompt_buckets=None, time_split=False)
    _, m = plain(state, batches[0], mask0, {}, jax.random.key(0))
    for k in ("reward/mean", "loss", "grad_norm", "entropy"):
        np.testing.assert_allclose(metrics[0][k], m[k], rtol=1e-5, atol=1e-6, err_msg=k)

def test_rows_no_weighted_reward_scores_are_dropped_from_the_update():
    """A row whose every weighted reward returned None: response mask 0, out of its group's
    baseline, no influence on the update (its advantages and log-probs may be anything),
    counted in `reward/dropped`."""
    reward = rewards.combine([(1.0, rewards.host_reward(lambda p, r, ex: [0.0] * len(r), _WordTokenizer(),
                                                        name="host")),
                              (0.0, rewards.jax_reward(target_fraction, name="jax_target"))])
    cfg = _cfg(sampling=SamplingConfig(max_new_tokens=4, num_samples=4), beta=0.1, entropy_coef=0.01)
    tx = optax.adam(1e-2)
    state = grpo.init_state(PARAMS, tx, ref_params=PARAMS)
    prompts = jnp.asarray(np.random.default_rng(1).integers(4, CFG.vocab_size, (3, P)), jnp.int32)
    out = grpo.rollout(state, prompts, jnp.ones_like(prompts, bool), jax.random.key(0), model=MODEL, cfg=cfg)
    host = np.random.default_rng(2).standard_normal(12).astype(np.float32)
    dropped = np.array([0, 1, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1], bool)  # groups with 3, 1 and 0 scored rows
    host[dropped] = np.nan
    batch, m = grpo.score(state, out, {}, {"host": host}, None, model=MODEL, cfg=cfg, reward=reward)
    assert int(m["reward/dropped"]) == 8
    np.testing.assert_allclose(m["reward/mean"], np.nanmean(host), rtol=1e-6)
    assert not np.asarray(batch.response_mask)[dropped].any()
    np.testing.assert_array_equal(batch.response_mask[~dropped], out.response_mask[~dropped])
    # Group 0's three scored rows are a group of 3; the others have no baseline (< 2 scored rows).
    want = np.zeros(12, np.float32)
    want[[0, 2, 3]] = ops.group_advantages(host[[0, 2, 3]], 3)
    np.testing.assert_allclose(batch.advantages, ops.broadcast_sequence(want, batch.response_mask), atol=1e-6)

    train = jax.jit(functools.partial(grpo.train, model=MODEL, tx=tx, cfg=cfg))
    state1, m1 = train(state, batch, jax.random.key(1))
    rows = jnp.asarray(dropped)[:, None]
    garbage = batch._replace(advantages=jnp.where(rows, 9.0, batch.advantages),
                             ref_logp=jnp.where(rows, -9.0, batch.ref_logp))  # what a dropped row holds is unused
    state2, m2 = train(state, garbage, jax.random.key(1))
    for a, b in zip(jax.tree.leaves(state1.policy.params), jax.tree.leaves(state2.policy.params)):
        np.testing.assert_array_equal(a, b)
    np.testing.assert_array_equal(m1["loss"], m2["loss"])
    assert not np.array_equal(jax.tree.leaves(state1.policy.params)[0], jax.tree.leaves(PARAMS)[0])


@pytest.mark.parametrize("agg", ["seq-mean-token-mean", "seq-mean-token-sum", "token-mean"])
def test_a_dropped_row_is_no_sequence_of_the_loss(agg):
    """In every aggregation a dropped row (its mask all 0) weighs nothing, not even as an
    empty sequence of a `seq-mean-*` mode: the update's loss and gradient norm on the batch
    with dropped rows equal those on the batch of its scored rows alone."""
    cfg = _cfg(sampling=SamplingConfig(max_new_tokens=4, num_samples=4), beta=0.1, entropy_coef=0.01, agg=agg,
               share_prompt=False, num_microbatches=1)
    tx = optax.adam(1e-2)
    state = grpo.init_state(PARAMS, tx, ref_params=PARAMS)
    prompts = jnp.asarray(np.random.default_rng(1).integers(4, CFG.vocab_size, (3, P)), jnp.int32)
    out = grpo.rollout(state, prompts, jnp.ones_like(prompts, bool), jax.random.key(0), model=MODEL, cfg=cfg)
    batch, _ = grpo.score(state, out, {}, {}, None, model=MODEL, cfg=cfg, reward=rewards.jax_reward(target_fraction))
    batch = batch._replace(advantages=jnp.asarray(np.random.default_rng(3).standard_normal(batch.advantages.shape),
                                                  jnp.float32) * batch.response_mask)
    keep = np.array([1, 0, 1, 1, 0, 1, 1, 0, 1, 1, 1, 1], bool)
    dropped = batch._replace(response_mask=batch.response_mask * jnp.asarray(keep)[:, None])
    kept = jax.tree.map(lambda x: x[np.flatnonzero(keep)] if getattr(x, "ndim", 0) and x.shape[0] == 12 else x, batch)
    train = functools.partial(grpo.train, model=MODEL, tx=tx, cfg=dataclasses.replace(cfg))
    _, m_dropped = jax.jit(train)(state, dropped, jax.random.key(1))
    _, m_kept = jax.jit(train)(state, kept, jax.random.key(1))
    np.testing.assert_allclose(m_dropped["loss"], m_kept["loss"], rtol=2e-5)
    np.testing.assert_allclose(m_dropped["grad_norm"], m_kept["grad_norm"], rtol=2e-5)


def test_a_batch_no_weighted_reward_scores_is_an_error_naming_the_function():
    def never(completions, **kw):
        return [None] * len(completions)

    reward = rewards.trl_reward(never, _WordTokenizer())
    cfg = _cfg(sampling=SamplingConfig(max_new_tokens=4, num_samples=2))
    it = grpo.make_iteration(MODEL, optax.sgd(0.0), cfg, reward)
    prompts = jnp.ones((2, P), jnp.int32) * 5
    with pytest.raises(ValueError, match=rf"no row of the batch has a score: every reward with a weight \({__name__}:"
                                         r"\S*never\) returned None for all 4 rows"):
        it(grpo.init_state(PARAMS, optax.sgd(0.0)), prompts, jnp.ones_like(prompts, bool), {}, jax.random.key(0))
