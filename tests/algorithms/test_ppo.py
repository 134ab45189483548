"""RLHF-PPO: the loss against a hand-composed ops reference, the first-minibatch ratio,
reward shaping + GAE inside the step, both critic layouts, the KL controller, gradient
accumulation, the vocabulary check, bf16, and a learning run on a synthetic reward.

Compiled functions are built once per module (2 shared CPU cores): tiny shapes throughout.
"""

import functools
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxrlhf import ops, rewards
from jaxrlhf.algorithms import common, kl_controller, ppo, reward_model, scoring, timing
from jaxrlhf.algorithms.experience import SamplingConfig
from jaxrlhf.models import ModelConfig, Transformer, init_params
from jaxrlhf.rollout.sampler import SampleOutput

V, P, T = 24, 4, 8
TARGET = 7  # the synthetic reward: fraction of response tokens equal to 7
CFG = ModelConfig(vocab_size=V, hidden_size=16, intermediate_size=32, num_layers=1, num_heads=2, num_kv_heads=1,
                  head_dim=8, max_position_embeddings=32)
CRITIC_CFG = CFG.replace(hidden_size=8, intermediate_size=16, head_dim=4)  # a critic of another size

ACTOR = Transformer(CFG, head="lm")
CRITIC = Transformer(CRITIC_CFG, head="score")
RM = Transformer(CRITIC_CFG, head="score")  # a frozen random score model (same vocab)
SHARED = Transformer(CFG, head="lm_value")


@functools.lru_cache(maxsize=None)
def _update(cfg, model, critic, tx):
    """One compiled `ppo.update` per (config, models, optimizer), shared between tests."""
    return jax.jit(functools.partial(ppo.update, actor_model=model, critic_model=critic, tx_actor=tx,
                                     tx_critic=tx, cfg=cfg))


ITERATIONS = 30
TX = common.make_optimizer(common.OptimConfig(lr=1e-2, max_grad_norm=None))[0]


def target_fraction(response_ids, response_mask, extras):
    hits = jnp.sum((response_ids == TARGET) & response_mask, axis=1)
    return hits / jnp.maximum(jnp.sum(response_mask, axis=1), 1)


