"""A run config checked before any work: impossible values, and batch shapes that do not
fit the mesh.

`check_config(config, placement)` is called at the start of `train_and_evaluate`, before
the task, the model or the workdir are touched, so that a negative step count or a batch
that does not split over the devices fails in seconds with the key to change — not after
an SFT phase has run (each phase used to check its own shapes when it started, and a
negative `steps` ran nothing and reported success).

Checked for every phase the run will execute (`stopping.run_phases`):
- the reward model's `pairs` and, for on-policy pairs, their sampling fields
  (`runs.policy_pairs.PolicyPairsConfig`), and its `ensemble_reduce`;
- counts that must be positive (`steps` of the run's own phases, batch sizes,
  `sampling.num_samples`, minibatches, microbatches, ...) or non-negative (`sft.steps`,
  `train.eval_every`, `train.max_param_norm_change`, `task.chat_template_timeout`, ...);
- the global batch rows each phase hands to the mesh (`sft.batch_size`,
  `grpo.prompts_per_step` or `grpo.pool_size`, `ppo.prompts_per_step`, `dpo.batch_size`,
  `reward_model.batch_size`) against the mesh's row shards (`Placement.check_rows`);
- the rows of one update against its minibatches × microbatches (GRPO: prompts_per_step
  × num_samples responses; PPO: prompts_per_step × num_samples; DPO and the reward model:
  batch_size).
The held-out evaluation pads its batches to the mesh, so `train.eval_batch_size` only has
to be positive.
"""

from __future__ import annotations

from typing import Protocol

from jaxrlhf.algorithms import reward_model
from jaxrlhf.models import lora, quant
from jaxrlhf.runs.policy_pairs import PolicyPairsConfig
from jaxrlhf.runs.stopping import run_phases


class RowChecker(Protocol):
    """What the checks need of a `sharding.Placement`: `check_rows(rows, field)` raises a
    ValueError naming `field` when `rows` does not split over the mesh's row shards."""

    def check_rows(self, rows: int, field: str) -> None: ...


# field -> smallest allowed value, per section; "steps" of a run's own phases is >= 1 (below).
_MINIMUM = {
    "sft": {"steps": 0, "batch_size": 1},
    "grpo": {"steps": 1, "prompts_per_step": 1, "pool_size": 0, "sampling.num_samples": 1,
             "sampling.max_new_tokens": 1, "sampling.min_new_tokens": 0, "sampling.slots": 0, "num_iterations": 1,
             "num_minibatches": 1, "num_microbatches": 1, "guide_coef": 0},
    "ppo": {"steps": 1, "prompts_per_step": 1, "sampling.num_samples": 1, "sampling.max_new_tokens": 1,
            "sampling.min_new_tokens": 0, "sampling.slots": 0, "num_ppo_epochs": 1, "num_minibatches": 1,
            "num_microbatches": 1},
    "dpo": {"steps": 1, "batch_size": 1, "num_microbatches": 1},
    "reward_model": {"steps": 1, "batch_size": 1, "num_microbatches": 1, "ensemble": 1, "sft_steps": 0},
    "train": {"log_every": 1, "eval_every": 0, "checkpoint_every": 1, "keep_checkpoints": 1, "eval_batch_size": 1,
              "eval_samples": 0, "eval_slots": 0, "max_param_norm_change": 0},
    "task": {"chat_template_timeout": 0},  # the fields a task has (a text task's); others are not checked
}
_HINTS = {"sft.steps": " (0 skips the SFT warm start)", "train.max_param_norm_change": " (0 = no bound)",
          "task.chat_template_timeout": " (0 = no time limit)"}
_OPTIM_MINIMUM = {"lr": 0, "warmup_steps": 0, "decay_steps": 0}


def _get(section, dotted: str):
    for part in dotted.split("."):
        section = section[part]
    return section


def _check_minimum(key: str, value, minimum) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value >= minimum:
        hint = _HINTS.get(key, "")
        raise ValueError(f"{key}={value!r} is impossible: it must be >= {minimum}{hint}")


def check_values(config) -> None:
    """Every count of the phases `config` runs (and of `train`) within its range: a
    ValueError naming the first key that is not, e.g. `grpo.steps=-3`."""
    _check_minimum("sft.steps", config.sft.steps, 0)  # also when SFT does not run: -1 is not "skip"
    run = run_phases(config)
    if "reward_model" in run:
        PolicyPairsConfig.from_config(config.reward_model)  # reward_model.pairs and its sampling fields
        reward_model.check_reduce(config.reward_model.get("ensemble_reduce", "mean"))
    if "grpo" in run:
        _check_pool(config.grpo)
    for section in (*run, "train", "task"):
        if section not in config:  # e.g. a test's config without a task
            continue
        for field, minimum in _MINIMUM[section].items():
            if section == "sft" and field == "steps" and config.algorithm == "sft":
                minimum = 1
            try:
                value = _get(config[section], field)
            except KeyError:  # a config without this field: nothing to check
                continue
            _check_minimum(f"{section}.{field}", value, minimum)
        sampling = config[section].get("sampling") if section not in ("train", "task") else None
        if sampling is not None and sampling.get("min_new_tokens", 0) > sampling.max_new_tokens:
            raise ValueError(f"{section}.sampling.min_new_tokens={sampling.min_new_tokens} is impossible: it must be "
                             f"<= {section}.sampling.max_new_tokens={sampling.max_new_tokens}")
        for name in ("optim", "critic_optim"):
            if section not in ("train", "task") and name in config[section]:
                for field, minimum in _OPTIM_MINIMUM.items():
                    _check_minimum(f"{section}.{name}.{field}", config[section][name][field], minimum)


