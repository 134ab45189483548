"""The phases a run is made of, each a `loop.run_phase` over one algorithm's step.

`update_phase` (one update per batch of the task's arrays: the loop of `sft_phase`, and of
a phase a user registers, docs/extending.md), `sft_phase` (the warm start of the built-in
task, or a whole SFT run), `grpo_phase` and `ppo_phase`; the phases on preference pairs
are `runs.pair_phases`. Every phase checkpoints under `workdir/<name>/` and resumes from
there. Each builds its algorithm's config from its section (`library_config`).

Every phase runs on the run's `sharding.Placement` (the mesh of `config.mesh`, the rules of
`config.rules`): its train state is born in the rules' shardings (every role: policy,
reference, critic, reward model), its step is jitted with explicit in/out shardings and a
donated state, and each process reads only its own rows of every global batch. The
GRPO/PPO steps run as three timed sharded programs, rollout, scoring and update
(`algorithms.timing`: `time/rollout_s`, `time/scoring_s`, `time/update_s`, tokens/s in the
metrics), or with `train.time_split=False` and a pure-JAX reward as one; the other phases'
one update reports `time/update_s`.

Every phase takes `early_stop` (a `runs.stopping.EarlyStop`, from `config.train.stop_*`):
stop on a held-out metric of its evaluation, and with `keep_best` end with the policy of
its best evaluation.
"""

from __future__ import annotations

import functools
import logging
import time
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from jaxrlhf import options
from jaxrlhf import rewards as rewards_lib
from jaxrlhf.algorithms import common, dpo, grpo, ppo, reward_model, scoring, sft, timing
from jaxrlhf.algorithms.experience import SamplingConfig
from jaxrlhf.models import lora
from jaxrlhf.models.config import RUNTIME_FIELDS
from jaxrlhf.models.transformer import Transformer
from jaxrlhf.parallel.loading import load_pretrained_sharded
from jaxrlhf.monitor import METRIC_KEYS, HealthMonitor, MonitorConfig
from jaxrlhf.rollout.sampler import SampleOutput
from jaxrlhf.algorithms.ppo_rollout import on_actor
from jaxrlhf.runs.completions import completion_rows
from jaxrlhf.runs import pipeline
from jaxrlhf.runs.hooks import load_hooks
from jaxrlhf.runs.loop import ArrayBatches, PhaseConfig, run_phase
from jaxrlhf.runs.sharding import Placement
from jaxrlhf.runs.stopping import EarlyStop
from jaxrlhf.runs.held_out import host_extras
from jaxrlhf.runs.tasks import Task

log = logging.getLogger("jaxrlhf")


def array_batches(arrays: dict, batch_size: int, seed: int, placement: Placement, field: str) -> ArrayBatches:
    """This process's rows of each global batch of `batch_size` (the config field `field`)."""
    n = next(iter(arrays.values())).shape[0]
    if batch_size > n:
        raise ValueError(f"{field}={batch_size} is larger than the {n} examples of the task")
    return ArrayBatches(arrays, placement.batch_iterator(n, batch_size, seed=seed, field=field))


def sharded_step(step_fn, placement: Placement, state_shardings, rows: int):
    """`step(state, local_rows, rng)`: the global batch assembled from each process's rows,
    then `step_fn` jitted for the mesh (`parallel.jit_step`, the state donated)."""
    jitted = placement.jit_step(step_fn, state_shardings)

    def step(state, local, rng):
        return jitted(state, placement.global_batch(local, rows), rng)

    return step


def optimizer(section, field: str, *, total_steps: int):
    """`(tx, schedule)` of an optimizer section (`common.OptimConfig`, e.g. `grpo.optim`:
    `field`) for a phase of `total_steps` optimizer steps (the schedule's span unless its
    `decay_steps` is set)."""
    return common.make_optimizer(options.build(common.OptimConfig, section, f"{field}.", total_steps=total_steps))