def _prompts(b=8, seed=0):
    rng = np.random.default_rng(seed)
    ids = rng.integers(3, V, (b, P))
    mask = np.ones((b, P), bool)
    mask[: b // 2, 0] = False  # some left padding
    ids[~mask] = 0
    return jnp.asarray(ids, jnp.int32), jnp.asarray(mask)


def _rollout_batch(seed=0, b=8, eos=2):
    """Synthetic prompt ⧺ response with padding and EOS in some rows."""
    rng = np.random.default_rng(seed)
    prompt_ids, prompt_mask = map(np.asarray, _prompts(b, seed))
    resp = rng.integers(3, V, (b, T))
    lengths = rng.integers(1, T + 1, b)
    lengths[0] = lengths[1] = T  # row 1 runs out of tokens without EOS: it is not finished
    rmask = np.arange(T)[None] < lengths[:, None]
    for i in range(0, b, 2):  # even rows end with EOS
        resp[i, lengths[i] - 1] = eos
    resp[~rmask] = 0
    seq = np.concatenate([prompt_ids, resp], 1)
    attn = np.concatenate([prompt_mask, rmask], 1)
    return jnp.asarray(seq, jnp.int32), jnp.asarray(attn), jnp.asarray(rmask)


def _full_forward_logp(model, params, seq, attn, tau=1.0):
    """Reference: full-sequence logits, explicit shift (logits at P+t−1 predict token P+t)."""
    out = model.apply({"params": params}, seq, attn)
    logits = out.logits[:, P - 1:-1] / tau
    logp_all = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
    logp = jnp.take_along_axis(logp_all, seq[:, P:, None], axis=-1)[..., 0]
    ent = -jnp.sum(jnp.exp(logp_all) * logp_all, axis=-1)
    values = None if out.values is None else out.values[:, P - 1:-1]
    return logp, ent, values


def _np_init(model, seed):
    """HF-style random params (N(0, 0.02), norms at 1) built with numpy from the abstract
    shapes: no eager JAX ops to dispatch on a busy machine."""
    rng = np.random.default_rng(seed)
    abstract = jax.eval_shape(lambda: init_params(model, jax.random.key(0)))

    def leaf(path, x):
        if "norm" in jax.tree_util.keystr(path):
            return jnp.ones(x.shape, x.dtype)
        return jnp.asarray(0.02 * rng.standard_normal(x.shape), x.dtype)

    return jax.tree_util.tree_map_with_path(leaf, abstract)


@pytest.fixture(scope="module")
def params():
    return dict(actor=_np_init(ACTOR, 0), critic=_np_init(CRITIC, 1), rm=_np_init(RM, 2),
                shared=_np_init(SHARED, 0))  # the actor's trunk (same seed) plus a value head


# --------------------------------------------------------------------------------------
# Config, vocab, controller


def test_config_validation():
    s = SamplingConfig(max_new_tokens=T)
    with pytest.raises(ValueError, match="kl_estimator"):
        ppo.PPOConfig(sampling=s, kl_estimator="k4")
    with pytest.raises(ValueError, match="eos_id"):
        ppo.PPOConfig(sampling=s, missing_eos_penalty=1.0)
    with pytest.raises(ValueError, match="reward_whitening"):
        ppo.PPOConfig(sampling=s, reward_whitening="ema")
    with pytest.raises(ValueError, match="target"):
        ppo.PPOConfig(sampling=s, kl_target=-1.0)
    with pytest.raises(ValueError, match="num_minibatches"):
        ppo.PPOConfig(sampling=s, num_minibatches=0)
    with pytest.raises(ValueError, match="critic"):
        ppo.PPOConfig(sampling=s, critic="twin")


def test_vocab_mismatch_is_a_clear_error(params):
    big = ModelConfig(vocab_size=512, hidden_size=8, intermediate_size=16, num_layers=1, num_heads=2,
                      num_kv_heads=1, head_dim=4)
    actor, rm = Transformer(big, head="lm"), Transformer(big.replace(vocab_size=300), head="score")
    cfg = ppo.PPOConfig(sampling=SamplingConfig(max_new_tokens=T), critic="shared")
    shared = Transformer(big, head="lm_value")
    msg = "policy vocab_size 512 != reward model vocab_size 300 — the reward model must share the policy tokenizer"
    with pytest.raises(ValueError, match=msg):
        ppo.init_state(cfg, shared, {}, common.make_optimizer(common.OptimConfig())[0], reward=(rm, {}))
    with pytest.raises(ValueError, match=msg):
        ppo.make_iteration(shared, None, rm, None, None, cfg)
    with pytest.raises(ValueError, match="head='lm_value'"):
        ppo.make_iteration(actor, None, rm.clone(config=big), None, None, cfg)


def test_reward_forms(params):
    seq, attn, mask = _rollout_batch(2)
    inp = rewards.RewardInput.from_sequences(seq, attn, P)
    expected = target_fraction(seq[:, P:], mask, {})
    for form in (target_fraction, rewards.jax_reward(target_fraction)):
        reward, rparams = scoring.compiled_reward(form)
        np.testing.assert_allclose(reward.total(reward.device_scores(inp, {}, rparams)), expected)
    reward, _ = scoring.compiled_reward(rewards.combine([(2.0, rewards.jax_reward(target_fraction, name="t7"))]))
    parts = reward.device_scores(inp, {})
    np.testing.assert_allclose(reward.total(parts), 2 * expected)
    np.testing.assert_allclose(reward.metrics(parts)["reward/t7"], expected.mean())
    length = lambda sequences, attention_mask: jnp.sum(attention_mask, axis=1).astype(jnp.float32)
    reward, _ = scoring.compiled_reward(length)
    np.testing.assert_allclose(reward.total(reward.device_scores(inp, {})), jnp.sum(attn, axis=1))
    reward, rparams = scoring.compiled_reward((RM, params["rm"]))  # params kept apart, given at call time
    assert rparams is params["rm"] and reward.components[0].vocab_size == V
    last = P + jnp.sum(mask, axis=1) - 1
    np.testing.assert_allclose(reward.device_scores(inp, {}, rparams)["reward_model"],
                               RM.apply({"params": params["rm"]}, seq, attn).values[jnp.arange(8), last], atol=1e-6)
    host = rewards.host_reward(lambda p, r, ex: [0.0] * len(r), tokenizer=object())
    assert scoring.compiled_reward(host) == (host, None)  # scored between two programs (`host_iteration`)
    with pytest.raises(TypeError, match="cannot tell"):
        scoring.compiled_reward(lambda x: x)


def test_kl_controller_moves_beta_toward_target():
    cfg = kl_controller.KLControllerConfig(init_beta=0.1, target=6.0, horizon=100)
    st = kl_controller.init(cfg)
    update = jax.jit(functools.partial(kl_controller.update, cfg=cfg))
    up = update(st, 12.0, 10)      # error clip(12/6 − 1) = 0.2 → β·(1 + 0.2·10/100) = 0.102
    down = update(st, 3.0, 10)     # error −0.5 → clipped −0.2 → 0.098
    same = update(st, 6.0, 10)     # on target
    np.testing.assert_allclose([up.beta, down.beta, same.beta], [0.102, 0.098, 0.1], rtol=1e-6)
    small = update(st, 6.6, 10)    # error 0.1 → 0.1·(1 + 0.01) = 0.101
    np.testing.assert_allclose(small.beta, 0.101, rtol=1e-6)
    assert update(st, jnp.nan, 10).beta == st.beta
    fixed = kl_controller.KLControllerConfig(init_beta=0.1)
    assert kl_controller.update(kl_controller.init(fixed), 100.0, 10, cfg=fixed).beta == np.float32(0.1)


def test_process_scores_eos_penalty_whitening_clipping():
    s = SamplingConfig(max_new_tokens=3, eos_id=2)
    ids = jnp.array([[5, 2, 0], [5, 5, 5], [2, 0, 0], [5, 5, 2]])
    mask = ids != 0
    mask = mask.at[0, 2].set(False).at[2, 1:].set(False)
    raw = jnp.array([1.0, 2.0, 3.0, 4.0])
    sub = ppo.PPOConfig(sampling=s, missing_eos_penalty=1.5)
    out, _ = ppo.process_scores(raw, ids, mask, ppo.RunningMoments.create(), sub)
    np.testing.assert_allclose(out, [1.0, 0.5, 3.0, 4.0])  # row 1 has no EOS: 2 − 1.5
    rep = ppo.PPOConfig(sampling=s, missing_eos_penalty=1.5, missing_eos_mode="replace", reward_clip=1.0)
    out, _ = ppo.process_scores(raw, ids, mask, ppo.RunningMoments.create(), rep)
    np.testing.assert_allclose(out, [1.0, -1.0, 1.0, 1.0])  # −1.5 → clipped to −1; 3, 4 → 1
    run = ppo.PPOConfig(sampling=s, reward_whitening="running")
    stats = ppo.RunningMoments.create()
    seen = []
    for batch in (raw, raw * 3.0 + 1.0):
        out, stats = ppo.process_scores(batch, ids, mask, stats, run)
        seen.extend(np.asarray(batch))
        mu, var = np.mean(seen), np.var(seen)
        np.testing.assert_allclose(out, (np.asarray(batch) - mu) / np.sqrt(var + 1e-8), rtol=1e-5)


# --------------------------------------------------------------------------------------
# Loss, shaping and GAE against ops composed by hand


@pytest.mark.parametrize("weighted", [False, True])
def test_loss_and_gradient_equal_hand_composed_ops(params, weighted):
    """Also with the off-policy correction's importance weights on the policy loss."""
    cfg = ppo.PPOConfig(sampling=SamplingConfig(max_new_tokens=T, temperature=0.8), entropy_coef=0.01, vf_coef=0.1,
                        vf_clip=0.2, agg="seq-mean-token-mean")
    seq, attn, mask = _rollout_batch(1)
    rng = np.random.default_rng(2)
    weights = jnp.asarray(rng.uniform(0, 2, (8, T)), jnp.float32) * mask if weighted else None
    batch = ppo.Batch(sequences=seq, attention_mask=attn, response_mask=mask,
                      old_logp=jnp.asarray(rng.normal(-3.2, 0.2, (8, T)), jnp.float32),
                      old_values=jnp.asarray(rng.normal(0, 0.3, (8, T)), jnp.float32),
                      advantages=jnp.asarray(rng.normal(0, 1, (8, T)), jnp.float32),
                      returns=jnp.asarray(rng.normal(0, 1, (8, T)), jnp.float32), is_weights=weights)
    p = {"actor": params["actor"], "critic": params["critic"]}

    def ours(p):
        return ppo.ppo_loss(p, batch, actor_model=ACTOR, critic_model=CRITIC, cfg=cfg)[0]

    def reference(p):
        logp, ent, _ = _full_forward_logp(ACTOR, p["actor"], seq, attn, tau=0.8)
        values = CRITIC.apply({"params": p["critic"]}, seq, attn).values[:, P - 1:-1]
        pg, _ = ops.policy_loss(logp, batch.old_logp, batch.advantages, mask, clip_low=0.2,
                                agg="seq-mean-token-mean", is_weights=weights)
        vl, _ = ops.value_loss(values, batch.old_values, batch.returns, mask, clip=0.2,
                               agg="seq-mean-token-mean")
        return pg + 0.1 * vl - 0.01 * ops.aggregate(ent, mask, mode="seq-mean-token-mean")

    l1, g1 = jax.jit(jax.value_and_grad(ours))(p)
    l2, g2 = jax.jit(jax.value_and_grad(reference))(p)
    np.testing.assert_allclose(l1, l2, rtol=1e-5, atol=1e-7)
    for a, b in zip(jax.tree.leaves(g1), jax.tree.leaves(g2)):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-7)
    assert any(float(jnp.abs(g).max()) > 0 for g in jax.tree.leaves(g1["critic"]))


