"""`runs.pipeline.Pipeline` with stand-in callbacks (no model): the schedules' bounds, the
overlap a lock-step loop cannot have, and the drop rule. The GRPO phase through it is in
test_pipeline_runs.py."""

from __future__ import annotations

import random
import threading
import time
from types import SimpleNamespace

import jax
import pytest

from jaxrlhf.runs.pipeline import Pipeline, PipelineSection


class Prompts:
    """Batch i is the G rows (i, 0..G-1): a whole group each."""

    def __init__(self, g=4):
        self.i, self.g = 0, g

    def next_batch(self):
        rows = [(self.i, r) for r in range(self.g)]
        self.i += 1
        return rows

    @property
    def position(self):
        return {"i": self.i}

    def restore(self, position):
        self.i = position["i"]


def _ctx(tmp_path, steps):
    return SimpleNamespace(workdir=tmp_path, phase=SimpleNamespace(name="grpo"), state=0, start=0, end=steps,
                           meta=None, step=0)


def _pipeline(s, schedule, *, dispatch, finish=lambda x: x):
    return Pipeline(Prompts(), max_staleness=s, schedule=schedule, rng=jax.random.key(0), dispatch=dispatch,
                    finish=finish, rebuild=None, arrays=None, groups_per_batch=1)


def _learn(pipe, ctx, steps, *, publishes=1, pause=lambda: None):
    """The learner: take a batch, 'update' (the state is the version), publish."""
    pipe.on_start(ctx)
    taken = []
    try:
        for k in range(steps):
            item = pipe.next_batch()
            taken.append(item)
            pause()
            with pipe.lock:
                for _ in range(publishes):
                    ctx.state += 1
                    pipe.publish(ctx.state)
    finally:
        pipe.on_end(ctx, None)
    return taken


@pytest.mark.parametrize("s", [0, 1, 3])
def test_deterministic_schedule_samples_batch_k_with_version_k_minus_s(tmp_path, s):
    seen = []
    pipe = _pipeline(s, "deterministic", dispatch=lambda state, local, rng: seen.append((local[0][0], state)) or local)
    taken = _learn(pipe, _ctx(tmp_path, 8), 8)
    assert [(i, v) for i, v in seen] == [(k, max(0, k - s)) for k in range(8)]  # sampled with exactly these weights
    assert [t.index for t in taken] == list(range(8))
    assert [t.staleness for t in taken] == [k - max(0, k - s) for k in range(8)]
    assert [pipe.metrics(t)[f"pipeline/staleness_{t.staleness}"] for t in taken] == [1.0] * 8


@pytest.mark.parametrize("s, timeout, overlaps", [(1, 30.0, True), (0, 2.0, False)])
def test_the_reward_of_batch_k_can_wait_for_the_sampler_to_start_batch_k_plus_1(tmp_path, s, timeout, overlaps):
    """The reward (host work) of batch k blocks until the sampler has started batch k + 1.
    Rollout ahead of learning (s = 1) gets through; a lock-step loop (s = 0) cannot, and
    the wait times out."""
    steps = 5
    started = [threading.Event() for _ in range(steps + 1)]
    started[steps].set()  # no batch after the last

    def dispatch(state, local, rng):
        started[local[0][0]].set()
        return local

    def finish(local):
        k = local[0][0]
        if not started[k + 1].wait(timeout):
            raise TimeoutError(f"the sampler never started batch {k + 1} while batch {k} was scored")
        return local

    pipe = _pipeline(s, "deterministic", dispatch=dispatch, finish=finish)
    if overlaps:
        assert [t.index for t in _learn(pipe, _ctx(tmp_path, steps), steps)] == list(range(steps))
    else:
        with pytest.raises(TimeoutError, match="never started batch 1"):
            _learn(pipe, _ctx(tmp_path, steps), steps)


@pytest.mark.parametrize("s", [1, 2])
def test_free_schedule_keeps_the_bound_and_loses_or_repeats_nothing(tmp_path, s):
    """A producer thread samples with the newest weights; the learner (random pauses) takes
    every batch once, in order, whole, never staler than s; with a slow learner the
    producer runs ahead (staleness > 0 occurs)."""
    steps, rnd = 30, random.Random(0)
    versions = {}

    def dispatch(state, local, rng):
        versions[local[0][0]] = state
        time.sleep(rnd.uniform(0, 0.004))
        return local

    pipe = _pipeline(s, "free", dispatch=dispatch)
    taken = _learn(pipe, _ctx(tmp_path, steps), steps, pause=lambda: time.sleep(rnd.uniform(0, 0.01)))
    assert [t.index for t in taken] == list(range(steps))
    assert all(t.sample == [(t.index, r) for r in range(4)] for t in taken)  # whole groups, in order
    assert all(0 <= t.staleness <= s for t in taken) and max(t.staleness for t in taken) >= 1
    assert all(versions[t.index] == t.version for t in taken) and sorted(versions) == list(range(steps))
    assert pipe.dropped_groups == 0


def test_a_batch_staler_than_the_bound_is_dropped_whole_and_counted(tmp_path):
    """A learner that publishes 3 versions per batch (several updates per batch) outruns
    the bound s = 1: the batches behind by more are dropped, never trained on."""
    pipe = _pipeline(1, "free", dispatch=lambda state, local, rng: local)
    taken = _learn(pipe, _ctx(tmp_path, 12), 3, publishes=3)
    assert all(t.staleness <= 1 for t in taken)
    assert pipe.dropped_groups > 0 and pipe.metrics(taken[-1])["pipeline/dropped_groups"] == pipe.dropped_groups


def test_options():
    assert not PipelineSection().active and PipelineSection(max_staleness=1).active
    assert PipelineSection(schedule="free").active
    with pytest.raises(ValueError, match="max_staleness"):
        PipelineSection(max_staleness=-1)
    with pytest.raises(ValueError, match="schedule"):
        PipelineSection(schedule="eager")
