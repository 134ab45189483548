"""The phases and algorithms a run can be made of, registered by name, and `plan(config)`:
the phases `config.algorithm` runs, in order.

A `Phase` is one kind of training phase: its config section's classes (run options beside
the library config, `runs.sections`), the function that runs it on the run's state
(`Run`), its RNG stream, its shape checks against the mesh, and the names its periodic
evaluation reports. An `Algorithm` is a plan of phases: `policy_plan("grpo")` is the SFT
warm start (when `sft.steps` > 0) then GRPO. The built-in five (`runs.builtin`) are
registered like any other; a new one is its module, its config and one
`register(Phase(...), Algorithm(...))` call — made where the config file imports it, so
`python -m jaxrlhf.train --config=my_config.py` runs it (docs/extending.md).

`plan(config)` is the one definition of a run's phase order: the workdir's record, the
checks before any work, early stopping's phases, LoRA's phases and the run itself all read
it. Each phase draws its randomness from `fold_in(key(config.seed), phase.stream)`.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

PHASES: dict[str, "Phase"] = {}
ALGORITHMS: dict[str, "Algorithm"] = {}


@dataclasses.dataclass(frozen=True)
class Phase:
    """One kind of phase.

    name: its config section, checkpoint folder and metric prefix.
    sections: the classes its config section is made of (`options.section(*sections)`).
    run: `run(run: Run) -> None`, the phase on the run's state: it reads `run.params`
      (the policy so far) and sets what it trains (`run.params`, or `run.reward_model`).
    stream: its RNG stream, `fold_in(key(config.seed), stream)` (and its LoRA seed).
    policy: it trains the policy: the table gets a row of the policy it starts from, its
      early-stopping rule starts from that row, and it may train LoRA adapters.
    check_shapes: `check_shapes(section, placement)`: its batch rows against the mesh
      (`placement.check_rows(rows, field)`) and their minibatch splits; a ValueError
      naming the key.
    eval_metrics: `eval_metrics(config, sampled) -> set` of the names (without `eval/`)
      its periodic evaluation reports (None: the task's held-out metrics, those of
      `held_out.make_accuracy_fn`).
    build: `build(section, task, monitor) -> config`, its algorithm's config from its
      section (`options.build`), the task's tokens and the `train.monitor` section: built
      once before the workdir is claimed, so that an option only the class checks fails
      there (None: nothing to build).
    """

    name: str
    sections: tuple[type, ...]
    run: Callable[["Run"], None]
    stream: int
    policy: bool = True
    check_shapes: Callable[[Any, Any], None] | None = None
    eval_metrics: Callable[[Any, Any], set] | None = None
    build: Callable[[Any, Any, Any], Any] | None = None


@dataclasses.dataclass(frozen=True)
class Algorithm:
    """A run's plan: `phases(config)` the phase names in order; `exports` "policy" (the
    final policy is evaluated and exported) or "reward_model"."""

    name: str
    phases: Callable[[Any], tuple[str, ...]]
    exports: str = "policy"


def policy_plan(name: str) -> Callable[[Any], tuple[str, ...]]:
    """The plan of an algorithm that trains the policy in phase `name`: the SFT warm start
    (when `sft.steps` > 0), then `name`."""
    def phases(config) -> tuple[str, ...]:
        return (("sft",) if config.sft.steps > 0 else ()) + (name,)
    return phases


def register(*items: Phase | Algorithm) -> None:
    """Add phases and algorithms (a name registered again is replaced: a notebook may
    re-run its cell)."""
    for item in items:
        (PHASES if isinstance(item, Phase) else ALGORITHMS)[item.name] = item


def algorithm(config) -> Algorithm:
    """`config.algorithm`'s registered algorithm; a ValueError naming the registered ones."""
    name = config.algorithm
    if name not in ALGORITHMS:
        raise ValueError(f"algorithm={name!r}; expected one of {tuple(ALGORITHMS)} (a new one is registered with "
                         "runs.registry.register, docs/extending.md)")
    return ALGORITHMS[name]


def plan(config) -> tuple[str, ...]:
    """The phases `config` runs, in order."""
    return algorithm(config).phases(config)


@dataclasses.dataclass
class Run:
    """What every phase of a run shares, and what the phases hand on to each other.

    config, task, placement, workdir, writer, should_stop: the run's. model / plain: the
    policy's model with and without LoRA adapters in its config. params: the policy so
    far. accuracy: the held-out evaluation of a policy (`held_out.make_accuracy_fn`).
    stops: `{phase: EarlyStop}`. rows: the summary table's rows so far; extras: other
    held-out results for the summary. reward_model: `(model, params)` a phase trained
    for a later one (PPO's); folder_reward_model: the `reward.model_path` one, or None.
    adapted: the phases that train LoRA adapters.
    """

    config: Any
    task: Any
    placement: Any
    workdir: Any
    writer: Any
    should_stop: Any
    model: Any
    plain: Any
    params: Any
    accuracy: Callable
    stops: dict
    adapted: tuple
    rows: list = dataclasses.field(default_factory=list)
    extras: dict = dataclasses.field(default_factory=dict)
    reward_model: Any = None
    folder_reward_model: Any = None
    rng: Any = None

    def stream(self, phase: Phase):
        """The phase's RNG key."""
        import jax

        return jax.random.fold_in(self.rng, phase.stream)


__all__ = ["ALGORITHMS", "Algorithm", "PHASES", "Phase", "Run", "algorithm", "plan", "policy_plan", "register"]
