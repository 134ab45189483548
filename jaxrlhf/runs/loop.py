"""The one training loop every algorithm runs through: a short loop and its hooks.

`run_phase` drives `step(state, batch, rng) -> (state, metrics)` for a number of steps:
it restores the phase's newest checkpoint that restores (with the data position; a
damaged newer one is moved aside), then for each step takes a batch from its `Batches`,
runs the step with the RNG folded with the step, adds the step's timings to its metrics,
and calls its hooks (`runs.hooks` lists the moments and their order). The hooks do all the
rest (`runs.loop_hooks`): the health monitor (a NaN stops the run before anything is
saved), the update guard (`runs.health`: a state that is not finite or whose parameters'
norm jumped stops the run before it is saved), periodic evaluation, early stopping on a
held-out metric (`runs.stopping`, optionally ending with the best evaluation's
parameters), metrics to `metrics.jsonl` and TensorBoard with the log cut back to the
restored step and a tqdm bar, checkpoints every N steps and/or every N seconds with a
keep policy, and SIGTERM (preemption) saving a checkpoint before a clean exit: one that
comes anywhere in the phase (its restore, a step, an evaluation, a save, the last save)
stops it after the step in progress, saved. A Ctrl-C waits at most `SAVE_WAIT_S` for a
checkpoint save in flight. A user's hooks (`train.hooks`, `hooks=`) come after the checks,
the evaluation and early stopping, before the row is written and the step saved.

In a multi-process job every process runs the loop in lockstep (steps, evaluations and
checkpoint saves are collective): metrics are read replicated, only process 0 writes them,
and a stop request (SIGTERM, `should_stop`) or a time-based save seen by any process is
taken by all of them at the same step.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from pathlib import Path
from typing import Any, Callable, Protocol

import jax

from jaxrlhf import exits
from jaxrlhf.algorithms import timing
from jaxrlhf.monitor import HealthMonitor
from jaxrlhf.parallel import distributed
from jaxrlhf.rollout.buckets import CompileCounter
from jaxrlhf.runs.checkpointing import Checkpointer
from jaxrlhf.runs.hooks import Context, Hook, as_user_hook
from jaxrlhf.runs.loop_hooks import (SAVE_WAIT_S, CheckMetrics, Checkpoints, Evaluate, GuardUpdates, Preemption,
                                     StopEarly, WriteMetrics)
from jaxrlhf.runs.metrics import MetricsWriter, to_python
from jaxrlhf.runs.stopping import EarlyStop

log = logging.getLogger("jaxrlhf")


class Preempted(exits.Stopped):
    """Raised after a SIGTERM-triggered checkpoint: exit code 0, the run resumes later."""

    def __init__(self, step: int):
        super().__init__("SIGTERM")
        self.step = step


class Batches(Protocol):
    """A resumable batch source: the loop's one input, and the seam where another source
    plugs in without touching the loop (`jaxrlhf.data.BatchIterator` wrapped with the
    arrays today; the buffer of a sampler running ahead of the trainer later).

    `next_batch()`: this process's rows of the next batch, on the host or on the devices,
    whatever the step takes. `position`: JSON that says where the source is, saved in each
    checkpoint's meta just after the step that took the last batch; `restore(position)`
    puts a new source there when the phase resumes, so that the resumed run takes the
    batches an uninterrupted one would have. A source whose batches depend on the
    trainer's state (an asynchronous sampler) must record in its position what it needs
    to make them again, or say in its documentation that resuming is not exact. A source
    that is also a `hooks.Hook` (`runs.pipeline.Pipeline`: it needs the first state, the
    new states and the checkpoints) joins the hooks after early stopping, before the user's.
    """

    def next_batch(self) -> Any: ...

    @property
    def position(self) -> dict: ...

    def restore(self, position: dict) -> None: ...


class ArrayBatches:
    """Rows of a dict of whole-set arrays, in the order of a `BatchIterator`."""

    def __init__(self, arrays: dict, iterator):
        self.arrays = arrays
        self.iterator = iterator

    def next_batch(self):
        idx = next(self.iterator)
        return {k: v[idx] for k, v in self.arrays.items()}

    @property
    def position(self) -> dict:
        return dict(self.iterator.position)

    def restore(self, position: dict) -> None:
        self.iterator.restore(position)


@dataclasses.dataclass
class PhaseConfig:
    name: str
    num_steps: int
    log_every: int = 10
    eval_every: int = 0
    checkpoint_every: int = 100
    keep_checkpoints: int = 2
    max_param_norm_change: float | None = None  # relative bound per update (`health.UpdateGuard`), None = none
    progress: bool = True
    show: tuple[str, ...] = ("loss",)  # metric names shown on the progress bar
    checkpoint_every_s: float | None = None  # also save when this many seconds passed since the last save
    hooks: tuple = ()  # the user's hooks (`hooks.load_hooks(train.hooks)`), `runs.hooks` says when they run


def run_phase(
    phase: PhaseConfig,
    *,
    workdir: str | Path,
    state: Any,
    step_fn: Callable[[Any, Any, jax.Array], tuple[Any, dict]],
    batches: Batches,
    rng: jax.Array,
    writer: MetricsWriter,
    monitor: HealthMonitor | None = None,
    eval_fn: Callable[[Any], dict] | None = None,
    extra_meta: Callable[[Any], dict] | None = None,
    should_stop: Callable[[int], bool] | None = None,
    early_stop: EarlyStop | None = None,
    params_of: Callable[[Any], Any] | None = None,
    with_params: Callable[[Any, Any], Any] | None = None,
    hooks: tuple = (),
    clock: Callable[[], float] = time.monotonic,
) -> tuple[Any, dict]:
    """Run (or resume) a phase; returns `(state, last_metrics)`.

    Checkpoints go to `workdir/<phase.name>/`; a phase whose final checkpoint exists is
    restored and not re-run. A phase resumes from its newest checkpoint that restores and
    holds a finite state (`Checkpointer.restore_newest`), and before it runs cuts the log
    back to that step (`MetricsWriter.start_phase`): the metrics of an interrupted and
    resumed run equal an uninterrupted run's. `should_stop(step)` lets a caller interrupt
    the run like a SIGTERM (tests use it to check that resuming equals an uninterrupted run).
    A checkpoint is saved every `phase.checkpoint_every` steps and, with
    `phase.checkpoint_every_s` set, whenever that many seconds of `clock()` passed since
    the last save (or the phase's start); the newest `phase.keep_checkpoints` are kept.

    After every update the new state is checked before it can be saved (`health.UpdateGuard`):
    a floating leaf that is not finite, or a change of the global norm of `params_of(state)`
    (default: the whole state) beyond `phase.max_param_norm_change` times its value, raises
    `UnhealthyUpdateError` naming the phase, step and reason; the checkpoints saved before
    are kept.

    `early_stop` (a `stopping.EarlyStop`) reads each evaluation: the phase ends early, as a
    finished phase (final checkpoint saved, its meta's `stopped_early_at` keeps a rerun from
    re-running it), after `patience` evaluations without a new best. The starting state is
    evaluated first (step 0; `early_stop.start_evaluation` when the caller has it) and is a
    candidate like the periodic ones. With `keep_best` the
    phase ends with the parameters of the best evaluation: `params_of(state)` (the trained
    policy's parameters, not the optimizer state) is copied on the device at each new best
    — one more copy of those parameters in device memory, with their shardings — saved as
    the checkpoints' `best` item so a resumed run keeps the same ones, and put back with
    `with_params(state, best)` before the final save. Its state is in every checkpoint's
    meta; the final metrics row adds `early_stop/best_step` and `early_stop/best_value`.

    `hooks`: the user's hooks (`runs.hooks`), called after `phase.hooks`, both after the
    built-in checks, evaluation and early stopping and before the metrics row is written
    and the step saved; what one raises stops the phase with a `HookError` naming it.

    Every step's metrics get `time/step_s` and `time/compiles`; the phase ends with a log
    line of where its time went (`TimeSplit`: the means of the steps' `time/*` metrics over
    the steps that compiled nothing).
    """
    if early_stop is not None:
        if eval_fn is None or not phase.eval_every:
            raise ValueError(f"{phase.name}: stopping on eval/{early_stop.metric} (train.stop_metric) needs a "
                             "periodic held-out evaluation (train.eval_every > 0)")
        if early_stop.keep_best and (params_of is None or with_params is None):
            raise ValueError(f"{phase.name}: keep_best needs params_of and with_params")
    guard = GuardUpdates(phase.name, params_of or (lambda whole: whole), phase.max_param_norm_change)
    ckpt = Checkpointer(Path(workdir) / phase.name, max_to_keep=phase.keep_checkpoints)
    checkpoints = Checkpoints(ckpt, every=phase.checkpoint_every, every_s=phase.checkpoint_every_s,
                              check=guard.restorable, extra_meta=extra_meta, clock=clock)
    preemption = Preemption(should_stop)
    # The order of `runs.hooks`: the checks, the evaluation and early stopping, the user's hooks,
    # then the row written, the stop decision and the checkpoint (with every hook's meta).
    ctx = Context(phase=phase, workdir=Path(workdir), writer=writer, checkpointer=ckpt, batches=batches, state=state,
                  hooks=(CheckMetrics(monitor), guard, Evaluate(eval_fn, phase.eval_every),
                         *([StopEarly(early_stop, eval_fn, params_of, with_params)] if early_stop is not None else []),
                         *([batches] if isinstance(batches, Hook) else []),
                         *(as_user_hook(h) for h in (*phase.hooks, *hooks)), WriteMetrics(), preemption, checkpoints))
    last: dict = {}
    where_time_goes = TimeSplit()
    error = None
    # From here to the phase's last save, a SIGTERM (in its restore, a step, an evaluation, a
    # save) is a flag: the phase stops after the step in progress, saved, or after its final save.
    preemption.install()
    try:  # every hook's on_end (the checkpointer closed) on every way out, a failed restore included
        checkpoints.resume(ctx)
        ctx.emit("on_start")
        for step in range(ctx.start, ctx.end):
            exits.raise_if_interrupted()  # a Ctrl-C that the previous step's save swallowed
            t0 = time.perf_counter()
            batch = batches.next_batch()
            with CompileCounter() as compiles:
                ctx.state, metrics = step_fn(ctx.state, batch, jax.random.fold_in(rng, step))
                metrics = to_python(distributed.gather(metrics))
            metrics[timing.STEP_S] = time.perf_counter() - t0
            metrics[timing.COMPILES] = compiles.count  # XLA compilations of this step: 0 after the first
            where_time_goes.add(metrics)
            ctx.step = step + 1
            ctx.finished = ctx.step == phase.num_steps
            for hook in ctx.hooks:  # checks, evaluation, early stop, the user's, metrics, checkpoint
                hook.on_step(ctx, ctx.step, ctx.state, metrics)
            last = metrics
            if ctx.finished:
                break
            if ctx.stopping:
                ckpt.wait()
                raise Preempted(ctx.step)
        exits.raise_if_interrupted()  # one the last save swallowed
    except BaseException as e:
        error = e
        raise
    finally:
        ctx.end_phase(error)
    if distributed.any_process(preemption.raised):  # after the last step's save: it is written
        raise Preempted(ctx.saved or ctx.start)
    if where_time_goes.steps:
        log.info("%s: %s", phase.name, where_time_goes.describe())
    return ctx.state, last


class TimeSplit:
    """Sums of the steps' `time/*` metrics over the steps that compiled nothing (a first
    step's compilation would swamp them), for the phase's closing log line."""

    def __init__(self):
        self.steps, self.sums, self.tokens = 0, {}, 0.0

    def add(self, metrics: dict) -> None:
        if metrics.get(timing.COMPILES):
            return
        self.steps += 1
        for name in (timing.STEP_S, *timing.PARTS, timing.HOST_REWARD_S):
            if name in metrics:
                self.sums[name] = self.sums.get(name, 0.0) + metrics[name]
        if timing.TOKENS_PER_S in metrics:
            self.tokens += metrics[timing.TOKENS_PER_S] * metrics[timing.ROLLOUT_S]

    def describe(self) -> str:
        """E.g. `time per step 0.120 s (mean of 99 steps without compilation): rollout 0.050 s
        (42%), scoring 0.020 s (17%), update 0.045 s (38%); 5,120 generated tokens/s`."""
        mean = {k: v / self.steps for k, v in self.sums.items()}
        step = mean[timing.STEP_S]
        text = f"time per step {step:.3f} s (mean of {self.steps} steps without compilation)"
        parts = [(k.split("/")[1][:-2], mean[k]) for k in (*timing.PARTS, timing.HOST_REWARD_S) if k in mean]
        if parts:
            text += ": " + ", ".join(f"{name} {s:.3f} s ({s / step:.0%})" for name, s in parts)
        if timing.ROLLOUT_S in self.sums:
            text += f"; {self.tokens / max(self.sums[timing.ROLLOUT_S], 1e-9):,.0f} generated tokens/s"
        return text


__all__ = ["ArrayBatches", "Batches", "PhaseConfig", "Preempted", "SAVE_WAIT_S", "TimeSplit", "run_phase"]
