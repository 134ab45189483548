"""The off-policy correction in the GRPO-family loss (`algorithms.offpolicy`): the weighted
loss against a float64 NumPy reference written from the formulas, its gradient against the
hand-composed ops, "none" changing nothing, bypass, and the option checks."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxrlhf import ops
from jaxrlhf.algorithms import grpo
from jaxrlhf.algorithms.experience import SamplingConfig, score_responses
from jaxrlhf.algorithms.offpolicy import CorrectionConfig
from jaxrlhf.models import ModelConfig, Transformer, init_params

CFG = ModelConfig(vocab_size=16, hidden_size=32, intermediate_size=64, num_layers=1, num_heads=2, num_kv_heads=1,
                  head_dim=16, max_position_embeddings=32)
MODEL = Transformer(CFG)
PARAMS = init_params(MODEL, jax.random.key(0))
P, T, G, TAU = 3, 5, 4, 0.8


def _cfg(**kw):
    kw.setdefault("sampling", SamplingConfig(max_new_tokens=T, num_samples=G, temperature=TAU))
    return grpo.GRPOConfig(**kw)


def _batch(n=8, seed=0, with_old=True):
    """Left-padded prompts, right-padded responses; the sampler's log-probs 0.4 nats off the
    trainer's (a stale behaviour policy), the old (proximal) ones 0.2 off."""
    rng = np.random.default_rng(seed)
    seq = jnp.asarray(rng.integers(3, CFG.vocab_size, (n, P + T)))
    pmask = np.arange(P)[None] >= (P - rng.integers(1, P + 1, n))[:, None]
    rmask = np.arange(T)[None] < rng.integers(1, T + 1, n)[:, None]
    attn = jnp.asarray(np.concatenate([pmask, rmask], 1))
    logp0 = score_responses(MODEL, PARAMS, seq, attn, P, temperature=TAU)
    old = logp0 + jnp.asarray(rng.normal(0, 0.2, (n, T)), jnp.float32) if with_old else None
    sampler = logp0 + jnp.asarray(rng.normal(0, 0.4, (n, T)), jnp.float32)
    sampler = jnp.where(rmask, sampler, 7.0)  # garbage on padding must not matter
    adv = ops.broadcast_sequence(jnp.asarray(rng.standard_normal(n), jnp.float32), rmask)
    return grpo.Batch(seq, attn, jnp.asarray(rmask), adv, old, sampler_logp=sampler)


def _reference_loss(logp, old, sampler, adv, mask, *, mode, level, cap, low, high, clip=0.2):
    """The weighted clipped loss from the formulas, float64, token-mean: w_t from
    Δ = old − sampler at the given level and mode, l_t = max(−A ρ, −A clip(ρ)), Σ w l / Σ m."""
    logp, old, sampler, adv = (np.asarray(x, np.float64) for x in (logp, old, sampler, adv))
    m = np.asarray(mask, bool)
    delta = np.where(m, old - sampler, 0.0)
    if level == "token":
        r = np.exp(delta)
    elif level == "sequence":
        r = np.broadcast_to(np.exp(np.clip(delta.sum(1, keepdims=True), -20, 20)), m.shape)
    else:
        r = np.broadcast_to(np.exp(delta.sum(1, keepdims=True) / m.sum(1, keepdims=True)), m.shape)
    w = {"tis": np.minimum(r, cap), "mis": np.where((r < low) | (r > high), 0.0, r), "none": np.ones_like(r)}[mode]
    rho = np.exp(logp - old)
    per = np.maximum(-adv * rho, -adv * np.clip(rho, 1 - clip, 1 + clip))
    return (w * per)[m].sum() / m.sum(), w


@pytest.mark.parametrize("mode, level", [("tis", "token"), ("mis", "sequence"), ("tis", "geometric"),
                                         ("none", "token")])
def test_weighted_loss_matches_a_float64_reference(mode, level):
    batch = _batch()
    corr = CorrectionConfig(mode=mode, level=level, cap=1.3, low=0.6, high=1.8)
    cfg = _cfg(correction=corr)
    (loss, metrics), grads = jax.value_and_grad(grpo.loss_fn, has_aux=True)(PARAMS, batch, cfg, model=MODEL)
    logp = score_responses(MODEL, PARAMS, batch.sequences, batch.attention_mask, P, temperature=TAU)
    want, w = _reference_loss(logp, batch.old_logp, batch.sampler_logp, batch.advantages, batch.response_mask,
                              mode=mode, level=level, cap=1.3, low=0.6, high=1.8)
    np.testing.assert_allclose(float(loss), want, rtol=2e-5, atol=1e-6)
    m = np.asarray(batch.response_mask, bool)
    np.testing.assert_allclose(float(metrics["is_weight_mean"]), w[m].mean(), rtol=1e-5)
    d = np.asarray(batch.sampler_logp, np.float64) - np.asarray(batch.old_logp, np.float64)
    np.testing.assert_allclose(float(metrics["mismatch_kl"]), (np.exp(-d) - 1 + d)[m].mean(), rtol=1e-4)
    np.testing.assert_allclose(float(metrics["max_abs_logp_diff"]), np.abs(d)[m].max(), rtol=1e-5)
    if mode != "none":
        assert 0 < float(metrics["is_frac_truncated"]) < 1  # the bounds bite on this batch
    # The gradient is the hand-composed ops' (weights are constants).
    weights, _ = ops.importance_weights(batch.old_logp, batch.sampler_logp, batch.response_mask, mode=mode,
                                        cap=1.3, low=0.6, high=1.8, level=level)

    def composed(params):
        logits = MODEL.apply({"params": params}, batch.sequences, batch.attention_mask).logits
        logp = ops.token_logprobs(ops.shift_logits_for_response(logits, P), batch.sequences[:, P:], temperature=TAU)
        return ops.policy_loss(logp, batch.old_logp, batch.advantages, batch.response_mask,
                               is_weights=weights if mode != "none" else None)[0]

    want_g = jax.grad(composed)(PARAMS)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-7), grads, want_g)