def _check_pool(c) -> None:
    """Dynamic sampling keeps `prompts_per_step` groups out of a pool of `pool_size` prompts
    (0: the pool is the step's own prompts): the pool must hold at least that many."""
    if c.get("dynamic_sampling") and 0 < c.get("pool_size", 0) < c.prompts_per_step:
        raise ValueError(f"grpo.pool_size={c.pool_size} is impossible with grpo.dynamic_sampling: the pool must hold "
                         f"at least grpo.prompts_per_step={c.prompts_per_step} prompts (0: no larger pool)")


def _split(rows: int, rows_name: str, parts: dict) -> None:
    """`rows` (described by `rows_name`) must split into the product of `parts` equal pieces."""
    n = 1
    for v in parts.values():
        n *= v
    if rows % n:
        names = " × ".join(f"{k}={v}" for k, v in parts.items())
        raise ValueError(f"{rows_name} = {rows} rows do not split into {names} equal parts; change one of them")


def check_shapes(config, placement: RowChecker) -> None:
    """The batch rows of every phase `config` runs against the mesh's row shards and their
    minibatch / microbatch splits: a ValueError naming the key to change."""
    for phase in run_phases(config):
        c = config[phase]
        if phase in ("sft", "dpo", "reward_model"):
            placement.check_rows(c.batch_size, f"{phase}.batch_size")
            if "num_microbatches" in c:
                _split(c.batch_size, f"{phase}.batch_size", {f"{phase}.num_microbatches": c.num_microbatches})
        elif phase == "grpo":
            pooled = c.dynamic_sampling and c.pool_size > 0
            placement.check_rows(c.pool_size if pooled else c.prompts_per_step,
                                 "grpo.pool_size" if pooled else "grpo.prompts_per_step")
            _split(c.prompts_per_step * c.sampling.num_samples, "grpo.prompts_per_step × grpo.sampling.num_samples",
                   {"grpo.num_minibatches": c.num_minibatches, "grpo.num_microbatches": c.num_microbatches})
        else:  # ppo
            placement.check_rows(c.prompts_per_step, "ppo.prompts_per_step")
            n = c.prompts_per_step * c.sampling.num_samples
            _split(n, "ppo.prompts_per_step × ppo.sampling.num_samples", {"ppo.num_minibatches": c.num_minibatches})
            _split(n // c.num_minibatches, "a PPO minibatch (prompts_per_step × num_samples / num_minibatches)",
                   {"ppo.num_microbatches": c.num_microbatches})


def lora_phases(config) -> tuple[str, ...]:
    """The phases that train LoRA adapters (`model.lora`; none when its rank is 0), checked:
    a rank >= 0, valid target patterns, and `phases` among the run's ("" = all of them).
    A reward-model phase and a PPO critic train their new head beside the adapters."""
    section = config.get("model", {}).get("lora")
    if section is not None:
        quant.check_kind(section.get("quantize", "none"), rank=section.rank)
    if section is None or lora.from_section(section) is None:
        return ()
    if "reward_model" in run_phases(config) and config.reward_model.get("sft_steps", 0) > 0:
        raise ValueError(f"reward_model.sft_steps={config.reward_model.sft_steps} trains the reward model's trunk in "
                         "full, and model.lora is on: set reward_model.sft_steps=0 (or model.lora.rank=0)")
    available = run_phases(config)
    names = tuple(x for x in section.phases.replace(" ", "").split(",") if x) or available
    for name in names:
        if name not in available:
            raise ValueError(f"model.lora.phases={section.phases!r}: {name!r} is not a phase of this run; its "
                             f"phases are {', '.join(available)}")
    if "reward_model" in names and config.reward_model.get("ensemble", 1) > 1:
        raise ValueError(f"reward_model.ensemble={config.reward_model.ensemble}: an ensemble of LoRA reward models "
                         "is not supported; set reward_model.ensemble=1 or leave reward_model out of model.lora.phases")
    return names


def check_config(config, placement: RowChecker) -> None:
    """`check_values`, `lora_phases` then `check_shapes`: everything about `config` that can
    be known before the task and model are built, checked before any work."""
    check_values(config)
    lora_phases(config)
    check_shapes(config, placement)


__all__ = ["check_config", "check_shapes", "check_values", "lora_phases"]