def sampling(cfg, name: str, task: Task) -> SamplingConfig:
    """The `<name>.sampling` section, with the task's stop and padding tokens."""
    return options.build(SamplingConfig, cfg.sampling, f"{name}.sampling.", eos_id=task.stop_ids, pad_id=task.pad_id)


def library_config(name: str, cfg, task: Task, *, monitor=None):
    """The algorithm config phase `name` builds from its section `cfg` (`runs.sections`):
    `SFTConfig`, `RewardModelConfig`, `GRPOConfig`, `PPOConfig` or `DPOConfig`, with the
    fields the run sets (`cli=False`) from `task` and the `train.monitor` section."""
    if name == "sft":
        return options.build(sft.SFTConfig, cfg, "sft.", prompt_len=task.prompt_len)
    if name == "reward_model":
        return options.build(reward_model.RewardModelConfig, cfg, "reward_model.")
    if name == "dpo":
        return options.build(dpo.DPOConfig, cfg, "dpo.")
    if name == "ppo":
        return options.build(ppo.PPOConfig, cfg, "ppo.", sampling=sampling(cfg, "ppo", task))
    if name == "grpo":
        # a monitor's KL target needs the KL measured, even with β = 0
        track = bool(cfg.track_kl or (monitor is not None and monitor.kl_target is not None))
        return options.build(grpo.GRPOConfig, cfg, "grpo.", sampling=sampling(cfg, "grpo", task), track_kl=track,
                             prompts_per_step=cfg.prompts_per_step if cfg.dynamic_sampling else None)
    raise ValueError(f"no phase {name!r}")


def phase_config(name, cfg, train, **kw) -> PhaseConfig:
    return PhaseConfig(name=name, num_steps=cfg.steps, log_every=train.log_every, eval_every=train.eval_every,
                       checkpoint_every=train.checkpoint_every, keep_checkpoints=train.keep_checkpoints,
                       max_param_norm_change=train.max_param_norm_change, progress=train.progress,
                       checkpoint_every_s=train.get("checkpoint_every_s"), hooks=load_hooks(train.get("hooks")), **kw)


def stopping_options(early_stop: EarlyStop | None, role: str | None = None) -> dict:
    """`run_phase`'s early-stopping arguments; the trained parameters are `state.params`,
    or `state.<role>.params` (GRPO's policy, PPO's actor)."""
    def params_of(state):
        return (getattr(state, role) if role else state).params

    def with_params(state, params):
        if role is None:
            return state.replace(params=params)
        return state.replace(**{role: getattr(state, role).replace(params=params)})

    return dict(early_stop=early_stop, params_of=params_of, with_params=with_params)


def timed_update(step_fn, schedule):
    """A one-update step (SFT, reward model, DPO) with its `time/update_s` (the step waited
    for) and `lr` in the metrics."""
    def step(state, batch, rng):
        t0 = time.perf_counter()
        state, metrics = jax.block_until_ready(step_fn(state, batch, rng))
        return state, {**metrics, "lr": schedule(state.step - 1), timing.UPDATE_S: time.perf_counter() - t0}
    return step


