"""PPO's critic from a checkpoint of another size (`ppo.critic_path`): a causal LM folder
gets a fresh score head, a sequence-classification folder keeps its own; the critic's
relation to the other options is checked before any work."""

from __future__ import annotations

import importlib.util
import logging
from pathlib import Path

import numpy as np
import pytest

from jaxrlhf import data
from jaxrlhf.models import ModelConfig, load_pretrained, random_init, save_pretrained
from jaxrlhf.runs import train_and_evaluate

pytestmark = pytest.mark.heavy  # end-to-end runs: the full suite (CI) runs them, the quick command leaves them out

REPO = Path(__file__).resolve().parents[2]


def _config(**ppo):
    spec = importlib.util.spec_from_file_location("addition_ppo_rule", REPO / "configs" / "addition_ppo_rule.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    config = module.get_config("tiny")
    with config.unlocked():
        config.sft.steps = 0
        config.ppo.update(steps=2, **ppo)
        config.train.update(eval_every=0, export=False)
    return config


def _critic_folder(path: Path, head: str) -> Path:
    """A random critic wider and deeper than the tiny policy (hidden 48, 2 layers)."""
    cfg = ModelConfig(vocab_size=data.CharTokenizer().vocab_size, hidden_size=48, intermediate_size=96, num_layers=2,
                      num_heads=2, num_kv_heads=2, head_dim=24, max_position_embeddings=64)
    model, params = random_init(cfg, head=head, seed=7)
    save_pretrained(model, params, path)
    return path



@pytest.mark.parametrize("head", ["lm", "score"])
def test_a_critic_of_another_size_from_a_folder_trains(tmp_path, caplog, head):
    folder = _critic_folder(tmp_path / "critic", head)
    with caplog.at_level(logging.INFO, logger="jaxrlhf"):
        summary = train_and_evaluate(_config(critic_path=str(folder)), tmp_path / "run")
    assert "after PPO" in summary["stages"]
    assert f"PPO critic from {folder}: 2 layers, hidden size 48" in caplog.text
    if head == "score":  # its own score head is kept, not drawn anew
        assert "initialised" not in caplog.text.split("PPO critic from")[0].split("score")[-1]
        _, saved = load_pretrained(folder)
        assert np.asarray(saved["score"]["kernel"]).shape == (48, 1)


@pytest.mark.parametrize("ppo, message", [
    (dict(critic_path="/no/such/folder"), r"ppo.critic_path='/no/such/folder': no Hugging Face checkpoint folder"),
    (dict(critic_path="{folder}", critic="shared"), r"ppo.critic_path=.* puts the value head on the actor"),
], ids=["missing", "shared"])
def test_a_critic_path_that_cannot_work_is_refused_before_any_work(tmp_path, ppo, message):
    folder = _critic_folder(tmp_path / "critic", "lm")
    ppo = {k: v.format(folder=folder) for k, v in ppo.items()}
    with pytest.raises(ValueError, match=message):
        train_and_evaluate(_config(**ppo), tmp_path / "run")
    assert not (tmp_path / "run").exists()


def test_a_critic_path_with_lora_on_ppo_is_refused(tmp_path):
    config = _config(critic_path=str(_critic_folder(tmp_path / "critic", "lm")))
    with config.unlocked():
        config.model.lora.rank = 4
    with pytest.raises(ValueError, match=r"ppo.critic_path=.*model.lora trains PPO's critic as adapters"):
        train_and_evaluate(config, tmp_path / "run")
