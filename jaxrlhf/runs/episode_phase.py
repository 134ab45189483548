"""GRPO and PPO on multi-turn episodes, and their held-out evaluation, for a task with
`Task.episodes` (the built-in `calculator`, docs/episodes.md#a-built-in-task-sums-with-a-calculator).

A step's rollout is `rollout.episodes.run_episodes` over the step's rows, G episodes per
row (`grpo.sampling.num_samples`, `ppo.sampling.num_samples`), each with its own environment
instance reset with the same row. The episode's reward is handed to the task's host reward
component "env" (`env_task.episode_reward`: logged as `reward/env`, beside any Python
rewards of the `reward` section, which see the whole episode's text), then the algorithm's
own scoring and update (`grpo.split`'s or `ppo.split`'s `score` and `train`, jitted): the
sample's `response_mask` is the policy mask, so the loss, KL and advantages (PPO's GAE,
its value loss and whitening too) count the policy's tokens only, never the environment's,
and the forward passes (actor, reference, PPO's critic) run over the whole episode
(`attention_mask`). PPO's roles and state are `ppo_phase`'s (`phases.ppo_setup`).

The step reports the algorithm's metrics, the time split (`time/rollout_s` is the episodes', the
environments' own time inside it is `episode/env_seconds`) and the episodes' figures
(`episode_metrics`): `episode/turns`, `episode/tool_calls`, `episode/tool_errors/<kind>`,
`episode/well_formed_calls`, `episode/cut/<limit>`, `episode/policy_tokens`,
`episode/env_tokens`, per episode. The held-out evaluation (`make_episode_accuracy_fn`) is
greedy episodes on the test rows: `accuracy` (the environment's `stats["correct"]` when it
keeps one, else a reward >= 0.5), `reward`, and the same episode figures.

With `<phase>.pipeline.max_staleness` > 0 the episodes run ahead of learning
(`runs.pipeline`): a batch's episodes run on the pipeline's worker thread with a copy of the
weights of their version (the environments' time and the decoding beside the learner's
programs), and the step scores and updates with the learner's (`<phase>.correction`).

One process (any number of its local devices); the rows of a step are not split over
processes yet.
"""

from __future__ import annotations

import time

import jax
import jax.numpy as jnp
import numpy as np

from jaxrlhf import rewards as rewards_lib
from jaxrlhf.algorithms import grpo, timing
from jaxrlhf.data.calculator import ERROR_KINDS as CALC_ERRORS
from jaxrlhf.envs.tools import ERROR_KINDS as TOOL_ERRORS
from jaxrlhf.models import lora
from jaxrlhf.rollout import episodes as engine
from jaxrlhf.rollout.sampler import SampleOutput
from jaxrlhf.runs import phases, pipeline
from jaxrlhf.runs.loop import run_phase
from jaxrlhf.runs.sharding import Placement
from jaxrlhf.runs.tasks import Task

ERROR_KINDS = tuple(dict.fromkeys((*CALC_ERRORS, *TOOL_ERRORS)))  # `stats` keys counted as tool errors
PROMPT_MULTIPLE = 8


def run(model, params, task: Task, rows: list, rng, *, temperature: float, top_k: int = 0, top_p: float = 1.0):
    """`(EpisodeOutput, envs)`: one episode per row of `rows`, each with a fresh environment
    of the task, the prompts left-padded to one fixed width (the task's `prompt_len`, its
    longest allowed, rounded up to a multiple of 8: every step compiles the same shapes)."""
    spec = task.episodes
    envs = [spec.make_env() for _ in rows]
    out = engine.run_episodes(model, params, envs, rows, rng, max_turns=spec.max_turns,
                              max_turn_tokens=spec.max_turn_tokens, max_total_tokens=spec.max_total_tokens,
                              max_env_tokens=spec.max_env_tokens, temperature=temperature, top_k=top_k, top_p=top_p,
                              eos_id=spec.stop_ids, pad_id=task.pad_id, cut_reward=spec.cut_reward,
                              prompt_multiple=PROMPT_MULTIPLE, prompt_len=task.prompt_len,
                              prompt_field="task.max_prompt_tokens")
    return out, envs


