"""On-policy preference pairs for the reward model (`runs.policy_pairs`, `reward_model.pairs`).

The sampler-level tests use the parity task of the sampled-eval tests (a random tiny model
gets about half of its samples right, so most prompts have mixed outcomes)."""

from __future__ import annotations

import dataclasses
import os
import sys

import jax
import numpy as np
import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _sampled_eval_task as T  # noqa: E402

from jaxrlhf import data  # noqa: E402
from jaxrlhf.runs import config_base, pair_phases, policy_pairs, tasks, validation  # noqa: E402
from jaxrlhf.runs.metrics import MetricsWriter  # noqa: E402

CFG = policy_pairs.PolicyPairsConfig(samples_per_prompt=4, temperature=1.0, num_prompts=12)


def _with_parity(prompts: dict) -> dict:
    p = dict(prompts)
    n = p["prompt_ids"].shape[0]
    p["parity"] = (np.arange(n) % 2).astype(np.int32)
    p["tag"] = np.asarray([T.IdsTokenizer().decode(i[m]) for i, m in zip(p["prompt_ids"], p["prompt_mask"])],
                          dtype=object)
    return p


@pytest.fixture(scope="module")
def parity():
    """(model, params, task): the parity reward on the training prompts too, and the
    task's synthetic pairs."""
    model, params, task = T.build("device")
    base = tasks.addition(config_base.task(num_train=16, num_test=T.NUM_PROMPTS, num_pairs=16, seed=0))
    task = dataclasses.replace(task, prompts=_with_parity(base.prompts), pairs=base.pairs, test_pairs=base.test_pairs)
    return model, params, task


def test_pairs_from_samples_pairs_each_distinct_mistake_with_a_right_answer():
    # 3 prompts x 4 samples of 2 tokens: mixed outcomes (one mistake twice, its padding
    # different), all right, all wrong.
    ids = np.array([[4, 0], [5, 2], [4, 9], [6, 0], [5, 2], [5, 2], [5, 2], [5, 2], [1, 0], [3, 0], [4, 0], [1, 0]],
                   np.int32)
    mask = np.array([[1, 0], [1, 1], [1, 0], [1, 0]] + [[1, 1]] * 4 + [[1, 0]] * 4, bool)
    correct = np.array([[False, True, False, False], [True] * 4, [False] * 4])
    prompts = np.arange(6).reshape(3, 2)
    got = policy_pairs.pairs_from_samples(prompts, prompts > 0, ids, mask, correct)
    assert got["prompt_index"].tolist() == [0, 0]  # prompts 1 and 2 have no mixed outcome
    assert got["chosen_ids"].tolist() == [[5, 2]] * 2 and got["chosen_mask"].all()
    assert got["rejected_ids"].tolist() == [[4, 0], [6, 0]] and got["rejected_mask"].tolist() == [[1, 0]] * 2
    assert (got["prompt_ids"] == prompts[0]).all() and (got["prompt_mask"] == (prompts[0] > 0)).all()


def test_sampled_pairs_are_well_formed_and_deterministic(parity):
    model, params, task = parity
    prompts = policy_pairs.training_prompts(task, CFG)
    pairs, stats = policy_pairs.sample_pairs(model, params, task, prompts, CFG, rng=jax.random.key(1), batch_size=8)
    rule = lambda ids, rows: T.correct_rule(ids[:, 0], prompts["parity"][rows])
    rows = pairs["prompt_index"]
    assert stats["pairs"] == rows.size > 0 and stats["prompts"] == CFG.num_prompts
    assert rule(pairs["chosen_ids"], rows).all() and not rule(pairs["rejected_ids"], rows).any()
    assert (pairs["prompt_ids"] == prompts["prompt_ids"][rows]).all()
    for c, cm, r, rm in zip(pairs["chosen_ids"], pairs["chosen_mask"], pairs["rejected_ids"], pairs["rejected_mask"]):
        assert cm[0] and rm[0] and c[cm].tolist() != r[rm].tolist()
    # training prompts only: none of them is a held-out sum
    text = [task.decode(i[m]) for i, m in zip(pairs["prompt_ids"], pairs["prompt_mask"])]
    a, b = zip(*(map(int, t.rstrip("=").split("+")) for t in text))
    assert not data.is_held_out(data.AdditionTask(num_digits=2), np.array(a), np.array(b)).any()
    again, _ = policy_pairs.sample_pairs(model, params, task, prompts, CFG, rng=jax.random.key(1), batch_size=20)
    assert all((again[k] == pairs[k]).all() for k in pairs)  # a function of the key and the params alone


def test_reward_model_phase_trains_on_both_pair_sets(parity, tmp_path):
    """`pairs="both"`: the synthetic and the on-policy pairs (responses of another length)
    in one training set; both held-out sets evaluated. Without synthetic pairs: one line."""
    model, params, task = parity
    cfg = config_base.pairs_phase("reward_model", steps=2, batch_size=8, pairs="both", samples_per_prompt=4,
                                  num_prompts=12)
    train = config_base.train(progress=False, tensorboard=False, eval_batch_size=8)
    kw = dict(policy_model=model, policy_params=params, workdir=tmp_path, rng=jax.random.key(0))
    writer = MetricsWriter(tmp_path, tensorboard=False)
    try:
        with pytest.raises(ValueError, match="reward_model.pairs='both' needs the task's preference pairs"):
            pair_phases.reward_model_phase(cfg, train, task=dataclasses.replace(task, pairs=None), writer=writer, **kw)
        _, _, held_out = pair_phases.reward_model_phase(cfg, train, task=task, writer=writer, **kw)
    finally:
        writer.close()
    assert held_out["policy_pairs/train_pairs"] > 0 and held_out["policy_pairs/test_prompts"] == T.NUM_PROMPTS
    assert 0 <= held_out["policy_pairs/accuracy"] <= 1 and 0 <= held_out["accuracy"] <= 1


def test_pair_options_are_checked_before_any_work():
    import importlib.util

    path = os.path.join(os.path.dirname(__file__), "..", "..", "configs", "addition_ppo.py")
    spec = importlib.util.spec_from_file_location("addition_ppo", path)
    addition_ppo = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(addition_ppo)
    for key, value, expected in (("pairs", "mine", "reward_model.pairs='mine'"),
                                 ("samples_per_prompt", 1, "reward_model.samples_per_prompt=1"),
                                 ("samples_per_prompt", 0, "reward_model.samples_per_prompt=0"),
                                 ("temperature", 0.0, "reward_model.temperature=0.0")):
        config = addition_ppo.get_config("tiny")
        config.unlock()
        config.reward_model.update(pairs="policy", samples_per_prompt=8)
        config.reward_model[key] = value
        with pytest.raises(ValueError, match=expected.replace("(", r"\(")):
            validation.check_values(config)
