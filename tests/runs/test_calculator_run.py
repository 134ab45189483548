"""The built-in calculator task end to end (`configs/calculator_grpo.py:tiny` through
`python -m jaxrlhf.train`): SFT on the expert's demonstrations teaches well-formed calls,
GRPO runs on episodes with the environment's reward, the episode metrics are logged, and
the sequences the trainer scores are the sampled ones (sampler = trainer log-probs)."""

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests import _xla

REPO = Path(__file__).resolve().parents[2]


def _train(*args) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("XLA_FLAGS", "JAXRLHF_"))}
    env.update(JAX_PLATFORMS="cpu", XLA_FLAGS=_xla.flags(None))
    return subprocess.run([sys.executable, "-m", "jaxrlhf.train", *args], env=env, cwd=REPO, capture_output=True,
                          text=True, timeout=600)


@pytest.mark.heavy  # end to end; GRPO on episodes stays quick through the env-class and text-env runs
def test_tiny_calculator_config_trains_on_episodes(tmp_path):
    proc = _train("--config=configs/calculator_grpo.py:tiny", f"--workdir={tmp_path}", "--config.train.export=False")
    assert proc.returncode == 0, proc.stderr[-3000:]
    stages = json.loads((tmp_path / "summary.json").read_text())["stages"]
    # an untrained policy writes no well-formed call; SFT on the demonstrations does, and calls the calculator
    assert stages["start"]["well_formed_calls"] < 0.5
    assert stages["after SFT"]["well_formed_calls"] >= 0.9 and stages["after SFT"]["tool_calls"] >= 0.5
    assert {"accuracy", "reward", "turns", "tool_errors/malformed"} <= set(stages["after GRPO"])
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    rows = [{k[len("grpo/"):]: v for k, v in r.items() if k.startswith("grpo/")} for r in rows]
    rows = [r for r in rows if "loss" in r]
    assert len(rows) == 3
    for r in rows:
        assert r["finite"] == 1 and math.isfinite(r["loss"]) and math.isfinite(r["reward/env"])
        assert r["reward/mean"] == pytest.approx(r["reward/env"]) == pytest.approx(r["episode/reward"], abs=1e-6)
        for key in ("episode/turns", "episode/tool_calls", "episode/well_formed_calls", "episode/cut/turns",
                    "episode/tool_errors/malformed", "episode/env_seconds", "time/rollout_s"):
            assert math.isfinite(r[key]), key
        # the policy mask has holes: environment tokens sit in the sequence, and the loss
        # counts the policy's only (response_length is the policy mask's count)
        assert r["episode/env_tokens"] > 0
        assert r["response_length/mean"] == pytest.approx(r["episode/policy_tokens"])
        # the trainer's log-probs over whole episodes are the sampler's
        assert r["logp_mismatch"] < 1e-4


@pytest.mark.parametrize("algorithm", ["grpo", pytest.param("ppo", marks=pytest.mark.heavy)])
def test_your_environment_class_on_jsonl_rows(tmp_path, algorithm):
    """task.name='env': an environment class by import path (`env.cls`, here the calculator's
    own, made once per episode) on the rows of JSONL files, GRPO (or PPO) on its episodes."""
    from jaxrlhf.data import calculator as calc
    from jaxrlhf.runs import config_base as base
    from jaxrlhf.runs import train_and_evaluate

    task = calc.CalculatorTask(num_terms=2, num_digits=2)
    for name, split, n in (("train.jsonl", "train", 32), ("test.jsonl", "test", 8)):
        (tmp_path / name).write_text("".join(json.dumps(r) + "\n" for r in calc.make_rows(task, n, split=split)))
    c = base.mlc.ConfigDict()
    c.algorithm, c.seed = algorithm, 0
    base.parallel(c)
    c.task = base.env_task(path=str(tmp_path / "train.jsonl"), test_path=str(tmp_path / "test.jsonl"),
                                  max_prompt_tokens=8)
    c.env = base.env(cls="jaxrlhf.data.calculator:CalculatorEnv", max_turns=2, max_turn_tokens=6, max_total_tokens=16)
    c.reward = base.reward()
    c.model = base.model(hidden_size=32, intermediate_size=64, num_layers=1, num_heads=2, num_kv_heads=2,
                         head_dim=16)
    c.sft = base.sft(steps=0)
    if algorithm == "grpo":
        c.grpo = base.grpo(steps=2, prompts_per_step=4, sampling=dict(num_samples=2))
    else:
        c.ppo = base.ppo(steps=2, prompts_per_step=4, reward="task", sampling=dict(num_samples=2))
    c.train = base.train(log_every=1, eval_every=0, progress=False, tensorboard=False, export=False)
    summary = train_and_evaluate(c, tmp_path / "run")
    assert {"accuracy", "reward", "turns", "tool_calls"} <= set(summary["stages"][f"after {algorithm.upper()}"])
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    a = algorithm
    rows = [r for r in rows if f"{a}/loss" in r]
    assert len(rows) == 2 and all(math.isfinite(r[f"{a}/reward/env"]) and f"{a}/episode/turns" in r for r in rows)
    assert all(r[f"{a}/finite"] == 1 and math.isfinite(r[f"{a}/loss"]) for r in rows)


