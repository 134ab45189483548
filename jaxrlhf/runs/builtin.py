"""The six built-in phases and algorithms, registered like any other (`runs.registry`).

- `sft`:          SFT on the task.
- `grpo`:         (SFT warm start if `sft.steps > 0`) -> GRPO family on the task's reward.
- `ppo`:          (SFT warm start) -> reward model on preference pairs -> RLHF-PPO (with
                  `ppo.reward="task"`: no reward model). With `reward_model.sft_steps` > 0
                  the reward model starts from its own copy of the trunk trained that many
                  more SFT steps (phase `reward_model_sft`); with `reward_model.ensemble` >
                  1 it is K members, PPO scoring with their `ensemble_reduce`d score.
- `dpo`:          (SFT warm start) -> DPO on preference pairs.
- `reward_model`: (SFT warm start) -> Bradley–Terry reward model on preference pairs.
- `opd`:          (SFT warm start) -> on-policy distillation from a frozen teacher folder
                  (`opd.teacher_path`, `algorithms.opd`) on the task's prompts.

Each phase's RNG stream is the number it always had (sft 1, grpo 2, reward_model 3, ppo
4, dpo 5; the reward model's own trunk 6; opd 7), so results do not depend on the registry.
"""

from __future__ import annotations

import logging
import os

import jax
import jax.numpy as jnp
import ml_collections as mlc

from jaxrlhf import exits, ops, options
from jaxrlhf import rewards as rewards_lib
from jaxrlhf.algorithms import opd, timing
from jaxrlhf.models import lora
from jaxrlhf.models.config import RUNTIME_FIELDS
from jaxrlhf.models.transformer import Transformer
from jaxrlhf.parallel.loading import load_pretrained_sharded
from jaxrlhf.runs import episode_phase, pair_phases, phases, sections, setup, stopping
from jaxrlhf.runs.loop import run_phase
from jaxrlhf.runs.sharding import Placement
from jaxrlhf.runs.registry import Algorithm, Phase, Run, policy_plan, register

log = logging.getLogger("jaxrlhf")


def policy_args(run: Run, phase: Phase) -> dict:
    """The keyword arguments every policy phase function of `runs.phases` takes: the run's
    model, task, workdir, writer, evaluation, placement, its starting params (LoRA adapters
    added when it trains them), its RNG key and its early-stopping rule (starting from the
    table's last row)."""
    fresh = phase.name in run.adapted
    params = setup.start_adapters(run.model, run.params, fresh=fresh, seed=run.config.seed * 1000 + phase.stream,
                                  placement=run.placement)
    rule = run.stops.get(phase.name)
    if rule is not None and run.rows:
        rule.start_evaluation = run.rows[-1][1]  # the evaluation of its starting params: not taken again
    return dict(model=run.model if lora.has_adapters(params) else run.plain, params=params, task=run.task,
                workdir=run.workdir, writer=run.writer, eval_fn=run.accuracy, should_stop=run.should_stop,
                placement=run.placement, rng=run.stream(phase), early_stop=rule)


def _run_sft(run: Run) -> None:
    c = run.config
    run.params, _ = phases.sft_phase(c.sft, c.train, **policy_args(run, SFT))


def _run_grpo(run: Run) -> None:
    c, folder = run.config, run.folder_reward_model
    # a task of multi-turn episodes (task.name='calculator'): GRPO on episodes
    phase = phases.grpo_phase if run.task.episodes is None else episode_phase.grpo_episode_phase
    run.params, _ = phase(c.grpo, c.train, reward_model_and_params=folder,
                                      model_weight=c.reward.model_weight if folder else 1.0,
                                      **policy_args(run, GRPO))


def _reward_model_trunk(run: Run, params):
    """The reward model's own trunk (`reward_model.sft_steps` > 0): a copy of the policy's
    `params` trained that many more SFT steps (the `sft` section's batch size and optimizer,
    a fresh schedule, batch order from `sft.seed + 1`), checkpointed as phase
    `reward_model_sft`. The policy's params are left as they are."""
    config = run.config
    cfg = mlc.ConfigDict(dict(config.sft.to_dict(), steps=config.reward_model.sft_steps, seed=config.sft.seed + 1))
    copy = stopping.copy_params(params)  # the phase donates its state
    trunk, _ = phases.sft_phase(cfg, config.train, model=run.model, task=run.task, workdir=run.workdir,
                                writer=run.writer, should_stop=run.should_stop, placement=run.placement, params=copy,
                                rng=jax.random.fold_in(run.rng, 6), name="reward_model_sft")
    return trunk