def test_shaping_and_gae_inside_the_step_equal_ops_by_hand(params):
    """The scoring phase (forward passes + scores + shaping + GAE + whitening) on a shared
    trunk, with EOS penalty and batch whitening, against ops applied to full forward passes."""
    cfg = ppo.PPOConfig(sampling=SamplingConfig(max_new_tokens=T, eos_id=2), critic="shared", kl_estimator="k3",
                        beta=0.3, missing_eos_penalty=0.5, reward_whitening="batch", reward_clip=1.5,
                        gamma=0.9, lam=0.8)
    rm_reward = reward_model.as_reward(RM)
    score = functools.partial(ppo.score, actor_model=SHARED, critic_model=None, reward=rm_reward, cfg=cfg)
    seq, attn, mask = _rollout_batch(3)
    out = SampleOutput(seq[:, :P], attn[:, :P], seq[:, P:], mask, jnp.zeros(mask.shape), seq, attn, mask.sum(1))
    # The actor has moved away from the reference: KL is not zero.
    ref = jax.tree.map(lambda x: x + jnp.asarray(0.05 * np.random.default_rng(9).standard_normal(x.shape), x.dtype),
                       params["shared"])
    state = ppo.PPOState(actor=common.TrainState(jnp.int32(0), params["shared"], None), critic=None,
                         ref_params=ref, reward_params=params["rm"],
                         kl_ctl=kl_controller.init(cfg.kl_config), reward_stats=ppo.RunningMoments.create(),
                         step=jnp.int32(0))

    @jax.jit
    def both(state, ref):
        scored, metrics = score(state, out, {}, {}, None)  # the reward model's score on state.reward_params
        batch = scored.batch
        logp, _, values = _full_forward_logp(SHARED, params["shared"], seq, attn)
        ref_logp, _, _ = _full_forward_logp(SHARED, ref, seq, attn)
        rm_values = RM.apply({"params": params["rm"]}, seq, attn).values
        last = P + jnp.sum(mask, axis=1) - 1  # the prompt is left-padded: the response ends here
        raw = rm_values[jnp.arange(8), last]
        # Finished: EOS among the valid tokens, or shorter than T (cut at a stop string).
        finished = jnp.any((seq[:, P:] == 2) & mask, axis=1) | (jnp.sum(mask, axis=1) < T)
        s = jnp.where(finished, raw, raw - 0.5)
        s = jnp.clip((s - s.mean()) / jnp.sqrt(s.var() + 1e-8), -1.5, 1.5)
        kl = ops.kl(logp, ref_logp, estimator="k3")
        rewards = ops.shape_rewards(s, kl, mask, 0.3)
        adv, ret = ops.gae(rewards, values, mask, gamma=0.9, lam=0.8, method="scan")
        return batch, metrics, (logp, values, raw, kl, adv, ret)

    batch, metrics, (logp, values, raw, kl, adv, ret) = both(state, ref)
    np.testing.assert_allclose(batch.old_logp * mask, logp * mask, atol=2e-5)
    np.testing.assert_allclose(batch.old_values * mask, values * mask, atol=2e-5)
    np.testing.assert_allclose(batch.returns, ret, atol=5e-5)
    np.testing.assert_allclose(batch.advantages, ops.whiten(adv, mask), atol=2e-4)
    assert batch.ref_logp is None  # kl_in="reward": the KL is in the advantages
    np.testing.assert_allclose(metrics["reward/mean"], raw.mean(), atol=1e-5)
    np.testing.assert_allclose(metrics["advantage/mean"], ops.masked_mean(adv, mask), atol=5e-5)
    np.testing.assert_allclose(metrics["kl/k3"], ops.masked_mean(kl, mask), atol=1e-5)
    assert float(metrics["kl/k3"]) > 0


