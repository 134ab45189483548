"""The `:tiny` variants of the GRPO-family configs of issue 43 (CISPO, GDPO,
REINFORCE++-baseline) end to end, once each, with a bound each algorithm's broken form
fails. (tests/runs/test_configs.py also runs them, heavy-marked, with a resume.)"""

import importlib.util
import json
import math
from pathlib import Path

import pytest

from jaxrlhf.runs import train_and_evaluate

pytestmark = pytest.mark.heavy  # end-to-end runs: the full suite (CI) runs them, the quick command leaves them out

CONFIGS = Path(__file__).resolve().parents[2] / "configs"


def _run(name, workdir):
    spec = importlib.util.spec_from_file_location(name, CONFIGS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    config = module.get_config("tiny")
    with config.unlocked():
        config.train.update(export=False, checkpoint_every=100)
    summary = train_and_evaluate(config, workdir)
    rows = [json.loads(line) for line in (workdir / "metrics.jsonl").read_text().splitlines()]
    rows = [{k[len("grpo/"):]: v for k, v in r.items() if k.startswith("grpo/")} for r in rows]
    rows = [r for r in rows if "loss" in r]
    assert rows and all(math.isfinite(r["loss"]) and r["finite"] == 1 for r in rows)
    # the policy moved: a step with lr > 0 and a non-zero gradient (the first has lr 0: warm-up)
    assert any(r["lr"] > 0 and r["grad_norm"] > 0 for r in rows)
    assert {"accuracy", "reward"} <= set(summary["stages"]["after GRPO"])
    return rows


@pytest.mark.parametrize("name", ["addition_cispo", "addition_gdpo", "addition_rpp_baseline"])
def test_tiny_config_trains(name, tmp_path):
    rows = _run(name, tmp_path)
    if name == "addition_cispo":
        # two minibatches: the second one's ratio leaves 1 (with one update per batch it is
        # exactly 1 and CISPO is REINFORCE); clipfrac is logged
        assert all("clipfrac" in r for r in rows)
        assert max(max(r["ratio_max"] - 1, 1 - r["ratio_min"]) for r in rows) > 1e-4
    if name == "addition_gdpo":
        # the two components (exact match, the format x 100), each logged; whitened over the
        # batch, the advantages' std is ~1
        assert all({"reward/exact_match", "reward/answer_format"} <= set(r) and "reward/token_match" not in r
                   for r in rows)
        assert all(0.5 < r["advantage/std"] < 1.5 for r in rows)