def _run_reward_model(run: Run) -> None:
    config = run.config
    # An SFT phase's adapters folded in: the base of the reward model and of PPO's roles.
    params = setup.start_adapters(run.model, run.params, fresh=False, seed=0, placement=run.placement)
    run.params = trunk = params
    if config.reward_model.sft_steps > 0:  # the reward model's own, further-trained trunk
        trunk = _reward_model_trunk(run, params)
        exits.signal_at("between_phases")  # test hook
        run.extras["reward_model_trunk"] = run.accuracy(trunk)
        log.info("reward model trunk after %d more SFT steps: held-out exact match %.3f",
                 config.reward_model.sft_steps, run.extras["reward_model_trunk"]["accuracy"])
    rm_model, rm_params, rm_eval = pair_phases.reward_model_phase(
        config.reward_model, config.train, policy_model=run.model if "reward_model" in run.adapted else run.plain,
        policy_params=params, trunk_params=trunk, task=run.task, workdir=run.workdir, writer=run.writer,
        rng=run.stream(REWARD_MODEL), should_stop=run.should_stop, placement=run.placement,
        early_stop=run.stops.get("reward_model"))
    run.extras["reward_model_heldout"] = rm_eval
    log.info("reward model held-out: %s", ", ".join(f"{k}={v:.4g}" for k, v in rm_eval.items()))
    if {"reward_model", "ppo"} <= set(run.adapted):  # its frozen trunk is a copy of the actor's base:
        rm_params = lora.trainable(rm_params)  # PPO keeps its adapters and head alone (the copy is freed)
    run.reward_model = (rm_model, rm_params)


def _run_ppo(run: Run) -> None:
    c, folder, rm = run.config, run.folder_reward_model, run.reward_model
    ensemble = rm is not None and folder is None and c.reward_model.ensemble > 1
    # a task of multi-turn episodes (task.name='calculator'): PPO on episodes
    phase = phases.ppo_phase if run.task.episodes is None else episode_phase.ppo_episode_phase
    run.params, _ = phase(c.ppo, c.train, reward_model_and_params=rm if folder is None else folder,
                          model_weight=c.reward.model_weight if folder else None,
                          ensemble_reduce=c.reward_model.ensemble_reduce if ensemble else None,
                          **policy_args(run, PPO))


def _run_dpo(run: Run) -> None:
    c = run.config
    run.params, run.extras["dpo_heldout_pairs"] = pair_phases.dpo_phase(c.dpo, c.train, **policy_args(run, DPO))


def _opd_configs(section, task, monitor=None) -> tuple:
    """`(GRPOConfig, OPDConfig)` of the `opd` section, and its teacher's folder checked
    against the task's tokenizer (`opd.check_teacher`): before any work."""
    track = bool(section.track_kl or (monitor is not None and monitor.kl_target is not None))
    gcfg = options.build(opd.GRPOConfig, section, "opd.", sampling=phases.sampling(section, "opd", task),
                         track_kl=track)
    for name in ("dynamic_sampling", "guide_coef"):
        if getattr(gcfg, name):
            raise ValueError(f"opd.{name}={section[name]!r}: OPD distils every sampled response; this GRPO option "
                             "is not used by OPD, turn it off")
    ocfg = options.build(opd.OPDConfig, section, "opd.")
    if section.teacher_path != BASE_TEACHER:
        opd.check_teacher(section.teacher_path, task.tokenizer, task.vocab_size)
    return gcfg, ocfg


BASE_TEACHER = "base"  # opd.teacher_path: the LoRA student's own base teaches it


def load_teacher(path: str, student: Transformer, *, mesh, rules, runtime: dict | None = None):
    """`(teacher, params)` from the folder `path`, a causal LM in the student's dtypes (and
    `runtime`: the `models.config.RUNTIME_FIELDS` of the run's model section), its head
    fused (`opd.fused_head`), read straight into `mesh`'s shardings under `rules`."""
    c = student.config
    runtime = dict(runtime or {}, logprobs_head="chunked")
    teacher, params = load_pretrained_sharded(os.fspath(path), mesh, rules, on_indivisible="replicate", head="lm",
                                              dtype=c.dtype, param_dtype=c.param_dtype, **runtime)
    log.info("OPD teacher from %s: %d layers, hidden size %d, vocabulary %d (the student's: %d layers, hidden size "
             "%d, vocabulary %d)", path, teacher.config.num_layers, teacher.config.hidden_size,
             teacher.config.vocab_size, c.num_layers, c.hidden_size, c.vocab_size)
    return teacher, params


