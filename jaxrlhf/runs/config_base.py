"""The sections every config file in `configs/` is assembled from, each generated from its
dataclass (`runs.sections`: every option's name, default, bounds and doc live there).

A config file picks sections, changes what its task needs, and `lock()`s the result, so
that `--config.optim.lr=1e-6` works and `--config.optim.lrr=1e-6` is an error naming `lr`.
A phase turns its section back into its algorithm's config with `options.build`
(`GRPOConfig(**section)`); `None` turns off an option that can be off, here and on the
command line (`--config.grpo.clip_high=None`). The table of every option:
docs/options.md.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import ml_collections as mlc

from jaxrlhf.algorithms.common import OptimConfig
from jaxrlhf.algorithms.experience import SamplingConfig
from jaxrlhf.monitor import MonitorConfig
from jaxrlhf.options import section
from jaxrlhf.runs import sections as S


def recipe(beside: str, name: str, arg=None) -> mlc.ConfigDict:
    """`get_config(arg)` of the config file `name`.py in the folder of `beside` (a config
    file's `__file__`), unlocked: a config that varies a recipe starts from it and changes
    only its own fields (`configs/addition_cispo.py`), so the recipe is written once."""
    path = Path(beside).with_name(f"{name}.py")
    spec = importlib.util.spec_from_file_location(f"jaxrlhf_recipe_{name}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    c = module.get_config(arg)
    c.unlock()
    return c


def parallel(c: mlc.ConfigDict, **kw) -> mlc.ConfigDict:
    """Top-level `mesh` and `rules` of config `c` (`sections.Parallel`): the device mesh every
    phase runs on and the sharding rules of every role's parameters. Override with
    `--config.mesh=fsdp=2,tensor=2 --config.rules=fsdp`."""
    c.update(section(S.Parallel, **kw))
    return c


def task(**kw) -> mlc.ConfigDict:
    """The built-in addition task (`sections.AdditionTask`)."""
    return section(S.AdditionTask, **kw)


def jsonl_task(**kw) -> mlc.ConfigDict:
    """Rows from local JSONL/Parquet files and TFDS datasets (`sections.JsonlTask`)."""
    return section(S.JsonlTask, **kw)


def word_problems_task(**kw) -> mlc.ConfigDict:
    """Generated arithmetic questions in words for a chat model (`sections.WordProblemsTask`)."""
    return section(S.WordProblemsTask, **kw)


def calculator_task(**kw) -> mlc.ConfigDict:
    """The built-in multi-turn tool task: sums with a calculator (`sections.CalculatorTask`)."""
    return section(S.CalculatorTask, **kw)


def env_task(**kw) -> mlc.ConfigDict:
    """Your environment class (`env.cls`) on rows from JSONL files (`sections.EnvTask`)."""
    return section(S.EnvTask, **kw)


def env(**kw) -> mlc.ConfigDict:
    """The episodes' environment and limits (`sections.EnvSection`)."""
    return section(S.EnvSection, **kw)


def reward(**kw) -> mlc.ConfigDict:
    """Python rewards and a reward-model folder beside the task's (`sections.RewardSection`)."""
    return section(S.RewardSection, **kw)


def model(**kw) -> mlc.ConfigDict:
    """A fresh model of these sizes, or `path=` a local Hugging Face checkpoint folder
    (`sections.ModelSection`); `lora`: train low-rank adapters instead of all weights."""
    return section(S.ModelSection, **kw)


def lora(**kw) -> mlc.ConfigDict:
    """LoRA adapters (`sections.LoRASection`)."""
    return section(S.LoRASection, **kw)


def optim(**kw) -> mlc.ConfigDict:
    """An optimizer (`algorithms.common.OptimConfig`)."""
    return section(OptimConfig, **kw)


def sampling(**kw) -> mlc.ConfigDict:
    """How an RL phase samples (`algorithms.experience.SamplingConfig`)."""
    return section(SamplingConfig, **kw)


def sft(**kw) -> mlc.ConfigDict:
    """The supervised phase (`sections.SFTRun` + `algorithms.sft.SFTConfig`; the warm start
    of RL runs, `steps=0` skips it)."""
    return section(*S.PHASE_SECTIONS["sft"], **kw)


def addition_warm_start() -> mlc.ConfigDict:
    """The addition configs' SFT warm start: 600 steps of a 900-step cosine schedule at lr
    1e-3, stopping with the policy still wrong on a quarter of held-out sums (0.78 / 0.75 /
    0.63 exact match for seeds 0 / 1 / 2) for the RL phase to work on. At lr 3e-3 the end
    point was bimodal (0.12 to 0.94 by seed and even by float rounding)."""
    return sft(steps=600, batch_size=64, optim=dict(lr=1e-3, schedule="cosine", warmup_steps=50,
                                                    decay_steps=900, end_lr_ratio=0.1))


def grpo(**kw) -> mlc.ConfigDict:
    """The GRPO family (`sections.GRPORun` + `algorithms.grpo.GRPOConfig`)."""
    return section(*S.PHASE_SECTIONS["grpo"], **kw)


def monitor(**kw) -> mlc.ConfigDict:
    """The health monitor's thresholds (`monitor.MonitorConfig`)."""
    return section(MonitorConfig, **kw)


def train(**kw) -> mlc.ConfigDict:
    """The loop: logging, evaluation, early stopping, checkpoints, export, the update guard
    and the health monitor (`sections.TrainConfig`)."""
    return section(S.TrainConfig, **kw)


def pairs_phase(kind: str, **kw) -> mlc.ConfigDict:
    """Training on preference pairs: kind "reward_model" (`sections.RewardModelRun` +
    `algorithms.reward_model.RewardModelConfig`) or "dpo" (`sections.DPORun` +
    `algorithms.dpo.DPOConfig`)."""
    return section(*S.PHASE_SECTIONS[kind], **kw)


def ppo(**kw) -> mlc.ConfigDict:
    """RLHF-PPO (`sections.PPORun` + `algorithms.ppo.PPOConfig`)."""
    return section(*S.PHASE_SECTIONS["ppo"], **kw)
