"""The training loop: resume equals uninterrupted, NaN stops before a save, SIGTERM saves."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _toy_phase import ARRAYS, TX, toy_step  # noqa: E402

from jaxrlhf import data  # noqa: E402
from jaxrlhf.algorithms import common, timing  # noqa: E402
from jaxrlhf.monitor import NonFiniteError  # noqa: E402
from jaxrlhf.runs.checkpointing import CheckpointError, Checkpointer  # noqa: E402
from jaxrlhf.runs.loop import ArrayBatches, PhaseConfig, Preempted, TimeSplit, run_phase  # noqa: E402
from jaxrlhf.runs.metrics import MetricsWriter  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
_step = jax.jit(toy_step)


def _run(workdir, num_steps=6, should_stop=None, step_fn=_step):
    state = common.TrainState.create({"w": jnp.zeros(3)}, TX)
    batches = ArrayBatches(ARRAYS, data.BatchIterator(40, 8, seed=3))
    writer = MetricsWriter(workdir, tensorboard=False)
    try:
        return run_phase(PhaseConfig("phase", num_steps, log_every=1, checkpoint_every=100, progress=False),
                         workdir=workdir, state=state, step_fn=step_fn, batches=batches, rng=jax.random.key(0),
                         writer=writer, should_stop=should_stop)
    finally:
        writer.close()


def _metrics(workdir):
    """The logged metrics without wall-clock timings (which differ between runs)."""
    rows = [json.loads(line) for line in (Path(workdir) / "metrics.jsonl").read_text().splitlines()]
    return [{k: v for k, v in row.items() if "time/" not in k} for row in rows]


def test_resume_reproduces_the_uninterrupted_run(tmp_path):
    full_state, _ = _run(tmp_path / "full")
    with pytest.raises(Preempted) as stopped:
        _run(tmp_path / "resumed", should_stop=lambda step: step == 3)
    assert stopped.value.step == 3 and stopped.value.code == 0
    resumed_state, _ = _run(tmp_path / "resumed")
    assert _metrics(tmp_path / "resumed") == _metrics(tmp_path / "full")  # steps 1..3 then 4..6
    np.testing.assert_array_equal(resumed_state.params["w"], full_state.params["w"])
    # A finished phase is restored, not re-run.
    again, last = _run(tmp_path / "resumed")
    np.testing.assert_array_equal(again.params["w"], full_state.params["w"])
    assert last == {} and len(_metrics(tmp_path / "resumed")) == 6


def test_nan_stops_before_any_checkpoint(tmp_path):
    def nan_at_2(state, batch, rng):
        state, m = _step(state, batch, rng)
        return state, {"loss": jnp.where(state.step == 2, jnp.nan, m["loss"])}

    with pytest.raises(NonFiniteError):
        _run(tmp_path, num_steps=6, step_fn=nan_at_2)
    assert Checkpointer(tmp_path / "phase").latest_step() is None


def test_corrupt_checkpoint_is_a_clear_error(tmp_path):
    with pytest.raises(Preempted):
        _run(tmp_path, should_stop=lambda step: step == 2)
    for f in (tmp_path / "phase" / "2" / "state").rglob("*"):
        if f.is_file() and f.stat().st_size > 0:
            f.write_bytes(b"garbage")
    with pytest.raises(CheckpointError, match=r"move \S*phase aside to start this phase over. The newest, 2: .*phase/2 is corrupt"):
        _run(tmp_path)
    assert sorted(p.name for p in (tmp_path / "phase").iterdir()) == ["2"]  # no step restores: nothing moved


def test_sigterm_saves_a_restorable_checkpoint_and_exits_cleanly(tmp_path):
    workdir = tmp_path / "run"
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    cmd = [sys.executable, "-m", "jaxrlhf.train", f"--config={REPO}/configs/addition_grpo.py:tiny",
           f"--workdir={workdir}", "--config.sft.steps=100000", "--config.train.checkpoint_every=100000"]
    log = tmp_path / "log.txt"
    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, env=env, stdout=out, stderr=subprocess.STDOUT)
    try:
        metrics = workdir / "metrics.jsonl"
        deadline = time.monotonic() + 300
        # Poll the metrics file: training prints nothing to the terminal while it runs.
        while proc.poll() is None and time.monotonic() < deadline:
            if metrics.exists() and metrics.read_text().count("\n") >= 3:
                break
            time.sleep(0.05)
        assert proc.poll() is None, "the run ended before it could be interrupted"
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=120)
    finally:
        proc.kill()
    out = log.read_text()
    assert proc.returncode == 0, out[-2000:]
    step = Checkpointer(workdir / "sft").latest_step()
    assert step is not None and step >= 3


def test_the_closing_time_line_averages_the_steps_that_compiled_nothing():
    """The means of the parts over the steps without compilation, each part's share of the
    step, and tokens/s as all tokens over all rollout seconds (not a mean of ratios)."""
    split = TimeSplit()
    rows = [(1.0, 0.5, 0.2, 0.2, 100.0, 3), (0.4, 0.1, 0.1, 0.1, 100.0, 0), (0.6, 0.3, 0.1, 0.1, 200.0, 0)]
    for step, rollout, scoring, update, tokens, compiles in rows:
        split.add({timing.STEP_S: step, timing.ROLLOUT_S: rollout, timing.SCORING_S: scoring,
                   timing.UPDATE_S: update, timing.TOKENS_PER_S: tokens / rollout, timing.COMPILES: compiles})
    assert split.describe() == ("time per step 0.500 s (mean of 2 steps without compilation): rollout 0.200 s (40%), "
                                "scoring 0.100 s (20%), update 0.100 s (20%); 750 generated tokens/s")
    update_only = TimeSplit()
    update_only.add({timing.STEP_S: 0.2, timing.UPDATE_S: 0.1, timing.COMPILES: 0})
    assert update_only.describe() == "time per step 0.200 s (mean of 1 steps without compilation): update 0.100 s (50%)"
