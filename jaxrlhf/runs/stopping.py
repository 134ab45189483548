"""Stopping a phase on a held-out metric, and keeping its best parameters.

With a learned reward, the score a phase optimises can rise while the true held-out
metric (`eval/accuracy`) falls. `EarlyStop` watches one metric of the phase's periodic
evaluation (`train.eval_every`): it records the best value and its step, stops the phase
after `patience` evaluations in a row without a new best, and with `keep_best` makes the
phase end with the parameters of its best evaluation instead of the last ones.
`loop.run_phase` drives it and saves its state in every checkpoint, so a resumed run
stops at the same step and keeps the same parameters as an uninterrupted one.

`from_config(config, sampled)` reads `config.train.stop_*` / `keep_best`, checks them
against the phases of the run and the names their evaluations report (before any work),
and returns one `EarlyStop` per phase it applies to.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax
import jax.numpy as jnp

from jaxrlhf.runs import registry

MODES = ("max", "min")


@dataclasses.dataclass
class EarlyStop:
    """The rule (`metric`, `patience`, `min_delta`, `mode`, `keep_best`) and what it has seen.

    `metric`: a name of the phase's evaluation, without the `eval/` prefix. An evaluation
    is a new best when it beats the best so far by more than `min_delta` (higher for
    `mode="max"`, lower for "min"); a tie is not, so the earlier step is kept. The phase
    stops after `patience` evaluations in a row without a new best (0: never; the best is
    still recorded). `keep_best`: the phase ends with the parameters of the best
    evaluation (`loop.run_phase` keeps a device copy of them). `start_evaluation`: the
    evaluation of the phase's starting parameters when the caller already has it (the
    summary table's row before the phase), which `run_phase` then takes as step 0's
    instead of evaluating the same parameters again.
    """

    metric: str
    patience: int = 0
    min_delta: float = 0.0
    mode: str = "max"
    keep_best: bool = False
    best_value: float | None = None
    best_step: int | None = None
    evals_since_best: int = 0
    stopped_at: int | None = None
    start_evaluation: dict | None = dataclasses.field(default=None, repr=False)

    def __post_init__(self):
        if not self.metric:
            raise ValueError("EarlyStop needs a metric name (train.stop_metric)")
        if self.mode not in MODES:
            raise ValueError(f"train.stop_mode={self.mode!r}: expected one of {MODES}")
        if isinstance(self.patience, bool) or not isinstance(self.patience, int) or self.patience < 0:
            raise ValueError(f"train.stop_patience={self.patience!r}: expected an integer >= 0 (0 = never stop)")
        if not self.min_delta >= 0:
            raise ValueError(f"train.stop_min_delta={self.min_delta!r}: expected a number >= 0")

    def update(self, step: int, evaluation: dict) -> bool:
        """Record the evaluation at `step`; True when it is a new best. A NaN is never one."""
        if self.metric not in evaluation:
            raise ValueError(f"train.stop_metric={self.metric!r} is not among the evaluation's metrics "
                             f"{sorted(evaluation)} (names without the 'eval/' prefix)")
        value = float(evaluation[self.metric])
        sign = 1.0 if self.mode == "max" else -1.0
        better = math.isfinite(value) and (
            self.best_value is None or sign * (value - self.best_value) > self.min_delta)
        if better:
            self.best_value, self.best_step, self.evals_since_best = value, int(step), 0
        else:
            self.evals_since_best += 1
        return better

    @property
    def should_stop(self) -> bool:
        return self.patience > 0 and self.evals_since_best >= self.patience

    def state_dict(self) -> dict:
        """What a checkpoint's meta records (JSON)."""
        return dict(metric=self.metric, mode=self.mode, best_value=self.best_value, best_step=self.best_step,
                    evals_since_best=self.evals_since_best, stopped_at=self.stopped_at)

    def load_state_dict(self, d: dict | None) -> bool:
        """Take up what a checkpoint recorded; False (nothing taken) when it watched another
        metric or direction, or recorded nothing."""
        if not d or d.get("metric") != self.metric or d.get("mode") != self.mode:
            return False
        self.best_value, self.best_step = d["best_value"], d["best_step"]
        self.evals_since_best, self.stopped_at = int(d["evals_since_best"]), d["stopped_at"]
        return True

    def forget_best(self) -> None:
        self.best_value, self.best_step, self.evals_since_best = None, None, 0

    def report(self) -> dict:
        """For `summary.json`: the metric, the best step and value, where the phase stopped
        early (None: it ran all its steps) and whether the best parameters were kept."""
        return dict(metric=self.metric, mode=self.mode, best_step=self.best_step, best_value=self.best_value,
                    stopped_early_at=self.stopped_at, keep_best=self.keep_best)

    def describe(self, phase: str) -> str:
        if self.best_step is None:
            return f"{phase}: no evaluation of eval/{self.metric} yet"
        text = f"{phase}: best eval/{self.metric} {self.best_value:.4g} at step {self.best_step}"
        if self.stopped_at is not None:
            text += f"; stopped early at step {self.stopped_at} ({self.patience} evaluations without a new best)"
        if self.keep_best:
            text += f"; kept the parameters of step {self.best_step}"
        return text