def episode_metrics(out: engine.EpisodeOutput, envs: list) -> dict:
    """The episodes' figures (module docstring), per episode; the environments' numeric
    `stats` (e.g. `tool_calls`, error counts) averaged, errors as `episode/tool_errors/<kind>`."""
    n = len(envs)
    policy = np.asarray(out.sample.response_mask).sum(axis=1)
    m = {"episode/turns": float(np.mean(out.turns)), "episode/policy_tokens": float(np.mean(policy)),
         "episode/env_tokens": float(np.mean(out.env_mask.sum(axis=1))),
         "episode/env_seconds": float(np.sum(out.stats["env_seconds"])),
         "episode/reward": float(np.mean(out.rewards))}
    for limit in engine.LIMITS:
        m[f"episode/cut/{limit}"] = sum(c == limit for c in out.cut) / n
    totals: dict[str, float] = {}
    for env in envs:
        for k, v in (getattr(env, "stats", None) or {}).items():
            if isinstance(v, (int, float)) and not isinstance(v, bool):
                totals[k] = totals.get(k, 0.0) + float(v)
    for k, v in totals.items():
        m[f"episode/tool_errors/{k}" if k in ERROR_KINDS else f"episode/{k}"] = v / n
    if "tool_calls" in totals:
        errors = sum(v for k, v in totals.items() if k in ERROR_KINDS)
        m["episode/well_formed_calls"] = 1.0 - errors / totals["tool_calls"] if totals["tool_calls"] else 1.0
    return m


def _correct(out: engine.EpisodeOutput, envs: list) -> np.ndarray:
    """`[N]` bool: the environment's `stats["correct"]` where it keeps one, else reward >= 0.5."""
    return np.array([bool(getattr(e, "stats", {}).get("correct", r >= 0.5)) for e, r in zip(envs, out.rewards)])


def _head(out: engine.EpisodeOutput, k: int) -> engine.EpisodeOutput:
    """The first `k` episodes of `out` (host arrays)."""
    return engine.EpisodeOutput(sample=SampleOutput(*(None if x is None else np.asarray(x)[:k] for x in out.sample)),
                                env_mask=out.env_mask[:k], rewards=out.rewards[:k], turns=out.turns[:k],
                                cut=out.cut[:k], prefill_tokens=out.prefill_tokens[:k],
                                stats={name: v[:k] for name, v in out.stats.items()})


def make_episode_accuracy_fn(model, task: Task, *, batch_size: int = 512, placement=None):
    """`accuracy(params) -> {"accuracy", "reward", ...}` (with `return_samples=k`, 0
    included, `(result, the first k samples)`): greedy episodes on the task's test rows, in
    batches of `batch_size` episodes (a short last batch padded with copies of its last row,
    so every batch compiles alike)."""
    del placement  # one process: the episodes run on its devices
    rows = task.episodes.test_rows

    def accuracy(params, *, return_samples: int | None = None):
        correct, rewards, figures, samples = [], [], [], []
        for i in range(0, len(rows), batch_size):
            batch = rows[i:i + batch_size]
            k = len(batch)
            padded = batch + [batch[-1]] * (min(batch_size, len(rows)) - k)
            out, envs = run(model, params, task, padded, jax.random.key(0), temperature=0.0)
            out, envs = _head(out, k), envs[:k]
            correct.append(_correct(out, envs))
            rewards.append(np.asarray(out.rewards))
            figures.append((k, episode_metrics(out, envs)))
            s = out.sample
            for j in range(min((return_samples or 0) - len(samples), k)):
                prompt = task.decode(s.prompt_ids[j][s.prompt_mask[j]])
                text = task.decode(s.response_ids[j][s.attention_mask[j, -s.response_ids.shape[1]:]])
                samples.append((prompt, text, float(correct[-1][j])))
        n = sum(k for k, _ in figures)
        result = {"accuracy": float(np.concatenate(correct).mean()), "reward": float(np.concatenate(rewards).mean())}
        for key in figures[0][1]:
            if key != "episode/env_seconds":
                result[key.removeprefix("episode/")] = sum(k * f.get(key, 0.0) for k, f in figures) / n
        return result if return_samples is None else (result, samples)

    return accuracy


def _checks(task: Task, reward_model_and_params):
    if reward_model_and_params is not None:
        raise ValueError("reward.model_path: a reward model does not score episodes yet; leave it empty")
    if jax.process_count() > 1:
        raise ValueError("episodes run on one process for now; start the run on one")
    return rewards_lib.as_reward(task.reward)


def _collect(model, reward, task: Task, group: int, sampling):
    """`collect(params, local, key) -> sample`: `group` episodes per row of `local` with
    `params`, the environment's reward handed to the host component "env"; the sample
    holds the episodes' `SampleOutput`, its host scores, their figures and times."""
    spec = task.episodes

    def collect(params, local, key):
        rows = [spec.rows[int(i)] for i in np.asarray(local["row"]) for _ in range(group)]
        t0 = time.perf_counter()
        out, envs = run(model, params, task, rows, key, temperature=sampling.temperature, top_k=sampling.top_k,
                        top_p=sampling.top_p)
        t1 = time.perf_counter()
        host = reward.host_scores(rewards_lib.RewardInput.from_sample(out.sample), {"env_reward": out.rewards},
                                  drop_unscored=True)
        return dict(out=out.sample, host=host, figures=episode_metrics(out, envs), rollout_s=t1 - t0,
                    host_s=time.perf_counter() - t1, tokens=float(np.asarray(out.sample.response_mask).sum()))

    return collect


