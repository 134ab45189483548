"""The episode engine (`rollout.episodes`): exact tokens, sampler = trainer log-probs over
whole episodes, the KV cache kept across turns, limits and environment errors."""

import jax
import numpy as np
import pytest

from jaxrlhf import envs
from jaxrlhf.algorithms import common
from jaxrlhf.models import ModelConfig, Transformer, init_params
from jaxrlhf.rollout import episodes

EOS = 2
CFG = ModelConfig(vocab_size=37, hidden_size=32, intermediate_size=48, num_layers=2, num_heads=4,
                  num_kv_heads=2, head_dim=8, max_position_embeddings=256)
MODEL = Transformer(CFG)


def _params(eos_gain=3.0, seed=0):
    """Random params with a sharpened LM head whose EOS column is larger again: turns end at
    many different lengths."""
    params = init_params(MODEL, jax.random.key(seed))
    head = params["lm_head"]["kernel"] * 4.0
    return dict(params, lm_head={"kernel": head.at[:, EOS].multiply(eos_gain)})


PARAMS = _params()


class Scripted:
    """A token environment: a prompt of `prompt_len` ids from the row's seed, then after
    each policy turn `obs` ids (a different number per turn), done after `turns` turns with
    reward of a step = its policy tokens (an episode's: all its policy tokens). Records every call."""

    closed = []

    def __init__(self, turns=3, obs=(3, 1, 5), prompt_len=None):
        self.turns, self.obs, self.prompt_len = turns, obs, prompt_len
        self.actions, self.cuts, self.returned, self.n = [], [], [], 0

    def reset(self, row):
        rng = np.random.default_rng(row["seed"])
        self.rng = rng
        return rng.integers(3, CFG.vocab_size, self.prompt_len or 2 + row["seed"] % 5).tolist()

    def step(self, action_ids, cut):
        self.actions.append(list(action_ids))
        self.cuts.append(cut)
        self.n += 1
        ids = self.rng.integers(3, CFG.vocab_size, self.obs[(self.n - 1) % len(self.obs)]).tolist()
        self.returned.append(ids)
        done = self.n >= self.turns
        return envs.TokenStep([] if done else ids, float(len(action_ids)), done)

    def close(self):
        Scripted.closed.append(self)


def _run(env_list, seed=0, params=PARAMS, **kw):  # 4 rows and these shapes everywhere: one compile
    opts = dict(max_turns=4, max_turn_tokens=6, max_total_tokens=48, max_env_tokens=8, eos_id=EOS, temperature=1.0)
    opts.update(kw)
    rows = [{"seed": i} for i in range(len(env_list))]
    return episodes.run_episodes(MODEL, params, env_list, rows, jax.random.key(seed), **opts)


def test_the_batch_holds_exactly_the_sampled_and_environment_ids_in_order():
    env_list = [Scripted() for _ in range(4)]
    out = _run(env_list)
    s = out.sample
    for i, env in enumerate(env_list):
        ids = np.asarray(s.response_ids[i])
        policy, envm = np.asarray(s.response_mask[i]), out.env_mask[i]
        want, want_policy = [], []
        for k, action in enumerate(env.actions):
            want += action
            want_policy += [True] * len(action)
            if k < len(env.actions) - 1:  # the last step's ids are not appended (done or cut)
                want += env.returned[k]
                want_policy += [False] * len(env.returned[k])
        n = len(want)
        assert ids[:n].tolist() == want and policy[:n].tolist() == want_policy
        assert not policy[n:].any() and not envm[n:].any() and (envm[:n] == ~policy[:n]).all()
        prompt = np.asarray(s.prompt_ids[i])[np.asarray(s.prompt_mask[i])]
        assert prompt.tolist() == env.reset({"seed": i})  # the same ids the env gave
        assert np.asarray(s.attention_mask[i]).tolist() == np.asarray(s.prompt_mask[i]).tolist() + (policy | envm).tolist()
        for action, cut in zip(env.actions, env.cuts):  # a turn ends at EOS, else it was cut at 6 tokens
            assert (not cut and action[-1] == EOS) or (cut and len(action) == 6 and EOS not in action)
        assert out.turns[i] == len(env.actions)
        assert out.prefill_tokens[i] == len(prompt) + sum(len(x) for x in env.returned[:-1])
    assert all(e in Scripted.closed for e in env_list)


@pytest.mark.parametrize("temperature", [0.7, 0.0])
def test_sampler_logprobs_equal_the_trainers_over_whole_episodes(temperature):
    """Every policy token's log-prob from the episode engine (KV cache across turns,
    environment chunks appended) equals the trainer's on the assembled sequence."""
    out = _run([Scripted(turns=4, obs=(2, 7, 1)) for _ in range(4)], seed=3, temperature=temperature)
    s = out.sample
    p = s.prompt_ids.shape[1]
    logp, _, _ = common.response_logprobs(MODEL, PARAMS, s.sequences, s.attention_mask, p,
                                          temperature=temperature or 1.0)
    mask = np.asarray(s.response_mask)
    assert mask.sum() > 20 and out.env_mask.sum() > 10 and (out.turns > 1).any()
    np.testing.assert_allclose(np.where(mask, np.asarray(logp), 0.0), np.asarray(s.logprobs), atol=1e-5, rtol=0)


