"""A run config checked before any work: impossible values, and batch shapes that do not
fit the mesh.

`check_config(config, placement)` is called at the start of `train_and_evaluate`, before
the task, the model or the workdir are touched, so that a negative step count or a batch
that does not split over the devices fails in seconds with the key to change — not after
an SFT phase has run (each phase used to check its own shapes when it started, and a
negative `steps` ran nothing and reported success).

Checked for every phase the run will execute (`registry.plan`):
- the reward model's `pairs` and, for on-policy pairs, their sampling fields
  (`runs.policy_pairs.PolicyPairsConfig`);
- every option's type and bounds, as its dataclass field declares them (`runs.sections`,
  `jaxrlhf.options`: `grpo.num_minibatches=0 is impossible: it must be >= 1`);
- the global batch rows each phase hands to the mesh (`sft.batch_size`,
  `grpo.prompts_per_step` or `grpo.pool_size`, `ppo.prompts_per_step`, `dpo.batch_size`,
  `reward_model.batch_size`) against the mesh's row shards (`Placement.check_rows`);
- the rows of one update against its minibatches × microbatches (GRPO: prompts_per_step
  × num_samples responses; PPO: prompts_per_step × num_samples; DPO and the reward model:
  batch_size).
The held-out evaluation pads its batches to the mesh, so `train.eval_batch_size` only has
to be positive.

`check_built(config, task)`, once the task is built (still before the workdir is claimed),
builds every library config the run's phases will build (`GRPOConfig`, `PPOConfig`, their
optimizers, ...: each phase's registered `build`), so that a relation between options only the class checks
(`grpo.kl_target` needs `grpo.beta` > 0) fails there too.
"""

from __future__ import annotations

import dataclasses
from typing import Protocol

from jaxrlhf import options
from jaxrlhf.algorithms.common import OptimConfig
from jaxrlhf.models import lora, quant
from jaxrlhf.runs import phases, registry, sections
from jaxrlhf.runs.registry import plan
from jaxrlhf.runs.policy_pairs import PolicyPairsConfig


class RowChecker(Protocol):
    """What the checks need of a `sharding.Placement`: `check_rows(rows, field)` raises a
    ValueError naming `field` when `rows` does not split over the mesh's row shards."""

    def check_rows(self, rows: int, field: str) -> None: ...


def check_values(config) -> None:
    """Every option of the sections `config` runs (the phases of `registry.plan`,
    `train`, `task`, `model`, `reward`, the top level) within its type and bounds, as its
    dataclass field declares them (`runs.sections`, `options.check_values`): a ValueError
    naming the first key that is not, e.g. `grpo.steps=-3`. Then the relations between
    options that no single field states."""
    run = plan(config)
    for name, classes in sections.schema(config).items():
        if name in registry.PHASES and name not in run:
            if name == "sft" and "steps" in config.sft:  # also when SFT does not run: -1 is not "skip"
                options.check_value(sections.SFTRun, _field(sections.SFTRun, "steps"), config.sft.steps, "sft.steps")
            continue
        options.check_values(classes, config[name] if name else config, f"{name}." if name else "")
    if config.algorithm == "sft" and config.sft.steps < 1:
        raise ValueError(f"sft.steps={config.sft.steps} is impossible: it must be >= 1 for algorithm='sft'")
    if "reward_model" in run:
        PolicyPairsConfig.from_config(config.reward_model)  # reward_model.pairs and its sampling fields
    if "grpo" in run:
        _check_pool(config.grpo)
    for name in run:
        sampling = config[name].get("sampling")
        if sampling is not None and sampling.min_new_tokens > sampling.max_new_tokens:
            raise ValueError(f"{name}.sampling.min_new_tokens={sampling.min_new_tokens} is impossible: it must be "
                             f"<= {name}.sampling.max_new_tokens={sampling.max_new_tokens}")


def _field(cls, name: str):
    return next(f for f in dataclasses.fields(cls) if f.name == name)


