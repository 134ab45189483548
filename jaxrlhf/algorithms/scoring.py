"""From sampled responses to scores: the reward plumbing of the online algorithms (PPO, the
GRPO family).

Every reward is a `jaxrlhf.rewards.Reward` (JAX, host and reward-model components);
`compiled_reward` turns the shorter forms PPO accepts (a reward-model `Transformer`, bare
callables) into one, with the reward model's parameters kept apart so that they stay an
argument of the compiled program. An iteration gets reward `extras` per prompt `[B, ...]`;
the rewards see them per response, `N = B·G` rows (`repeat_extras` inside the program,
`host_scores` for the host components between two programs).
"""

from __future__ import annotations

import inspect
from typing import Any, Mapping

import jax.numpy as jnp
import numpy as np

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


def split_extras(extras: Mapping[str, Any] | None) -> tuple[dict, dict]:
    """`(arrays, others)`: the extras a compiled program can take (those with a shape) and
    the rest (e.g. lists of answer strings, for host rewards only)."""
    extras = {} if extras is None else dict(extras)
    arrays = {k: v for k, v in extras.items() if hasattr(v, "shape")}
    others = {k: v for k, v in extras.items() if not hasattr(v, "shape")}
    return arrays, others


def repeat_extras(extras: Mapping[str, Any] | None, g: int, n_prompts: int) -> dict:
    """Extras of `n_prompts` prompts (`[B, ...]` arrays) for their `B·G` responses: each row
    repeated `g` times, a prompt's samples contiguous (traceable)."""
    def rep(x):
        x = jnp.asarray(x)
        if x.ndim == 0 or x.shape[0] != n_prompts:
            raise ValueError(f"extras arrays must have one row per prompt ([B, ...] with B = {n_prompts}), "
                             f"got shape {x.shape}")
        return jnp.repeat(x, g, axis=0)
    return {k: rep(v) for k, v in ({} if extras is None else extras).items()}


def host_scores(reward: rewards.Reward, out, extras: Mapping[str, Any] | None, g: int) -> dict[str, np.ndarray]:
    """`{name: [N]}` of the host components of `reward` on the sampled responses `out` (a
    `rollout.SampleOutput` of numpy arrays, `N = B·G` rows), given the prompts' `extras`:
    arrays repeated per sample with numpy, lists of `B` values (e.g. answer strings) too."""
    n_prompts = out.response_ids.shape[0] // g
    arrays, others = split_extras(extras)
    per_sample = {k: np.repeat(np.asarray(v), g, axis=0) for k, v in arrays.items()}
    for k, v in others.items():
        v = list(v)
        if len(v) != n_prompts:
            raise ValueError(f"extras[{k!r}] has {len(v)} entries; expected one per prompt ({n_prompts})")
        per_sample[k] = [x for x in v for _ in range(g)]
    return reward.host_scores(rewards.RewardInput.from_sample(out), per_sample)