def test_same_key_same_episodes_and_rows_do_not_depend_on_each_other():
    a = _run([Scripted() for _ in range(4)], seed=7)
    b = _run([Scripted() for _ in range(4)], seed=7)
    np.testing.assert_array_equal(np.asarray(a.sample.sequences), np.asarray(b.sample.sequences))
    c = _run([Scripted() for _ in range(4)], seed=8)
    assert not np.array_equal(np.asarray(a.sample.sequences), np.asarray(c.sample.sequences))


def test_rewards_turns_and_limits():
    out = _run([Scripted(turns=2), Scripted(turns=10), Scripted(turns=10, obs=(30,)), Scripted(turns=10, obs=(8,))],
               max_turns=3, cut_reward=-1.0)
    assert out.cut[0] is None and out.rewards[0] == float(np.asarray(out.sample.lengths[0]))
    assert out.cut[1] == "turns" and out.turns[1] == 3 and out.rewards[1] == -1.0
    assert out.cut[2] == "env_tokens" and out.turns[2] == 1 and out.rewards[2] == -1.0
    assert out.cut[3] in ("tokens", "turns") and out.rewards[3] == -1.0
    short = _run([Scripted(turns=10, obs=(8,)) for _ in range(4)], max_turns=20, cut_reward=-1.0)
    assert short.cut == ["tokens"] * 4 and (short.rewards == -1.0).all()  # 48 tokens run out first
    assert (np.asarray(short.sample.attention_mask).sum(axis=1) - np.asarray(short.sample.prompt_mask).sum(axis=1)
            <= 48).all()


def test_a_turn_cut_at_its_token_limit_is_given_to_the_environment_as_cut():
    params = _params(eos_gain=0.0)  # EOS rarely drawn: most turns run to their limit
    env_list = [Scripted(turns=2) for _ in range(4)]
    _run(env_list, params=params)
    turns = [(a, cut) for env in env_list for a, cut in zip(env.actions, env.cuts)]
    assert sum(cut for _, cut in turns) >= 4
    for action, cut in turns:
        assert (cut and len(action) == 6 and EOS not in action) or (not cut and action[-1] == EOS)


class Raises(Scripted):
    def step(self, action_ids, cut):
        raise KeyError("boom")


class WrongType(Scripted):
    def step(self, action_ids, cut):
        return {"ids": []}


class TooLong(Scripted):
    def step(self, action_ids, cut):
        raise envs.EnvLimit("env_tokens", "observation of 10 MB")


def test_environment_errors_are_named_and_every_env_is_closed():
    Scripted.closed.clear()
    env_list = [Scripted(), Raises(), Scripted(), Scripted()]
    with pytest.raises(envs.EnvError, match=r"test_episodes:Raises\.step raised KeyError"):
        _run(env_list)
    assert all(e in Scripted.closed for e in env_list)
    with pytest.raises(envs.EnvError, match=r"WrongType\.step returned dict"):
        _run([WrongType()] * 4)
    out = _run([TooLong(), Scripted(), Scripted(), Scripted()], cut_reward=0.5)
    assert out.cut == ["env_tokens", None, None, None] and out.rewards[0] == 0.5


def test_arguments_are_checked():
    with pytest.raises(ValueError, match="max_turns must be a positive integer"):
        _run([Scripted()], max_turns=0)
    with pytest.raises(ValueError, match="one row per environment"):
        episodes.run_episodes(MODEL, PARAMS, [Scripted()], [], jax.random.key(0), max_turns=1, max_turn_tokens=1,
                              max_total_tokens=4, max_env_tokens=1, eos_id=EOS)


def test_lora_episodes_logprobs_equal_the_trainers():
    """With LoRA adapters (B perturbed off zero), over whole episodes."""
    from jaxrlhf.models import lora

    model = Transformer(CFG.replace(lora=lora.LoraConfig(rank=4)))
    params = lora.add_adapters(model, PARAMS, jax.random.key(1))
    params = jax.tree_util.tree_map_with_path(
        lambda path, x: x + 0.05 * jax.random.normal(jax.random.key(len(path)), x.shape)
        if "lora_b" in jax.tree_util.keystr(path).lower() else x, params)
    rows = [{"seed": i} for i in range(4)]
    out = episodes.run_episodes(model, params, [Scripted(turns=3) for _ in rows], rows, jax.random.key(5), max_turns=4,
                                max_turn_tokens=6, max_total_tokens=48, max_env_tokens=8, eos_id=EOS)
    s = out.sample
    logp, _, _ = common.response_logprobs(model, params, s.sequences, s.attention_mask, s.prompt_ids.shape[1])
    base, _, _ = common.response_logprobs(MODEL, PARAMS, s.sequences, s.attention_mask, s.prompt_ids.shape[1])
    mask = np.asarray(s.response_mask)
    assert np.abs(np.where(mask, np.asarray(logp) - np.asarray(base), 0)).max() > 1e-3  # the adapters act
    np.testing.assert_allclose(np.where(mask, np.asarray(logp), 0.0), np.asarray(s.logprobs), atol=1e-5, rtol=0)