def _check_pool(c) -> None:
    """Dynamic sampling keeps `prompts_per_step` groups out of a pool of `pool_size` prompts
    (0: the pool is the step's own prompts): the pool must hold at least that many."""
    if c.get("dynamic_sampling") and c.get("pool_size") is not None and c.pool_size < c.prompts_per_step:
        raise ValueError(f"grpo.pool_size={c.pool_size} is impossible with grpo.dynamic_sampling: the pool must hold "
                         f"at least grpo.prompts_per_step={c.prompts_per_step} prompts (None: no larger pool)")


def check_shapes(config, placement: RowChecker) -> None:
    """The batch rows of every phase `config` runs against the mesh's row shards and their
    minibatch / microbatch splits (each phase's registered `check_shapes`): a ValueError
    naming the key to change."""
    for name in plan(config):
        spec = registry.PHASES[name]
        if spec.check_shapes is not None:
            spec.check_shapes(config[name], placement)


def lora_phases(config) -> tuple[str, ...]:
    """The phases that train LoRA adapters (`model.lora`; none when its rank is 0), checked:
    a rank >= 0, valid target patterns, and `phases` among the run's ("" = all of them).
    A reward-model phase and a PPO critic train their new head beside the adapters; OPD from
    its own base (`opd.teacher_path="base"`) needs adapters on the opd phase."""
    section = config.get("model", {}).get("lora")
    if section is not None:
        quant.check_kind(section.get("quantize", "none"), rank=section.rank)
    names = _lora_phases(config, section)
    if "opd" in plan(config) and config.opd.get("teacher_path") == "base" and "opd" not in names:
        raise ValueError("opd.teacher_path='base' distils a LoRA student's own base into it: turn on LoRA for the "
                         "opd phase (model.lora.rank > 0, and opd among model.lora.phases)")
    return names


def _lora_phases(config, section) -> tuple[str, ...]:
    if section is None or lora.from_section(section) is None:
        return ()
    if "reward_model" in plan(config) and config.reward_model.sft_steps > 0:
        raise ValueError(f"reward_model.sft_steps={config.reward_model.sft_steps} trains the reward model's trunk in "
                         "full, and model.lora is on: set reward_model.sft_steps=0 (or model.lora.rank=0)")
    available = plan(config)
    names = tuple(x for x in section.phases.replace(" ", "").split(",") if x) or available
    for name in names:
        if name not in available:
            raise ValueError(f"model.lora.phases={section.phases!r}: {name!r} is not a phase of this run; its "
                             f"phases are {', '.join(available)}")
    if "ppo" in names and config.ppo.get("critic_path"):
        raise ValueError(f"ppo.critic_path={config.ppo.critic_path!r}: a critic from a checkpoint has a trunk of its "
                         "own, and model.lora trains PPO's critic as adapters on the actor's base; set "
                         "ppo.critic_path=None or leave ppo out of model.lora.phases")
    if "reward_model" in names and config.reward_model.ensemble > 1:
        raise ValueError(f"reward_model.ensemble={config.reward_model.ensemble}: an ensemble of LoRA reward models "
                         "is not supported; set reward_model.ensemble=1 or leave reward_model out of model.lora.phases")
    return names


def check_built(config, task) -> None:
    """Every library config the phases of `config` build from their sections, built once
    with `task`'s tokens: a ValueError naming the section and the option."""
    monitor = config.train.monitor if "train" in config else None
    for name in plan(config):
        spec, section = registry.PHASES[name], config[name]
        for entry in options.walk(*spec.sections):  # its optimizers (`optim`, PPO's `critic_optim`)
            if options.nested(entry.cls, entry.field.name) is OptimConfig:
                phases.optimizer(section[entry.key], f"{name}.{entry.key}", total_steps=1)
        if spec.build is not None:
            spec.build(section, task, monitor)


def check_config(config, placement: RowChecker) -> None:
    """`check_values`, `lora_phases` then `check_shapes`: everything about `config` that can
    be known before the task and model are built, checked before any work."""
    check_values(config)
    lora_phases(config)
    check_shapes(config, placement)


__all__ = ["check_built", "check_config", "check_shapes", "check_values", "lora_phases"]