def _update_batch(seed, advantages=None):
    seq, attn, mask = _rollout_batch(seed)
    rng = np.random.default_rng(seed + 1)
    adv = jnp.asarray(rng.normal(0, 1, (8, T)), jnp.float32) if advantages is None else advantages
    return ppo.Batch(sequences=seq, attention_mask=attn, response_mask=mask,
                     old_logp=jnp.asarray(rng.normal(-3.2, 0.1, (8, T)), jnp.float32),
                     old_values=jnp.zeros((8, T)), advantages=adv,
                     returns=jnp.asarray(rng.normal(0, 1, (8, T)), jnp.float32))


def _update_cfg(micro):
    return ppo.PPOConfig(sampling=SamplingConfig(max_new_tokens=T), num_ppo_epochs=1, num_minibatches=2,
                         num_microbatches=micro, critic="shared")


def test_accumulation_2x_equals_1x(params):
    batch = _update_batch(5)
    out = []
    for micro in (1, 2):
        cfg = _update_cfg(micro)
        state = ppo.init_state(cfg, SHARED, params["shared"], TX)
        out.append(_update(cfg, SHARED, None, TX)(state, batch, jax.random.key(0)))
    (s1, m1), (s2, m2) = out
    for a, b in zip(jax.tree.leaves(s1.actor.params), jax.tree.leaves(s2.actor.params)):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6)
    for key in ("loss", "policy_loss", "value_loss", "entropy", "clipfrac", "approx_kl", "ratio_mean", "grad_norm"):
        np.testing.assert_allclose(m1[key], m2[key], rtol=1e-4, atol=1e-6, err_msg=key)


