"""The one training loop every algorithm runs through.

`run_phase` drives `step(state, batch, rng) -> (state, metrics)` for a number of steps and
owns what a user expects around it: resume from the latest checkpoint of the phase (with
the data position), RNG folded with the step, a tqdm bar with live metrics, metrics to
`metrics.jsonl` and TensorBoard, the health monitor (a NaN stops the run before anything
is saved), periodic evaluation, and SIGTERM (preemption) saving a checkpoint before a
clean exit.

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

from jaxrlhf.monitor import HealthMonitor, NonFiniteError
from jaxrlhf.parallel import distributed
from jaxrlhf.runs.checkpointing import Checkpointer
from jaxrlhf.runs.metrics import MetricsWriter, to_python

log = logging.getLogger("jaxrlhf")


class Preempted(SystemExit):
    """Raised after a SIGTERM-triggered checkpoint: exit code 0, the run resumes later."""

    def __init__(self, step: int):
        super().__init__(0)
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
    progress: bool = True
    show: tuple[str, ...] = ("loss",)  # metric names shown on the progress bar


class _SigtermFlag:
    """Turns SIGTERM into a flag the loop polls between steps (main thread only)."""

    def __init__(self):
        self.raised = False
        self._previous = None

    def __enter__(self):
        try:
            self._previous = signal.signal(signal.SIGTERM, self._handle)
        except ValueError:  # not the main thread: leave signals alone
            self._previous = None
        return self

    def _handle(self, signum, frame):
        log.warning("SIGTERM received: saving a checkpoint after this step, then exiting")
        self.raised = True

    def __exit__(self, *exc):
        if self._previous is not None:
            signal.signal(signal.SIGTERM, self._previous)


def _any_process(flag: bool) -> bool:
    """`flag` of any process (a preemption signal may reach only some of them)."""
    if jax.process_count() == 1:
        return bool(flag)
    from jax.experimental import multihost_utils
    return bool(np.max(multihost_utils.process_allgather(np.asarray(flag, np.int32))))


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
) -> tuple[Any, dict]:
    """Run (or resume) a phase; returns `(state, last_metrics)`.

    Checkpoints go to `workdir/<phase.name>/`; a phase whose final checkpoint exists is
    restored and not re-run. `should_stop(step)` lets a caller interrupt the run like a
    SIGTERM (tests use it to check that resuming equals an uninterrupted run).
    """
    ckpt = Checkpointer(Path(workdir) / phase.name, max_to_keep=phase.keep_checkpoints)
    start = 0
    if ckpt.latest_step() is not None:
        start, state, meta = ckpt.restore(state)
        batches.restore(meta["data"])
        log.info("%s: resuming at step %d of %d", phase.name, start, phase.num_steps)
    last: dict = {}
    bar = tqdm(total=phase.num_steps, initial=start, desc=phase.name, disable=not (phase.progress and writer.enabled),
               dynamic_ncols=True, mininterval=1.0)
    try:
        with _SigtermFlag() as sigterm:
            for step in range(start, phase.num_steps):
                t0 = time.perf_counter()
                batch = batches.next_batch()
                state, metrics = step_fn(state, batch, jax.random.fold_in(rng, step))
                metrics = to_python(distributed.gather(metrics))
                metrics["time/step_s"] = time.perf_counter() - t0
                done = step + 1
                if monitor is not None:
                    monitor.check(metrics, done)  # raises NonFiniteError before any save
                elif not all(np.isfinite(v) for v in metrics.values() if isinstance(v, float)):
                    raise NonFiniteError(done, [k for k, v in metrics.items()
                                                if isinstance(v, float) and not np.isfinite(v)])
                if eval_fn is not None and phase.eval_every and (done % phase.eval_every == 0):
                    metrics.update({f"eval/{k}": v for k, v in to_python(eval_fn(state)).items()})
                if done % phase.log_every == 0 or done == phase.num_steps:
                    writer.write(done, metrics, prefix=f"{phase.name}/")
                bar.update(1)
                bar.set_postfix({k: f"{metrics[k]:.4g}" for k in phase.show if k in metrics}, refresh=False)
                last = metrics
                stop = _any_process(sigterm.raised or (should_stop is not None and should_stop(done)))
                if done % phase.checkpoint_every == 0 or done == phase.num_steps or stop:
                    meta = {"data": batches.position, "step": done, **(extra_meta(state) if extra_meta else {})}
                    ckpt.save(done, state, meta, force=True)
                if stop and done < phase.num_steps:
                    ckpt.wait()
                    raise Preempted(done)
    finally:
        bar.close()
        ckpt.close()
    return state, last
