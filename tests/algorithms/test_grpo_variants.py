"""CISPO, GDPO and REINFORCE++-baseline as GRPO-family options: the loss and the
advantages the step uses equal the `ops` functions on the same inputs, and the config
checks that keep them honest (issue 43)."""

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from jaxrlhf import ops, rewards
from jaxrlhf.algorithms import advantages, grpo
from jaxrlhf.algorithms.experience import SamplingConfig, score_responses
from jaxrlhf.models import ModelConfig, Transformer, init_params

CFG = ModelConfig(vocab_size=16, hidden_size=32, intermediate_size=64, num_layers=1, num_heads=2, num_kv_heads=1,
                  head_dim=16, max_position_embeddings=32)
MODEL = Transformer(CFG)
PARAMS = init_params(MODEL, jax.random.key(0))
P, T, G = 3, 5, 4


def _cfg(**kw):
    kw.setdefault("sampling", SamplingConfig(max_new_tokens=T, num_samples=G, temperature=0.8))
    return grpo.GRPOConfig(**kw)


def _batch(n=8, seed=0):
    rng = np.random.default_rng(seed)
    seq = jnp.asarray(rng.integers(3, CFG.vocab_size, (n, P + T)))
    rmask = np.arange(T)[None] < rng.integers(1, T + 1, n)[:, None]
    attn = jnp.asarray(np.concatenate([np.ones((n, P), bool), rmask], 1))
    logp0 = score_responses(MODEL, PARAMS, seq, attn, P, temperature=0.8)
    old = logp0 + jnp.asarray(rng.normal(0, 0.3, (n, T)), jnp.float32)  # ratios well away from 1
    adv = ops.broadcast_sequence(jnp.asarray(rng.standard_normal(n), jnp.float32), rmask)
    return grpo.Batch(seq, attn, jnp.asarray(rmask), adv, old)


# --------------------------------------------------------------------------- CISPO


@pytest.mark.heavy  # the step; ops.cispo_loss has its quick tests in tests/ops
def test_cispo_loss_and_gradient_are_ops_cispo_loss():
    """`policy_loss='cispo'`: the step's loss, gradient and metrics are `ops.cispo_loss`'s on
    the same log-probs (ε_low = clip_low, ε_high = clip_high), and not the clipped surrogate's."""
    batch = _batch()
    cfg = _cfg(policy_loss="cispo", clip_low=1.0, clip_high=0.28, num_minibatches=2)
    mask = batch.response_mask

    def reference(params):
        logits = MODEL.apply({"params": params}, batch.sequences, batch.attention_mask).logits
        logp = ops.token_logprobs(ops.shift_logits_for_response(logits, P), batch.sequences[:, P:], temperature=0.8)
        return ops.cispo_loss(logp, batch.old_logp, batch.advantages, mask, clip_low=1.0, clip_high=0.28)

    (want, want_m), want_g = jax.value_and_grad(reference, has_aux=True)(PARAMS)
    (got, got_m), got_g = jax.value_and_grad(grpo.loss_fn, has_aux=True)(PARAMS, batch, cfg, model=MODEL)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6), got_g, want_g)
    assert float(got_m["clipfrac"]) > 0 and float(got_m["clipfrac"]) == pytest.approx(float(want_m["clipfrac"]))
    np.testing.assert_allclose(got_m["policy_loss"], want)
    # the clipped surrogate on the same batch gives another gradient (clipped tokens drop out there)
    _, clip_g = jax.value_and_grad(grpo.loss_fn, has_aux=True)(PARAMS, batch, _cfg(clip_low=1.0, clip_high=0.28),
                                                               model=MODEL)
    assert max(float(jnp.max(jnp.abs(a - b))) for a, b in zip(jax.tree.leaves(got_g), jax.tree.leaves(clip_g))) > 1e-4


def test_cispo_config_checks_and_preset():
    with pytest.warns(UserWarning, match="plain REINFORCE"):
        _cfg(policy_loss="cispo")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        _cfg(policy_loss="cispo", num_minibatches=2)
        _cfg(policy_loss="cispo", num_iterations=2)
    with pytest.raises(ValueError, match="dual_clip"):
        _cfg(policy_loss="cispo", num_minibatches=2, dual_clip=3.0)
    with pytest.raises(ValueError, match="ratio_level"):
        _cfg(policy_loss="cispo", num_minibatches=2, ratio_level="sequence")
    with pytest.raises(ValueError, match="policy_loss"):
        _cfg(policy_loss="ppo")
    c = grpo.preset("cispo", SamplingConfig(max_new_tokens=T, num_samples=G))
    assert (c.policy_loss, c.clip_low, c.clip_high, c.num_minibatches) == ("cispo", 1.0, 4.0, 2)
    for name in ("gdpo", "reinforce_pp_baseline"):
        assert grpo.preset(name, SamplingConfig(num_samples=G)).advantage == name


