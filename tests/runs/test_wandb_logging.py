"""Weights & Biases as an optional logger: a tiny SFT run with `train.wandb=True` offline
writes the offline run's files beside `metrics.jsonl`, with the same metrics; without the
package the flag is refused with a clear error (in-process, ~6 s)."""

import builtins
import importlib.util
import json
from pathlib import Path

import pytest

from jaxrlhf.runs import metrics, train_and_evaluate

CONFIGS = Path(__file__).resolve().parents[2] / "configs"


def _tiny_sft(**train):
    spec = importlib.util.spec_from_file_location("addition_sft", CONFIGS / "addition_sft.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    config = module.get_config("tiny")
    with config.unlocked():
        config.sft.steps = 2
        config.train.update(export=False, eval_every=0, checkpoint_every=2, **train)
    return config


def test_an_offline_wandb_run_logs_beside_metrics_jsonl(tmp_path, monkeypatch):
    import wandb  # noqa: F401  (the test extra installs it: the logger is tested, not skipped)
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    monkeypatch.setenv("WANDB_SILENT", "true")
    train_and_evaluate(_tiny_sft(wandb=True, wandb_project="jaxrlhf-test"), tmp_path / "run")
    runs = list((tmp_path / "run" / "wandb").glob("offline-run-*"))
    assert len(runs) == 1, list((tmp_path / "run").rglob("*"))
    assert list(runs[0].glob("*.wandb")), "no offline run file"
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2] and "sft/loss" in rows[0]


def test_wandb_without_the_package_is_a_clear_error(tmp_path, monkeypatch):
    real_import = builtins.__import__

    def no_wandb(name, *args, **kwargs):
        if name == "wandb":
            raise ImportError("No module named 'wandb'")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_wandb)
    with pytest.raises(ValueError, match=r"train.wandb=True needs the wandb package: pip install"):
        metrics.start_wandb(tmp_path, project="p")
    with pytest.raises(ValueError, match="train.wandb_mode='cloud'"):
        monkeypatch.setattr(builtins, "__import__", real_import)
        metrics.start_wandb(tmp_path, project="p", mode="cloud")
