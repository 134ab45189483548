"""Rollout ahead of learning on one device set: a producer/consumer pipeline with bounded
staleness (docs/concepts.md#asynchronous-rl-rollout-ahead-of-learning).

The learner's state after `v` updates is policy version `v`. Batch `k` (the one learner
step `k` trains on, 0-based) is sampled with the weights of some version `v_k ≤ k`; its
staleness when trained on is `k − v_k`, at most `max_staleness`. Two schedules:

- "deterministic": `v_k = max(0, k − max_staleness)`. Right after update `k` the pipeline
  dispatches the rollout of batch `k + 1 + max_staleness` with the new weights; its host
  work (stop strings, a Python reward) runs on a worker thread while the device trains on
  the batches before it. The run is a function of its seed: the equality and resume tests
  use it. `max_staleness = 0` is the synchronous loop.
- "free": a producer thread samples batch `j` with the newest weights as soon as the
  learner has reached version `j − max_staleness`; the learner takes the batches in order.
  Staleness is then anywhere in `[0, max_staleness]`, as timing falls (one process only).

Every sample carries its version; the step reports the staleness (`pipeline/staleness`
and a histogram `pipeline/staleness_<s>`, the fraction of steps at each `s`), the time the
learner waited for its batch (`pipeline/wait_s`) and the groups dropped for exceeding the
bound (`pipeline/dropped_groups`, whole batches: a group never splits). The pipeline is the
loop's `Batches` (the loop itself is unchanged) and one of its hooks: `on_start` gets the
first (or restored) state, each checkpoint keeps the samples in flight (their arrays in
`<workdir>/<phase>.pipeline/`, their versions in the meta), so an interrupted
deterministic run resumes to the metrics of an uninterrupted one.
"""

from __future__ import annotations

import collections
import concurrent.futures
import dataclasses
import logging
import threading
import time
from pathlib import Path
from typing import Any, Callable, NamedTuple

import jax
import numpy as np

from jaxrlhf.algorithms import timing
from jaxrlhf.options import check, option
from jaxrlhf.rollout.sampler import SampleOutput
from jaxrlhf.runs.hooks import Hook

log = logging.getLogger("jaxrlhf")
SCHEDULES = ("deterministic", "free")


@dataclasses.dataclass(frozen=True)
class PipelineSection:
    """How far rollout may run ahead of learning (`runs.pipeline`)."""

    max_staleness: int = option(0, "policy versions a sample may lag the learner: batch k is sampled with the weights "
                                "after k − s updates at the oldest (0: the synchronous loop, bit for bit). A sample's "
                                "host work (a Python reward, stop strings) then overlaps the device's training; pair "
                                "it with the loss's off-policy correction (correction.mode)", min=0)
    schedule: str = option("deterministic", "'deterministic' (batch k sampled with version max(0, k − s): "
                           "reproducible and exactly resumable) or 'free' (a producer thread samples with the newest "
                           "weights as soon as the bound allows; one process only)", choices=SCHEDULES)

    def __post_init__(self):
        check(self)

    @property
    def active(self) -> bool:
        """Rollout runs through the pipeline (else the phase's synchronous step)."""
        return self.max_staleness > 0 or self.schedule == "free"


@dataclasses.dataclass
class Item:
    """One sampled batch in the buffer: its index (the learner step that takes it), the
    version of the weights that sampled it, the prompt source's position before it, and
    the sample itself (a dict the phase's callbacks make; a future until its host work is
    done)."""

    index: int
    version: int
    position: dict
    sample: Any
    staleness: int = 0  # set when the learner takes it
    wait_s: float = 0.0  # how long the learner waited for it