def opd_phase(cfg, train, *, model, params, task, workdir, writer, rng, placement=None, eval_fn=None,
              should_stop=None, early_stop=None):
    """On-policy distillation (`algorithms.opd`) of the policy `params` from the teacher of
    `cfg.teacher_path` on the task's prompts; returns `(params, last_metrics)`.

    GRPO's sharded rollout, scoring and update (`phases.rl_step`), the teacher's params
    in the state (`OPDState.teacher_params`) in the shardings of its own model under the
    run's rules, read straight into them from its folder; (β > 0) the reference is the
    policy's start, as in GRPO."""
    placement = placement or Placement.local()
    gcfg, ocfg = _opd_configs(cfg, task, train.monitor)
    own_base = cfg.teacher_path == BASE_TEACHER
    if own_base and not lora.has_adapters(params):
        raise ValueError(f"opd.teacher_path={BASE_TEACHER!r} distils the LoRA student's own base into it: the opd "
                         "phase needs LoRA adapters (model.lora.rank > 0)")
    if own_base:  # the student's base arrays, no copy (`opd.teacher_params_of`)
        teacher, t_params = model, None
    else:
        teacher, t_params = load_teacher(cfg.teacher_path, model, mesh=placement.mesh, rules=placement.rules,
                                         runtime={f: getattr(model.config, f) for f in RUNTIME_FIELDS})
    tx, schedule = phases.optimizer(cfg.optim, "opd.optim", total_steps=cfg.steps * gcfg.updates_per_iteration)
    keys = task.extra_keys
    batches = phases.array_batches({k: task.prompts[k] for k in ("prompt_ids", "prompt_mask", *keys)},
                                   cfg.prompts_per_step, cfg.seed, placement, "opd.prompts_per_step")
    p_sh, t_sh = placement.param_shardings(model), placement.param_shardings(teacher)
    own_reference = gcfg.uses_reference and not lora.has_adapters(params)
    reward = rewards_lib.as_reward(task.reward)
    make = lambda p, tp=None: opd.init_state(p, tx, tp, ref_params=p if own_reference else None, cfg=gcfg)
    teacher_args = () if own_base else (placement.place(t_params, t_sh),)
    state, state_sh = placement.init_state(make, placement.place(params, p_sh), *teacher_args,
                                           params_shardings=p_sh, roles=None if own_base else {"teacher_params": t_sh})
    step, batches = phases.rl_step(opd.split(model, teacher, tx, gcfg, ocfg, reward, schedule=schedule), reward,
                                   train, placement, state_sh, keys, cfg.prompts_per_step, gcfg.sampling, task=task,
                                   drop_unscored=True, ahead=(phases.pipeline_section(cfg, "opd"), batches, rng),
                                   completions=phases.completions_sink(train, writer, "opd", lambda s: s.reward_params))
    state, last = run_phase(
        phases.phase_config("opd", cfg, train, show=("distill/reverse_kl", "reward/mean", "eval/accuracy",
                                               timing.TOKENS_PER_S)),
        workdir=workdir, state=state, step_fn=step, batches=batches, rng=rng, writer=writer,
        monitor=phases.health_monitor(train.monitor, "grpo", clip=gcfg.clip_low),
        eval_fn=(lambda s: eval_fn(s.policy.params)) if eval_fn else None, should_stop=should_stop,
        **phases.stopping_options(early_stop, "policy"))
    return state.policy.params, last


def _run_opd(run: Run) -> None:
    run.params, _ = opd_phase(run.config.opd, run.config.train, **policy_args(run, OPD))


# --------------------------------------------------------------------------- shape checks


def _split(rows: int, rows_name: str, parts: dict) -> None:
    """`rows` (described by `rows_name`) must split into the product of `parts` equal pieces."""
    n = 1
    for v in parts.values():
        n *= v
    if rows % n:
        names = " × ".join(f"{k}={v}" for k, v in parts.items())
        raise ValueError(f"{rows_name} = {rows} rows do not split into {names} equal parts; change one of them")


def batch_shapes(name: str):
    """The shape check of a phase of one update per batch of `<name>.batch_size` rows, split
    into `<name>.num_microbatches`."""
    def check(c, placement) -> None:
        placement.check_rows(c.batch_size, f"{name}.batch_size")
        if "num_microbatches" in c:
            _split(c.batch_size, f"{name}.batch_size", {f"{name}.num_microbatches": c.num_microbatches})
    return check


def _grpo_shapes(c, placement) -> None:
    pooled = c.dynamic_sampling and c.pool_size is not None
    placement.check_rows(c.pool_size if pooled else c.prompts_per_step,
                         "grpo.pool_size" if pooled else "grpo.prompts_per_step")
    _split(c.prompts_per_step * c.sampling.num_samples, "grpo.prompts_per_step × grpo.sampling.num_samples",
           {"grpo.num_minibatches": c.num_minibatches, "grpo.num_microbatches": c.num_microbatches})


