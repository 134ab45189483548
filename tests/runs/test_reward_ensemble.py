"""An ensemble of reward models (`reward_model.ensemble`, `ensemble_reduce`) and the reward
model's own trunk (`reward_model.sft_steps`): checked before any work, K = 1 is the single
reward model of before, and both run end to end through the command line (`addition_ppo.py:tiny`)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import jax
import numpy as np
import pytest

from jaxrlhf.runs import pair_phases, setup, validation
from jaxrlhf.runs.metrics import MetricsWriter
from jaxrlhf.runs.sharding import Placement
from jaxrlhf.runs.tasks import build_task

REPO = Path(__file__).resolve().parents[2]


def _config(**rm):
    import importlib.util

    spec = importlib.util.spec_from_file_location("addition_ppo", REPO / "configs" / "addition_ppo.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    config = module.get_config("tiny")
    config.unlock()
    config.reward_model.update(rm)
    return config


@pytest.mark.parametrize("fields, message", [
    (dict(ensemble_reduce="max"), r"reward_model.ensemble_reduce='max' is impossible: it must be one of 'mean', 'min'"),
    (dict(ensemble=0), "reward_model.ensemble=0 is impossible: it must be >= 1"),
    (dict(sft_steps=-1), "reward_model.sft_steps=-1 is impossible: it must be >= 0"),
])
def test_bad_values_are_refused_naming_the_field(fields, message):
    with pytest.raises(ValueError, match=message):
        validation.check_config(_config(**fields), Placement.local())


def test_lora_reward_models_refuse_an_ensemble_and_a_trunk_of_their_own():
    for fields, message in ((dict(ensemble=2), "reward_model.ensemble=2: an ensemble of LoRA reward models"),
                            (dict(sft_steps=5), r"reward_model.sft_steps=5 trains the reward model's trunk in full")):
        config = _config(**fields)
        config.model.lora.rank = 2
        with pytest.raises(ValueError, match=message):
            validation.check_config(config, Placement.local())


@pytest.mark.heavy  # a further case of the ensemble path; the quick command keeps the trunk and fresh-copy runs
def test_one_member_is_the_single_reward_model(tmp_path):
    """K = 1 returns the single reward model's params as they were (not stacked); member 0
    of K = 2 is trained exactly as K = 1 (same head, batches, rng), member 1 differs, and the
    ensemble's held-out accuracy is that of its reduced score."""
    config = _config()
    task = build_task(config.task)
    model, params = setup.build_model(config.model, vocab_size=task.vocab_size, pad_id=task.pad_id,
                                      bos_id=task.bos_id, eos_id=task.eos_id)
    cfg = config.reward_model
    cfg.update(steps=2, samples_per_prompt=0)
    out = {}
    for k in (1, 2):
        cfg.ensemble = k
        writer = MetricsWriter(tmp_path / str(k), tensorboard=False)
        try:
            out[k] = pair_phases.reward_model_phase(cfg, config.train, policy_model=model, policy_params=params, task=task,
                                               workdir=tmp_path / str(k), writer=writer, rng=jax.random.key(0))
        finally:
            writer.close()
    _, one, held_one = out[1]
    _, two, held_two = out[2]
    assert jax.tree.structure(one) == jax.tree.structure(two)
    for a, b in zip(jax.tree.leaves(one), jax.tree.leaves(two)):
        assert b.shape == (2, *a.shape)
        np.testing.assert_array_equal(np.asarray(b[0]), np.asarray(a))
    assert not np.array_equal(np.asarray(two["score"]["kernel"][0]), np.asarray(two["score"]["kernel"][1]))
    assert held_two["member0/accuracy"] == held_one["accuracy"] and "member1/accuracy" in held_two
    assert "member0/accuracy" not in held_one
    assert (tmp_path / "2" / "reward_model_1").is_dir() and not (tmp_path / "1" / "reward_model_1").exists()


