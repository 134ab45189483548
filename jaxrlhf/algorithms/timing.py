"""Where an RL step's time goes (docs/concepts.md#what-a-run-shows): the metric names, and
the step run as three timed programs.

An RL step is `rollout` (sampling), `score` (the reward and the forward passes the update
needs: old / reference log-probs, values, advantages) and `train` (the gradient steps).
Compiled as one program (`Split.fused`) nothing in between can be timed; run as three
jitted programs back to back (`run_split`), each waited for, the step reports

- `time/rollout_s`: sampling;
- `time/scoring_s`: everything between sampling and the gradient steps, a host (Python)
  reward included, whose own share is `time/host_reward_s`;
- `time/update_s`: the gradient steps;
- `time/tokens_per_s`: generated (valid) response tokens / rollout seconds;
- `time/step_tokens_per_s`: the same tokens / the three parts' seconds together.

The training loop (`runs.loop`) adds `time/step_s` (the whole step with the batch and the
metrics' read-back) and `time/compiles`; DPO, SFT and the reward model report
`time/update_s` alone (their step is one update).
"""

from __future__ import annotations

import time
from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp

ROLLOUT_S = "time/rollout_s"
SCORING_S = "time/scoring_s"
UPDATE_S = "time/update_s"
HOST_REWARD_S = "time/host_reward_s"
TOKENS_PER_S = "time/tokens_per_s"
STEP_TOKENS_PER_S = "time/step_tokens_per_s"
STEP_S = "time/step_s"
COMPILES = "time/compiles"

PARTS = (ROLLOUT_S, SCORING_S, UPDATE_S)  # they add up to the RL step's time (without the loop's)
RL_STEP = (*PARTS, TOKENS_PER_S, STEP_TOKENS_PER_S)  # what every timed RL step reports


class Split(NamedTuple):
    """An RL step as three pure functions (not jitted; the caller jits them, with its
    shardings and donation):

    rollout: `(state, prompt_ids, prompt_mask, rng) -> (SampleOutput, tokens)`, `tokens` the
      number of valid response tokens sampled (a scalar; `count_tokens` adds it).
    score: `(state, out, extras, host_scores, rng) -> (prepared, metrics)`: the reward's JAX
      components on `out` given the prompts' `extras` (`[B, ...]` arrays), with the host
      components' `host_scores` (`{name: [N]}`, `{}` when there are none), then everything
      the update needs; `prepared` is what `train` takes.
    train: `(state, prepared, rng) -> (state, metrics)`: the gradient steps. Its metrics
      win over `score`'s where both name one (e.g. `finite` over the whole step).
    """

    rollout: Callable
    score: Callable
    train: Callable

    def fused(self, state, prompt_ids, prompt_mask, extras, rng) -> tuple[Any, dict]:
        """The three parts composed, for one program (`jax.jit(split.fused)`): the same
        state and metrics as `run_split`, without the times."""
        out, _ = self.rollout(state, prompt_ids, prompt_mask, rng)
        prepared, m_score = self.score(state, out, extras, {}, rng)
        state, m_train = self.train(state, prepared, rng)
        return state, {**m_score, **m_train}


def count_tokens(sample: Callable) -> Callable:
    """`sample(...) -> SampleOutput` made to return `(out, tokens)` too: the valid response
    tokens, counted inside the rollout program (no extra device call to read them)."""
    def rollout(*args):
        out = sample(*args)
        return out, jnp.sum(out.response_mask, dtype=jnp.int32)
    return rollout


def split_metrics(rollout_s: float, scoring_s: float, update_s: float, tokens: float) -> dict:
    """The time split's metrics from its three durations (seconds) and the valid response
    tokens the rollout generated."""
    total = rollout_s + scoring_s + update_s
    return {ROLLOUT_S: rollout_s, SCORING_S: scoring_s, UPDATE_S: update_s,
            TOKENS_PER_S: tokens / max(rollout_s, 1e-9), STEP_TOKENS_PER_S: tokens / max(total, 1e-9)}


def run_split(rollout: Callable, score: Callable, train: Callable, state, prompt_ids, prompt_mask, extras, rng, *,
              host: Callable | None = None, cut: Callable | None = None) -> tuple[Any, dict]:
    """One RL step as three jitted programs (a `Split`'s parts, jitted by the caller), each
    waited for before the next starts, so that their wall-clock times are theirs.

    `host(out) -> {name: [N]}` scores the responses on the host (a Python reward) between
    the rollout and `score`; its time is `time/host_reward_s`, inside `time/scoring_s`.
    `cut(out) -> out` edits the responses on the host before they are scored (stop
    strings, `rollout.stop_strings`); its time is inside `time/scoring_s` too.
    Returns `(state, {**score metrics, **train metrics, **split_metrics(...)})`.
    """
    t0 = time.perf_counter()
    out, tokens = jax.block_until_ready(rollout(state, prompt_ids, prompt_mask, rng))
    t1 = time.perf_counter()
    extra = {}
    host_scores = {}
    if cut is not None:
        out = cut(out)
    if host is not None:
        host_scores = host(out)
        extra[HOST_REWARD_S] = time.perf_counter() - t1
    prepared, m_score = jax.block_until_ready(score(state, out, extras, host_scores, rng))
    t2 = time.perf_counter()
    state, m_train = jax.block_until_ready(train(state, prepared, rng))
    t3 = time.perf_counter()
    tokens = float(jax.device_get(tokens.addressable_data(0)))  # a scalar: the same on every process
    return state, {**m_score, **m_train, **extra, **split_metrics(t1 - t0, t2 - t1, t3 - t2, tokens)}


__all__ = ["COMPILES", "HOST_REWARD_S", "PARTS", "RL_STEP", "ROLLOUT_S", "SCORING_S", "STEP_S",
           "STEP_TOKENS_PER_S", "Split", "TOKENS_PER_S", "UPDATE_S", "count_tokens", "run_split", "split_metrics"]