def update_phase(name: str, cfg, train, *, arrays: dict, make_step, model, params, workdir, writer, rng,
                 init_state=None, show=("loss",), monitor=None, placement: Placement | None = None, eval_fn=None,
                 should_stop=None, early_stop: EarlyStop | None = None, section: str | None = None, **_):
    """A phase of one update per batch, on `loop.run_phase` with everything around it
    (checkpoints and resume, SIGTERM, evaluation, early stopping, the update guard, the
    health `monitor`, metrics); returns `(params, last_metrics)`.

    `cfg` is the phase's config section `section` (default `name`: `<name>.steps`,
    `.batch_size`, `.seed`, `.optim`);
    `arrays` the task's whole-set arrays its batches take rows of; `make_step(model, tx)`
    returns `step(state, batch, rng) -> (state, metrics)` on a `common.TrainState` (or the
    state `init_state(params, tx)` makes). The keyword arguments a registered phase gets
    from `builtin.policy_args` pass through (the task among them, unused here). The step is
    jitted for the mesh with the state donated; each process reads its own rows."""
    placement = placement or Placement.local()
    section = section or name
    tx, schedule = optimizer(cfg.optim, f"{section}.optim", total_steps=cfg.steps)
    batches = array_batches(arrays, cfg.batch_size, cfg.seed, placement, f"{section}.batch_size")
    p_sh = placement.param_shardings(model)
    make = init_state or common.TrainState.create
    state, state_sh = placement.init_state(lambda p: make(p, tx), placement.place(params, p_sh),
                                           params_shardings=p_sh)
    step = sharded_step(make_step(model, tx), placement, state_sh, cfg.batch_size)
    state, last = run_phase(
        phase_config(name, cfg, train, show=show), workdir=workdir, state=state,
        step_fn=timed_update(step, schedule), batches=batches, rng=rng, writer=writer, monitor=monitor,
        eval_fn=(lambda s: eval_fn(s.params)) if eval_fn else None, should_stop=should_stop,
        **stopping_options(early_stop))
    return state.params, last


def sft_phase(cfg, train, *, task: Task, name: str = "sft", **kw):
    """Masked cross-entropy on the task's SFT arrays (`update_phase`); returns `(params,
    last_metrics)`. `name`: the phase's checkpoint folder and metrics prefix
    ("reward_model_sft": the reward model's own trunk, `reward_model.sft_steps`); its
    options are the `sft` section's either way."""
    if task.sft is None:
        raise ValueError(f"task {task.name!r} has no SFT examples: for files set task.kind='sft' (rows of messages, "
                         "or prompt and completion), or sft.steps=0")
    scfg = library_config("sft", cfg, task)
    return update_phase(name, cfg, train, arrays={k: task.sft[k] for k in sft.BATCH_KEYS},
                        make_step=lambda model, tx: sft.make_train_step(model, tx, scfg),
                        init_state=sft.init_state, show=("loss", "token_accuracy"), section="sft", **kw)


def health_monitor(m, algorithm: str, *, clip: float, kl_target: float | None = None) -> HealthMonitor:
    """The monitor of an RL phase: the thresholds of section `m` (`train.monitor`) with the
    algorithm's metric names (`monitor.METRIC_KEYS`) and clip ε; `kl_target` stands in for
    an unset `train.monitor.kl_target` (PPO's adaptive controller's)."""
    return HealthMonitor(options.build(MonitorConfig, m, "train.monitor.", clip=clip,
                                       kl_target=kl_target if m.kl_target is None else m.kl_target,
                                       **METRIC_KEYS[algorithm]))


def with_reward_model(reward, rm_model: Transformer, weight: float) -> rewards_lib.Reward:
    """`reward` plus a frozen reward model's score at `weight` (a "reward_model" component
    whose parameters are given at call time: the phase's state holds them)."""
    return rewards_lib.combine([(1.0, rewards_lib.as_reward(reward)),
                                (float(weight), reward_model.as_reward(rm_model))])