def test_non_finite_gradients_skip_the_update(params):
    batch = _update_batch(5, advantages=jnp.full((8, T), jnp.nan).at[:, 0].set(1.0))
    cfg = _update_cfg(1)
    state = ppo.init_state(cfg, SHARED, params["shared"], TX)
    new, m = _update(cfg, SHARED, None, TX)(state, batch, jax.random.key(0))
    assert not bool(m["finite"]) and int(m["skipped_steps"]) == 2  # both minibatches skipped
    for a, b in zip(jax.tree.leaves(new.actor), jax.tree.leaves(state.actor)):
        np.testing.assert_array_equal(a, b)


# --------------------------------------------------------------------------------------
# Whole iterations: separate critic (learning run) and shared trunk in bf16


SEPARATE_CFG = ppo.PPOConfig(sampling=SamplingConfig(max_new_tokens=T), kl_estimator="k1", beta=0.05,
                             num_ppo_epochs=2, num_minibatches=2, vf_coef=0.5)


def _separate_iteration(params, **kw):
    """`(state, iteration)` of the separate-critic run: smaller critic, synthetic JAX reward."""
    tx_a, sched = common.make_optimizer(common.OptimConfig(lr=3e-3))
    tx_c, _ = common.make_optimizer(common.OptimConfig(lr=1e-2))
    state = ppo.init_state(SEPARATE_CFG, ACTOR, params["actor"], tx_a, critic_model=CRITIC,
                           critic_params=params["critic"], tx_critic=tx_c, reward=target_fraction)
    return state, ppo.make_iteration(ACTOR, CRITIC, target_fraction, tx_a, tx_c, SEPARATE_CFG, lr_schedule=sched,
                                     donate=False, **kw)


@pytest.fixture(scope="module")
def separate_run(params):
    """ITERATIONS timed iterations (three programs, the default) of the separate-critic run.
    Each metrics row gets the call's own wall time under "wall_s"; `first_actor` is the
    actor's params after the first iteration."""
    state, it = _separate_iteration(params)
    prompts, pmask = _prompts(16)
    history = []
    for _ in range(ITERATIONS):
        t0 = time.perf_counter()
        state, m = it(state, prompts, pmask, jax.random.key(1))
        history.append(dict(jax.device_get(m), wall_s=time.perf_counter() - t0))
        if len(history) == 1:
            first_actor = jax.device_get(state.actor.params)
    return state, history, first_actor


def test_first_minibatch_ratio_is_exactly_one(separate_run):
    _, history, _ = separate_run
    for m in history[:3]:
        assert abs(float(m["first/ratio_max"]) - 1.0) <= 1e-6 and abs(float(m["first/ratio_min"]) - 1.0) <= 1e-6
        assert float(m["first/clipfrac"]) == 0.0 and float(m["first/approx_kl"]) <= 1e-7
    assert float(history[0]["sampler_logp_diff_max"]) < 1e-4  # sampler and trainer agree
    # later minibatches do move
    assert float(history[0]["ratio_max"]) > 1.0 + 1e-4


class _IdsTokenizer:
    """Token ids as space-separated numbers: a text reward that can count them."""

    def decode(self, ids, skip_special_tokens=True):
        return " ".join(map(str, ids))


