"""PPO on a batch whose policy mask has holes (a multi-turn episode's: the environment's
tokens sit between the policy's, docs/episodes.md#ppo-on-episodes): the scoring's
advantages and returns are GAE over each row's policy tokens (a float64 reference on the
compacted rows), the environment's tokens get advantage 0 and no loss, whatever the
critic or the batch says there; and a plain rollout's scoring is what it was.

Tiny shapes, one compiled function per test (2 shared CPU cores).
"""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

from jaxrlhf import ops, rewards
from jaxrlhf.algorithms import common, ppo, scoring
from jaxrlhf.algorithms.experience import SamplingConfig
from jaxrlhf.models import ModelConfig, Transformer, init_params
from jaxrlhf.rollout.sampler import SampleOutput

V, P, T = 24, 3, 10
TARGET = 7
CFG = ModelConfig(vocab_size=V, hidden_size=16, intermediate_size=32, num_layers=1, num_heads=2, num_kv_heads=1,
                  head_dim=8, max_position_embeddings=32)
ACTOR = Transformer(CFG, head="lm")
CRITIC = Transformer(CFG.replace(hidden_size=8, intermediate_size=16, head_dim=4), head="score")

# Response layouts, one row each: p = policy token, e = environment token, . = padding.
LAYOUTS = ("pppeeepp..", "ppeppeeppp", "pppppp....", "peeepeeep.")


def target_fraction(response_ids, response_mask, extras):
    hits = jnp.sum((response_ids == TARGET) & response_mask, axis=1)
    return hits / jnp.maximum(jnp.sum(response_mask, axis=1), 1)


def _init(model, seed):
    rng = np.random.default_rng(seed)
    abstract = jax.eval_shape(lambda: init_params(model, jax.random.key(0)))
    leaf = lambda path, x: (jnp.ones(x.shape, x.dtype) if "norm" in jax.tree_util.keystr(path)
                            else jnp.asarray(0.3 * rng.standard_normal(x.shape), x.dtype))
    return jax.tree_util.tree_map_with_path(leaf, abstract)


def _episodes():
    """`(SampleOutput, env_mask)`: left-padded prompts, responses of `LAYOUTS` (the policy
    mask has holes, the attention mask covers the environment's tokens too)."""
    rng = np.random.default_rng(0)
    n = len(LAYOUTS)
    policy = np.array([[c == "p" for c in row] for row in LAYOUTS])
    env = np.array([[c == "e" for c in row] for row in LAYOUTS])
    resp = np.where(policy | env, rng.integers(3, V, (n, T)), 0)
    resp[policy & (rng.random((n, T)) < 0.4)] = TARGET  # some reward to shape
    prompt_mask = np.ones((n, P), bool)
    prompt_mask[0, 0] = False
    prompt = np.where(prompt_mask, rng.integers(3, V, (n, P)), 0)
    seq = np.concatenate([prompt, resp], 1)
    attn = np.concatenate([prompt_mask, policy | env], 1)
    j = lambda x: jnp.asarray(x)
    out = SampleOutput(j(prompt.astype(np.int32)), j(prompt_mask), j(resp.astype(np.int32)), j(policy),
                       jnp.zeros((n, T)), j(seq.astype(np.int32)), j(attn), j(policy.sum(1)))
    return out, env


def _state(cfg, actor, critic, ref):
    tx = common.make_optimizer(common.OptimConfig(lr=1e-2))[0]
    return ppo.init_state(cfg, ACTOR, actor, tx, critic_model=CRITIC, critic_params=critic, tx_critic=tx,
                          reward=target_fraction, ref_params=ref)


def _gae64(rewards, values, gamma, lam):
    """GAE over one row's (compacted) policy tokens, float64, no bootstrap after the last."""
    adv, nxt_v, nxt_a = np.zeros(len(rewards)), 0.0, 0.0
    for i in reversed(range(len(rewards))):
        nxt_a = rewards[i] + gamma * nxt_v - values[i] + gamma * lam * nxt_a
        adv[i], nxt_v = nxt_a, values[i]
    return adv