class Pipeline(Hook):
    """The loop's `Batches` and a hook. The phase gives it three callbacks:

    - `dispatch(state, local, rng) -> sample`: this process's prompt rows `local` (what the
      prompt source's `next_batch` returns) sampled with `state`'s weights and the batch's
      key `fold_in(rng, index)` — device work only, not waited for;
    - `finish(sample) -> sample`: the host work (on a worker thread, in batch order);
    - `rebuild(local, arrays) -> sample`: a finished sample from its saved arrays.

    and `arrays(sample) -> {name: np.ndarray}`: what a checkpoint keeps of a finished
    sample (this process's rows). Versions are counted on the host: the loop's step at
    `on_start`, plus one per `publish`.
    """

    def __init__(self, prompts, *, max_staleness: int, schedule: str, rng: jax.Array, dispatch: Callable,
                 finish: Callable, rebuild: Callable, arrays: Callable, groups_per_batch: int, process: int = 0):
        if schedule not in SCHEDULES:
            raise ValueError(f"pipeline.schedule={schedule!r}; expected one of {SCHEDULES}")
        if schedule == "free" and jax.process_count() > 1:
            raise ValueError("pipeline.schedule='free' runs a producer thread whose timing differs between "
                             "processes: use 'deterministic' in a multi-process job")
        self.prompts, self.s, self.schedule, self.rng = prompts, max_staleness, schedule, rng
        self._dispatch, self._finish, self._rebuild, self._arrays = dispatch, finish, rebuild, arrays
        self.groups, self.process = groups_per_batch, process
        self.lock = threading.RLock()  # held while a rollout or an update is dispatched (donation)
        self._cond = threading.Condition(self.lock)
        self._buffer: collections.deque[Item] = collections.deque()
        self._pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="jaxrlhf-pipeline")
        self._state, self._version, self._next, self._end = None, 0, 0, 0
        self._producer: threading.Thread | None = None
        self._stop = False
        self._error: BaseException | None = None
        self._dir: Path | None = None
        self.dropped_groups = 0
        self.last_dispatched: Any = None  # the newest rollout's sample (its arrays: device work in flight)

    # ------------------------------------------------------------------ Batches

    def next_batch(self) -> Item:
        """The next batch in order, its host work done; a batch staler than the bound is
        dropped whole (counted in `dropped_groups`) and the next one taken."""
        t0 = time.perf_counter()
        while True:
            with self._cond:
                while not self._buffer and self._error is None:
                    if self.schedule == "deterministic":
                        raise RuntimeError("pipeline: no batch was dispatched for this step (on_start not called?)")
                    self._cond.wait(0.1)
                self._raise()
                item = self._buffer.popleft()
                self._cond.notify_all()
            item.sample = _done(item.sample)
            item.staleness = self._version - item.version  # the learner's version before it trains on it
            if item.staleness <= self.s:
                item.wait_s = time.perf_counter() - t0
                return item
            self.dropped_groups += self.groups
            log.warning("pipeline: batch %d (version %d) is %d versions behind the learner (> max_staleness=%d): "
                        "dropped", item.index, item.version, item.staleness, self.s)
            if self.schedule == "deterministic":
                self._fill()

    @property
    def position(self) -> dict:
        """The prompt source's position before the first batch not yet taken."""
        with self.lock:
            return dict(self._buffer[0].position) if self._buffer else dict(self.prompts.position)

    def restore(self, position: dict) -> None:
        self.prompts.restore(position)

    # ------------------------------------------------------------------ the learner's side

    def publish(self, state) -> None:
        """The learner's new state (call with `lock` held, right after dispatching the
        update that made it): the deterministic schedule dispatches the rollouts it now
        allows; the free producer is woken."""
        with self._cond:
            self._state, self._version = state, self._version + 1
            self._cond.notify_all()
        if self.schedule == "deterministic":
            self._fill()

    def metrics(self, item: Item) -> dict:
        """The step's pipeline metrics for the batch it trains on."""
        lag = item.staleness
        out = {"pipeline/staleness": float(lag), "pipeline/version": float(item.version),
               "pipeline/wait_s": item.wait_s, "pipeline/dropped_groups": float(self.dropped_groups)}
        out.update({f"pipeline/staleness_{s}": float(s == lag) for s in range(self.s + 1)})
        return out

    # ------------------------------------------------------------------ production

    def _produce_one(self, state) -> None:
        """Dispatch batch `_next` with `state` (lock held) and queue its host work."""
        index, position = self._next, dict(self.prompts.position)
        local = self.prompts.next_batch()
        sample = self._dispatch(state, local, jax.random.fold_in(self.rng, index))
        self.last_dispatched = sample
        future = self._pool.submit(self._finish, sample)
        self._buffer.append(Item(index, self._version, position, future))
        self._next += 1

    def _may_produce(self) -> bool:
        """Batch `_next` is in the phase and within the bound of the learner's version."""
        return self._next < self._end and self._next <= self._version + self.s

    def _fill(self) -> None:
        with self._cond:
            while self._may_produce():
                self._produce_one(self._state)

    def _run_producer(self) -> None:
        try:
            while True:
                with self._cond:
                    while not self._stop and not self._may_produce():
                        self._cond.wait()
                    if self._stop:
                        return
                    self._produce_one(self._state)
                    self._cond.notify_all()
        except BaseException as e:  # noqa: BLE001 - handed to the learner, which raises it
            with self._cond:
                self._error = e
                self._cond.notify_all()

    def _raise(self) -> None:
        if self._error is not None:
            raise RuntimeError(f"pipeline: the rollout producer failed: {self._error}") from self._error

    # ------------------------------------------------------------------ hooks

    def on_start(self, ctx):
        self._dir = Path(ctx.workdir) / f"{ctx.phase.name}.pipeline"
        self._state, self._version = ctx.state, ctx.start
        self._next, self._end = ctx.start, ctx.end
        saved = (ctx.meta or {}).get("pipeline")
        if saved:
            self._load(ctx.start, saved)
        if self.schedule == "deterministic":
            self._fill()
        else:
            self._producer = threading.Thread(target=self._run_producer, name="jaxrlhf-producer", daemon=True)
            self._producer.start()

    def checkpoint_meta(self, ctx) -> dict:
        """The samples in flight: their arrays written to `<phase>.pipeline/<step>-p<process>.npz`
        (waiting for their host work), their indices and versions in the meta."""
        with self.lock:
            items = list(self._buffer)
        if not items:
            return {"pipeline": []}
        arrays = {}
        for i, item in enumerate(items):
            arrays.update({f"{i}/{k}": v for k, v in self._arrays(_done(item.sample)).items()})
        self._dir.mkdir(parents=True, exist_ok=True)
        path = self._dir / f"{ctx.step}-p{self.process}.npz"
        tmp = path.with_suffix(".tmp.npz")
        np.savez(tmp, **arrays)
        tmp.replace(path)  # a checkpoint never points at half a file
        return {"pipeline": [[item.index, item.version] for item in items]}

    def on_save(self, ctx, step):
        keep = set(ctx.checkpointer.all_steps()) | {step}
        for path in self._dir.glob("*.npz") if self._dir and self._dir.exists() else ():
            if int(path.name.split("-")[0].split(".")[0]) not in keep:
                path.unlink(missing_ok=True)

    def on_end(self, ctx, error):
        with self._cond:
            self._stop = True
            self._cond.notify_all()
        if self._producer is not None:
            self._producer.join(timeout=60)
        self._pool.shutdown(wait=True, cancel_futures=True)

    def _load(self, step: int, saved: list) -> None:
        """The samples in flight at checkpoint `step`, rebuilt from their arrays with the
        prompts they were sampled from (the prompt source replays them); without the file
        they are sampled again with the restored weights (the run then is not exact)."""
        path = self._dir / f"{step}-p{self.process}.npz"
        if not path.exists():
            log.warning("pipeline: %s is missing: the %d batches in flight at step %d are sampled again with the "
                        "restored weights (this resume is not exact)", path, len(saved), step)
            return
        with np.load(path) as data:
            for i, (index, version) in enumerate(saved):
                position = dict(self.prompts.position)
                local = self.prompts.next_batch()
                arrays = {k.split("/", 1)[1]: data[k] for k in data.files if k.split("/", 1)[0] == str(i)}
                self._buffer.append(Item(index, version, position, self._rebuild(local, arrays)))
                self._next = index + 1