def copy_params(params: Any) -> Any:
    """A device copy with the same shardings (new buffers, so a donating step cannot free it)."""
    return jax.tree.map(jnp.copy, params)


def task_metric_names(sampled=None) -> set[str]:
    """The names (without `eval/`) of the task's held-out evaluation
    (`held_out.make_accuracy_fn`): accuracy, reward and the sampled metrics."""
    names = {"accuracy", "reward"}
    if sampled is not None:
        names |= {f"mean@{sampled.num_samples}", *(f"{m}@{k}" for m in ("pass", "maj") for k in sampled.ks)}
    return names


def eval_metric_names(config, phase: str, sampled=None) -> set[str]:
    """The names (without `eval/`) phase `phase`'s periodic evaluation reports: its
    registered `eval_metrics`, or the task's held-out metrics (`task_metric_names`)."""
    spec = registry.PHASES[phase]
    return task_metric_names(sampled) if spec.eval_metrics is None else spec.eval_metrics(config, sampled)


def from_config(config, sampled=None) -> dict[str, EarlyStop]:
    """`{phase: EarlyStop}` from `config.train` (`stop_metric`, `stop_mode`, `stop_patience`,
    `stop_min_delta`, `stop_phases`, `keep_best`); empty when `stop_metric` is None (off).
    Checked before any work: a rule needs a periodic evaluation (`eval_every` > 0), phases
    this run has, and a metric each of them reports. Errors name the field."""
    t = config.train
    metric, phases = t.get("stop_metric"), t.get("stop_phases")
    if metric is None:
        for field, off in (("stop_patience", 0), ("keep_best", False), ("stop_phases", None)):
            if t.get(field, off) != off:
                raise ValueError(f"train.{field}={t.get(field)!r} needs train.stop_metric: the held-out metric to "
                                 "watch, e.g. 'accuracy'")
        return {}
    if t.eval_every <= 0:
        raise ValueError(f"train.stop_metric={metric!r} needs a periodic held-out evaluation: set "
                         f"train.eval_every > 0 (it is {t.eval_every}), or turn the rule off with "
                         "train.stop_metric=None train.stop_patience=0 train.keep_best=False")
    if metric.startswith("eval/"):
        raise ValueError(f"train.stop_metric={metric!r}: name the metric without the 'eval/' prefix, "
                         f"e.g. {metric[5:]!r}")
    available = registry.plan(config)
    names = tuple(x for x in (phases or "").replace(" ", "").split(",") if x) or (config.algorithm,)
    for name in names:
        if name not in available:
            raise ValueError(f"train.stop_phases={phases!r}: {name!r} is not a phase of this run; its phases "
                             f"are {', '.join(available)}")
        metrics = eval_metric_names(config, name, sampled)
        if metric not in metrics:
            raise ValueError(f"train.stop_metric={metric!r} is not a metric of the {name} phase's evaluation; "
                             f"it reports {', '.join(sorted(metrics))}")
    rule = dict(metric=metric, mode=t.stop_mode, patience=t.stop_patience, min_delta=float(t.stop_min_delta),
                keep_best=bool(t.keep_best))
    return {name: EarlyStop(**rule) for name in names}