def _rollout_key(rng, state):
    return jax.random.fold_in(jax.random.fold_in(rng, state.step), 0)


def _episode_step(collect, params_of, score, update):
    """`step(state, local_rows, rng)`: the step's episodes with the policy `params_of(state)`
    (`_collect`), then the algorithm's jitted `score` and `update` (its `split`'s) on the
    episodes' sample, whose `response_mask` is the policy mask; the metrics are the
    algorithm's, the time split and `episode_metrics`."""
    def step(state, local, rng):
        sample = collect(params_of(state), local, _rollout_key(rng, state))
        t1 = time.perf_counter()
        prepared, m_score = jax.block_until_ready(score(state, sample["out"], {}, sample["host"], rng))
        t2 = time.perf_counter()
        state, m_train = jax.block_until_ready(update(state, prepared, rng))
        t3 = time.perf_counter()
        metrics = {**m_score, **m_train, **sample["figures"],  # scoring: the host reward's time and the program's
                   **timing.split_metrics(sample["rollout_s"], sample["host_s"] + t2 - t1, t3 - t2, sample["tokens"])}
        return state, metrics

    return step


def _episode_pipeline(collect, params_of, score, update, section, batches, rng, *, rows: int):
    """`(step, pipeline)` of episodes ahead of learning (`runs.pipeline`): the episodes of a
    batch run on the pipeline's worker thread (the environments' time and the decoding
    beside the learner's programs), with a copy of the weights that sample them (the update
    after it donates the state's); the step scores and updates with the learner's."""
    def dispatch(state, local, key):
        return dict(params=jax.tree.map(jnp.copy, params_of(state)), local=local, key=_rollout_key(key, state))

    def finish(sample):
        return collect(sample.pop("params"), sample["local"], sample["key"])

    def arrays(sample):
        out = {f"out.{k}": np.asarray(v) for k, v in sample["out"].arrays().items()}
        out.update({f"host.{k}": np.asarray(v) for k, v in sample["host"].items()})
        out.update({f"figures.{k}": np.float64(v) for k, v in sample["figures"].items()})
        return {**out, **{k: np.float64(sample[k]) for k in ("rollout_s", "host_s", "tokens")}}

    def rebuild(local, saved):
        part = lambda prefix: {k[len(prefix):]: v for k, v in saved.items() if k.startswith(prefix)}
        return dict(out=SampleOutput(**part("out.")), host=part("host."),
                    figures={k: float(v) for k, v in part("figures.").items()},
                    **{k: float(saved[k]) for k in ("rollout_s", "host_s", "tokens")})

    pipe = pipeline.Pipeline(batches, max_staleness=section.max_staleness, schedule=section.schedule, rng=rng,
                             dispatch=dispatch, finish=finish, rebuild=rebuild, arrays=arrays, groups_per_batch=rows)

    def step(state, item, rng):
        sample = item.sample
        with pipe.lock:
            t1 = time.perf_counter()
            prepared, m_score = jax.block_until_ready(score(state, sample["out"], {}, sample["host"], rng))
            t2 = time.perf_counter()
            state, m_train = jax.block_until_ready(update(state, prepared, rng))
            t3 = time.perf_counter()
            pipe.publish(state)
        metrics = {**m_score, **m_train, **sample["figures"], **pipe.metrics(item), timing.HOST_REWARD_S: sample["host_s"],
                   **timing.split_metrics(sample["rollout_s"], t2 - t1, t3 - t2, sample["tokens"])}
        return state, metrics

    return step, pipe


def _run(name: str, role: str, cfg, train, *, state, make_step, monitor, workdir, writer, rng, placement, eval_fn,
         should_stop, early_stop, task: Task):
    """`run_phase` of an episode phase `name` over the task's rows, `cfg.prompts_per_step`
    a step, from `make_step() -> (collect, params_of, score, update)`: synchronously
    (`_episode_step`) or ahead of learning (`<name>.pipeline`, `_episode_pipeline`); the
    trained params are `state.<role>.params`."""
    batches = phases.array_batches({"row": np.arange(len(task.episodes.rows))}, cfg.prompts_per_step, cfg.seed,
                                   placement, f"{name}.prompts_per_step")
    section = phases.pipeline_section(cfg, name)
    collect, params_of, score, update = make_step()
    if section.active:
        step, batches = _episode_pipeline(collect, params_of, score, update, section, batches, rng,
                                          rows=cfg.prompts_per_step)
    else:
        step = _episode_step(collect, params_of, score, update)
    return run_phase(
        phases.phase_config(name, cfg, train, show=("reward/mean", "episode/turns", "episode/well_formed_calls",
                                                    "eval/accuracy", timing.TOKENS_PER_S)),
        workdir=workdir, state=state, step_fn=step, batches=batches, rng=rng, writer=writer, monitor=monitor,
        eval_fn=(lambda s: eval_fn(getattr(s, role).params)) if eval_fn else None, should_stop=should_stop,
        **phases.stopping_options(early_stop, role))