# --------------------------------------------------------------------------- GDPO, REINFORCE++-baseline


def _exact(ids, mask, ex):  # 0/1: the first token is 5
    return (ids[:, 0] == 5).astype(jnp.float32)


def _fmt(ids, mask, ex):  # 0/1 on another feature of the response
    return (jnp.sum(mask, axis=1) % 2 == 0).astype(jnp.float32)


REWARD = rewards.combine([(1.0, rewards.jax_reward(_exact, name="exact")),
                          (100.0, rewards.jax_reward(_fmt, name="fmt"))])


def _scored_batch(cfg, reward=REWARD, seed=0):
    """`grpo.score`'s batch and metrics on a rollout of 4 prompts, and the rollout."""
    state = grpo.init_state(PARAMS, optax.adam(1e-3))
    prompts = jnp.asarray(np.random.default_rng(seed).integers(4, CFG.vocab_size, (4, P)), jnp.int32)
    out = grpo.rollout(state, prompts, jnp.ones_like(prompts, bool), jax.random.key(seed), model=MODEL, cfg=cfg)
    batch, metrics = grpo.score(state, out, {}, {}, None, model=MODEL, cfg=cfg, reward=reward)
    return batch, metrics, out


@pytest.mark.heavy  # the step; ops.gdpo_advantages has its quick tests in tests/ops
def test_gdpo_advantages_in_the_step_are_ops_gdpo_advantages():
    """The step's advantages are `ops.gdpo_advantages` of the reward's components
    `[N, K]` with its weights; they differ from GRPO's z-score of the weighted sum, whose
    ×100 component drowns the other; each component is logged as `reward/<name>`."""
    cfg = _cfg(advantage="gdpo", sampling=SamplingConfig(max_new_tokens=T, num_samples=G, temperature=1.0, eos_id=7))
    batch, metrics, out = _scored_batch(cfg)
    inputs = rewards.RewardInput.from_sample(out)
    comps = jnp.stack([_exact(inputs.response_ids, inputs.response_mask, {}),
                       _fmt(inputs.response_ids, inputs.response_mask, {})], axis=1)
    assert float(jnp.std(comps[:, 0])) > 0 and float(jnp.std(comps[:, 1])) > 0  # both vary: a real test
    want = ops.broadcast_sequence(ops.gdpo_advantages(comps, G, weights=jnp.array([1.0, 100.0])), out.response_mask)
    np.testing.assert_allclose(batch.advantages, want, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(metrics["reward/exact"], jnp.mean(comps[:, 0]))
    np.testing.assert_allclose(metrics["reward/fmt"], jnp.mean(comps[:, 1]))
    grpo_batch, _, _ = _scored_batch(_cfg(advantage="grpo", sampling=cfg.sampling))
    assert float(jnp.max(jnp.abs(grpo_batch.advantages - batch.advantages))) > 0.1
    # the helper the step uses: components and weights whose product is the total
    got_comps, got_w = grpo.reward_components(REWARD, {"exact": comps[:, 0], "fmt": comps[:, 1]})
    np.testing.assert_allclose(got_comps @ got_w, REWARD.total({"exact": comps[:, 0], "fmt": comps[:, 1]}))


def test_reinforce_pp_baseline_in_the_step_is_the_ops_composition():
    """The step's "reinforce_pp_baseline" advantages: the group mean out of each total score
    (`ops.group_advantages` "dr_grpo"), broadcast, then `ops.whiten` over the valid tokens."""
    cfg = _cfg(advantage="reinforce_pp_baseline",
               sampling=SamplingConfig(max_new_tokens=T, num_samples=G, temperature=1.0, eos_id=7))
    batch, metrics, out = _scored_batch(cfg)
    total, _ = REWARD(rewards.RewardInput.from_sample(out))
    mask = out.response_mask
    want = ops.whiten(ops.broadcast_sequence(ops.group_advantages(total, G, method="dr_grpo"), mask), mask)
    np.testing.assert_allclose(batch.advantages, want, rtol=1e-5, atol=1e-5)


def test_gdpo_without_several_weighted_components_is_an_error_naming_the_option():
    one = rewards.jax_reward(_exact, name="exact")
    cfg = _cfg(advantage="gdpo")
    for reward in (one, rewards.combine([(1.0, one), (0.0, rewards.jax_reward(_fmt, name="fmt"))])):
        with pytest.raises(ValueError, match=r"grpo.advantage='gdpo' normalises each reward component apart"):
            grpo.make_iteration(MODEL, optax.adam(1e-3), cfg, reward)
    with pytest.raises(ValueError, match="components="):
        grpo.compute_advantages(jnp.zeros(8), cfg, jnp.ones((8, T)))
    assert "gdpo" in advantages.PER_COMPONENT and "gdpo" in advantages.GROUPED
