"""Where the KL goes (`kl_in`), for GRPO and PPO, against a float64 NumPy reference on a
tiny batch: GRPO's KL in the sequence reward before the group advantage, PPO's KL in the
actor loss; β = 0 is the same as no KL; an adaptive GRPO β moves toward its target."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxrlhf import rewards
from jaxrlhf.algorithms import common, grpo, ppo
from jaxrlhf.algorithms.experience import SamplingConfig, score_responses
from jaxrlhf.models import ModelConfig, Transformer, init_params
from jaxrlhf.rollout.sampler import SampleOutput

CFG = ModelConfig(vocab_size=16, hidden_size=16, intermediate_size=32, num_layers=1, num_heads=2, num_kv_heads=1,
                  head_dim=8, max_position_embeddings=16)
MODEL = Transformer(CFG)
PARAMS = init_params(MODEL, jax.random.key(0))
REF = init_params(MODEL, jax.random.key(1))  # another model: a KL well away from 0
P, T, N, G, TAU = 3, 5, 8, 4, 0.8
TX = common.make_optimizer(common.OptimConfig(lr=1e-2, max_grad_norm=None))[0]


def count_fives(ids, mask, extras):
    return jnp.sum((ids == 5) & mask, axis=1).astype(jnp.float32)


REWARD = rewards.as_reward(count_fives)


@functools.lru_cache(maxsize=None)
def _rollout():
    """A fixed `SampleOutput` of N rows in groups of G: padded prompts and responses."""
    rng = np.random.default_rng(0)
    seq = rng.integers(3, 8, (N, P + T))
    seq[:, :P] = np.repeat(seq[::G, :P], G, axis=0)
    rlen = np.array([5, 3, 1, 4, 2, 5, 5, 3])
    pmask = np.ones((N, P), bool)
    pmask[:G, 0] = False
    rmask = np.arange(T)[None] < rlen[:, None]
    seq[:, P:][~rmask] = 0
    seq = jnp.asarray(seq, jnp.int32)
    attn = jnp.asarray(np.concatenate([pmask, rmask], 1))
    return SampleOutput(seq[:, :P], jnp.asarray(pmask), seq[:, P:], jnp.asarray(rmask), jnp.zeros((N, T)), seq, attn,
                        jnp.asarray(rlen, jnp.int32))


def _logp(params):
    out = _rollout()
    return np.asarray(score_responses(MODEL, params, out.sequences, out.attention_mask, P, temperature=TAU), np.float64)


def _np_kl(logp, ref, estimator):
    d = logp - ref
    return {"k1": d, "k2": 0.5 * d * d, "k3": np.exp(-d) - 1 + d}[estimator]


def _grpo_cfg(**kw):
    return grpo.GRPOConfig(sampling=SamplingConfig(max_new_tokens=T, num_samples=G, temperature=TAU), **kw)


def _grpo_score(cfg):
    state = grpo.init_state(PARAMS, TX, ref_params=REF, cfg=cfg)
    return grpo.score(state, _rollout(), {}, {}, None, model=MODEL, cfg=cfg, reward=REWARD)


@pytest.mark.parametrize("estimator", [pytest.param("k1", marks=pytest.mark.heavy), "k3"])
def test_grpo_kl_in_the_reward_enters_the_group_advantage(estimator):
    """A_i = (s'_i − mean_g s') / (std_g s' + ε) with s'_i = s_i − β·Σ_t m_t·kl_t."""
    beta = 3.0
    batch, metrics = _grpo_score(_grpo_cfg(beta=beta, kl_in="reward", kl_estimator=estimator))
    out = _rollout()
    mask = np.asarray(out.response_mask)
    scores = np.sum((np.asarray(out.response_ids) == 5) & mask, axis=1).astype(np.float64)
    kl_seq = np.sum(np.where(mask, _np_kl(_logp(PARAMS), _logp(REF), estimator), 0.0), axis=1)
    shaped = (scores - beta * kl_seq).reshape(-1, G)
    adv = (shaped - shaped.mean(1, keepdims=True)) / (shaped.std(1, ddof=1, keepdims=True) + 1e-6)
    want = np.where(mask, adv.reshape(-1)[:, None], 0.0)
    np.testing.assert_allclose(np.asarray(batch.advantages), want, rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(float(metrics["kl/seq"]), kl_seq.mean(), rtol=1e-4)
    plain = (scores.reshape(-1, G) - scores.reshape(-1, G).mean(1, keepdims=True)) / (
        scores.reshape(-1, G).std(1, ddof=1, keepdims=True) + 1e-6)
    assert np.abs(adv - plain).max() > 0.05  # the KL moved the advantages


def test_grpo_kl_placement_in_the_loss_and_beta_zero():
    """KL in the reward: the loss has no KL term (= the β = 0 loss); KL in the loss: that
    loss plus β·token-mean(kl) (float64); β = 0 in the reward: the advantages without KL."""
    beta = 0.2
    batch, _ = _grpo_score(_grpo_cfg(beta=beta, kl_in="loss"))
    batch = batch._replace(old_logp=batch.ref_logp + 0.1)  # any old log-probs: both losses see the same
    loss = lambda cfg: float(grpo.loss_fn(PARAMS, batch, cfg, model=MODEL)[0])
    none = loss(_grpo_cfg(beta=0.0))
    assert loss(_grpo_cfg(beta=beta, kl_in="reward")) == pytest.approx(none, abs=1e-7)
    mask = np.asarray(batch.response_mask)
    kl = _np_kl(_logp(PARAMS), np.asarray(batch.ref_logp, np.float64), "k3")
    np.testing.assert_allclose(loss(_grpo_cfg(beta=beta, kl_in="loss")) - none, beta * kl[mask].mean(), rtol=1e-4)
    zero, _ = _grpo_score(_grpo_cfg(beta=0.0, kl_in="reward", track_kl=True))
    plain, _ = _grpo_score(_grpo_cfg(beta=0.0))
    np.testing.assert_array_equal(np.asarray(zero.advantages), np.asarray(plain.advantages))


def test_grpo_adaptive_beta_moves_toward_the_target():
    """With the measured KL far below `kl_target` β falls by Ziegler et al.'s step, from the
    batch's Σ_t kl_t (float64 reference); far above, it rises."""
    for target, direction in ((1e4, -1), (1e-4, 1)):
        cfg = _grpo_cfg(beta=0.1, kl_target=target, kl_horizon=32)
        state = grpo.init_state(PARAMS, TX, ref_params=REF, cfg=cfg)
        batch, metrics = grpo.score(state, _rollout(), {}, {}, None, model=MODEL, cfg=cfg, reward=REWARD)
        state, m = grpo.train(state, batch, jax.random.key(0), model=MODEL, tx=TX, cfg=cfg)
        mask = np.asarray(_rollout().response_mask)
        kl = np.sum(np.where(mask, _np_kl(_logp(PARAMS), _logp(REF), "k3"), 0.0), axis=1).mean()
        want = 0.1 * (1 + np.clip(kl / target - 1, -0.2, 0.2) * N / 32)
        assert float(m["beta"]) == pytest.approx(0.1)
        np.testing.assert_allclose(float(m["beta_next"]), want, rtol=1e-5)
        assert np.sign(float(state.kl_ctl.beta) - 0.1) == direction


def test_grpo_kl_options_are_validated():
    with pytest.raises(ValueError, match="kl_in='rewards'"):
        _grpo_cfg(beta=0.1, kl_in="rewards")
    with pytest.raises(ValueError, match="kl_target.*beta must be > 0"):
        _grpo_cfg(beta=0.0, kl_target=1.0)
    with pytest.raises(ValueError, match="init_state.*cfg=cfg"):
        cfg = _grpo_cfg(beta=0.1, kl_target=1.0)
        grpo.score(grpo.init_state(PARAMS, TX, ref_params=REF), _rollout(), {}, {}, None, model=MODEL, cfg=cfg,
                   reward=REWARD)


def _ppo_batch():
    out = _rollout()
    rng = np.random.default_rng(1)
    mask = out.response_mask
    f = lambda x: jnp.asarray(np.where(mask, x, 0.0), jnp.float32)
    return ppo.Batch(sequences=out.sequences, attention_mask=out.attention_mask, response_mask=mask,
                     old_logp=f(_logp(PARAMS) + rng.normal(0, 0.1, (N, T))), old_values=f(rng.normal(0, 1, (N, T))),
                     advantages=f(rng.normal(0, 1, (N, T))), returns=f(rng.normal(0, 1, (N, T))),
                     ref_logp=jnp.asarray(_logp(REF), jnp.float32))


@pytest.mark.parametrize("estimator", ["k2", "k3"])
def test_ppo_kl_in_the_loss(estimator):
    """kl_in="loss": the actor loss gains β·token-mean(kl(logp, ref_logp)) (float64), and
    the per-token rewards carry the score alone (= KL in the reward at β = 0)."""
    beta = 0.3
    model = Transformer(CFG, head="lm_value")
    params = dict(PARAMS, value_head={"kernel": jnp.zeros((CFG.hidden_size, 1))})
    sampling = SamplingConfig(max_new_tokens=T, num_samples=1, temperature=TAU)
    cfg = lambda kl_in: ppo.PPOConfig(sampling=sampling, critic="shared", kl_in=kl_in, kl_estimator=estimator)
    loss = lambda c, b: ppo.ppo_loss({"actor": params, "critic": None}, _ppo_batch(), actor_model=model,
                                     critic_model=None, cfg=c, beta=b)
    in_reward, _ = loss(cfg("reward"), beta)
    in_loss, metrics = loss(cfg("loss"), beta)
    mask = np.asarray(_rollout().response_mask)
    want = beta * _np_kl(_logp(PARAMS), _logp(REF), estimator)[mask].mean()
    np.testing.assert_allclose(float(in_loss - in_reward), want, rtol=1e-4)
    np.testing.assert_allclose(float(metrics["kl_loss"]), want, rtol=1e-4)
    assert float(loss(cfg("loss"), 0.0)[0]) == pytest.approx(float(in_reward), abs=1e-7)
    b = _ppo_batch()
    scores = jnp.arange(N, dtype=jnp.float32)
    adv = lambda c, bt: ppo.compute_advantages(scores, b.old_logp, b.ref_logp, b.old_values, mask, bt, c)
    np.testing.assert_array_equal(np.asarray(adv(cfg("loss"), beta).rewards), np.asarray(adv(cfg("reward"), 0.0).rewards))
    assert not np.allclose(np.asarray(adv(cfg("reward"), beta).rewards), np.asarray(adv(cfg("loss"), beta).rewards))


def test_ppo_update_slices_ref_logp_when_there_is_one():
    """`ppo.update` cuts every field of the `Batch` into its minibatches, a None field as
    nothing: with kl_in="reward" a batch with or without ref_logp trains the same; with
    kl_in="loss" the minibatches carry it (a k3 KL term > 0) and a batch without it is refused."""
    model = Transformer(CFG, head="lm_value")
    params = dict(PARAMS, value_head={"kernel": jnp.zeros((CFG.hidden_size, 1))})
    sampling = SamplingConfig(max_new_tokens=T, num_samples=1, temperature=TAU)
    cfg = lambda kl_in: ppo.PPOConfig(sampling=sampling, critic="shared", kl_in=kl_in, kl_estimator="k3",
                                      beta=0.3, num_ppo_epochs=1, num_minibatches=2)

    def update(c, batch):
        state = ppo.init_state(c, model, jax.tree.map(jnp.copy, params), TX)
        return ppo.update(state, batch, jax.random.key(0), actor_model=model, critic_model=None, tx_actor=TX,
                          tx_critic=None, cfg=c)

    batch = _ppo_batch()
    with_ref, _ = update(cfg("reward"), batch)
    without, _ = update(cfg("reward"), batch._replace(ref_logp=None))
    for a, b in zip(jax.tree.leaves(with_ref.actor.params), jax.tree.leaves(without.actor.params)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    _, metrics = update(cfg("loss"), batch)
    assert float(metrics["kl_loss"]) > 0
    with pytest.raises(ValueError, match=r"kl_in='loss' needs batch.ref_logp"):
        update(cfg("loss"), batch._replace(ref_logp=None))
