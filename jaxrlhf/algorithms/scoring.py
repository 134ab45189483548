"""From sampled responses to the scores advantages are computed from, for the online
algorithms (PPO, the GRPO family): reward plumbing, then score shaping.

Rewards. Every reward is a `jaxrlhf.rewards.Reward` (JAX, host and reward-model
components); `compiled_reward` turns the shorter forms PPO accepts (a reward-model
`Transformer`, bare callables) into one, with the reward model's parameters kept apart so
that they stay an argument of the compiled program. An iteration gets reward `extras` per
prompt `[B, ...]`; the rewards see them per response, `N = B·G` rows (`repeat_extras`
inside the program, `host_scores` for the host components between two programs).

Score shaping, `[N]` scores in, `[N]` out: `missing_eos_penalty` and `RunningMoments`
(PPO's `process_scores`), DAPO's `overlong_penalty` and dynamic sampling's
`select_groups` (the GRPO family's `learn`).
"""

from __future__ import annotations

import inspect
from typing import Any, Mapping, NamedTuple

import flax
import jax
import jax.numpy as jnp
import numpy as np

from jaxrlhf import rewards
from jaxrlhf.algorithms import reward_model
from jaxrlhf.models.transformer import Transformer
from jaxrlhf.rollout.sampler import finished

PyTree = Any


def compiled_reward(reward) -> tuple[rewards.Reward, PyTree]:
    """A reward that runs inside one compiled program, as `(rewards.Reward, params or None)`:

    - `(Transformer(head="score"), params)`: a reward model (`reward_model.as_reward`),
      scored at the last valid token of prompt ⧺ response (`models.score_at_last_token`),
      its params returned apart (give them to `Reward.device_scores`);
    - `Transformer(head="score")`: the same, params given separately;
    - a `rewards.Reward` (`rewards.jax_reward`, `rewards.model_reward`, `rewards.combine`);
      each component's mean is reported as `reward/<name>`. Its host (text) components
      cannot run inside the program: they are scored between two programs (rollout, then
      the update), which `Reward.is_jax` tells the caller to build;
    - a plain callable: with 3 positional parameters it is taken as
      `fn(response_ids, response_mask, extras)` (`rewards.jax_reward`), with 2 as
      `fn(sequences, attention_mask)` (`rewards.model_reward`).
    """
    if isinstance(reward, tuple) and len(reward) == 2 and isinstance(reward[0], Transformer):
        return reward_model.as_reward(reward[0]), reward[1]
    if isinstance(reward, Transformer):
        return reward_model.as_reward(reward), None
    if isinstance(reward, rewards.Reward):
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


def host_scores(reward: rewards.Reward, out, extras: Mapping[str, Any] | None, g: int, *,
                eos_id: int | None, drop_unscored: bool = False) -> dict[str, np.ndarray]:
    """`{name: [N]}` of the host components of `reward` on the sampled responses `out` (a
    `rollout.SampleOutput` of numpy arrays, `N = B·G` rows), given the prompts' `extras`:
    arrays repeated per sample with numpy, lists of `B` values (e.g. answer strings) too.
    `eos_id`: the sampler's; None (it never stopped) decodes each response whole, as the
    loss sees it (`jaxrlhf.rewards`' rule). `drop_unscored`: a row no weighted reward
    scores is no error (the caller drops it; `Reward.host_scores`)."""
    n_prompts = out.response_ids.shape[0] // g
    arrays, others = split_extras(extras)
    per_sample = {k: np.repeat(np.asarray(v), g, axis=0) for k, v in arrays.items()}
    for k, v in others.items():
        v = list(v)
        if len(v) != n_prompts:
            raise ValueError(f"extras[{k!r}] has {len(v)} entries; expected one per prompt ({n_prompts})")
        per_sample[k] = [x for x in v for _ in range(g)]
    return reward.host_scores(rewards.RewardInput.from_sample(out), per_sample, cut_at_eos=eos_id is not None,
                              drop_unscored=drop_unscored)


# --------------------------------------------------------------------------------------
# Score shaping: between a reward's scores and the advantages