def grpo_phase(cfg, train, *, model, params, task: Task, workdir, writer, rng, placement: Placement | None = None,
               eval_fn=None, should_stop=None, early_stop: EarlyStop | None = None, reward_model_and_params=None,
               model_weight: float = 1.0):
    """GRPO (or a variant) on the task's prompts and reward; returns `(params, last_metrics)`.

    `reward_model_and_params`: a frozen reward model (`runs.reward_folder`) whose score
    joins the task's reward at `model_weight`; its params sit in the state
    (`GRPOState.reward_params`) in the shardings of its own model under the run's rules.

    The policy and (β > 0) the reference share the model's shardings. The step is a
    sharded rollout, scoring and update, timed (`rl_step`); a host reward (text, e.g. the
    JSONL task's answer check) runs between the rollout and the scoring, each process
    scoring the responses of its own prompts.
    """
    placement = placement or Placement.local()
    gcfg = library_config("grpo", cfg, task, monitor=train.monitor)
    tx, schedule = optimizer(cfg.optim, "grpo.optim", total_steps=cfg.steps * gcfg.updates_per_iteration)
    keys = task.extra_keys + (task.reference_keys(f"grpo.guide_coef={gcfg.guide_coef}") if gcfg.guide_coef else ())
    dynamic_pool = cfg.dynamic_sampling and cfg.pool_size is not None
    pool = cfg.pool_size if dynamic_pool else cfg.prompts_per_step
    batches = array_batches({k: task.prompts[k] for k in ("prompt_ids", "prompt_mask", *keys)}, pool, cfg.seed,
                            placement, "grpo.pool_size" if dynamic_pool else "grpo.prompts_per_step")
    p_sh = placement.param_shardings(model)
    # With LoRA adapters the reference is the policy's own base (`grpo.reference_params`).
    own_reference = gcfg.uses_reference and not lora.has_adapters(params)
    reward, roles, args = rewards_lib.as_reward(task.reward), None, [placement.place(params, p_sh)]
    if reward_model_and_params is not None:
        rm_model, rm_params = reward_model_and_params
        reward = with_reward_model(reward, rm_model, model_weight)
        scoring.check_reward_vocab(model.config.vocab_size, reward)
        roles = {"reward_params": placement.param_shardings(rm_model)}
        args.append(placement.place(rm_params, roles["reward_params"]))
    make = lambda p, rp=None: grpo.init_state(p, tx, ref_params=p if own_reference else None, cfg=gcfg,
                                              reward_params=rp)
    state, state_sh = placement.init_state(make, *args, params_shardings=p_sh, roles=roles)
    # The task pads every prompt to one length already: no buckets.
    ahead = (pipeline_section(cfg, "grpo"), batches, rng)
    step, batches = rl_step(grpo.split(model, tx, gcfg, reward, schedule=schedule), reward, train, placement,
                            state_sh, keys, pool, gcfg.sampling, task=task, drop_unscored=True, ahead=ahead,
                            completions=completions_sink(train, writer, "grpo", lambda s: s.reward_params,
                                                         with_advantage=not gcfg.dynamic_sampling))
    monitor = health_monitor(train.monitor, "grpo", clip=gcfg.clip_low)
    state, last = run_phase(
        phase_config("grpo", cfg, train, show=("reward/mean", "kl/mean", "response_length/mean", "eval/accuracy",
                                          timing.TOKENS_PER_S)),
        workdir=workdir, state=state, step_fn=step, batches=batches,
        rng=rng, writer=writer, monitor=monitor, eval_fn=(lambda s: eval_fn(s.policy.params)) if eval_fn else None,
        should_stop=should_stop, **stopping_options(early_stop, "policy"))
    return state.policy.params, last


def pipeline_section(cfg, phase: str) -> pipeline.PipelineSection:
    """The `<phase>.pipeline` section of an RL phase (rollout ahead of learning)."""
    return options.build(pipeline.PipelineSection, cfg.get("pipeline", {}), f"{phase}.pipeline.")


def completions_sink(train, writer, phase: str, params_of, *, with_advantage: bool = True):
    """`rl_step`'s `completions` of a phase: `(every, sink(rows, step), params_of(state) ->
    the reward model's params, with_advantage)`, or None with `train.log_completions_every` 0."""
    every = train.log_completions_every
    if not every:
        return None
    return every, functools.partial(writer.write_completions, phase=phase), params_of, with_advantage


def _advantages(prepared):
    """`(advantages [N, T], response_mask [N, T])` of a scored batch: GRPO's `Batch`, PPO's
    `Scored` (which holds a `ppo.Batch`)."""
    batch = prepared.batch if hasattr(prepared, "batch") else prepared
    return batch.advantages, batch.response_mask