def test_a_host_reward_iteration_equals_the_jax_reward_one(params, separate_run):
    """The synthetic reward computed on the decoded text (rollout, host scoring, update: two
    programs) gives the JAX reward's first iteration of `separate_run`, and says where."""
    cfg = ppo.PPOConfig(sampling=SamplingConfig(max_new_tokens=T), kl_estimator="k1", beta=0.05,
                        num_ppo_epochs=2, num_minibatches=2, vf_coef=0.5)
    tx_a, sched = common.make_optimizer(common.OptimConfig(lr=3e-3))
    tx_c, _ = common.make_optimizer(common.OptimConfig(lr=1e-2))
    fraction = lambda p, r, ex: [t.split().count(str(TARGET)) / max(len(t.split()), 1) for t in r]
    host = rewards.host_reward(fraction, _IdsTokenizer(), name="target_fraction")
    state = ppo.init_state(cfg, ACTOR, params["actor"], tx_a, critic_model=CRITIC, critic_params=params["critic"],
                           tx_critic=tx_c, reward=host)
    it = ppo.make_iteration(ACTOR, CRITIC, host, tx_a, tx_c, cfg, lr_schedule=sched, donate=False)
    _, m = it(state, *_prompts(16), jax.random.key(1))
    first = separate_run[1][0]
    for key in ("reward/target_fraction", "reward/mean", "loss", "value_loss", "grad_norm", "kl/k1"):
        np.testing.assert_allclose(m[key], first[key], rtol=1e-5, atol=1e-7, err_msg=key)
    assert m[timing.SCORING_S] >= m[timing.HOST_REWARD_S] > 0  # the host reward is part of the scoring


def test_the_timed_iteration_reports_where_its_time_went(separate_run):
    """Every name of the time split, finite and >= 0; the parts add up to no more than the
    call's own wall time; tokens/s is the valid tokens sampled over the rollout's seconds."""
    for m in separate_run[1]:
        times = {k: m[k] for k in timing.RL_STEP}
        assert all(np.isfinite(v) and v >= 0 for v in times.values()), times
        assert sum(m[k] for k in timing.PARTS) <= m["wall_s"], (times, m["wall_s"])
        np.testing.assert_allclose(m[timing.TOKENS_PER_S], m["num_tokens"] / m[timing.ROLLOUT_S], rtol=1e-6)


def test_the_fused_iteration_equals_the_timed_one(params, separate_run):
    """`time_split=False`: one program, no times, the same new params and metrics."""
    state, it = _separate_iteration(params, time_split=False)
    state, m = it(state, *_prompts(16), jax.random.key(1))
    _, history, first_actor = separate_run
    assert set(history[0]) == set(m) | set(timing.RL_STEP) | {"wall_s"}
    for k in m:
        np.testing.assert_allclose(m[k], history[0][k], rtol=1e-5, atol=1e-6, err_msg=k)
    for a, b in zip(jax.tree.leaves(state.actor.params), jax.tree.leaves(first_actor)):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


def test_separate_critic_metrics(separate_run):
    state, history, _ = separate_run
    m = history[0]
    for key in ("reward/mean", "reward/std", "reward/shaped_mean", "kl/k1", "kl/k3", "kl/seq", "beta", "entropy",
                "response_length/mean", "response_length/max", "clipfrac", "approx_kl", "ratio_mean", "ratio_max",
                "value_loss", "value/clipfrac", "advantage/mean", "advantage/std", "returns/mean", "grad_norm",
                "grad_norm_critic", "lr", "finite"):
        assert key in m and np.isfinite(m[key]), key
    assert bool(m["finite"]) and float(m["kl/k1"]) == 0.0  # actor == reference at step 0
    assert int(state.step) == ITERATIONS and int(state.actor.step) == ITERATIONS * 2 * 2  # K·M optimizer steps
    assert int(state.critic.step) == int(state.actor.step)
    np.testing.assert_allclose(m["response_length/mean"], T)


def test_learning_raises_score_with_bounded_kl(separate_run):
    _, history, _ = separate_run
    score = np.array([float(m["reward/mean"]) for m in history])
    kl = np.array([float(m["kl/k3"]) for m in history])
    start, end = score[:3].mean(), score[-3:].mean()
    # Random init: about 1/24 of the tokens are the target. The KL-regularised optimum is the
    # reference tilted by exp(r/β) per token (r = 1/8 per target token, β = 0.05: ×e^2.5 ≈ 12),
    # i.e. p(target) ≈ 12/(23 + 12) ≈ 0.35 at KL ≈ 0.35·ln(0.35·24) + 0.65·ln(0.65·24/23) ≈ 0.5
    # nats per token; without the penalty the policy collapses onto the target (KL → ln 24 ≈ 3.2).
    assert end > start + 0.12, (start, end)
    assert np.all(kl < 1.2), kl.max()
    assert all(bool(m["finite"]) for m in history)