def test_env_cls_is_read_as_a_token_or_a_text_environment():
    from jaxrlhf.data import calculator as calc
    from jaxrlhf.runs import env_task

    make, stops = env_task.make_env_factory({"cls": "jaxrlhf.data.calculator:CalculatorEnv"})
    assert isinstance(make(), calc.CalculatorEnv) and stops == calc.STOP_IDS
    # a text environment (step(assistant_text)) needs a chat template to become tokens
    with pytest.raises(ValueError, match="chat template"):
        env_task.make_env_factory({"cls": "jaxrlhf.envs:ToolEnv"}, tokenizer=calc.TOKENIZER)
    with pytest.raises(ValueError, match="env.cls is empty"):
        env_task.make_env_factory({})
    with pytest.raises(ValueError, match="env.cls='nowhere:Env'"):
        env_task.make_env_factory({"cls": "nowhere:Env"})


@pytest.mark.heavy  # PPO on episodes end to end; the GRPO run and tests/algorithms/test_ppo_episodes.py are quick
def test_tiny_calculator_ppo_config_trains_on_episodes_with_a_critic(tmp_path):
    """configs/calculator_ppo.py:tiny: PPO on the episodes (a shorter SFT, enough for calls):
    finite PPO metrics beside the episode metrics, and the mask of the advantages, the
    values and the losses is the policy mask, with holes where the environment wrote."""
    proc = _train("--config=configs/calculator_ppo.py:tiny", f"--workdir={tmp_path}", "--config.train.export=False",
                  "--config.sft.steps=150", "--config.train.eval_every=0")
    assert proc.returncode == 0, proc.stderr[-3000:]
    stages = json.loads((tmp_path / "summary.json").read_text())["stages"]
    assert {"accuracy", "reward", "turns", "tool_calls"} <= set(stages["after PPO"])
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    rows = [{k[len("ppo/"):]: v for k, v in r.items() if k.startswith("ppo/")} for r in rows]
    rows = [r for r in rows if "loss" in r]
    assert len(rows) == 3
    for r in rows:
        assert r["finite"] == 1 and r["skipped_steps"] == 0
        for key in ("loss", "policy_loss", "value_loss", "entropy", "advantage/std", "returns/mean", "value/mean",
                    "grad_norm_critic", "kl/k1", "reward/env", "episode/turns", "episode/tool_calls",
                    "episode/well_formed_calls", "episode/cut/turns", "episode/env_seconds", "time/rollout_s"):
            assert math.isfinite(r[key]), key
        assert r["reward/mean"] == pytest.approx(r["reward/env"]) == pytest.approx(r["episode/reward"], abs=1e-6)
        assert r["first/ratio_mean"] == pytest.approx(1.0, abs=1e-5)  # the trainer's log-probs are the sampler's
        # the tokens the advantages, values and losses count (num_tokens) are the policy's,
        # and the episodes have the environment's between them: the mask has holes
        assert r["num_tokens"] == pytest.approx(8 * r["episode/policy_tokens"])
        assert r["response_length/mean"] == pytest.approx(r["episode/policy_tokens"])
    assert any(r["episode/env_tokens"] > 0 and r["episode/tool_calls"] > 0 for r in rows)


def test_ppo_on_episodes_needs_the_task_reward():
    """Episodes are scored by their environment: PPO's learned reward model is refused
    before any work."""
    import importlib.util

    from jaxrlhf.runs import experiment

    spec = importlib.util.spec_from_file_location("calculator_ppo", REPO / "configs" / "calculator_ppo.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    c = module.get_config("tiny")
    c.unlock()
    c.ppo.reward = "model"
    with pytest.raises(ValueError, match="ppo.reward='model'.*set ppo.reward='task'"):
        experiment._task(c)
