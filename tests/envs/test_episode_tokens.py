"""The decisive token test: a text environment through a real chat template, run by the
episode engine with a policy that samples token splits re-encoding would not return. The
training batch holds exactly the sampled ids, the environment's ids, the sampler's
log-probs (equal to the trainer's) and the policy mask; an implementation that
re-tokenised the episode's text would fail it."""

from __future__ import annotations

import os
import sys

import jax
import numpy as np

from jaxrlhf.algorithms import common
from jaxrlhf.envs import ChatEpisode, Step
from jaxrlhf.models import ModelConfig, Transformer, init_params
from jaxrlhf.rollout import episodes

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _tiny_chat import tiny_tokenizer  # noqa: E402


class Chat:
    """Replies "Go on." to each turn; done after three; reward 1 per turn."""

    def reset(self, row):
        self.turns = 0
        return [{"role": "user", "content": row["prompt"]}]

    def step(self, text):
        self.turns += 1
        return Step([{"role": "user", "content": "Go on."}], 1.0, self.turns >= 3)


class Recording(ChatEpisode):
    """A ChatEpisode that keeps each turn's action ids and the ids it returned."""

    def __init__(self, *a, **kw):
        super().__init__(*a, **kw)
        self.log = []

    def reset(self, row):
        self.prompt = super().reset(row)
        return self.prompt

    def step(self, action_ids, cut):
        result = super().step(action_ids, cut)
        self.log.append((list(action_ids), cut, list(result.ids), result.done))
        return result


def test_the_batch_holds_the_sampled_ids_not_a_retokenisation():
    tokenizer = tiny_tokenizer("qwen2.5")
    stop = tokenizer.convert_tokens_to_ids("<|im_end|>")
    vocab = len(tokenizer)
    cfg = ModelConfig(vocab_size=vocab, hidden_size=32, intermediate_size=48, num_layers=1, num_heads=2,
                      num_kv_heads=2, head_dim=16, max_position_embeddings=512)
    model = Transformer(cfg)
    params = init_params(model, jax.random.key(0))
    params = dict(params, lm_head={"kernel": params["lm_head"]["kernel"].at[:, stop].add(0.4)})  # turns end sometimes
    eps = [Recording(Chat(), tokenizer) for _ in range(4)]
    rows = [{"prompt": "What is 2 + 3?"}] * 4
    out = episodes.run_episodes(model, params, eps, rows, jax.random.key(0), max_turns=3, max_turn_tokens=12,
                                max_total_tokens=160, max_env_tokens=32, eos_id=stop,
                                pad_id=tokenizer.convert_tokens_to_ids("<|endoftext|>"))
    s = out.sample
    retokenised = 0
    for i, ep in enumerate(eps):
        want, policy = [], []
        for k, (action, cut, env_ids, done) in enumerate(ep.log):
            text = tokenizer.decode(action)
            retokenised += tokenizer.encode(text, add_special_tokens=False) != action
            want += action + ([] if done else env_ids)
            policy += [True] * len(action) + ([] if done else [False] * len(env_ids))
        n = len(want)
        assert np.asarray(s.response_ids[i])[:n].tolist() == want  # the sampled ids, as sampled
        assert np.asarray(s.response_mask[i])[:n].tolist() == policy and not np.asarray(s.response_mask[i])[n:].any()
        prompt = np.asarray(s.prompt_ids[i])[np.asarray(s.prompt_mask[i])].tolist()
        assert prompt == ep.prompt
        assert out.rewards[i] == 3.0 and out.cut[i] is None
    # The precondition that makes this decisive: re-encoding the policy's text gives other ids.
    assert retokenised >= 3
    logp, _, _ = common.response_logprobs(model, params, s.sequences, s.attention_mask, s.prompt_ids.shape[1])
    mask = np.asarray(s.response_mask)
    np.testing.assert_allclose(np.where(mask, np.asarray(logp), 0.0), np.asarray(s.logprobs), atol=1e-5, rtol=0)