@pytest.mark.heavy  # a further combination of PPO options
def test_shared_trunk_bf16_with_reward_model_and_adaptive_kl(params):
    cfg_bf16 = CFG.replace(dtype="bfloat16")
    model = Transformer(cfg_bf16, head="lm_value")
    rm = Transformer(CRITIC_CFG.replace(dtype="bfloat16"), head="score")
    cfg = ppo.PPOConfig(sampling=SamplingConfig(max_new_tokens=T, eos_id=2), critic="shared", kl_estimator="k3",
                        beta=0.1, kl_target=1e-4, kl_horizon=20, missing_eos_penalty=1.0,
                        reward_whitening="running", reward_clip=3.0, num_ppo_epochs=2, num_minibatches=1,
                        num_microbatches=2, entropy_coef=0.01)
    tx = common.make_optimizer(common.OptimConfig(lr=1e-2))[0]
    own = jax.tree.map(jnp.copy, params["shared"])  # may be donated with the state below
    state = ppo.init_state(cfg, model, own, tx, reward=(rm, params["rm"]))
    it = ppo.make_iteration(model, None, rm, tx, None, cfg, donate=True)  # three timed programs
    prompts, pmask = _prompts(8, seed=4)
    state, m1 = it(state, prompts, pmask, jax.random.key(2))
    state, m2 = it(state, prompts, pmask, jax.random.key(2))
    assert all(float(m1[k]) > 0 for k in timing.RL_STEP)
    # the trained part of the state is donated; the frozen reward params are not
    assert not any(x.is_deleted() for x in jax.tree.leaves(params["rm"]))
    for m in (m1, m2):
        assert bool(m["finite"]), {k: float(v) for k, v in m.items()}
    # step 0: policy == reference → KL 0 < target → β falls by the clipped error: 0.1·(1 − 0.2·8/20)
    assert float(m1["kl/seq"]) == 0.0
    np.testing.assert_allclose(m1["beta_next"], 0.1 * (1 - 0.2 * 8 / 20), rtol=1e-5)
    # step 1: the policy moved, KL above the tiny target → β rises
    assert float(m2["kl/seq"]) > 1e-4 and float(m2["beta_next"]) > float(m2["beta"])
    np.testing.assert_allclose(m2["beta"], m1["beta_next"])
    assert float(m1["first/approx_kl"]) < 1e-4  # bf16 compute, float32 log-probs
    assert state.critic is None and "value_head" in state.actor.params
    assert int(state.reward_stats.count) == 16


# --------------------------------------------------------------------------------------
# Rows no weighted reward scores (a Python function's None)


def test_running_moments_and_whitening_see_only_the_scored_rows():
    s = SamplingConfig(max_new_tokens=3, eos_id=2)
    ids = jnp.array([[5, 2, 0], [5, 5, 5], [2, 0, 0], [5, 5, 2], [5, 5, 5]])
    mask = ids != 0
    scored = jnp.array([True, False, True, True, False])
    raw = jnp.array([1.0, jnp.nan, 3.0, 4.0, 1e6])  # what an unscored row holds is never used
    for whitening in ("batch", "running"):
        cfg = ppo.PPOConfig(sampling=s, missing_eos_penalty=1.5, reward_whitening=whitening, reward_clip=1.2)
        stats = mine = ppo.RunningMoments.create()
        for batch in (raw, raw * 3.0 + 1.0):
            out, stats = ppo.process_scores(batch, ids, mask, stats, cfg, scored=scored)
            want, mine = ppo.process_scores(batch[scored], ids[scored], mask[scored], mine, cfg)
            np.testing.assert_allclose(out[scored], want, rtol=1e-6)
            np.testing.assert_array_equal(out[~scored], 0.0)
            for a, b in zip(jax.tree.leaves(stats), jax.tree.leaves(mine)):
                np.testing.assert_allclose(a, b, rtol=1e-6)
    none = ppo.RunningMoments.create().update(raw, jnp.zeros(5, bool))  # no scored row: nothing changes
    assert (float(none.count), float(none.mean), float(none.var)) == (0.0, 0.0, 1.0)


@pytest.mark.parametrize("whitening, agg", [pytest.param("batch", "token-mean", marks=pytest.mark.heavy),
                                             ("running", "seq-mean-token-mean")])