def test_the_reward_model_starts_from_its_own_trunk(tmp_path):
    """`trunk_params` (`reward_model.sft_steps`): the reward model's trunk is that one (lr 0:
    nothing moves it), not the policy's."""
    config = _config()
    task = build_task(config.task)
    model, params = setup.build_model(config.model, vocab_size=task.vocab_size, pad_id=task.pad_id,
                                      bos_id=task.bos_id, eos_id=task.eos_id)
    trunk = jax.tree.map(lambda x: x + 1.0, params)
    cfg = config.reward_model
    cfg.update(steps=1, samples_per_prompt=0)
    cfg.optim.update(lr=0.0, warmup_steps=0)
    writer = MetricsWriter(tmp_path, tensorboard=False)
    try:
        _, rm_params, _ = pair_phases.reward_model_phase(cfg, config.train, policy_model=model, policy_params=params,
                                                    trunk_params=trunk, task=task, workdir=tmp_path, writer=writer,
                                                    rng=jax.random.key(0))
    finally:
        writer.close()
    for name in set(params) - {"lm_head"}:
        for a, b in zip(jax.tree.leaves(rm_params[name]), jax.tree.leaves(trunk[name])):
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def _train(*args):
    env = dict(os.environ, PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    return subprocess.run([sys.executable, "-m", "jaxrlhf.train", "--config=configs/addition_ppo.py:tiny", *args],
                          env=env, cwd=REPO, capture_output=True, text=True, timeout=600)


@pytest.mark.heavy  # end to end; members and trunk in-process: this file
def test_ensemble_and_own_trunk_run_end_to_end_and_resume(tmp_path):
    """`--config.reward_model.ensemble=2 --config.reward_model.ensemble_reduce=min
    --config.reward_model.sft_steps=2` through the command line: the trunk's SFT phase and
    both members checkpoint, PPO logs the members' disagreement, and a rerun on the same
    workdir restores every phase (nothing trained again)."""
    args = (f"--workdir={tmp_path}", "--config.reward_model.ensemble=2", "--config.reward_model.ensemble_reduce=min",
            "--config.reward_model.sft_steps=2")
    proc = _train(*args)
    assert proc.returncode == 0, proc.stderr[-3000:]
    for phase in ("reward_model_sft", "reward_model", "reward_model_1", "ppo"):
        assert (tmp_path / phase).is_dir(), phase
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    stds = [r["ppo/reward/reward_model_std"] for r in rows if "ppo/reward/reward_model_std" in r]
    assert stds and all(s >= 0 for s in stds)
    assert any("reward_model_1/loss" in r for r in rows) and any("reward_model_sft/loss" in r for r in rows)
    summary = json.loads((tmp_path / "summary.json").read_text())
    held = summary["reward_model_heldout"]
    assert {"accuracy", "member0/accuracy", "member1/accuracy"} <= set(held)
    assert 0 <= summary["reward_model_trunk"]["accuracy"] <= 1
    again = _train(*args)
    assert again.returncode == 0, again.stderr[-3000:]
    assert [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()] == rows
    assert json.loads((tmp_path / "summary.json").read_text())["stages"] == summary["stages"]


def test_each_member_starts_with_a_fresh_copy_of_the_stopping_rule(tmp_path, monkeypatch):
    """`early_stop` rules member 0; members 1.. get copies of the rule as it was before
    member 0 ran, not one carrying member 0's best value and count of evaluations."""
    from jaxrlhf.runs import stopping

    config = _config()
    task = build_task(config.task)
    model, params = setup.build_model(config.model, vocab_size=task.vocab_size, pad_id=task.pad_id,
                                      bos_id=task.bos_id, eos_id=task.eos_id)
    cfg = config.reward_model
    cfg.update(steps=2, samples_per_prompt=0, ensemble=2)
    config.train.eval_every = 1
    rule = stopping.EarlyStop("accuracy", patience=5)
    seen = []
    member = pair_phases._reward_model_member

    def recording(*args, early_stop, **kw):
        seen.append((early_stop, early_stop.state_dict()))
        return member(*args, early_stop=early_stop, **kw)

    monkeypatch.setattr(pair_phases, "_reward_model_member", recording)
    writer = MetricsWriter(tmp_path, tensorboard=False)
    try:
        pair_phases.reward_model_phase(cfg, config.train, policy_model=model, policy_params=params, task=task,
                                  workdir=tmp_path, writer=writer, rng=jax.random.key(0), early_stop=rule)
    finally:
        writer.close()
    fresh = stopping.EarlyStop("accuracy", patience=5).state_dict()
    assert [s for _, s in seen] == [fresh, fresh]
    assert seen[0][0] is rule and seen[1][0] is not rule
    assert rule.best_step is not None  # member 0's evaluations were recorded in the caller's rule
