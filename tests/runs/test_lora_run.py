"""LoRA through `train_and_evaluate` on the built-in addition task, at tiny size.

The SFT warm start trains all weights; the GRPO phase then trains rank-8 adapters only,
against the warm-started policy (the base without adapters) as the reference
(`--config.model.lora.rank=8 --config.model.lora.phases=grpo`, as docs/training.md shows).
The resumed run starts from a copy of the finished one and reuses its compiled programs
(a persistent compile cache). DPO with LoRA learns in tests/algorithms/test_dpo.py.
"""

from __future__ import annotations

import importlib.util
import json
import logging
import os
import shutil
import sys
from pathlib import Path

import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _compile_cache import persistent_compile_cache, session_folder  # noqa: E402

from jaxrlhf.runs import train_and_evaluate  # noqa: E402

pytestmark = pytest.mark.heavy  # GRPO with LoRA end to end; LoRA steps also in models/test_lora.py

CONFIGS = Path(__file__).resolve().parents[2] / "configs"


def _config():
    """`configs/addition_grpo.py:tiny` with a warm start that leaves the policy often wrong
    (0.63 held-out exact match under the suite's -O0 compile) and LoRA on the GRPO phase, as
    the command line would set it. The SFT rate is 1e-3: at 3e-3 the end point was bimodal (0.15 on one machine, 0.93 on
    another, by float rounding), which left GRPO nothing to raise."""
    spec = importlib.util.spec_from_file_location("addition_grpo", CONFIGS / "addition_grpo.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    c = module.get_config("tiny")
    c.task.update(reverse_answer=True, num_train=1024, num_test=256)
    c.model.update(num_layers=2, num_heads=4)
    c.model.lora.update(rank=8, phases="grpo")
    c.sft.update(steps=700, batch_size=64)
    c.sft.optim.update(lr=1e-3, schedule="constant", warmup_steps=0)
    c.train.update(eval_every=0, checkpoint_every=25)
    return c


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    return session_folder(tmp_path_factory)


@pytest.fixture(scope="module")
def grpo_run(tmp_path_factory, cache):
    c = _config()
    # The shipped recipe's dynamic sampling (a pool of 2 x the prompts a step) without its
    # guidance term, so that what the adapters learn comes from the GRPO loss alone.
    c.grpo.update(steps=150, prompts_per_step=16, pool_size=32, guide_coef=0.0, beta=0.04)
    c.grpo.sampling.num_samples = 8
    c.grpo.optim.update(lr=1e-3, schedule="constant", warmup_steps=0)
    workdir = tmp_path_factory.mktemp("lora_grpo")
    with persistent_compile_cache(cache):
        return c, workdir, train_and_evaluate(c, workdir)


def test_grpo_with_lora_raises_held_out_accuracy(grpo_run):
    _, workdir, summary = grpo_run
    before, after = summary["stages"]["after SFT"], summary["stages"]["after GRPO"]
    print("GRPO with LoRA: held-out exact match", before["accuracy"], "->", after["accuracy"], "reward",
          before["reward"], "->", after["reward"])
    # Measured (the suite's -O0 compile, 2026-12-06): exact match 0.633 -> 0.668, reward 1.060 -> 1.103
    # (lr 3e-3 without the pool fell to 0.512; 1e-3 without it to 0.590).
    assert after["accuracy"] > before["accuracy"] and after["reward"] >= before["reward"] + 0.03, (before, after)
    rows = [json.loads(line) for line in (workdir / "metrics.jsonl").read_text().splitlines()]
    kl = [r["grpo/kl/mean"] for r in rows if "grpo/kl/mean" in r]
    assert kl and kl[0] < 1e-6 < max(kl)  # step 0: policy = base = reference; then the adapters move it


def test_export_is_merged_plus_a_peft_folder_on_the_warm_started_base(grpo_run):
    _, workdir, _ = grpo_run
    export = workdir / "export"
    assert (export / "config.json").exists() and (export / "model.safetensors").exists()
    peft = json.loads((export / "peft" / "adapter_config.json").read_text())
    assert peft["peft_type"] == "LORA" and peft["r"] == 8 and peft["lora_alpha"] == 16.0
    assert sorted(peft["target_modules"]) == sorted(
        ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"])
    assert peft["base_model_name_or_path"] == "./base"  # the SFT warm start changed it: saved inside, relative
    assert (export / "peft" / "adapter_model.safetensors").exists()
    assert (export / "peft" / "base" / "config.json").exists()


def test_grpo_with_lora_resumes_exactly(grpo_run, tmp_path, cache, caplog):
    """The finished run's workdir without its last GRPO checkpoint (a kill after step 75's
    save): the rerun restores the adapters and their optimizer state at step 75 and logs
    steps 76-100 and results equal to the uninterrupted run's."""
    config, full, summary = grpo_run
    resumed = tmp_path / "resumed"
    shutil.copytree(full, resumed)
    shutil.rmtree(resumed / "grpo" / str(config.grpo.steps))
    rows = lambda w: [{k: v for k, v in json.loads(r).items() if "/time/" not in k}
                      for r in (w / "metrics.jsonl").read_text().splitlines()]
    with persistent_compile_cache(cache), caplog.at_level(logging.INFO, logger="jaxrlhf"):
        again = train_and_evaluate(config, resumed)
    last = config.grpo.steps - config.train.checkpoint_every
    assert f"grpo: resuming at step {last} of {config.grpo.steps}" in caplog.text
    assert rows(resumed) == rows(full)
    assert again["stages"] == summary["stages"]
