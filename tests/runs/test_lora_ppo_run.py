"""PPO with LoRA through the command line, at tiny size:
`python -m jaxrlhf.train --config=configs/addition_ppo.py:tiny --config.model.lora.rank=4`.

Every phase (SFT warm start, reward model, PPO's actor and critic) trains rank-4 adapters
(and the reward model's and critic's score heads); PPO's first iteration has KL 0 to its
reference, the base without the actor's adapters; the export is the merged policy, which
transformers loads, and its PEFT folder on the exported base gives the same logits.
`model.lora.phases` of a PPO run is checked in-process. The LoRA roles themselves are
tested in-process in tests/algorithms/test_ppo_lora.py.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import _xla
import numpy as np
import pytest

from jaxrlhf.runs import validation

pytestmark = pytest.mark.heavy  # LoRA PPO end to end; the LoRA PPO iteration also in algorithms/test_ppo_lora.py

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    workdir = tmp_path_factory.mktemp("ppo_lora")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("XLA_FLAGS", "JAXRLHF_"))}
    env.update(JAX_PLATFORMS="cpu", XLA_FLAGS=_xla.flags())
    proc = subprocess.run([sys.executable, "-m", "jaxrlhf.train", f"--config={REPO}/configs/addition_ppo.py:tiny",
                           "--config.model.lora.rank=4", f"--workdir={workdir}"], env=env, cwd=REPO,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return workdir


def test_every_phase_trains_adapters_and_ppo_starts_at_its_reference(run):
    log = (run / "train.log").read_text()
    assert log.count("LoRA rank 4 on") == 3  # the SFT warm start, the reward model, PPO's actor
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    kl = [r["ppo/kl/k1"] for r in rows if "ppo/kl/k1" in r]
    assert kl and kl[0] == 0.0  # the actor = the base = the reference at the first rollout
    for key in ("reward_model/grad_norm", "ppo/grad_norm", "ppo/grad_norm_critic"):
        assert all(r[key] > 0 for r in rows if key in r) and any(key in r for r in rows), key


def test_the_merged_export_loads_in_transformers_and_equals_its_peft_folder(run):
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    peft = pytest.importorskip("peft")
    export = run / "export"
    assert json.loads((export / "peft" / "adapter_config.json").read_text())["r"] == 4
    ids = torch.as_tensor(np.random.default_rng(0).integers(3, 14, (3, 9)))
    with torch.no_grad():
        merged = transformers.AutoModelForCausalLM.from_pretrained(export).eval()(input_ids=ids).logits.numpy()
        base = transformers.AutoModelForCausalLM.from_pretrained(export / "peft" / "base").eval()
        plain = base(input_ids=ids).logits.numpy()
        adapted = peft.PeftModel.from_pretrained(base, export / "peft").eval()(input_ids=ids).logits.numpy()
    assert np.abs(merged - plain).max() > 1e-4  # the adapters moved the policy
    np.testing.assert_allclose(adapted, merged, atol=1e-5, rtol=0)


def test_lora_phases_of_a_ppo_run_are_checked_before_any_work():
    """`model.lora.phases` may name PPO's reward-model and PPO phases ("" = all of them);
    a phase the run does not have is an error naming the field."""
    spec = importlib.util.spec_from_file_location("addition_ppo", REPO / "configs" / "addition_ppo.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    config = module.get_config("tiny")
    with config.unlocked():
        config.model.lora.rank = 4
        assert validation.lora_phases(config) == ("sft", "reward_model", "ppo")
        config.model.lora.phases = "reward_model,ppo"
        assert validation.lora_phases(config) == ("reward_model", "ppo")
        config.model.lora.phases = "grpo"
        with pytest.raises(ValueError, match=r"model.lora.phases='grpo': 'grpo' is not a phase of this run"):
            validation.lora_phases(config)
