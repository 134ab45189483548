"""The GRPO family's advantage estimators by name: `GRPOConfig.advantage` picks one.

An estimator is `fn(scores_N, response_mask_NxT, cfg, scored_N) -> advantages_NxT`: the
sequence scores `[N]` (groups of `cfg.group_size` contiguous), the valid response tokens,
the `GRPOConfig`, and the rows that have a score (`[N]` bool, or None: all); a row without
a score gets 0 everywhere. An estimator registered with `components=True` also gets
`components=(scores_NxK, weights_K)`: the reward's K components, unweighted, and their
weights (`scores_N` is then their weighted sum, shaping included). The built-in six
(formulas: docs/concepts.md#grpo-and-its-variants-dr-grpo-dapo,
docs/concepts.md#reinforce-with-a-group-baseline,
docs/concepts.md#gdpo-several-rewards-normalised-apart):

- "grpo", "dr_grpo", "rloo": `ops.group_advantages` per group, broadcast to the tokens;
- "reinforce_pp": `ops.whiten` of the broadcast scores over the batch (REINFORCE++);
- "reinforce_pp_baseline": the scores less their group's mean (`ops.group_advantages`'s
  "dr_grpo", over the scored rows), broadcast to the tokens, then `ops.whiten` over the
  valid tokens of the batch (REINFORCE++-baseline);
- "gdpo" (components): `ops.gdpo_advantages` of the components, each z-scored in its
  group, their weighted sum whitened over the (scored) rows of the batch, broadcast to
  the tokens (GDPO).

A new one is one `register_advantage("name", fn)` call (its formula an `ops` function),
then `--config.grpo.advantage=name`: docs/extending.md.
"""

from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp

from jaxrlhf import ops

Estimator = Callable[[jax.Array, jax.Array, "object", "jax.Array | None"], jax.Array]
ADVANTAGE_ESTIMATORS: dict[str, Estimator] = {}
GROUPED: set[str] = set()  # the estimators that compare responses within a group (G >= 2)
PER_COMPONENT: set[str] = set()  # the estimators that take the reward's components


def register_advantage(name: str, fn: Estimator, *, grouped: bool = True, components: bool = False) -> None:
    """Make `fn` the estimator `GRPOConfig(advantage=name)` uses. `grouped`: it compares the
    responses of a group, so it needs G = `sampling.num_samples` >= 2. `components`: it is
    called with `components=(scores_NxK, weights_K)` too, and needs a reward of two or more
    weighted components (`check_reward`)."""
    ADVANTAGE_ESTIMATORS[name] = fn
    (GROUPED.add if grouped else GROUPED.discard)(name)
    (PER_COMPONENT.add if components else PER_COMPONENT.discard)(name)


def names() -> tuple[str, ...]:
    """The registered estimators' names (the choices of `GRPOConfig.advantage`)."""
    return tuple(ADVANTAGE_ESTIMATORS)


def _group_method(method: str) -> Estimator:
    def estimate(scores, response_mask, cfg, scored):
        g = cfg.group_size
        if scores.shape[0] % g:
            raise ValueError(f"compute_advantages: {scores.shape[0]} responses do not split into groups of "
                             f"G = sampling.num_samples = {g}; the batch must hold whole groups")
        adv = ops.group_advantages(scores, g, method=method, eps=cfg.adv_eps, mask=scored)
        return ops.broadcast_sequence(adv, response_mask)
    return estimate


def _reinforce_pp(scores, response_mask, cfg, scored):
    return ops.whiten(ops.broadcast_sequence(scores, response_mask), response_mask)


def _reinforce_pp_baseline(scores, response_mask, cfg, scored):
    # The group-mean baseline is "dr_grpo" (an unscored row is left out of its group's mean
    # and gets 0); an unscored row's tokens are out of `response_mask` (as `estimate` does),
    # so the whitening's statistics skip them too.
    if scored is not None:
        response_mask = response_mask * jnp.asarray(scored, response_mask.dtype)[:, None]
    centred = _group_method("dr_grpo")(scores, response_mask, cfg, scored)
    return ops.whiten(centred, response_mask)


def _gdpo(scores, response_mask, cfg, scored, *, components):
    # The components, not their sum: each normalised in its group (over the scored rows),
    # the weighted sum whitened over the scored rows of the batch.
    scores_NxK, weights_K = components
    adv = ops.gdpo_advantages(scores_NxK, cfg.group_size, weights=weights_K, eps=cfg.adv_eps, mask=scored)
    return ops.broadcast_sequence(adv, response_mask)


for _method in ops.GROUP_METHODS:
    register_advantage(_method, _group_method(_method))
register_advantage("reinforce_pp", _reinforce_pp, grouped=False)
register_advantage("reinforce_pp_baseline", _reinforce_pp_baseline, grouped=True)
register_advantage("gdpo", _gdpo, grouped=True, components=True)


def check_reward(name: str, reward) -> None:
    """An estimator that takes the reward's components (`PER_COMPONENT`) needs a reward
    (`rewards.Reward`) of two or more weighted components: a ValueError naming
    `grpo.advantage` otherwise (before any step)."""
    if name not in PER_COMPONENT:
        return
    weighted = [c.name for c in reward.components if c.weight != 0]
    if len(weighted) < 2:
        raise ValueError(f"grpo.advantage={name!r} normalises each reward component apart, but the reward has "
                         f"{len(weighted)} weighted component(s) {weighted}: give it two or more (e.g. the task's "
                         "own and reward.fns with reward.weights), or use grpo.advantage='grpo'")


def estimate(name: str, scores, response_mask, cfg, scored=None, components=None) -> jax.Array:
    """The advantages `[N, T]` of estimator `name`, rows without a score zeroed first;
    `components=(scores_NxK, weights_K)` for the estimators of `PER_COMPONENT` (needed
    there, ignored by the others)."""
    if name not in ADVANTAGE_ESTIMATORS:
        raise ValueError(f"advantage={name!r}; expected one of {names()} (register_advantage adds one)")
    if scored is not None:
        response_mask = response_mask * jnp.asarray(scored, response_mask.dtype)[:, None]
    if name in PER_COMPONENT:
        if components is None:
            raise ValueError(f"advantage={name!r} normalises each reward component apart: pass "
                             "components=(scores_NxK, weights_K)")
        return ADVANTAGE_ESTIMATORS[name](scores, response_mask, cfg, scored, components=components)
    return ADVANTAGE_ESTIMATORS[name](scores, response_mask, cfg, scored)


__all__ = ["ADVANTAGE_ESTIMATORS", "GROUPED", "PER_COMPONENT", "check_reward", "estimate", "names",
           "register_advantage"]