def test_scoring_is_gae_over_the_policy_tokens_only():
    """`ppo.score` on episodes: the batch's mask is the policy mask; KL, shaped rewards,
    GAE and whitening count the policy's tokens only (the critic's values at the
    environment's are never read), which get advantage and return 0 elsewhere."""
    actor, critic, ref = _init(ACTOR, 0), _init(CRITIC, 1), _init(ACTOR, 2)
    out, env = _episodes()
    policy = np.asarray(out.response_mask)
    reward, _ = scoring.compiled_reward(target_fraction)
    gamma, lam, beta = 0.9, 0.8, 0.3
    raw_cfg = ppo.PPOConfig(sampling=SamplingConfig(max_new_tokens=T), beta=beta, gamma=gamma, lam=lam,
                            whiten_advantages=False)
    white_cfg = dataclasses.replace(raw_cfg, whiten_advantages=True)

    @jax.jit
    def go(state):
        raw, m = ppo.score(state, out, {}, {}, None, actor_model=ACTOR, critic_model=CRITIC, reward=reward,
                           cfg=raw_cfg)
        white, _ = ppo.score(state, out, {}, {}, None, actor_model=ACTOR, critic_model=CRITIC, reward=reward,
                             cfg=white_cfg)
        ref_logp, _, _ = common.response_logprobs(ACTOR, ref, out.sequences, out.attention_mask, P)
        return raw.batch, white.batch, ref_logp, m

    raw, white, ref_logp, metrics = go(_state(raw_cfg, actor, critic, ref))
    np.testing.assert_array_equal(raw.response_mask, policy)
    np.testing.assert_array_equal(raw.attention_mask, out.attention_mask)  # the forward passes see the episode
    old_logp, values = np.float64(raw.old_logp), np.float64(raw.old_values)
    kl = old_logp - np.float64(ref_logp)
    score = np.float64(target_fraction(out.response_ids, out.response_mask, {}))
    for i in range(len(LAYOUTS)):
        at = np.flatnonzero(policy[i])
        r = -beta * kl[i, at]
        r[-1] += score[i]
        adv = _gae64(r, values[i, at], gamma, lam)
        np.testing.assert_allclose(raw.advantages[i, at], adv, rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(raw.returns[i, at], adv + values[i, at], rtol=1e-5, atol=1e-5)
    for b in (raw, white):  # the environment's tokens and the padding: nothing
        assert not np.any(np.asarray(b.advantages)[~policy]) and not np.any(np.asarray(b.returns)[~policy])
    assert np.any(env & (np.abs(values) > 1e-3))  # the critic does say something there
    # whitening over the policy tokens: the compacted advantages' own mean and variance
    a = np.float64(raw.advantages)[policy]
    np.testing.assert_allclose(np.asarray(white.advantages)[policy], (a - a.mean()) / np.sqrt(a.var() + 1e-8),
                               rtol=1e-4, atol=1e-4)
    assert metrics["num_tokens"] == policy.sum()
    np.testing.assert_allclose(metrics["response_length/mean"], policy.sum(1).mean())
    np.testing.assert_allclose(metrics["kl/k1"], kl[policy].mean(), rtol=1e-4, atol=1e-6)


def test_advantages_with_holes_equal_those_of_the_compacted_rows():
    """`compute_advantages` (KL, shaping, GAE, whitening) on a mask with holes equals the
    same on the rows with the environment's tokens taken out, whatever sits in the holes."""
    out, env = _episodes()
    policy = np.asarray(out.response_mask)
    rng = np.random.default_rng(3)
    old, ref, values = (rng.normal(-3, 0.5, (len(LAYOUTS), T)) for _ in range(3))
    for x in (old, ref, values):
        x[env] = 1e3  # garbage where the environment wrote: never read
    scores = rng.normal(0, 1, len(LAYOUTS))
    compact = lambda x: np.array([np.pad(row[m], (0, T - m.sum())) for row, m in zip(x, policy)])
    prefix = np.arange(T)[None] < policy.sum(1)[:, None]
    cfg = ppo.PPOConfig(sampling=SamplingConfig(max_new_tokens=T), beta=0.2, gamma=0.95, lam=0.9, kl_estimator="k3")
    f = jax.jit(functools.partial(ppo.compute_advantages, beta=0.2, cfg=cfg))
    f32 = lambda x: jnp.asarray(x, jnp.float32)
    holes = f(f32(scores), f32(old), f32(ref), f32(values), jnp.asarray(policy))
    rows = f(f32(scores), f32(compact(old)), f32(compact(ref)), f32(compact(values)), jnp.asarray(prefix))
    for a, b in zip(holes, rows):
        np.testing.assert_allclose(compact(np.asarray(a)), np.asarray(b), rtol=1e-5, atol=1e-6)
        assert not np.any(np.asarray(a)[~policy])


def test_the_loss_counts_the_policy_tokens_only():
    """`ppo_loss` on an episode batch: what the batch holds at the environment's tokens
    (advantages, returns, old log-probs and values) changes neither the loss nor its
    gradients; with the rollout's own log-probs (ratio 1) the policy loss is minus the
    policy tokens' mean advantage."""
    actor, critic = _init(ACTOR, 0), _init(CRITIC, 1)
    out, env = _episodes()
    policy = out.response_mask
    cfg = ppo.PPOConfig(sampling=SamplingConfig(max_new_tokens=T), vf_coef=0.5, entropy_coef=0.01)
    rng = np.random.default_rng(4)
    old_logp, _, _ = common.response_logprobs(ACTOR, actor, out.sequences, out.attention_mask, P)
    adv, ret = (jnp.asarray(np.where(policy, rng.normal(0, 1, (len(LAYOUTS), T)), 0.0), jnp.float32)
                for _ in range(2))
    batch = ppo.Batch(out.sequences, out.attention_mask, policy, jnp.where(policy, old_logp, 0.0),
                      jnp.zeros((len(LAYOUTS), T)), adv, ret)
    junk = lambda x: jnp.where(jnp.asarray(env), 50.0, x)
    dirty = batch._replace(old_logp=junk(batch.old_logp), old_values=junk(batch.old_values),
                           advantages=junk(batch.advantages), returns=junk(batch.returns))
    loss = jax.jit(jax.value_and_grad(functools.partial(ppo.ppo_loss, actor_model=ACTOR, critic_model=CRITIC,
                                                        cfg=cfg), has_aux=True))
    params = {"actor": actor, "critic": critic}
    (l1, m1), g1 = loss(params, batch)
    (l2, m2), g2 = loss(params, dirty)
    np.testing.assert_array_equal(l1, l2)
    jax.tree.map(np.testing.assert_array_equal, (m1, g1), (m2, g2))
    np.testing.assert_allclose(m1["policy_loss"], -ops.masked_mean(adv, policy), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(m1["ratio_mean"], 1.0, atol=1e-5)


def test_a_plain_rollout_scores_as_before():
    """Without holes the policy mask is `attention_mask[:, P:]`: `score_rollout` given it
    is the same bits as `score_rollout` deriving it."""
    actor, critic, ref = _init(ACTOR, 0), _init(CRITIC, 1), _init(ACTOR, 2)
    out, _ = _episodes()
    attn = jnp.concatenate([out.prompt_mask, out.response_mask], 1)  # no environment tokens
    cfg = ppo.PPOConfig(sampling=SamplingConfig(max_new_tokens=T))
    reward, _ = scoring.compiled_reward(target_fraction)
    scores = reward.device_scores(rewards.RewardInput.from_sample(out), {}, None)

    @jax.jit
    def both(state):
        f = functools.partial(ppo.score_rollout, ACTOR, CRITIC, reward, state, out.sequences, attn, P, cfg, scores)
        return f(), f(response_mask=out.response_mask)

    a, b = both(_state(cfg, actor, critic, ref))
    jax.tree.map(np.testing.assert_array_equal, a, b)
    assert a.response_mask.dtype == b.response_mask.dtype == jnp.bool_
