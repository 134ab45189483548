"""Python rewards by import path (`config.reward`), end to end on a tiny random Hugging Face
checkpoint and a JSONL file: PPO trains on them through the host-reward path with the rows'
own fields, and bad input stops the run with the function's name."""

import importlib.util
import json
import sys
from pathlib import Path

import numpy as np
import pytest

from jaxrlhf.runs import train_and_evaluate

CONFIGS = Path(__file__).resolve().parents[2] / "configs"

REWARDS = '''
def level(completions, level, **kwargs):
    return [float(x) for x in level]

def one_short(completions, **kwargs):
    return [0.0] * (len(completions) - 1)
'''


def _config(name: str):
    spec = importlib.util.spec_from_file_location(name, CONFIGS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.get_config("tiny")


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """(checkpoint folder, train.jsonl) with a reward module `own_rewards` on sys.path."""
    from jaxrlhf import data
    from jaxrlhf.models import ModelConfig, random_init, save_pretrained

    root = tmp_path_factory.mktemp("own")
    tok = data.CharTokenizer().to_hf()
    cfg = ModelConfig(vocab_size=len(tok), hidden_size=16, intermediate_size=32, num_layers=1, num_heads=2,
                      num_kv_heads=1, head_dim=8, model_type="qwen2", qkv_bias=True, pad_token_id=0, bos_token_id=1, eos_token_id=2)
    save_pretrained(*random_init(cfg), root / "ckpt", tokenizer=tok)
    rows = [{"question": f"{a}+{b}=", "answer": f"#### {a + b}", "level": 2} for a, b in [(1, 2), (3, 4), (5, 6), (7, 1)]]
    (root / "train.jsonl").write_text("\n".join(json.dumps(r) for r in rows))
    (root / "own_rewards.py").write_text(REWARDS)
    sys.path.insert(0, str(root))
    yield root / "ckpt", root / "train.jsonl"
    sys.path.remove(str(root))
    sys.modules.pop("own_rewards", None)


def _with(config, ckpt, path, **reward):
    with config.unlocked():
        config.model.path, config.task.path = str(ckpt), str(path)
        config.reward.update(reward)
        config.train.update(eval_every=0, export=False)
    return config


@pytest.mark.heavy  # PPO: a further case of the imported reward path
def test_ppo_trains_on_an_imported_reward_with_the_rows_fields(files, tmp_path):
    """PPO's score is the weighted sum of the task's reward (weight 0 here) and the imported
    function's, which reads each row's `level` field."""
    config = _with(_config("hf_jsonl_ppo"), *files, fns="own_rewards:level", weights="0.5", task_weight=0.0)
    with config.unlocked():
        config.ppo.steps = 1
    train_and_evaluate(config, tmp_path / "run")
    row = json.loads((tmp_path / "run" / "metrics.jsonl").read_text().splitlines()[0])
    assert row["ppo/reward/level"] == 2.0 and row["ppo/reward/mean"] == pytest.approx(0.5 * 2.0)
    assert row["ppo/time/scoring_s"] >= row["ppo/time/host_reward_s"] > 0  # the host reward is part of scoring
    assert row["ppo/time/rollout_s"] > 0 and row["ppo/time/update_s"] > 0


def test_a_reward_that_does_not_import_stops_the_run_before_any_work(files, tmp_path):
    config = _with(_config("hf_gsm8k_grpo"), *files, fns="own_rewards:level,not_a_module_q:fn")
    with pytest.raises(ValueError, match=r"reward 'not_a_module_q:fn': module 'not_a_module_q' does not import"):
        train_and_evaluate(config, tmp_path / "run")
    assert not (tmp_path / "run").exists()
    config = _with(_config("hf_gsm8k_grpo"), *files, fns="own_rewards:level", weights="1,2")
    with pytest.raises(ValueError, match=r"reward.weights='1,2' gives 2 weights for the 1 functions"):
        train_and_evaluate(config, tmp_path / "run")


def test_a_reward_with_the_wrong_number_of_scores_stops_grpo_naming_it(files, tmp_path):
    config = _with(_config("hf_gsm8k_grpo"), *files, fns="own_rewards:one_short")
    with pytest.raises(ValueError, match=r"reward 'one_short' returned shape \(\d+,\); expected \[N\]"):
        train_and_evaluate(config, tmp_path / "run")
    assert not (tmp_path / "run" / "grpo").exists()  # no GRPO step, no checkpoint


def test_responses_end_at_every_stop_token_of_the_checkpoint_and_config(files, tmp_path):
    """A chat model's several EOS ids: the tokenizer's, `generation_config.json`'s list and
    `task.stop_tokens` (a token string and an id) reach the task, its rewards and the RL
    phases' samplers (the sampler's own stopping: tests/rollout/test_stop_ids.py); a token
    the tokenizer lacks is refused naming the field."""
    import shutil

    from jaxrlhf.runs import phases, tasks

    ckpt = shutil.copytree(files[0], tmp_path / "ckpt")
    (ckpt / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 9]}))
    config = _with(_config("hf_gsm8k_grpo"), ckpt, files[1])
    with config.unlocked():
        config.task.stop_tokens = "=, 7"
    task = tasks.build_task(config.task, model_path=str(ckpt))
    want = (2, 9, task.tokenizer.convert_tokens_to_ids("="), 7)
    assert task.stop_ids == want and task.eos_id == 2
    assert phases.library_config("grpo", config.grpo, task).sampling.eos_id == want
    assert all(c.eos_id == want for c in task.reward.components)
    ids = np.asarray([[5, 9, 6], [5, 7, 6], [5, 6, 6]])  # "1<9>2", "1<7>2", "122"
    assert task.answers(ids, np.ones_like(ids, bool)) == ["1", "1", "122"]  # the text before the first stop
    with config.unlocked():
        config.task.stop_tokens = "<|im_end|>"
    with pytest.raises(ValueError, match=r"task.stop_tokens: '<\|im_end\|>' is neither a token"):
        tasks.build_task(config.task, model_path=str(ckpt))