def _done(sample):
    """A sample with its host work finished (waiting for it when it is still a future)."""
    return sample.result() if isinstance(sample, concurrent.futures.Future) else sample


class RLPrograms(NamedTuple):
    """What an RL phase's step is made of (`phases.rl_step`), for the pipelined step:
    `prepare(local) -> (local, batch, extras)`; the sharded `rollout(state, ids, mask, rng)
    -> (out, tokens)`, `update(state, prepared, rng)`; `scorer(state) -> (score program,
    logging step number or 0)`; `host(local) -> (out -> host scores)` or None; `cut(out)`
    (stop strings) or None; `log_rows(step)`; the placement and the global rows of a
    sampled batch."""

    prepare: Callable
    rollout: Callable
    scorer: Callable
    update: Callable
    host: Callable | None
    cut: Callable | None
    log_rows: Callable
    placement: Any
    rows: int


def pipelined(programs: RLPrograms, section: PipelineSection, prompts, rng: jax.Array, *,
              groups_per_batch: int) -> tuple[Callable, Pipeline]:
    """`(step, pipeline)`: the loop's step and its batches for rollout ahead of learning.

    The step takes a sampled batch from the pipeline, scores it with the learner's current
    weights (so `old_logp`, recomputed or the update's own, is the proximal policy and the
    sampler's log-probs the behaviour policy: `GRPOConfig.correction`), updates, and
    publishes the new weights, all under the pipeline's lock (a rollout is never dispatched
    on weights an update has donated)."""
    p = programs

    def dispatch(state, local, key):
        local, batch, extras = p.prepare(local)
        out, tokens = p.rollout(state, batch["prompt_ids"], batch["prompt_mask"], key)
        return dict(local=local, extras=extras, out=out, tokens=tokens)

    def finish(sample):
        t0 = time.perf_counter()
        out = p.cut(sample["out"]) if p.cut is not None else sample["out"]
        host = p.host(sample["local"])(out) if p.host is not None else {}
        return dict(sample, out=out, host=host, host_s=time.perf_counter() - t0)

    def local_rows(x):
        return np.asarray(p.placement.local_rows(x))

    def arrays(sample):
        out = {f"out.{k}": local_rows(v) for k, v in sample["out"].arrays().items()}
        out.update({f"host.{k}": local_rows(v) for k, v in sample["host"].items()})
        return {**out, "tokens": np.asarray(jax.device_get(sample["tokens"].addressable_data(0))),
                "host_s": np.float64(sample["host_s"])}

    def rebuild(local, saved):
        local, _, extras = p.prepare(local)
        fields = {k[4:]: v for k, v in saved.items() if k.startswith("out.")}
        host = {k[5:]: v for k, v in saved.items() if k.startswith("host.")}
        out = SampleOutput(**p.placement.global_batch(fields, p.rows))
        return dict(local=local, extras=extras, out=out, tokens=jax.numpy.asarray(saved["tokens"]),
                    host=p.placement.global_batch(host, p.rows) if host else {}, host_s=float(saved["host_s"]))

    pipe = Pipeline(prompts, max_staleness=section.max_staleness, schedule=section.schedule, rng=rng,
                    dispatch=dispatch, finish=finish, rebuild=rebuild, arrays=arrays,
                    groups_per_batch=groups_per_batch, process=jax.process_index())

    def step(state, item: Item, rng):
        sample = item.sample
        score, logging_step = p.scorer(state)
        with pipe.lock:
            # One device set: its programs take turns. The rollouts dispatched are waited for
            # before the learner's programs, and the update before the next rollout, so that
            # no two programs share the cores (XLA:CPU would run them side by side, each
            # slower); what overlaps is the host work on the worker thread.
            if pipe.last_dispatched is not None:  # (none yet when a resume's batches all came from the checkpoint)
                jax.block_until_ready(pipe.last_dispatched["out"])
            prepared, m_score = score(state, sample["out"], sample["extras"], sample["host"], rng)
            state, m_train = jax.block_until_ready(p.update(state, prepared, rng))
            pipe.publish(state)
        metrics = {**m_score, **m_train, **pipe.metrics(item)}
        if p.host is not None or p.cut is not None:
            metrics[timing.HOST_REWARD_S] = sample["host_s"]
        if logging_step:
            p.log_rows(logging_step)
        return state, metrics

    return step, pipe


__all__ = ["Item", "Pipeline", "PipelineSection", "RLPrograms", "SCHEDULES", "pipelined"]