@flax.struct.dataclass
class RunningMoments:
    """Mean and population variance of all scores seen so far (for "running" whitening)."""

    count: jax.Array
    mean: jax.Array
    var: jax.Array

    @classmethod
    def create(cls) -> "RunningMoments":
        return cls(jnp.zeros((), jnp.float32), jnp.zeros((), jnp.float32), jnp.ones((), jnp.float32))

    def update(self, x_N: jax.Array, mask: jax.Array | None = None) -> "RunningMoments":
        """Chan et al.'s parallel merge of (count, mean, M2) with a new batch: its rows where
        `mask` `[N]` bool is True (None: all); a batch with no such row changes nothing."""
        x = x_N.astype(jnp.float32)
        if mask is None:
            n = jnp.float32(x.shape[0])
            mean_b, var_b = jnp.mean(x), jnp.var(x)
        else:
            mask = jnp.asarray(mask, bool)
            n = jnp.sum(mask, dtype=jnp.float32)
            x = jnp.where(mask, x, 0.0)  # a masked-out row's value (even NaN) reaches no sum
            mean_b = jnp.sum(x) / jnp.maximum(n, 1.0)
            var_b = jnp.sum(jnp.where(mask, jnp.square(x - mean_b), 0.0)) / jnp.maximum(n, 1.0)
        total = self.count + n
        safe = jnp.maximum(total, 1.0) if mask is not None else total
        delta = mean_b - self.mean
        mean = self.mean + delta * n / safe
        m2 = self.var * self.count + var_b * n + jnp.square(delta) * self.count * n / safe
        if mask is None:
            return RunningMoments(total, mean, m2 / total)
        return RunningMoments(total, jnp.where(n > 0, mean, self.mean), jnp.where(n > 0, m2 / safe, self.var))


def missing_eos_penalty(scores_N: jax.Array, response_ids_NxT: jax.Array, response_mask_NxT: jax.Array, *,
                        eos_id, penalty: float, mode: str = "subtract") -> jax.Array:
    """Scores `[N]` of the responses that did not finish (`sampler.finished`: no `eos_id`
    among their valid tokens — any of its ids — nor cut short at a stop string; they ran
    out of `max_new_tokens`) penalised by `p = penalty ≥ 0`:

        "subtract": s − p   (TRL's `missing_eos_penalty`)
        "replace":  −p      (whatever the reward said)
    """
    has_eos = finished(response_ids_NxT, response_mask_NxT, eos_id)
    p = jnp.float32(penalty)
    penalised = scores_N - p if mode == "subtract" else jnp.full_like(scores_N, -p)
    return jnp.where(has_eos, scores_N, penalised)


def overlong_penalty(lengths: jax.Array, *, max_len: int, cache_len: int) -> jax.Array:
    """DAPO's soft overlong punishment (arXiv:2503.14476, eq. 13), lengths in tokens:

        0                                  if len ≤ L_max − L_cache
        ((L_max − L_cache) − len) / L_cache if L_max − L_cache < len ≤ L_max
        −1                                 if len > L_max

    Args:
      lengths: `[N]` valid response tokens (EOS included).
      max_len: L_max. cache_len: L_cache (0: a hard −1 beyond L_max only).

    Returns: `[N]` float32 penalties in [−1, 0].
    """
    lengths = jnp.asarray(lengths, jnp.float32)
    start = float(max_len - cache_len)
    soft = (start - lengths) / max(float(cache_len), 1.0)
    out = jnp.where(lengths <= start, 0.0, soft)
    return jnp.where(lengths > max_len, -1.0, out).astype(jnp.float32)


class GroupSelection(NamedTuple):
    """Dynamic sampling's choice: `indices` `[K·G]` rows to keep, `has_signal` `[K]` for the
    kept groups, `kept_fraction` (kept groups with signal / K) and `signal_fraction`
    (groups with signal / groups sampled)."""

    indices: jax.Array
    has_signal: jax.Array
    kept_fraction: jax.Array
    signal_fraction: jax.Array


def select_groups(scores: jax.Array, group_size: int, num_groups: int) -> GroupSelection:
    """Keeps `num_groups` groups, those whose scores are not all equal first (in order),
    then groups without signal as padding, so that the batch size stays fixed: the lowest
    scores first (a group whose answers are all equally wrong before one whose answers are
    all right; both have zero advantage, but guidance, `GRPOConfig.guide_coef`, still
    teaches the failed ones), in order among equal scores.

    Args:
      scores: `[M·G]` sequence scores of M ≥ num_groups contiguous groups.
    """
    n = scores.shape[0]
    if n % group_size:
        raise ValueError(f"select_groups: {n} scores do not split into groups of {group_size}")
    m = n // group_size
    if num_groups > m:
        raise ValueError(f"dynamic sampling keeps {num_groups} groups per step but only {m} prompts were "
                         "sampled: pass a prompt pool of at least prompts_per_step prompts")
    s = scores.reshape(m, group_size)
    best = jnp.max(s, axis=1)
    has = best > jnp.min(s, axis=1)
    # sorted by signal first, then (padding only) the best score, then the pool order
    order = jnp.lexsort((jnp.arange(m), jnp.where(has, 0.0, best), jnp.where(has, 0, 1)))
    keep = order[:num_groups]
    indices = (keep[:, None] * group_size + jnp.arange(group_size)[None]).reshape(-1)
    kept_signal = has[keep]
    return GroupSelection(indices, kept_signal, jnp.mean(kept_signal.astype(jnp.float32)),
                          jnp.mean(has.astype(jnp.float32)))


__all__ = ["GroupSelection", "RunningMoments", "check_reward_vocab", "check_vocab", "compiled_reward", "host_scores",
           "missing_eos_penalty", "overlong_penalty", "repeat_extras", "select_groups", "split_extras"]
