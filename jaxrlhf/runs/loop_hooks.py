"""The built-in hooks of `loop.run_phase`, in the order it calls them (`runs.hooks` says
why this order): `CheckMetrics`, `GuardUpdates`, `Evaluate`, `StopEarly`, `WriteMetrics`,
`Preemption`, `Checkpoints`."""

from __future__ import annotations

import logging
import signal
import time
from typing import Any, Callable

import numpy as np
from tqdm.auto import tqdm

from jaxrlhf import exits
from jaxrlhf.monitor import HealthMonitor, NonFiniteError
from jaxrlhf.parallel import distributed
from jaxrlhf.runs.checkpointing import Checkpointer
from jaxrlhf.runs.health import UpdateGuard
from jaxrlhf.runs.hooks import Context, Hook, name_of
from jaxrlhf.runs.metrics import to_python
from jaxrlhf.runs.stopping import EarlyStop, copy_params

log = logging.getLogger("jaxrlhf")

# Seconds a Ctrl-C waits for a checkpoint save in flight before the run stops without it.
SAVE_WAIT_S = 20


class CheckMetrics(Hook):
    """A NaN/Inf among a step's metrics raises `NonFiniteError` before anything is saved;
    with a `HealthMonitor`, its checks (warnings) run too."""

    def __init__(self, monitor: HealthMonitor | None = None):
        self.monitor = monitor

    def on_step(self, ctx, step, state, metrics):
        if self.monitor is not None:
            self.monitor.check(metrics, step)  # raises NonFiniteError before any save
        elif not all(np.isfinite(v) for v in metrics.values() if isinstance(v, float)):
            raise NonFiniteError(step, [k for k, v in metrics.items() if isinstance(v, float) and not np.isfinite(v)])


class GuardUpdates(Hook):
    """`health.UpdateGuard` on the state after each update (the metrics were computed before
    it): `UnhealthyUpdateError` before that state is saved. `restorable` is the check a
    resume applies to each saved state it tries (`Checkpoints.resume`)."""

    def __init__(self, phase: str, params_of: Callable[[Any], Any], max_norm_change: float = 0.0):
        self.guard = UpdateGuard(phase, params_of, max_norm_change=max_norm_change)

    def restorable(self, state) -> str | None:
        """None when a restored `state` may be resumed from (it becomes the norm's reference)."""
        return None if self.guard.start(state).state_finite else "the saved state holds values that are not finite"

    def on_start(self, ctx):
        if ctx.meta is None:  # a fresh start (a restored state was read by `restorable`)
            self.guard.start(ctx.state)

    def on_step(self, ctx, step, state, metrics):
        self.guard.check(state, step, last_saved=ctx.saved)  # raises UnhealthyUpdateError before any save


class Evaluate(Hook):
    """Every `every` steps: `eval_fn(state)` as the row's `eval/*` metrics, then `on_eval` of
    every hook (the same replicated values on every process)."""

    def __init__(self, eval_fn: Callable[[Any], dict] | None, every: int):
        self.eval_fn, self.every = eval_fn, every

    def on_step(self, ctx, step, state, metrics):
        if self.eval_fn is None or not self.every or step % self.every:
            return
        evaluation = to_python(self.eval_fn(state))
        metrics.update({f"eval/{k}": v for k, v in evaluation.items()})
        ctx.emit("on_eval", step, evaluation)