def grpo_episode_phase(cfg, train, *, model, params, task: Task, workdir, writer, rng,
                       placement: Placement | None = None, eval_fn=None, should_stop=None, early_stop=None,
                       reward_model_and_params=None, model_weight: float = 1.0):
    """GRPO on the task's episodes (module docstring); returns `(params, last_metrics)`."""
    del model_weight
    placement = placement or Placement.local()
    reward = _checks(task, reward_model_and_params)
    gcfg = phases.library_config("grpo", cfg, task, monitor=train.monitor)
    for name, on in (("dynamic_sampling", gcfg.dynamic_sampling), ("guide_coef", gcfg.guide_coef)):
        if on:
            raise ValueError(f"grpo.{name}={cfg[name]!r}: not with episodes (task.name={task.name!r}); turn it off")
    tx, schedule = phases.optimizer(cfg.optim, "grpo.optim", total_steps=cfg.steps * gcfg.updates_per_iteration)
    p_sh = placement.param_shardings(model)
    own_reference = gcfg.uses_reference and not lora.has_adapters(params)
    make = lambda p: grpo.init_state(p, tx, ref_params=p if own_reference else None, cfg=gcfg)
    state, state_sh = placement.init_state(make, placement.place(params, p_sh), params_shardings=p_sh)
    parts = grpo.split(model, tx, gcfg, reward, schedule=schedule)
    update = jax.jit(parts.train, out_shardings=(state_sh, placement.replicated), donate_argnums=0)
    make_step = lambda: (_collect(model, reward, task, gcfg.group_size, gcfg.sampling), lambda s: s.policy.params,
                         jax.jit(parts.score), update)
    state, last = _run("grpo", "policy", cfg, train, state=state, make_step=make_step,
                       monitor=phases.health_monitor(train.monitor, "grpo", clip=gcfg.clip_low), workdir=workdir,
                       writer=writer, rng=rng, placement=placement, eval_fn=eval_fn, should_stop=should_stop,
                       early_stop=early_stop, task=task)
    return state.policy.params, last


def ppo_episode_phase(cfg, train, *, model, params, task: Task, workdir, writer, rng,
                      placement: Placement | None = None, eval_fn=None, should_stop=None, early_stop=None,
                      reward_model_and_params=None, model_weight: float | None = None, ensemble_reduce=None):
    """PPO on the task's episodes, with its critic (`phases.ppo_setup`: the roles and state
    of `ppo_phase`): `ppo.sampling.num_samples` episodes per row, `ppo.split`'s scoring and
    update. The scoring's mask is the sample's policy mask: KL, shaped rewards, GAE (over
    the policy tokens, skipping the environment's, whose values are never read), whitening
    and every loss count the policy's tokens only, while the actor, critic and reference
    run over the whole episode. Returns `(params, last_metrics)`."""
    del model_weight, ensemble_reduce
    placement = placement or Placement.local()
    _checks(task, reward_model_and_params)
    built = phases.ppo_setup(cfg, model=model, params=params, task=task, placement=placement)
    pcfg, reward = built.cfg, built.reward
    update = jax.jit(built.parts.train, out_shardings=(built.state_sh, placement.replicated), donate_argnums=0)
    make_step = lambda: (_collect(built.actor_model, reward, task, pcfg.sampling.num_samples, pcfg.sampling),
                         lambda s: s.actor.params, jax.jit(built.parts.score), update)
    monitor = phases.health_monitor(train.monitor, "ppo", clip=pcfg.clip_low, kl_target=pcfg.kl_target)
    state, last = _run("ppo", "actor", cfg, train, state=built.state, make_step=make_step, monitor=monitor,
                       workdir=workdir, writer=writer, rng=rng, placement=placement, eval_fn=eval_fn, should_stop=should_stop,
                       early_stop=early_stop, task=task)
    params = state.actor.params
    if pcfg.shared:
        params = {k: v for k, v in params.items() if k != "value_head"}
    return params, last


__all__ = ["episode_metrics", "grpo_episode_phase", "make_episode_accuracy_fn", "ppo_episode_phase", "run"]