def test_mode_none_is_the_unweighted_loss_bit_for_bit():
    batch = _batch()
    (loss, metrics), grads = jax.value_and_grad(grpo.loss_fn, has_aux=True)(PARAMS, batch, _cfg(), model=MODEL)
    (loss0, m0), grads0 = jax.value_and_grad(grpo.loss_fn, has_aux=True)(PARAMS, batch._replace(sampler_logp=None),
                                                                        _cfg(), model=MODEL)
    assert float(loss) == float(loss0)
    jax.tree.map(np.testing.assert_array_equal, grads, grads0)
    assert "mismatch_kl" in metrics and "mismatch_kl" not in m0 and float(metrics["is_weight_mean"]) == 1.0


def test_the_weights_use_the_truncated_behaviour_log_probs_when_the_sampler_has_them():
    """With top-k / top-p the sampler drew from a renormalised distribution: its
    `behaviour_logp` (not the untruncated `sampler_logp`) is μ; `logp_mismatch` still
    compares the untruncated ones with the trainer's."""
    batch = _batch()
    behaviour = batch.sampler_logp + 0.3  # truncation renormalises: higher log-probs
    cfg = _cfg(correction=CorrectionConfig(mode="tis", cap=1.3))
    loss, metrics = grpo.loss_fn(PARAMS, batch._replace(behaviour_logp=behaviour), cfg, model=MODEL)
    logp = score_responses(MODEL, PARAMS, batch.sequences, batch.attention_mask, P, temperature=TAU)
    want, _ = _reference_loss(logp, batch.old_logp, behaviour, batch.advantages, batch.response_mask, mode="tis",
                              level="token", cap=1.3, low=0.5, high=5.0)
    np.testing.assert_allclose(float(loss), want, rtol=2e-5, atol=1e-6)
    _, plain = grpo.loss_fn(PARAMS, batch, cfg, model=MODEL)
    assert float(metrics["logp_mismatch"]) == float(plain["logp_mismatch"])
    assert float(metrics["is_weight_mean"]) != float(plain["is_weight_mean"])


def test_one_pass_weights_against_the_updates_own_forward():
    """With the batch used once (old_logp None: the proximal policy is the policy being
    updated), the weight is exp(sg(logp) − sampler_logp): decoupled PPO at μ = 1."""
    batch = _batch(with_old=False)
    cfg = _cfg(correction=CorrectionConfig(mode="tis", cap=1.5))
    loss, metrics = grpo.loss_fn(PARAMS, batch, cfg, model=MODEL)
    logp = score_responses(MODEL, PARAMS, batch.sequences, batch.attention_mask, P, temperature=TAU)
    want, _ = _reference_loss(logp, logp, batch.sampler_logp, batch.advantages, batch.response_mask, mode="tis",
                              level="token", cap=1.5, low=0.5, high=5.0)
    np.testing.assert_allclose(float(loss), want, rtol=2e-5, atol=1e-6)
    assert float(metrics["ratio_max"]) == pytest.approx(1.0)


def test_bypass_takes_the_samplers_log_probs_as_old_logp():
    """`bypass`: no weight; the clip measures π_θ against μ, so the loss is the plain clipped
    loss with old_logp = the sampler's, and no mismatch metrics (there is no π_prox)."""
    batch = _batch()
    bypassed = batch._replace(old_logp=batch.sampler_logp)  # what `grpo.score` puts in the batch
    loss, metrics = grpo.loss_fn(PARAMS, bypassed, _cfg(correction=CorrectionConfig(bypass=True)), model=MODEL)
    logp = score_responses(MODEL, PARAMS, batch.sequences, batch.attention_mask, P, temperature=TAU)
    want, _ = _reference_loss(logp, batch.sampler_logp, batch.sampler_logp, batch.advantages, batch.response_mask,
                              mode="none", level="token", cap=2, low=0.5, high=5)
    np.testing.assert_allclose(float(loss), want, rtol=2e-5, atol=1e-6)
    assert "mismatch_kl" not in metrics


def test_option_checks_name_the_field():
    with pytest.raises(ValueError, match="bypass=True .* mode must be 'none'"):
        CorrectionConfig(mode="tis", bypass=True)
    with pytest.raises(ValueError, match="low must be < high"):
        CorrectionConfig(mode="mis", low=2.0, high=1.0)
    with pytest.raises(ValueError, match="mode"):
        CorrectionConfig(mode="clip")
    with pytest.raises(ValueError, match="cap"):
        CorrectionConfig(cap=0.0)