class StopEarly(Hook):
    """`stopping.EarlyStop` over the evaluations; with `keep_best` the device copy of the
    best parameters is `ctx.best` (saved in each checkpoint until the last) and goes back
    into `ctx.state` at the phase's last step. The phase's starting state is evaluated
    first (step 0, or `early_stop.start_evaluation` when the caller has it)."""

    def __init__(self, early_stop: EarlyStop, eval_fn: Callable[[Any], dict], params_of, with_params):
        self.rule, self.eval_fn, self.params_of, self.with_params = early_stop, eval_fn, params_of, with_params

    def on_start(self, ctx):
        rule, meta, name = self.rule, ctx.meta, ctx.phase.name
        if meta is not None and rule.load_state_dict(meta.get("early_stop")):
            if rule.keep_best and rule.best_step is not None and meta.get("stopped_early_at") is None \
                    and ctx.start < ctx.phase.num_steps:
                if meta.get("best_saved"):
                    ctx.best = ctx.checkpointer.restore_best(self.params_of(ctx.state), ctx.start)
                else:  # the checkpoint was written without keep_best: the best so far is lost
                    log.warning("%s: checkpoint %d holds no best parameters; the best restarts from here",
                                name, ctx.start)
                    rule.forget_best()
        if ctx.start == 0 < ctx.end:
            # The starting point is a candidate too: with keep_best a phase that only makes the
            # held-out metric worse ends where it began. (The caller's own evaluation of these
            # parameters, when it has one with the metric: not computed twice.)
            seeded = rule.start_evaluation
            evaluation = seeded if seeded and rule.metric in seeded else to_python(self.eval_fn(ctx.state))
            self._update(ctx, 0, evaluation)
            log.info("%s: eval/%s at the start: %.4g", name, rule.metric, evaluation[rule.metric])

    def _update(self, ctx, step, evaluation):
        if self.rule.update(step, evaluation) and self.rule.keep_best:
            ctx.best = copy_params(self.params_of(ctx.state))

    def on_eval(self, ctx, step, evaluation):
        rule = self.rule
        # Every process sees the same (replicated) evaluation: the same decision.
        self._update(ctx, step, evaluation)
        if rule.should_stop and not ctx.finished:
            ctx.finished, rule.stopped_at = True, step
            log.info("%s: stopping early at step %d of %d: eval/%s has not improved on %.4g (step %d) for %d "
                     "evaluations", ctx.phase.name, step, ctx.phase.num_steps, rule.metric, rule.best_value,
                     rule.best_step, rule.evals_since_best)

    def on_step(self, ctx, step, state, metrics):
        rule = self.rule
        if not ctx.finished or rule.best_step is None:
            return
        metrics.update({"early_stop/best_step": rule.best_step, "early_stop/best_value": rule.best_value})
        if rule.keep_best and rule.best_step != step:
            ctx.state = self.with_params(state, ctx.best)
            log.info("%s: ending with the parameters of step %d (eval/%s %.4g), not step %d's", ctx.phase.name,
                     rule.best_step, rule.metric, rule.best_value, step)

    def checkpoint_meta(self, ctx) -> dict:
        meta = dict(early_stop=self.rule.state_dict(), best_saved=not ctx.finished and ctx.best is not None)
        if self.rule.stopped_at is not None:
            meta["stopped_early_at"] = self.rule.stopped_at
        return meta


class WriteMetrics(Hook):
    """The log cut back to the phase's start (`MetricsWriter.start_phase`), a row every
    `log_every` steps and at the end, and a tqdm bar with the `show` metrics."""

    def __init__(self):
        self.bar = None

    def on_start(self, ctx):
        phase = ctx.phase
        if ctx.start < ctx.end:
            ctx.writer.start_phase(phase.name, ctx.start)  # rows past the checkpoint go: an uninterrupted run's
        self.bar = tqdm(total=phase.num_steps, initial=ctx.start, desc=phase.name,
                        disable=not (phase.progress and ctx.writer.enabled), dynamic_ncols=True, mininterval=1.0)

    def on_step(self, ctx, step, state, metrics):
        if step % ctx.phase.log_every == 0 or ctx.finished:
            ctx.writer.write(step, metrics, phase=ctx.phase.name)
        self.bar.update(1)
        self.bar.set_postfix({k: f"{metrics[k]:.4g}" for k in ctx.phase.show if k in metrics}, refresh=False)

    def on_end(self, ctx, error):
        if self.bar is not None:
            self.bar.close()


class Preemption(Hook):
    """SIGTERM as a flag (main thread only) from `install()` to `on_end` (the handler
    before is put back), and `should_stop(step)`: either on any process sets `ctx.stopping`
    on every process at the same step."""

    def __init__(self, should_stop: Callable[[int], bool] | None = None):
        self.should_stop = should_stop
        self.raised = False
        self._previous = None

    def install(self) -> "Preemption":
        try:
            self._previous = signal.signal(signal.SIGTERM, self._handle)
        except ValueError:  # not the main thread: leave signals alone
            self._previous = None
        return self

    def _handle(self, signum, frame):
        log.warning("SIGTERM received: saving a checkpoint after this step, then exiting")
        self.raised = True

    def on_step(self, ctx, step, state, metrics):
        ctx.stopping = distributed.any_process(self.raised or (self.should_stop is not None and self.should_stop(step)))

    def on_end(self, ctx, error):
        if self._previous is not None:
            signal.signal(signal.SIGTERM, self._previous)
            self._previous = None


