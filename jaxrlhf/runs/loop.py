"""The one training loop every algorithm runs through.

`run_phase` drives `step(state, batch, rng) -> (state, metrics)` for a number of steps and
owns what a user expects around it: resume from the newest checkpoint of the phase that
restores (with the data position; a damaged newer one is moved aside), the log cut back to
that step, RNG folded with the step, a tqdm bar with live metrics, metrics to
`metrics.jsonl` and TensorBoard, the health monitor (a NaN stops the run before anything
is saved), the update guard (`runs.health`: a state that is not finite or whose
parameters' norm jumped stops the run before it is saved), periodic evaluation, early
stopping on a held-out metric (`runs.stopping`, optionally ending with the best
evaluation's parameters), and SIGTERM (preemption) saving a checkpoint before a clean exit:
one that comes anywhere in the phase (its restore, a step, an evaluation, a save, the last
save) stops it after the step in progress, saved. A Ctrl-C waits at most `SAVE_WAIT_S` for
a checkpoint save in flight.

In a multi-process job every process runs the loop in lockstep (steps, evaluations and
checkpoint saves are collective): metrics are read replicated, only process 0 writes them,
and a stop request (SIGTERM, `should_stop`) seen by any process stops all of them at the
same step.
"""

from __future__ import annotations

import dataclasses
import logging
import signal
import time
from pathlib import Path
from typing import Any, Callable, Protocol

import jax
import numpy as np
from tqdm.auto import tqdm

from jaxrlhf import exits
from jaxrlhf.algorithms import timing
from jaxrlhf.monitor import HealthMonitor, NonFiniteError
from jaxrlhf.parallel import distributed
from jaxrlhf.rollout.buckets import CompileCounter
from jaxrlhf.runs.checkpointing import Checkpointer
from jaxrlhf.runs.health import UpdateGuard
from jaxrlhf.runs.metrics import MetricsWriter, to_python
from jaxrlhf.runs.stopping import EarlyStop, copy_params

log = logging.getLogger("jaxrlhf")


# Seconds a Ctrl-C waits for a checkpoint save in flight before the run stops without it.
SAVE_WAIT_S = 20


class Preempted(exits.Stopped):
    """Raised after a SIGTERM-triggered checkpoint: exit code 0, the run resumes later."""

    def __init__(self, step: int):
        super().__init__("SIGTERM")
        self.step = step


class Batches(Protocol):
    """A resumable batch source (`jaxrlhf.data.BatchIterator` wrapped with the arrays)."""

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


class _SigtermFlag:
    """Turns SIGTERM into a flag the loop polls between steps (main thread only), from
    `install()` to `restore()` (the handler before is put back)."""

    def __init__(self):
        self.raised = False
        self._previous = None

    def install(self) -> "_SigtermFlag":
        try:
            self._previous = signal.signal(signal.SIGTERM, self._handle)
        except ValueError:  # not the main thread: leave signals alone
            self._previous = None
        return self

    def _handle(self, signum, frame):
        log.warning("SIGTERM received: saving a checkpoint after this step, then exiting")
        self.raised = True

    def restore(self) -> None:
        if self._previous is not None:
            signal.signal(signal.SIGTERM, self._previous)


