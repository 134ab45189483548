"""Training-health monitor (docs/concepts.md#what-a-run-shows): the known failure
signatures of RLHF-PPO/GRPO runs, checked on the per-step metric dicts the algorithms return.

    monitor = HealthMonitor(MonitorConfig(kl_target=6.0, clip=0.2))
    for step in range(num_steps):
        state, metrics = iteration(state, prompts, mask, rng)
        warnings = monitor.check(metrics, step)   # raises NonFiniteError on NaN/Inf
        if step % save_every == 0:
            save(state)                           # only reached with finite metrics

Warnings are logged (`logging.getLogger("jaxrlhf.monitor")`, WARNING) and returned as
strings that start with their code in brackets:

- `[kl]`         KL to the reference above `kl_factor` × target (policy drifting away;
                 raise β or lower the learning rate).
- `[clipfrac]`   clip fraction above `clipfrac_max` for `clipfrac_patience` consecutive
                 steps (updates too large: lower lr, epochs or clip range).
- `[first_ratio]` at the first minibatch of the first epoch the policy has not moved yet,
                 so the ratio must be 1: a ratio beyond `[1/(1+k·ε), 1+k·ε]` or an
                 approx KL above `first_approx_kl_max` means the old log-probs do not
                 match the trainer's forward pass (wrong shift, temperature, padding,
                 dtype, or log-probs taken from another engine).
- `[sampler_logp]` the sampler's own log-probs differ from the trainer's recomputation by
                 more than `sampler_logp_diff_max` nats (diagnostic of the same).
- `[value_loss]` value loss above `value_loss_factor` × its running median (critic
                 diverging; lower its lr or use value clipping).
- `[length_hacking]` over the last `length_window` steps the reward rose while the mean
                 response length grew by more than `length_growth` (relative): the policy
                 may be exploiting a length bias of the reward.

Any NaN/Inf among the metrics (or `finite == False`) raises `NonFiniteError`: the train
loop must catch it before writing a checkpoint (and stop, or restore the last good one).
A check whose metric is absent from the dict is skipped (GRPO has no critic, no value
loss). PPO and GRPO share one metric scheme (docs/concepts.md#metric-names), so the
checks read the same names in both, except the KL and the sampler gap, which each
measures its own way; `MonitorConfig.for_algorithm("grpo")` (or "ppo") reads that
algorithm's (`METRIC_KEYS`), so that every check can fire.
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import math
import statistics
from typing import Any, Mapping

import numpy as np

from jaxrlhf.options import check, option

logger = logging.getLogger("jaxrlhf.monitor")


class NonFiniteError(FloatingPointError):
    """A metric was NaN/Inf (or the step reported non-finite gradients).

    Attributes: `step`, `keys` (the offending metric names).
    """

    def __init__(self, step: int | None, keys: list[str]):
        self.step = step
        self.keys = list(keys)
        super().__init__(f"non-finite training metrics at step {step}: {', '.join(self.keys)} — "
                         f"stop before writing a checkpoint")


@dataclasses.dataclass(frozen=True)
class MonitorConfig:
    """Thresholds of the health checks, each field's doc and bounds on the field; the
    metric names each check reads (`*_key`, and `clip`) are the algorithm's
    (`for_algorithm`), not options."""

    kl_target: float | None = option(None, "warn when the KL to the reference passes kl_factor × this (GRPO: the "
                                     "per-token mean, nats; PPO: nats per response, and PPO's ppo.kl_target when "
                                     "None); None: no KL check. For GRPO with β = 0 a target keeps the reference "
                                     "model to measure the KL (grpo.track_kl)", above=0)
    kl_factor: float = option(3.0, "how far past kl_target the KL may go before a warning", above=0)
    kl_key: str = option("kl/seq", "the KL metric (PPO: nats per response, what the controller targets)", cli=False)
    clipfrac_max: float = option(0.3, "warn when the clip fraction stays above this (0.1–0.2 is usual)", min=0)
    clipfrac_patience: int = option(5, "for this many steps in a row (repeated every as many more)", min=1)
    clip: float = option(0.2, "the clip ε, scaling the first-minibatch ratio bound", above=0, cli=False)
    first_ratio_factor: float = option(10.0, "the first minibatch's ratio must stay in [1/(1 + f·ε), 1 + f·ε] (1 ± "
                                       "1e-6 in a healthy run: the policy has not moved yet)", above=0)
    first_approx_kl_max: float = option(1e-3, "nats per token of approx_kl at the first minibatch", min=0)
    sampler_logp_diff_max: float = option(1.0, "nats, max |sampler logp − trainer logp| over tokens", min=0)
    mismatch_kl_max: float = option(0.05, "nats per token: warn when mismatch_kl (the k3 estimate of KL(sampler ‖ "
                                    "proximal policy) on the sampled tokens, `algorithms.offpolicy`) passes this: the "
                                    "samples are too stale for the step size, or the sampler drifted from the trainer",
                                    min=0)
    value_loss_factor: float = option(10.0, "warn when the value loss passes this × its running median", above=0)
    value_loss_window: int = option(20, "steps of that running median", min=1)
    value_loss_min_history: int = option(5, "steps known before the value-loss check starts", min=1)
    length_window: int = option(10, "steps over which the length-hacking check compares its first and last thirds",
                                min=3)
    length_growth: float = option(0.5, "warn when over the window the mean response length grew by more than this "
                                  "fraction while the reward rose", min=0)
    reward_rise: float = option(0.0, "the score must rise by more than this (absolute) too (0: any rise)", min=0)
    score_key: str = option("reward/mean", "the score metric of the length-hacking check", cli=False)
    length_key: str = option("response_length/mean", "the length metric of the length-hacking check", cli=False)
    clipfrac_key: str = option("clipfrac", "the clip-fraction metric", cli=False)
    first_ratio_max_key: str = option("first/ratio_max", "the first minibatch's largest ratio", cli=False)
    first_ratio_min_key: str = option("first/ratio_min", "the first minibatch's smallest ratio", cli=False)
    first_approx_kl_key: str = option("first/approx_kl", "the first minibatch's approx_kl", cli=False)
    sampler_logp_key: str = option("sampler_logp_diff_max", "the sampler/trainer log-prob gap", cli=False)
    value_loss_key: str = option("value_loss", "the value loss", cli=False)
    mismatch_kl_key: str = option("mismatch_kl", "the sampler/proximal-policy KL", cli=False)

    @classmethod
    def for_algorithm(cls, name: str, **thresholds) -> "MonitorConfig":
        """The thresholds given, with the metric names of algorithm `name` (`METRIC_KEYS`)."""
        if name not in METRIC_KEYS:
            raise ValueError(f"MonitorConfig.for_algorithm: {name!r}; expected one of {sorted(METRIC_KEYS)}")
        return cls(**{**METRIC_KEYS[name], **thresholds})

    def __post_init__(self):
        check(self)


# The metrics whose names differ by algorithm (every other check reads `MonitorConfig`'s
# default, the same name in both): PPO's KL is nats per response (`kl/seq`, what its
# adaptive controller targets), GRPO's the per-token mean of its estimator against the
# reference (`kl/mean`, emitted when β > 0 or `track_kl`); PPO's sampler gap is taken at
# the rollout against the trainer's old log-probs (`sampler_logp_diff_max`), GRPO's
# against the policy of each update step, so it includes the update's own drift
# (`logp_mismatch`).
METRIC_KEYS = {
    "ppo": dict(kl_key="kl/seq", sampler_logp_key="sampler_logp_diff_max"),
    "grpo": dict(kl_key="kl/mean", sampler_logp_key="logp_mismatch"),
}


def _scalar(value: Any) -> float | None:
    try:
        arr = np.asarray(value)
    except Exception:  # not array-like (strings, objects): not a metric
        return None
    if arr.dtype.kind not in "biuf" or arr.size != 1:
        return None
    return float(arr.reshape(()))


class HealthMonitor:
    """Stateful checker over a stream of per-step metric dicts (pure Python, host side)."""

    def __init__(self, config: MonitorConfig = MonitorConfig(), log: logging.Logger | None = None):
        self.config = config
        self.log = log or logger
        self._clip_streak = 0
        self._value_losses: collections.deque[float] = collections.deque(maxlen=config.value_loss_window)
        self._scores: collections.deque[float] = collections.deque(maxlen=config.length_window)
        self._lengths: collections.deque[float] = collections.deque(maxlen=config.length_window)
        self._steps = 0

    def check(self, metrics: Mapping[str, Any], step: int | None = None) -> list[str]:
        """Checks one step's metrics. Returns the warnings (also logged); raises
        `NonFiniteError` if any metric is NaN/Inf or `metrics["finite"]` is False."""
        step = self._steps if step is None else step
        self._steps += 1
        values = {k: v for k, v in ((k, _scalar(v)) for k, v in metrics.items()) if v is not None}
        bad = sorted(k for k, v in values.items() if not math.isfinite(v))
        if "finite" in values and math.isfinite(values["finite"]) and not values["finite"]:
            bad.append("finite=False (non-finite gradients; the update was skipped)")
        if bad:
            raise NonFiniteError(step, bad)

        c = self.config
        out: list[str] = []
        get = values.get

        kl = get(c.kl_key)
        if c.kl_target is not None and kl is not None and kl > c.kl_factor * c.kl_target:
            out.append(f"[kl] step {step}: {c.kl_key} = {kl:.4g} is more than {c.kl_factor:g}× the target "
                       f"{c.kl_target:g}: the policy is drifting from the reference (raise β / lower lr)")

        clipfrac = get(c.clipfrac_key)
        if clipfrac is not None:
            self._clip_streak = self._clip_streak + 1 if clipfrac > c.clipfrac_max else 0
            n = self._clip_streak
            if n >= c.clipfrac_patience and (n - c.clipfrac_patience) % c.clipfrac_patience == 0:
                out.append(f"[clipfrac] step {step}: clip fraction {clipfrac:.3f} > {c.clipfrac_max:g} for {n} "
                           f"consecutive steps: updates are too large (lower lr / epochs)")

        hi = 1.0 + c.first_ratio_factor * c.clip
        r_max, r_min = get(c.first_ratio_max_key), get(c.first_ratio_min_key)
        fkl = get(c.first_approx_kl_key)
        if (r_max is not None and r_max > hi) or (r_min is not None and r_min < 1.0 / hi) or (
                fkl is not None and fkl > c.first_approx_kl_max):
            out.append(f"[first_ratio] step {step}: at the first minibatch ratio in [{r_min}, {r_max}], "
                       f"approx_kl {fkl} (expected 1 and 0): old log-probs do not match the trainer's "
                       f"forward pass (shift, temperature, padding, dtype or another engine's log-probs)")

        diff = get(c.sampler_logp_key)
        if diff is not None and diff > c.sampler_logp_diff_max:
            out.append(f"[sampler_logp] step {step}: sampler and trainer log-probs differ by up to {diff:.3g} "
                       f"nats (> {c.sampler_logp_diff_max:g})")

        mkl = get(c.mismatch_kl_key)
        if mkl is not None and mkl > c.mismatch_kl_max:
            out.append(f"[mismatch_kl] step {step}: {c.mismatch_kl_key} = {mkl:.3g} nats per token > "
                       f"{c.mismatch_kl_max:g}: the sampler's policy is far from the trained one (lower "
                       f"max_staleness or the learning rate, or turn on the importance-weight correction)")

        vl = get(c.value_loss_key)
        if vl is not None:
            if len(self._value_losses) >= c.value_loss_min_history:
                median = statistics.median(self._value_losses)
                if vl > c.value_loss_factor * max(median, 1e-12):
                    out.append(f"[value_loss] step {step}: value loss {vl:.4g} is more than "
                               f"{c.value_loss_factor:g}× its running median {median:.4g}: the critic is diverging")
            self._value_losses.append(vl)

        score, length = get(c.score_key), get(c.length_key)
        if score is not None and length is not None:
            self._scores.append(score)
            self._lengths.append(length)
            if len(self._lengths) == c.length_window:
                third = max(c.length_window // 3, 1)
                s0, s1 = np.mean(list(self._scores)[:third]), np.mean(list(self._scores)[-third:])
                l0, l1 = np.mean(list(self._lengths)[:third]), np.mean(list(self._lengths)[-third:])
                if s1 - s0 > c.reward_rise and l1 > (1.0 + c.length_growth) * max(l0, 1e-9):
                    out.append(f"[length_hacking] step {step}: over {c.length_window} steps the reward rose "
                               f"{s0:.4g} → {s1:.4g} while mean length grew {l0:.4g} → {l1:.4g} "
                               f"(+{(l1 / max(l0, 1e-9) - 1) * 100:.0f}%): the reward may favour length")

        for w in out:
            self.log.warning(w)
        return out
