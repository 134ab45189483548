"""The health monitor through `python -m jaxrlhf.train`: a deliberately broken GRPO run
(learning rate far too high, β = 0, a reward that also pays for length) logs the matching
warnings, and a healthy tiny run logs none."""

import json
import os
import pathlib
import subprocess
import sys

import pytest

REPO = pathlib.Path(__file__).resolve().parents[2]

# 300 SFT steps, so that the policy starts with short answers that the length reward can grow;
# plain GRPO (the config's guidance on the reference answers would hold the length down)
BROKEN = ["--config.sft.steps=300", "--config.sft.batch_size=64", "--config.grpo.steps=16",
          "--config.grpo.guide_coef=0", "--config.grpo.dynamic_sampling=False",
          "--config.grpo.optim.schedule=constant", "--config.grpo.optim.warmup_steps=0", "--config.grpo.optim.lr=3e-3",
          "--config.task.length_bonus=1.0", "--config.grpo.sampling.max_new_tokens=8", "--config.train.monitor.kl_target=0.01",
          "--config.train.monitor.length_window=6"]
# the same run and thresholds with the task's own reward and a learning rate 100x lower (at the
# config's 3e-4 this tiny policy drifts past 3 x kl_target within a few steps)
HEALTHY = [o for o in BROKEN if not o.startswith(("--config.grpo.optim.lr=", "--config.task.length_bonus="))] + [
    "--config.grpo.optim.lr=3e-5"]


def _train(tmp_path, *overrides):
    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]))
    cmd = [sys.executable, "-m", "jaxrlhf.train", f"--config={REPO}/configs/addition_grpo.py:tiny",
           f"--workdir={tmp_path / 'run'}", "--config.train.checkpoint_every=1000", "--config.train.export=false",
           *overrides]
    proc = subprocess.run(cmd, env=env, cwd=tmp_path, capture_output=True, text=True, timeout=600)
    log = proc.stdout + proc.stderr
    assert proc.returncode == 0, log[-3000:]
    return log


@pytest.mark.heavy  # end to end; the monitor itself: tests/test_monitor.py
@pytest.mark.slow
def test_broken_run_logs_the_matching_warnings(tmp_path):
    log = _train(tmp_path, *BROKEN)
    assert "[kl]" in log, log[-3000:]              # drift from the reference, measured with β = 0
    assert "[length_hacking]" in log, log[-3000:]  # the reward pays for length, and length grows


@pytest.mark.slow
@pytest.mark.heavy  # the quick command keeps the broken run, which checks the warnings themselves
def test_healthy_run_logs_none(tmp_path):
    log = _train(tmp_path, *HEALTHY)
    train_log = (tmp_path / "run" / "train.log").read_text()
    for text in (log, train_log):
        assert "jaxrlhf.monitor" not in text, text[-3000:]
    # the monitor had something to check: the KL to the reference, measured with β = 0 (track_kl)
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    kls = [r["grpo/kl/mean"] for r in rows if "grpo/kl/mean" in r]
    assert len(kls) >= 10 and max(kls) < 0.03, kls