def _resume(phase: PhaseConfig, ckpt: Checkpointer, state, batches: Batches, guard: UpdateGuard,
            early_stop: EarlyStop | None, params_of) -> tuple[int, Any, Any, int | None]:
    """`(start, state, best, stopped_at)` of a phase: its newest checkpoint that restores
    (`Checkpointer.restore_newest`: a damaged newer one is moved aside, and a state that is
    not finite does not count), with the data position and early-stopping state put back,
    or step 0 from `state`. `guard` reads the state the phase starts from."""
    if ckpt.latest_step() is None:
        guard.start(state)
        return 0, state, None, None

    def fit(restored):
        return None if guard.start(restored).state_finite else "the saved state holds values that are not finite"

    start, state, meta = ckpt.restore_newest(state, check=fit)
    batches.restore(meta["data"])
    best, stopped_at = None, meta.get("stopped_early_at")
    if stopped_at is not None:
        log.info("%s: stopped early at step %d of %d in an earlier run: not re-run", phase.name, stopped_at,
                 phase.num_steps)
    else:
        log.info("%s: resuming at step %d of %d", phase.name, start, phase.num_steps)
    if early_stop is not None and early_stop.load_state_dict(meta.get("early_stop")):
        if early_stop.keep_best and early_stop.best_step is not None and stopped_at is None \
                and start < phase.num_steps:
            if meta.get("best_saved"):
                best = ckpt.restore_best(params_of(state), start)
            else:  # the checkpoint was written without keep_best: the best so far is lost
                log.warning("%s: checkpoint %d holds no best parameters; the best restarts from here",
                            phase.name, start)
                early_stop.forget_best()
    return start, state, best, stopped_at


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
) -> tuple[Any, dict]:
    """Run (or resume) a phase; returns `(state, last_metrics)`.

    Checkpoints go to `workdir/<phase.name>/`; a phase whose final checkpoint exists is
    restored and not re-run. A phase resumes from its newest checkpoint that restores and
    holds a finite state (`Checkpointer.restore_newest`), and before it runs cuts the log
    back to that step (`MetricsWriter.start_phase`): the metrics of an interrupted and
    resumed run equal an uninterrupted run's. `should_stop(step)` lets a caller interrupt
    the run like a SIGTERM (tests use it to check that resuming equals an uninterrupted run).

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
    keep_best = early_stop is not None and early_stop.keep_best
    guard = UpdateGuard(phase.name, params_of or (lambda whole: whole), max_norm_change=phase.max_param_norm_change)
    ckpt = Checkpointer(Path(workdir) / phase.name, max_to_keep=phase.keep_checkpoints)
    bar = None
    # From here to the phase's last save, a SIGTERM (in its restore, a step, an evaluation, a
    # save) is a flag: the phase stops after the step in progress, saved, or after its final save.
    sigterm = _SigtermFlag().install()
    try:  # closes the checkpointer on every way out, a failed restore included
        start, state, best, stopped_at = _resume(phase, ckpt, state, batches, guard, early_stop, params_of)
        end = phase.num_steps if stopped_at is None else start  # an early-stopped phase is finished
        if start < end:
            writer.start_phase(phase.name, start)  # rows past the checkpoint go: the log of an uninterrupted run
        if early_stop is not None and start == 0 < end:
            # The starting point is a candidate too: with keep_best a phase that only makes the
            # held-out metric worse ends where it began. (The caller's own evaluation of these
            # parameters, when it has one with the metric: not computed twice.)
            seeded = early_stop.start_evaluation
            evaluation = seeded if seeded and early_stop.metric in seeded else to_python(eval_fn(state))
            if early_stop.update(0, evaluation) and keep_best:
                best = copy_params(params_of(state))
            log.info("%s: eval/%s at the start: %.4g", phase.name, early_stop.metric, evaluation[early_stop.metric])
        last: dict = {}
        saved = start or None  # the phase's newest checkpoint
        where_time_goes = TimeSplit()
        bar = tqdm(total=phase.num_steps, initial=start, desc=phase.name,
                   disable=not (phase.progress and writer.enabled), dynamic_ncols=True, mininterval=1.0)
        for step in range(start, end):
            exits.raise_if_interrupted()  # a Ctrl-C that the previous step's save swallowed
            t0 = time.perf_counter()
            batch = batches.next_batch()
            with CompileCounter() as compiles:
                state, metrics = step_fn(state, batch, jax.random.fold_in(rng, step))
                metrics = to_python(distributed.gather(metrics))
            metrics[timing.STEP_S] = time.perf_counter() - t0
            metrics[timing.COMPILES] = compiles.count  # XLA compilations of this step: 0 after the first
            where_time_goes.add(metrics)
            done = step + 1
            if monitor is not None:
                monitor.check(metrics, done)  # raises NonFiniteError before any save
            elif not all(np.isfinite(v) for v in metrics.values() if isinstance(v, float)):
                raise NonFiniteError(done, [k for k, v in metrics.items()
                                            if isinstance(v, float) and not np.isfinite(v)])
            # The metrics were computed before the update: the new state is checked itself.
            guard.check(state, done, last_saved=saved)  # raises UnhealthyUpdateError before any save
            finished = done == phase.num_steps
            if eval_fn is not None and phase.eval_every and (done % phase.eval_every == 0):
                evaluation = to_python(eval_fn(state))
                metrics.update({f"eval/{k}": v for k, v in evaluation.items()})
                if early_stop is not None:
                    # Every process sees the same (replicated) evaluation: the same decision.
                    if early_stop.update(done, evaluation) and keep_best:
                        best = copy_params(params_of(state))
                    if early_stop.should_stop and not finished:
                        finished, early_stop.stopped_at = True, done
                        log.info("%s: stopping early at step %d of %d: eval/%s has not improved on %.4g "
                                 "(step %d) for %d evaluations", phase.name, done, phase.num_steps,
                                 early_stop.metric, early_stop.best_value, early_stop.best_step,
                                 early_stop.evals_since_best)
            if finished and early_stop is not None and early_stop.best_step is not None:
                metrics.update({"early_stop/best_step": early_stop.best_step,
                                "early_stop/best_value": early_stop.best_value})
                if keep_best and early_stop.best_step != done:
                    state = with_params(state, best)
                    log.info("%s: ending with the parameters of step %d (eval/%s %.4g), not step %d's",
                             phase.name, early_stop.best_step, early_stop.metric, early_stop.best_value, done)
            if done % phase.log_every == 0 or finished:
                writer.write(done, metrics, phase=phase.name)
            bar.update(1)
            bar.set_postfix({k: f"{metrics[k]:.4g}" for k in phase.show if k in metrics}, refresh=False)
            last = metrics
            stop = distributed.any_process(sigterm.raised or (should_stop is not None and should_stop(done)))
            if done % phase.checkpoint_every == 0 or finished or stop:
                meta = {"data": batches.position, "step": done, **(extra_meta(state) if extra_meta else {})}
                keep = None if finished else best  # a finished state already holds the best
                if early_stop is not None:
                    meta.update(early_stop=early_stop.state_dict(), best_saved=keep is not None)
                    if early_stop.stopped_at is not None:
                        meta["stopped_early_at"] = early_stop.stopped_at
                ckpt.save(done, state, meta, best=keep, force=True)
                saved = done
                exits.signal_at("save")  # test hook
            if finished:
                break
            if stop:
                ckpt.wait()
                raise Preempted(done)
        exits.raise_if_interrupted()  # one the last save swallowed
    except KeyboardInterrupt:
        # Ctrl-C: a save in flight gets a bounded wait, never a hang on orbax's threads.
        if not ckpt.close(timeout=SAVE_WAIT_S):
            log.warning("%s: Ctrl-C: the checkpoint save in flight did not finish within %d s; left unfinished "
                        "(the next run removes it)", phase.name, SAVE_WAIT_S)
        raise
    finally:
        if bar is not None:
            bar.close()
        ckpt.close()
        sigterm.restore()
    if distributed.any_process(sigterm.raised):  # after the last step's save: it is written
        raise Preempted(saved or start)
    if where_time_goes.steps:
        log.info("%s: %s", phase.name, where_time_goes.describe())
    return state, last


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
