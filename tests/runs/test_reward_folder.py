"""A pretrained reward model from a folder (`reward.model_path`) for GRPO and PPO, and the
sampled completions log (`train.log_completions_every`), in-process on a tiny random
checkpoint and a JSONL file: the logged `reward_model` component is the folder's score of
the logged tokens, recomputed with `transformers`; bad folders are refused naming the field."""

import importlib.util
import json
import shutil
from pathlib import Path

import numpy as np
import pytest

from jaxrlhf.runs import train_and_evaluate

CONFIGS = Path(__file__).resolve().parents[2] / "configs"


def _config(name: str):
    spec = importlib.util.spec_from_file_location(name, CONFIGS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.get_config("tiny")


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """(policy folder, reward-model folder, train.jsonl), one tokenizer saved in both."""
    from jaxrlhf import data
    from jaxrlhf.models import ModelConfig, random_init, save_pretrained

    root = tmp_path_factory.mktemp("rm")
    tok = data.CharTokenizer().to_hf()
    cfg = ModelConfig(vocab_size=len(tok), hidden_size=16, intermediate_size=32, num_layers=1, num_heads=2,
                      num_kv_heads=1, head_dim=8, model_type="llama", pad_token_id=0, bos_token_id=1, eos_token_id=2)
    save_pretrained(*random_init(cfg), root / "ckpt", tokenizer=tok)
    save_pretrained(*random_init(cfg, head="score", seed=3), root / "rm", tokenizer=tok)
    rows = [{"question": f"{a}+{b}=", "answer": f"#### {a + b}"} for a, b in [(1, 2), (3, 4), (5, 6), (7, 1)]]
    (root / "train.jsonl").write_text("\n".join(json.dumps(r) for r in rows))
    return root / "ckpt", root / "rm", root / "train.jsonl"


def _with(config, files, **reward):
    ckpt, rm, path = files
    with config.unlocked():
        config.model.path, config.task.path = str(ckpt), str(path)
        config.reward.update(dict(dict(model_path=str(rm)), **reward))
        config.train.update(eval_every=0, export=False, log_completions_every=1)
    return config


def _hf_scores(rm, rows):
    """The folder's scores of each row's prompt ⧺ completion tokens, by `transformers`."""
    import torch
    import transformers

    model = transformers.AutoModelForSequenceClassification.from_pretrained(rm).eval()
    model.config.pad_token_id = None  # one unpadded row: its last token (a sampled pad id counts)
    with torch.no_grad():
        return np.array([model(torch.tensor([r["prompt_ids"] + r["completion_ids"]])).logits[0, 0].item()
                         for r in rows])


def _read(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


@pytest.fixture(scope="module")
def grpo_run(files, tmp_path_factory):
    """A 2-step GRPO run scored by the task's reward + 0.5 × the folder's, logging completions
    every step, with an offline W&B run."""
    import os

    os.environ.pop("WANDB_API_KEY", None)
    os.environ["WANDB_SILENT"] = "true"
    config = _with(_config("hf_gsm8k_grpo"), files, model_weight=0.5)
    with config.unlocked():
        config.train.update(wandb=True, wandb_mode="offline")
    workdir = tmp_path_factory.mktemp("grpo") / "run"
    train_and_evaluate(config, workdir)
    return workdir


def test_grpo_scores_with_the_folders_reward_model(files, grpo_run):
    metrics = _read(grpo_run / "metrics.jsonl")
    rows = _read(grpo_run / "completions.jsonl")
    assert [r["step"] for r in rows] == [1] * 8 + [2] * 8  # 4 prompts × 2 samples, every step
    np.testing.assert_allclose([r["reward/reward_model"] for r in rows], _hf_scores(files[1], rows),
                               rtol=1e-4, atol=1e-5)
    for step, m in enumerate(metrics, start=1):  # the rows are the whole step here: their means are the metrics'
        mine = [r for r in rows if r["step"] == step]
        assert np.mean([r["reward/reward_model"] for r in mine]) == pytest.approx(m["grpo/reward/reward_model"],
                                                                                   abs=1e-5)
        assert np.mean([r["reward"] for r in mine]) == pytest.approx(m["grpo/reward/mean"], abs=1e-5)
    for r in rows:
        others = sum(v for k, v in r.items() if k.startswith("reward/") and k != "reward/reward_model")
        assert r["reward"] == pytest.approx(others + 0.5 * r["reward/reward_model"], abs=1e-5)
        assert np.isfinite(r["advantage"])


def test_completions_decode_their_tokens_and_reach_wandb(files, grpo_run):
    from jaxrlhf.models import load_tokenizer

    tok = load_tokenizer(files[0])
    for r in _read(grpo_run / "completions.jsonl"):
        assert r["completion"] == tok.decode(r["completion_ids"], skip_special_tokens=True)
        assert r["prompt"] == tok.decode(r["prompt_ids"], skip_special_tokens=True) and r["phase"] == "grpo"
    tables = list((grpo_run / "wandb").glob("offline-run-*/files/media/table/grpo/completions_*.table.json"))
    assert len(tables) == 2, list((grpo_run / "wandb").rglob("*"))
    assert len(json.loads(tables[0].read_text())["data"]) == 8


@pytest.mark.heavy  # end to end; the GRPO one is not
def test_ppo_with_the_task_reward_and_the_folders(files, tmp_path):
    """`ppo.reward="task"` + `reward.model_path`: no reward-model phase; the score is the
    task's reward + the folder's."""
    config = _with(_config("hf_jsonl_ppo"), files)
    with config.unlocked():
        config.ppo.update(steps=1, reward="task")
    train_and_evaluate(config, tmp_path / "run")
    assert not (tmp_path / "run" / "reward_model").exists()
    m = _read(tmp_path / "run" / "metrics.jsonl")[0]
    rows = _read(tmp_path / "run" / "completions.jsonl")
    assert len(rows) == 4  # prompts_per_step × 1 sample
    np.testing.assert_allclose([r["reward/reward_model"] for r in rows], _hf_scores(files[1], rows),
                               rtol=1e-4, atol=1e-5)
    assert np.mean([r["reward/reward_model"] for r in rows]) == pytest.approx(m["ppo/reward/reward_model"], abs=1e-5)


def test_a_folder_that_is_not_a_reward_model_or_reads_other_tokens_is_refused(files, tmp_path):
    ckpt, rm, _ = files
    config = _with(_config("hf_gsm8k_grpo"), (ckpt, ckpt, files[2]))  # a causal LM
    with pytest.raises(ValueError, match=r"reward.model_path=.*architectures=\['LlamaForCausalLM'\] is not a reward"):
        train_and_evaluate(config, tmp_path / "run")
    assert not (tmp_path / "run").exists()
    other = shutil.copytree(rm, tmp_path / "other")
    spec = json.loads((other / "tokenizer.json").read_text())
    vocab = spec["model"]["vocab"]
    vocab["1"], vocab["2"] = vocab["2"], vocab["1"]
    (other / "tokenizer.json").write_text(json.dumps(spec))
    config = _with(_config("hf_gsm8k_grpo"), (ckpt, other, files[2]))
    with pytest.raises(ValueError, match=r"reward.model_path=.*tokenizer differs from the policy's \(token '1' is id"):
        train_and_evaluate(config, tmp_path / "run2")
    for f in other.glob("*"):
        if f.name not in ("config.json", "model.safetensors"):
            f.unlink()
    cfg = json.loads((other / "config.json").read_text())
    (other / "config.json").write_text(json.dumps(dict(cfg, vocab_size=cfg["vocab_size"] + 1)))
    config = _with(_config("hf_gsm8k_grpo"), (ckpt, other, files[2]))
    with pytest.raises(ValueError, match=r"reward.model_path=.*vocab_size \d+ != the policy's \d+"):
        train_and_evaluate(config, tmp_path / "run3")
