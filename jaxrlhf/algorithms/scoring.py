"""From sampled responses to scores: the reward plumbing of the online algorithms (PPO, the
GRPO family).

Every reward is a `jaxrlhf.rewards.Reward` (JAX, host and reward-model components);
`compiled_reward` turns the shorter forms PPO accepts (a reward-model `Transformer`, bare
callables) into one, with the reward model's parameters kept apart so that they stay an
argument of the compiled program.
"""

from __future__ import annotations

import inspect
from typing import Any

from jaxrlhf import rewards
from jaxrlhf.algorithms import reward_model
from jaxrlhf.models.transformer import Transformer

PyTree = Any


def compiled_reward(reward) -> tuple[rewards.Reward, PyTree]:
    """A reward that runs inside one compiled program, as `(rewards.Reward, params or None)`:

    - `(Transformer(head="score"), params)`: a reward model (`reward_model.as_reward`),
      scored at the last valid token of prompt ⧺ response (`models.score_at_last_token`),
      its params returned apart (give them to `Reward.device_scores`);
    - `Transformer(head="score")`: the same, params given separately;
    - a `rewards.Reward` of JAX and reward-model components (`rewards.jax_reward`,
      `rewards.model_reward`, `rewards.combine`); each component's mean is reported as
      `reward/<name>`;
    - a plain callable: with 3 positional parameters it is taken as
      `fn(response_ids, response_mask, extras)` (`rewards.jax_reward`), with 2 as
      `fn(sequences, attention_mask)` (`rewards.model_reward`).

    Host-side (text) rewards cannot run inside a compiled iteration: score on host and
    pass a JAX function of the token ids instead.
    """
    if isinstance(reward, tuple) and len(reward) == 2 and isinstance(reward[0], Transformer):
        return reward_model.as_reward(reward[0]), reward[1]
    if isinstance(reward, Transformer):
        return reward_model.as_reward(reward), None
    if isinstance(reward, rewards.Reward):
        if not reward.is_jax:
            raise TypeError("a reward with host-side (text) components cannot run inside a jitted iteration; "
                            "use JAX rewards on token ids or a reward model")
        return reward, None
    if callable(reward):
        try:
            params = [p for p in inspect.signature(reward).parameters.values()
                      if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD) and p.default is p.empty]
        except (TypeError, ValueError):
            params = []
        if len(params) == 3:
            return rewards.jax_reward(reward), None
        if len(params) == 2:
            return rewards.model_reward(reward), None
        raise TypeError(f"cannot tell how to call reward {reward!r}: wrap it in rewards.jax_reward(fn) "
                        f"(fn(response_ids, response_mask, extras)) or rewards.model_reward(fn) "
                        f"(fn(sequences, attention_mask))")
    raise TypeError(f"unsupported reward {type(reward).__name__}: pass (Transformer(head='score'), params), "
                    f"a Transformer, a rewards.Reward, or a JAX callable")


def check_vocab(policy_vocab: int, other_vocab: int | None, what: str = "reward model") -> None:
    """A model that reads the policy's token ids must share its vocabulary."""
    if other_vocab is not None and int(other_vocab) != int(policy_vocab):
        raise ValueError(f"policy vocab_size {policy_vocab} != {what} vocab_size {other_vocab} — "
                         f"the {what} must share the policy tokenizer")


def check_reward_vocab(policy_vocab: int, reward: rewards.Reward) -> None:
    """`check_vocab` for every component of `reward` whose vocabulary is known."""
    for c in reward.components:
        check_vocab(policy_vocab, c.vocab_size)