def rl_step(parts: timing.Split, reward: rewards_lib.Reward, train, placement: Placement, state_sh, keys,
             rows: int, sampling, *, task: Task, completions=None, drop_unscored: bool = False, ahead=None):
    """`step(state, local_rows, rng)` of an RL phase (GRPO's or PPO's `split`) on the mesh.
    `drop_unscored`: the phase drops a row no weighted host reward scores (GRPO, PPO), which is
    then no error (`Reward.host_scores`; a process whose rows are all unscored still is).

    With `train.time_split` (or a host reward, which needs the responses on the host before
    scoring) three timed programs, `timing.run_split`: a sharded rollout, the host reward
    on this process's responses, sharded scoring, a sharded update (state donated); the
    metrics then carry `timing.RL_STEP`. The task's stop strings (`Task.cut`) need the
    responses on the host too: each process cuts its own after the rollout, before any
    scoring. Otherwise, with a pure-JAX reward, one sharded program (`parts.fused`), untimed.

    `ahead`: `(pipeline section, prompt batches, the phase's rng)` (`runs.pipeline`); when
    its `max_staleness` > 0 (or its schedule is "free") rollout runs ahead of learning and
    `rl_step` returns `(step, pipeline)`, the pipeline being the loop's batches (and hook);
    else `(step, prompt batches)`.

    `completions` (`completions_sink`): every N steps the first rows of this process's scored
    responses go to its sink (`runs.completions`), the reward's JAX components evaluated
    once more on them before the update; the step then runs split."""
    pipe = ahead is not None and ahead[0].active
    if reward.is_jax and not train.time_split and not task.stop_strings and completions is None and not pipe:
        def fused(state, batch, rng):
            return parts.fused(state, batch["prompt_ids"], batch["prompt_mask"], {k: batch[k] for k in keys}, rng)
        step = sharded_step(fused, placement, state_sh, rows)
        return step if ahead is None else (step, ahead[1])
    update = jax.jit(parts.train, out_shardings=(state_sh, placement.replicated), donate_argnums=0)
    compiled = {}

    def out_sharding(x):
        """Rows over the batch shards; replicated for a scalar, or for rows that do not split
        over them (dynamic sampling's update batch of prompts_per_step × G rows)."""
        if x.ndim and x.shape[0] % placement.batch_ways == 0:
            return placement.rows(x.ndim, x.shape[0])
        return placement.replicated

    def rows_out(name, fn):
        """`fn` jitted at its first call with its outputs' rows over the batch shards."""
        def call(*args):
            if name not in compiled:
                sh = jax.tree.map(out_sharding, jax.eval_shape(fn, *args))
                compiled[name] = jax.jit(fn, out_shardings=sh)
            return compiled[name](*args)
        return call

    def host_scores(local):
        """The host reward of this process's responses (as NumPy: the read waits for the
        rollout), assembled into global `[N]` arrays."""
        def score(out):
            mine = jax.tree.map(placement.local_rows, out)
            host = scoring.host_scores(reward, mine, {k: local[k] for k in keys}, sampling.num_samples,
                                       eos_id=sampling.eos_id, drop_unscored=drop_unscored)
            host = {k: np.asarray(v, jax.dtypes.canonicalize_dtype(np.asarray(v).dtype)) for k, v in host.items()}
            return placement.global_batch(host, rows * sampling.num_samples)
        return score

    def cut(out):
        """This process's responses cut at the task's stop strings, as global arrays again."""
        mine = task.cut(SampleOutput(*jax.tree.map(placement.local_rows, tuple(out))))
        return SampleOutput(**placement.global_batch(mine.arrays(), rows * sampling.num_samples))

    rollout, score = rows_out("rollout", parts.rollout), rows_out("score", parts.score)
    every, sink, params_of, with_advantage = completions or (0, None, None, False)
    g = sampling.num_samples
    device_scores = rows_out("device_scores", lambda params, out, extras: reward.device_scores(
        rewards_lib.RewardInput.from_sample(out), scoring.repeat_extras(extras, g, out.response_ids.shape[0] // g),
        params))
    seen = {}

    def score_seen(state, out, extras, host, rng):
        """`score`, keeping what a logging step's rows are made of (before the update donates the state)."""
        prepared, metrics = score(state, out, extras, host, rng)
        seen.update(out=out, host=host, prepared=prepared, device=device_scores(params_of(state), out, extras))
        return prepared, metrics

    def log_rows(step_number):
        local = lambda tree: jax.tree.map(lambda x: np.asarray(placement.local_rows(x)), tree)
        out = SampleOutput(*local(tuple(seen["out"])))
        scores = {**local(seen["device"]), **{k: np.asarray(placement.local_rows(v)) for k, v in seen["host"].items()}}
        adv = None
        if with_advantage:
            adv, _ = local(_advantages(seen["prepared"]))
        scores = {c.name: scores[c.name] for c in reward.components}
        sink(completion_rows(task.tokenizer, out, scores, np.asarray(reward.total(scores)), adv), step=step_number)
        seen.clear()

    def prepare(local):
        """This process's prompt rows as `(local, global batch, extras)`."""
        local = host_extras(local, tuple(local))  # object arrays (answer strings) become lists
        batch = placement.global_batch({k: v for k, v in local.items() if hasattr(v, "shape")}, rows)
        return local, batch, {k: batch[k] for k in keys if k in batch}

    def scorer(state):
        """`(score program, step number or 0)`: the one that keeps the rows on a logging step."""
        step_number = int(state.step.addressable_data(0)) + 1 if every else 0
        logging_step = every and step_number % every == 0
        return (score_seen if logging_step else score), (step_number if logging_step else 0)

    def step(state, local, rng):
        local, batch, extras = prepare(local)
        score_fn, logging_step = scorer(state)
        state, metrics = timing.run_split(rollout, score_fn, update, state,
                                          batch["prompt_ids"], batch["prompt_mask"], extras, rng,
                                          host=None if reward.is_jax else host_scores(local),
                                          cut=cut if task.stop_strings else None)
        if logging_step:
            log_rows(logging_step)
        return state, metrics

    if ahead is None:
        return step
    if not pipe:
        return step, ahead[1]
    programs = pipeline.RLPrograms(prepare=prepare, rollout=rollout, scorer=scorer, update=update,
                                   host=None if reward.is_jax else host_scores, cut=cut if task.stop_strings else None,
                                   log_rows=log_rows, placement=placement, rows=rows * sampling.num_samples)
    return pipeline.pipelined(programs, *ahead, groups_per_batch=rows)


def load_critic(path: str, policy: Transformer, *, seed: int, placement: Placement):
    """PPO's critic from the checkpoint folder `path` (`ppo.critic_path`) as a "score"
    model in the policy's dtypes and runtime options, read straight into the mesh's
    shardings (a causal LM gets a fresh score head drawn with `seed`). Its vocabulary must
    hold every token id of the policy's."""
    c = policy.config
    model, params = load_pretrained_sharded(path, placement.mesh, placement.rules, on_indivisible="replicate",
                                            head="score", dtype=c.dtype, param_dtype=c.param_dtype, seed=seed,
                                            **{f: getattr(c, f) for f in RUNTIME_FIELDS})
    if model.config.vocab_size < c.vocab_size:
        raise ValueError(f"ppo.critic_path={path}: its vocab_size {model.config.vocab_size} is smaller than the "
                         f"policy's {c.vocab_size}; the critic reads the policy's token ids")
    log.info("PPO critic from %s: %d layers, hidden size %d", path, model.config.num_layers, model.config.hidden_size)
    return model, params


class PPOSetup(NamedTuple):
    """What `ppo_setup` builds: the library config, the actor's model (the value head on it
    when the critic is shared), the critic's (None when shared), the reward, the extras' keys
    it reads, `ppo.split`'s parts and the placed state with its shardings."""

    cfg: Any
    actor_model: Transformer
    critic_model: Transformer | None
    reward: Any
    keys: tuple
    parts: timing.Split
    state: Any
    state_sh: Any


def ppo_setup(cfg, *, model, params, task: Task, placement: Placement, reward_model_and_params=None,
              model_weight: float | None = None, ensemble_reduce: str | None = None) -> PPOSetup:
    """PPO's roles and state for section `cfg` (`ppo_phase`'s docstring: the critic, the
    reference, the reward), placed on the mesh; the episode phase (`runs.episode_phase`)
    builds its PPO with it too."""
    pcfg = library_config("ppo", cfg, task)
    updates = cfg.steps * pcfg.updates_per_iteration  # the schedules count optimizer steps
    tx_actor, schedule = optimizer(cfg.optim, "ppo.optim", total_steps=updates)
    if reward_model_and_params is not None and model_weight is not None:  # a folder's, beside the task's reward
        rm_model, rm_params = reward_model_and_params
        reward, keys = with_reward_model(task.reward, rm_model, model_weight), task.extra_keys
    elif reward_model_and_params is not None:
        rm_model, rm_params = reward_model_and_params
        reward, keys = rm_model, ()
        if ensemble_reduce is not None:
            reward = reward_model.as_ensemble_reward(rm_model, reduce=ensemble_reduce)
    else:
        rm_model = rm_params = None
        reward, keys = rewards_lib.as_reward(task.reward), task.extra_keys
    critic_model = critic_params = tx_critic = None
    actor_model = model
    adapted = lora.has_adapters(params)
    if pcfg.shared:
        actor_model = Transformer(model.config, head="lm_value")
        d = model.config.hidden_size
        params = dict(params, value_head={"kernel": jnp.zeros((d, 1), jnp.dtype(model.config.param_dtype))})
    elif cfg.get("critic_path"):  # its own trunk, of any size (not with LoRA: `validation.lora_phases`)
        critic_model, critic_params = load_critic(cfg.critic_path, model, seed=cfg.seed + 1, placement=placement)
        tx_critic, _ = optimizer(cfg.critic_optim, "ppo.critic_optim", total_steps=updates)
    else:
        critic_model, critic_params = reward_model.init_from_policy(
            model, lora.without_adapters(params), seed=cfg.seed + 1, copy=not adapted)
        if adapted:  # only its adapters and score head: it runs on the actor's base (`ppo.on_actor`)
            critic_params = lora.trainable(lora.add_adapters(critic_model, critic_params, jax.random.key(cfg.seed + 2)))
        tx_critic, _ = optimizer(cfg.critic_optim, "ppo.critic_optim", total_steps=updates)
    actor_sh = placement.param_shardings(actor_model)
    roles = {"actor": actor_sh, "ref_params": actor_sh}
    args = [placement.place(params, actor_sh), None, None]
    own = lambda p, sh: lora.trainable(sh) if lora.is_part(p) else sh  # a part's shardings: the part's
    if rm_model is not None:
        roles["reward_params"] = placement.param_shardings(rm_model)
        if ensemble_reduce is not None:
            roles["reward_params"] = placement.stacked(roles["reward_params"])
        args[1] = placement.place(rm_params, own(rm_params, roles["reward_params"]))
    if critic_model is not None:
        roles["critic"] = placement.param_shardings(critic_model)
        args[2] = placement.place(critic_params, own(critic_params, roles["critic"]))

    def make(actor_params, reward_params, critic_params):
        return ppo.init_state(pcfg, actor_model, actor_params, tx_actor, critic_model=critic_model,
                              critic_params=critic_params, tx_critic=tx_critic, reward=reward,
                              reward_params=reward_params)

    state, state_sh = placement.init_state(make, *args, roles=roles)
    parts = ppo.split(actor_model, critic_model, reward, tx_actor, tx_critic, pcfg, lr_schedule=schedule)
    return PPOSetup(pcfg, actor_model, critic_model, reward, keys, parts, state, state_sh)


def ppo_phase(cfg, train, *, model, params, reward_model_and_params=None, task: Task, workdir, writer, rng,
              placement: Placement | None = None, eval_fn=None, should_stop=None, early_stop: EarlyStop | None = None,
              model_weight: float | None = None, ensemble_reduce: str | None = None):
    """RLHF-PPO: actor `params`, frozen reference (a copy), critic on the policy's trunk
    (or shared), and the frozen reward model — or, with `reward_model_and_params=None`
    (`ppo.reward="task"`), the task's own reward given the task's extras; with a
    `model_weight` too, the task's reward plus that reward model's score at that weight (a
    pretrained one, `reward.model_path`: `runs.reward_folder`). The step is a
    sharded rollout, scoring and update, timed (`rl_step`); host (text) reward
    components, e.g. the JSONL task's answer check or Python rewards of the `reward`
    section, are scored on each process's responses in between, as in GRPO. The held-out
    exact-match accuracy (the true reward, `eval/accuracy`)
    is logged beside the score the policy optimises (`reward/mean`): with a learned reward
    model, the score going up is not the same as getting better.

    On the mesh, each role's fields of the state take that model's shardings: actor and
    reference the policy's, the critic its own, the reward model its own.

    With LoRA adapters in `params` (`model.config.lora`) one frozen base serves every role:
    the actor trains its adapters, the reference is the base without them, the critic
    trains its own adapters and score head on the same base arrays (or, shared, the value
    head beside the actor's adapters), and reward-model params that are a LoRA part alone
    (`lora.is_part`: adapters and score head, trained on a copy of this same base) run on
    it too. Nothing of the base is copied.

    `ensemble_reduce` ("mean" | "min"): the reward-model params are a stacked ensemble
    (`reward_model_phase` with `ensemble` > 1), scored by the members' reduced score
    (`reward_model.as_ensemble_reward`; their disagreement is `reward/reward_model_std`).
    """
    placement = placement or Placement.local()
    built = ppo_setup(cfg, model=model, params=params, task=task, placement=placement,
                      reward_model_and_params=reward_model_and_params, model_weight=model_weight,
                      ensemble_reduce=ensemble_reduce)
    pcfg, reward, keys, parts, state, state_sh = (built.cfg, built.reward, built.keys, built.parts, built.state,
                                                  built.state_sh)
    batches = array_batches({k: task.prompts[k] for k in ("prompt_ids", "prompt_mask", *keys)}, cfg.prompts_per_step,
                            cfg.seed, placement, "ppo.prompts_per_step")
    step, batches = rl_step(parts, scoring.compiled_reward(reward)[0], train, placement, state_sh, keys,
                            cfg.prompts_per_step, pcfg.sampling, task=task, drop_unscored=True,
                            ahead=(pipeline_section(cfg, "ppo"), batches, rng),
                            completions=completions_sink(train, writer, "ppo",
                                                         lambda s: on_actor(s.actor.params, s.reward_params)))

    def evaluate(state):
        return eval_fn(state.actor.params) if eval_fn else {}

    state, last = run_phase(
        phase_config("ppo", cfg, train, show=("reward/mean", "kl/k1", "eval/accuracy", timing.TOKENS_PER_S)),
        workdir=workdir, state=state, step_fn=step, batches=batches, rng=rng, writer=writer,
        monitor=health_monitor(train.monitor, "ppo", clip=pcfg.clip_low, kl_target=pcfg.kl_target),
        eval_fn=evaluate,
        should_stop=should_stop, **stopping_options(early_stop, "actor"))
    params = state.actor.params
    if pcfg.shared:
        params = {k: v for k, v in params.items() if k != "value_head"}
    return params, last


__all__ = ["PPOSetup", "grpo_phase", "update_phase", "health_monitor", "optimizer", "pipeline_section", "ppo_phase", "ppo_setup",
           "sampling", "library_config", "sft_phase", "with_reward_model"]