def _opd_shapes(c, placement) -> None:
    placement.check_rows(c.prompts_per_step, "opd.prompts_per_step")
    _split(c.prompts_per_step * c.sampling.num_samples, "opd.prompts_per_step × opd.sampling.num_samples",
           {"opd.num_minibatches": c.num_minibatches, "opd.num_microbatches": c.num_microbatches})


def _ppo_shapes(c, placement) -> None:
    placement.check_rows(c.prompts_per_step, "ppo.prompts_per_step")
    n = c.prompts_per_step * c.sampling.num_samples
    _split(n, "ppo.prompts_per_step × ppo.sampling.num_samples", {"ppo.num_minibatches": c.num_minibatches})
    _split(n // c.num_minibatches, "a PPO minibatch (prompts_per_step × num_samples / num_minibatches)",
           {"ppo.num_microbatches": c.num_microbatches})


# --------------------------------------------------------------------------- evaluation metric names

_Z = jax.ShapeDtypeStruct((1,), jnp.float32)


def _reward_model_metrics(config, sampled) -> set:
    """The reward model's held-out pair metrics (names from the loss, `jax.eval_shape`)."""
    _, m = jax.eval_shape(lambda c, r: ops.reward_model_loss(c, r, margin=c), _Z, _Z)
    return {"loss", "chosen_score", "rejected_score", *m}


def _dpo_metrics(config, sampled) -> set:
    """The task's held-out metrics and DPO's held-out pair metrics as `pairs/<name>`."""
    d = config.dpo
    _, m = jax.eval_shape(lambda c, r, rc, rr: ops.dpo_loss(
        c, r, rc, rr, beta=d.beta, loss_type=d.loss_type, label_smoothing=d.label_smoothing), _Z, _Z, _Z, _Z)
    return stopping.task_metric_names(sampled) | {f"pairs/{k}" for k in ("loss", *m)}


def _ppo_plan(config) -> tuple[str, ...]:
    learned = ("reward_model",) if config.ppo.reward == "model" else ()
    return (("sft",) if config.sft.steps > 0 else ()) + learned + ("ppo",)


def _builder(name: str):
    """The phase's `build`: `phases.library_config`."""
    return lambda section, task, monitor: phases.library_config(name, section, task, monitor=monitor)


SFT = Phase("sft", sections.PHASE_SECTIONS["sft"], _run_sft, stream=1, check_shapes=batch_shapes("sft"),
            build=_builder("sft"))
GRPO = Phase("grpo", sections.PHASE_SECTIONS["grpo"], _run_grpo, stream=2, check_shapes=_grpo_shapes,
             build=_builder("grpo"))
REWARD_MODEL = Phase("reward_model", sections.PHASE_SECTIONS["reward_model"], _run_reward_model, stream=3,
                     policy=False, check_shapes=batch_shapes("reward_model"), eval_metrics=_reward_model_metrics,
                     build=_builder("reward_model"))
def _build_ppo(section, task, monitor):
    """PPO's config, and its critic's folder: a checkpoint (`config.json`) of a separate critic."""
    path = section.get("critic_path")
    if path is not None:
        if section.critic == "shared":
            raise ValueError(f"ppo.critic_path={path!r} is the separate critic's checkpoint, and ppo.critic='shared' "
                             "puts the value head on the actor: set one of them")
        if not os.path.isfile(os.path.join(path, "config.json")):
            raise ValueError(f"ppo.critic_path={path!r}: no Hugging Face checkpoint folder there (no config.json)")
    return phases.library_config("ppo", section, task, monitor=monitor)


PPO = Phase("ppo", sections.PHASE_SECTIONS["ppo"], _run_ppo, stream=4, check_shapes=_ppo_shapes, build=_build_ppo)
DPO = Phase("dpo", sections.PHASE_SECTIONS["dpo"], _run_dpo, stream=5, check_shapes=batch_shapes("dpo"),
            eval_metrics=_dpo_metrics, build=_builder("dpo"))
OPD = Phase("opd", sections.PHASE_SECTIONS["opd"], _run_opd, stream=7, check_shapes=_opd_shapes,
            build=_opd_configs)

register(SFT, REWARD_MODEL, GRPO, PPO, DPO, OPD,
         Algorithm("sft", lambda config: ("sft",)),
         Algorithm("grpo", policy_plan("grpo")),
         Algorithm("ppo", _ppo_plan),
         Algorithm("dpo", policy_plan("dpo")),
         Algorithm("reward_model", policy_plan("reward_model"), exports="reward_model"),
         Algorithm("opd", policy_plan("opd")))

__all__ = ["DPO", "GRPO", "OPD", "PPO", "REWARD_MODEL", "SFT", "batch_shapes", "opd_phase", "policy_args"]