class Checkpoints(Hook):
    """The phase's checkpoints: `resume` restores the newest that restores and passes
    `check`; a save every `every` steps, every `every_s` seconds of `clock()` since the last
    save (or the phase's start; None = off; decided on every process alike), at the phase's
    end and when stopping. The meta holds the data position, `extra_meta(state)` and each
    hook's `checkpoint_meta`. On the way out it waits for the save in flight, at most
    `SAVE_WAIT_S` after a Ctrl-C."""

    def __init__(self, checkpointer: Checkpointer, *, every: int, every_s: float | None = None,
                 check: Callable[[Any], str | None] | None = None, extra_meta: Callable[[Any], dict] | None = None,
                 clock: Callable[[], float] = time.monotonic):
        if every_s is not None and (isinstance(every_s, bool) or not every_s > 0):
            raise ValueError(f"train.checkpoint_every_s={every_s!r}: expected seconds > 0 (None = no time-based "
                             "checkpoints)")
        self.ckpt, self.every, self.every_s = checkpointer, every, every_s
        self.check, self.extra_meta, self.clock = check, extra_meta, clock
        self._last = None

    def resume(self, ctx: Context) -> None:
        """`ctx.start`, `state`, `meta`, `end`, `saved` of the phase: its newest checkpoint that
        restores (`Checkpointer.restore_newest`: a damaged newer one is moved aside), with the
        data position put back; or step 0. A phase that stopped early is finished."""
        phase = ctx.phase
        ctx.start, ctx.end = 0, phase.num_steps
        if self.ckpt.latest_step() is not None:
            ctx.start, ctx.state, ctx.meta = self.ckpt.restore_newest(ctx.state, check=self.check)
            ctx.batches.restore(ctx.meta["data"])
            stopped_at = ctx.meta.get("stopped_early_at")
            if stopped_at is not None:
                ctx.end = ctx.start
                log.info("%s: stopped early at step %d of %d in an earlier run: not re-run", phase.name, stopped_at,
                         phase.num_steps)
            else:
                log.info("%s: resuming at step %d of %d", phase.name, ctx.start, phase.num_steps)
        ctx.saved = ctx.start or None

    def on_start(self, ctx):
        self._last = self.clock()

    def _due(self, ctx, step) -> bool:
        if step % self.every == 0 or ctx.finished or ctx.stopping:
            return True
        # Saves are collective: a clock past the mark on any process saves on all.
        return self.every_s is not None and distributed.any_process(self.clock() - self._last >= self.every_s)

    def on_step(self, ctx, step, state, metrics):
        if not self._due(ctx, step):
            return
        meta = {"data": ctx.batches.position, "step": step, **(self.extra_meta(state) if self.extra_meta else {})}
        for hook in ctx.hooks:
            extra = hook.checkpoint_meta(ctx)
            clash = sorted(set(extra) & set(meta))
            if clash:
                raise ValueError(f"{ctx.phase.name}: the checkpoint meta key(s) {', '.join(clash)} of hook "
                                 f"{name_of(hook)} are taken")
            meta.update(extra)
        keep = None if ctx.finished else ctx.best  # a finished state already holds the best
        self.ckpt.save(step, state, meta, best=keep, force=True)
        ctx.saved, self._last = step, self.clock()
        exits.signal_at("save")  # test hook
        ctx.emit("on_save", step)

    def on_end(self, ctx, error):
        if isinstance(error, KeyboardInterrupt):
            # Ctrl-C: a save in flight gets a bounded wait, never a hang on orbax's threads.
            if not self.ckpt.close(timeout=SAVE_WAIT_S):
                log.warning("%s: Ctrl-C: the checkpoint save in flight did not finish within %d s; left unfinished "
                            "(the next run removes it)", ctx.phase.name, SAVE_WAIT_S)
        self.ckpt.close()


__all__ = ["CheckMetrics", "Checkpoints", "Evaluate", "GuardUpdates", "Preemption", "SAVE_WAIT_S", "StopEarly",
           "WriteMetrics"]
