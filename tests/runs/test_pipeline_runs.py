"""RL phases with rollout ahead of learning (`<phase>.pipeline`), end to end on the tiny
built-in recipes: at zero staleness the pipeline is the synchronous loop bit for bit;
the deterministic schedule samples batch k with version max(0, k − s) and resumes to the
metrics of an uninterrupted run, GRPO's and PPO's (critic and all)."""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _compile_cache import cache_env, persistent_compile_cache, session_folder  # noqa: E402

from jaxrlhf import exits  # noqa: E402
from jaxrlhf.runs import train_and_evaluate  # noqa: E402

CONFIGS = Path(__file__).resolve().parents[2] / "configs"


def _config(steps=4, name="addition_grpo", phase="grpo", **pipeline):
    spec = importlib.util.spec_from_file_location(name, CONFIGS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    c = module.get_config("tiny")
    c[phase].update(steps=steps)
    c[phase].pipeline.update(**pipeline)
    c.train.update(eval_every=0, checkpoint_every=2, show_samples=0)  # 0: no samples printed (it once crashed)
    return c


def _rows(workdir, drop=("/time/", "/pipeline/")):
    rows = [json.loads(r) for r in (workdir / "metrics.jsonl").read_text().splitlines()]
    return [{k: v for k, v in r.items() if not any(d in k for d in drop)} for r in rows]


def _grpo(rows, phase="grpo"):
    return [r for r in rows if any(k.startswith(f"{phase}/") for k in r)]


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    return session_folder(tmp_path_factory)


def test_zero_staleness_through_the_pipeline_is_the_synchronous_loop_bit_for_bit(tmp_path, cache):
    """`schedule='free'` with `max_staleness=0` runs the producer thread and the buffer, and
    must give the synchronous loop's every metric and result exactly."""
    with persistent_compile_cache(cache):
        sync = train_and_evaluate(_config(), tmp_path / "sync")
        piped = train_and_evaluate(_config(schedule="free", max_staleness=0), tmp_path / "free0")
    assert _rows(tmp_path / "free0") == _rows(tmp_path / "sync")
    assert piped["stages"] == sync["stages"]
    staleness = [r["grpo/pipeline/staleness"] for r in _grpo(_rows(tmp_path / "free0", drop=()))]
    assert staleness == [0.0] * 4
    assert not any("pipeline" in k for r in _rows(tmp_path / "sync", drop=()) for k in r)


@pytest.fixture(scope="module")
def ahead(tmp_path_factory, cache):
    """Four steps two versions ahead, with the truncated-IS correction."""
    c = _config(max_staleness=2)
    c.grpo.correction.mode = "tis"
    workdir = tmp_path_factory.mktemp("ahead")
    with persistent_compile_cache(cache):
        return c, workdir, train_and_evaluate(c, workdir)


def test_batch_k_is_sampled_with_version_k_minus_s_and_corrected(ahead):
    _, workdir, _ = ahead
    rows = _grpo(_rows(workdir, drop=()))
    assert [r["grpo/pipeline/version"] for r in rows] == [0.0, 0.0, 0.0, 1.0]
    assert [r["grpo/pipeline/staleness"] for r in rows] == [0.0, 1.0, 2.0, 2.0]
    assert [r["grpo/pipeline/staleness_2"] for r in rows] == [0.0, 0.0, 1.0, 1.0]
    # Stale samples differ from the learner's policy: the correction measures the gap.
    assert rows[0]["grpo/mismatch_kl"] < 1e-6 < rows[3]["grpo/mismatch_kl"]
    assert all(0 < r["grpo/is_weight_mean"] <= 2.0 for r in rows)
    # the samples in flight at step 2's checkpoint; at the last step none are
    assert sorted(p.name for p in (workdir / "grpo.pipeline").iterdir()) == ["2-p0.npz"]


def test_an_interrupted_run_resumes_to_the_uninterrupted_metrics(ahead, tmp_path, cache):
    """A kill after step 2's save (the last checkpoint removed): the samples in flight at
    step 2 (sampled with version 0) come back from the checkpoint, so steps 3-4 repeat the
    uninterrupted run's exactly."""
    config, full, summary = ahead
    resumed = tmp_path / "resumed"
    shutil.copytree(full, resumed)
    shutil.rmtree(resumed / "grpo" / "4")
    with persistent_compile_cache(cache):
        again = train_and_evaluate(config, resumed)
    assert _rows(resumed, drop=("/time/", "wait_s")) == _rows(full, drop=("/time/", "wait_s"))
    assert again["stages"] == summary["stages"]
    # Without the saved samples the resume samples them again with the restored weights: not exact.
    lost = tmp_path / "lost"
    shutil.copytree(full, lost)
    shutil.rmtree(lost / "grpo" / "4")
    (lost / "grpo.pipeline" / "2-p0.npz").unlink()
    with persistent_compile_cache(cache):
        train_and_evaluate(config, lost)
    versions = [r["grpo/pipeline/version"] for r in _grpo(_rows(lost, drop=()))]
    assert versions == [0.0, 0.0, 2.0, 2.0]


def _run_and_resume(config, phase, tmp_path, cache):
    """`(full, resumed)`: the workdirs of a 4-step run and of its copy without the step-4
    checkpoint (a kill after step 2's save), run again."""
    full, resumed = tmp_path / "full", tmp_path / "resumed"
    with persistent_compile_cache(cache):
        train_and_evaluate(config, full)
        shutil.copytree(full, resumed)
        shutil.rmtree(resumed / phase / "4")
        train_and_evaluate(config, resumed)
    return full, resumed


@pytest.mark.heavy  # the resume property's quick test is GRPO's above
def test_ppo_one_version_ahead_with_its_critic_resumes_exactly(tmp_path, cache):
    """PPO (actor, critic, reference) one version ahead with the correction: batch k is
    sampled with version max(0, k − 1), its advantages use the learner's critic, and a run
    interrupted after step 2 resumes to the uninterrupted metrics."""
    c = _config(name="addition_ppo_rule", phase="ppo", max_staleness=1)
    c.ppo.correction.mode = "tis"
    full, resumed = _run_and_resume(c, "ppo", tmp_path, cache)
    rows = _grpo(_rows(full, drop=()), "ppo")
    assert [r["ppo/pipeline/version"] for r in rows] == [0.0, 0.0, 1.0, 2.0]
    assert rows[0]["ppo/mismatch_kl"] < 1e-6 < rows[2]["ppo/mismatch_kl"] and "ppo/value_loss" in rows[2]
    assert _rows(resumed, drop=("/time/", "wait_s")) == _rows(full, drop=("/time/", "wait_s"))


def _train(workdir, cache, signal_at=""):
    """The command line on the tiny GRPO recipe two versions ahead, no warm start, a
    checkpoint every step; `signal_at` the test hook's moment and signal."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("JAXRLHF_")}
    env.update(JAX_PLATFORMS="cpu", PYTHONPATH=str(CONFIGS.parent), **cache_env(cache))
    if signal_at:
        env[exits.TEST_SIGNAL_ENV] = signal_at
    args = ["sft.steps=0", "grpo.steps=4", "grpo.pipeline.max_staleness=2", "grpo.correction.mode=tis",
            "train.eval_every=0", "train.checkpoint_every=1", "train.show_samples=0"]
    cmd = [sys.executable, "-m", "jaxrlhf.train", f"--config={CONFIGS / 'addition_grpo.py'}:tiny",
           f"--workdir={workdir}", *(f"--config.{a}" for a in args)]
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)


@pytest.mark.heavy  # three command-line runs; the resume property's quick test is GRPO's above
def test_sigterm_mid_run_then_a_rerun_gives_the_uninterrupted_metrics(tmp_path, cache):
    """SIGTERM during step 1's checkpoint save: the run stops after the step in progress,
    step 2, saved (status 0), with the samples in flight (sampled with version 0) saved
    beside it, and its rerun logs steps 3-4 as the run that was never stopped."""
    full, stopped = tmp_path / "full", tmp_path / "stopped"
    assert _train(full, cache).returncode == 0
    first = _train(stopped, cache, signal_at="save#1:SIGTERM")
    assert first.returncode == 0, first.stderr[-2000:]
    assert [r["step"] for r in _grpo(_rows(stopped))] == [1, 2]
    assert (stopped / "grpo.pipeline" / "2-p0.npz").exists()
    again = _train(stopped, cache)
    assert again.returncode == 0, again.stderr[-2000:]
    assert "grpo: resuming at step 2 of 4" in again.stderr
    assert _rows(stopped, drop=("/time/", "wait_s")) == _rows(full, drop=("/time/", "wait_s"))


@pytest.mark.heavy  # two tiny calculator runs (300 SFT steps each); the pipeline's own tests are above
def test_episodes_one_version_ahead_resume_exactly(tmp_path, cache):
    """GRPO on multi-turn calculator episodes one version ahead: the episodes of batch k run
    on the worker thread with a copy of version max(0, k − 1)'s weights, and a run
    interrupted after step 2 resumes to the uninterrupted metrics."""
    c = _config(name="calculator_grpo", max_staleness=1)
    c.grpo.correction.mode = "tis"
    full, resumed = _run_and_resume(c, "grpo", tmp_path, cache)
    rows = _grpo(_rows(full, drop=()))
    assert [r["grpo/pipeline/version"] for r in rows] == [0.0, 0.0, 1.0, 2.0]
    assert all(r["grpo/episode/turns"] >= 1 for r in rows)
    assert _rows(resumed, drop=("/time/", "wait_s", "env_seconds")) == _rows(full, drop=("/time/", "wait_s",
                                                                                        "env_seconds"))