def test_rows_no_weighted_reward_scores_are_dropped_from_the_update(params, whitening, agg):
    """A host reward's None on every weighted reward: the PPO score + train step equals the
    step on the other rows alone (a dropped row is no sequence of a `seq-mean-*` mode
    either), whatever the dropped rows hold, and `reward/dropped` counts them; with nothing
    dropped the host path equals the JAX reward's."""
    cfg = ppo.PPOConfig(sampling=SamplingConfig(max_new_tokens=T, eos_id=2), critic="shared", kl_estimator="k3", agg=agg,
                        beta=0.3, kl_target=0.01, missing_eos_penalty=0.5, reward_whitening=whitening,
                        reward_clip=1.5, gamma=0.9, lam=0.8, entropy_coef=0.01, num_ppo_epochs=2)
    host_reward = rewards.host_reward(lambda p, r, ex: [0.0] * len(r), _IdsTokenizer(), name="host")
    seq, attn, mask = _rollout_batch(3)
    out = SampleOutput(seq[:, :P], attn[:, :P], seq[:, P:], mask, jnp.zeros(mask.shape), seq, attn, mask.sum(1))
    ref = jax.tree.map(lambda x: x + jnp.asarray(0.05 * np.random.default_rng(9).standard_normal(x.shape), x.dtype),
                       params["shared"])
    state = ppo.init_state(cfg, SHARED, params["shared"], TX, reward=host_reward, ref_params=ref)
    state = state.replace(reward_stats=ppo.RunningMoments(jnp.float32(6.0), jnp.float32(0.3), jnp.float32(2.0)))

    def step(reward):
        score = jax.jit(functools.partial(ppo.score, actor_model=SHARED, critic_model=None, reward=reward, cfg=cfg))
        train = jax.jit(functools.partial(ppo.train, actor_model=SHARED, critic_model=None, tx_actor=TX,
                                          tx_critic=None, cfg=cfg))
        return score, train

    score, train = step(host_reward)
    host = np.random.default_rng(4).standard_normal(8).astype(np.float32)
    dropped = np.array([0, 1, 0, 0, 1, 0, 1, 0], bool)
    keep = ~dropped
    junk = host.copy()
    junk[dropped] = np.nan
    s, m = score(state, out, {}, {"host": junk}, None)
    assert int(m["reward/dropped"]) == 3 and bool(s.finite)
    assert not np.asarray(s.batch.response_mask)[dropped].any()
    np.testing.assert_array_equal(s.batch.response_mask[keep], mask[keep])
    for x in (s.batch.advantages, s.batch.returns):
        np.testing.assert_array_equal(np.asarray(x)[dropped], 0.0)

    # The same rows masked out by hand: the step on the five scored rows alone.
    sub = jax.tree.map(lambda x: x[keep], out)
    s_sub, m_sub = score(state, sub, {}, {"host": host[keep]}, None)
    for name in ("sequences", "response_mask", "old_logp", "old_values", "advantages", "returns"):
        np.testing.assert_allclose(getattr(s.batch, name)[keep], getattr(s_sub.batch, name), atol=2e-5, err_msg=name)
    for a, b in zip(jax.tree.leaves((s.reward_stats, s.kl_ctl)), jax.tree.leaves((s_sub.reward_stats, s_sub.kl_ctl))):
        np.testing.assert_allclose(a, b, rtol=1e-5)
    for key in ("reward/mean", "reward/std", "reward/processed_mean", "reward/shaped_mean", "kl/k3", "kl/seq",
                "advantage/mean", "advantage/std", "returns/mean", "value/mean", "num_tokens", "beta_next"):
        np.testing.assert_allclose(m[key], m_sub[key], rtol=1e-5, atol=1e-6, err_msg=key)
    new, mt = train(state, s, jax.random.key(1))
    new_sub, mt_sub = train(state, s_sub, jax.random.key(1))
    for a, b in zip(jax.tree.leaves(new.actor.params), jax.tree.leaves(new_sub.actor.params)):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6)
    np.testing.assert_allclose(mt["loss"], mt_sub["loss"], rtol=1e-4, atol=1e-6)
    assert not np.array_equal(jax.tree.leaves(new.actor.params)[0], jax.tree.leaves(state.actor.params)[0])
    # What a dropped row holds is unused by the update.
    rows = jnp.asarray(dropped)[:, None]
    garbage = s._replace(batch=s.batch._replace(
        advantages=jnp.where(rows, 9.0, s.batch.advantages), returns=jnp.where(rows, -9.0, s.batch.returns),
        old_logp=jnp.where(rows, -9.0, s.batch.old_logp), old_values=jnp.where(rows, 5.0, s.batch.old_values)))
    new_g, mt_g = train(state, garbage, jax.random.key(1))
    for a, b in zip(jax.tree.leaves(new.actor.params), jax.tree.leaves(new_g.actor.params)):
        np.testing.assert_array_equal(a, b)
    np.testing.assert_array_equal(mt["loss"], mt_g["loss"])

    # Nothing dropped: the host path gives the JAX reward's numbers.
    s_host, m_host = score(state, out, {}, {"host": host}, None)
    assert int(m_host["reward/dropped"]) == 0
    jax_score, _ = step(rewards.jax_reward(lambda ids, rmask, ex: jnp.asarray(host), name="host"))
    s_jax, m_jax = jax_score(state, out, {}, {}, None)
    for a, b in zip(jax.tree.leaves(s_host), jax.tree.leaves(s_jax)):
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7)
    assert set(m_host) - set(m_jax) == {"reward/dropped"}
    for key in m_jax:
        np.testing.assert_allclose(m_host[key], m_jax[key], rtol=1e-6, atol=1e-7, err_msg=key)
