"""`train_and_evaluate(config, workdir)`: the phases of `registry.plan(config)`, in order —
for the built-in algorithms (`runs.builtin`) `sft`, `grpo`, `ppo`, `dpo`, `reward_model`,
each after the SFT warm start when `sft.steps` > 0 (PPO's reward model before it) — or
those of an algorithm registered by the user (`runs.registry`, docs/extending.md).

Every phase's counts and batch shapes are checked against the mesh before any work
(`runs.validation`), and the task is built then too, its tokenizer-dependent options
checked (`env_task.build_task`), with the Python rewards of the `reward` section imported
(`tasks.python_rewards`; they join the task's reward, `tasks.with_python_rewards`). Each
phase checkpoints under `workdir/<phase>/` and a rerun with the
same workdir resumes; the run holds the workdir's lock, and its config must be the one that
started the workdir (`runs.workdir`: `run.lock`, `run.json`).
The run ends with a before/after table of held-out accuracy, sample outputs, and (if
`train.export`) a Hugging Face folder `workdir/export/` with the final policy, written
whole into a temporary `workdir/.export.tmp-*` and renamed into place (an interrupted
export removes it; one killed outright is removed by the next run). Every row of
the table (start, after SFT, after the last phase) and every periodic evaluation
(`train.eval_every`) is one call of `held_out.make_accuracy_fn`: greedy exact match and
reward, plus with `train.eval_samples` > 0 the sampled metrics (`mean@n`, `pass@k`,
`maj@k`, see `runs.evaluation`) as extra columns and `eval/pass@4`-style metrics.

With `model.lora.rank` > 0 the phases of `model.lora.phases` train LoRA adapters only
(`models.lora`, `setup.lora_model` / `setup.start_adapters`; a reward model or PPO critic
also its new head), a policy's reference being the base without them, and the export adds
the PEFT folder `export/peft` (a reward model's export is merged only; an ensemble's is
one folder per member, `export/member<k>`). A PPO run whose
reward-model and PPO phases both train adapters keeps one base: the reward model's
adapters and head run on the actor's (`ppo.on_actor`).

With `train.stop_metric` set, a phase (the run's own, or those of `train.stop_phases`)
stops when that held-out metric has not improved for `train.stop_patience` evaluations,
and with `train.keep_best` ends with the parameters of its best evaluation, so the next
phase, the "after" row and the export use those (`runs.stopping`); `summary.json`'s
`early_stopping` records each such phase's best step and value and where it stopped.

Every phase runs on the device mesh `config.mesh` (default "data=-1") over all devices of
all processes, with the sharding rules `config.rules` (default "fsdp_tp"), see
`runs.sharding`. A multi-process job (`parallel.distributed.initialize()` first) runs the
same program on every process: each reads only its own rows of every batch, evaluation
results are replicated so every process sees the same numbers, checkpoints are written
by all processes into the shared `workdir`, and process 0 alone writes `config.json`,
metrics, `summary.json` and the export. A checkpoint restores into the shardings of the
current mesh, so a run can resume on another mesh or device count.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import shutil
import tempfile
import time
from pathlib import Path

import jax

from jaxrlhf import exits, reward_workers, runlog
from jaxrlhf.models import lora, peft_export, quant, save_pretrained
from jaxrlhf.models.hf_checkpoint import move_into_place
from jaxrlhf.runs import builtin  # noqa: F401  (registers the five built-in algorithms)
from jaxrlhf.runs import hooks, registry, reward_folder, setup, stopping, validation
from jaxrlhf.runs.evaluation import SampledEval
from jaxrlhf.runs.metrics import MetricsWriter, start_wandb
from jaxrlhf.runs.sharding import Placement
from jaxrlhf.runs.episode_phase import make_episode_accuracy_fn
from jaxrlhf.runs.held_out import make_accuracy_fn
from jaxrlhf.runs.env_task import build_task
from jaxrlhf.runs.tasks import python_rewards, with_python_rewards
from jaxrlhf.runs.workdir import claim

log = logging.getLogger("jaxrlhf")

def _print_summary(rows, samples, elapsed, show=True, sampled: SampledEval | None = None):
    """The before/after table: greedy exact match and reward, then (with `sampled`) one
    column per sampled metric in the order mean@n, pass@k..., maj@k..."""
    cols = []
    if sampled is not None:
        cols = [f"mean@{sampled.num_samples}", *(f"{m}@{k}" for m in ("pass", "maj") for k in sampled.ks)]
    lines = ["", "| stage | held-out exact match | held-out reward |" + "".join(f" {c} |" for c in cols),
             "|---|---|---|" + "---|" * len(cols)]
    lines += [f"| {name} | {m['accuracy']:.3f} | {m['reward']:.3f} |" + "".join(f" {m[c]:.3f} |" for c in cols)
              for name, m in rows]
    if cols:
        n = sampled.num_samples
        lines += [f"Exact match and reward: greedy decoding. Sampled: {sampled.describe()}; mean@{n} = accuracy "
                  "of one sample,", "pass@k = chance that one of k samples is correct (unbiased estimate), maj@k = "
                  "the majority answer of the first k is correct."]
    if samples:
        lines += ["", "Sample outputs (held-out, greedy):"]
        lines += [f"  {p!r} -> {r!r}  {'correct' if ok else 'wrong'}" for p, r, ok in samples]
    lines += ["", f"total time {elapsed:.0f} s"]
    text = "\n".join(lines)
    if show:
        print(text, flush=True)
    return text


def _export_merged(model, params, path: Path, tokenizer=None):
    """`model` (any head) as a Hugging Face folder at `path`: a QLoRA base de-quantised
    (`quant.dequantize_base`), LoRA adapters merged into the weights (`lora.merge`).
    Returns (the float model without adapters it was written as, the de-quantised params)."""
    plain = quant.float_model(model)
    if quant.has_quantized(params):
        params = quant.dequantize_base(model, params)
    merged = lora.merge(model.config, params) if lora.has_adapters(params) else params
    save_pretrained(plain, merged, path, tokenizer=tokenizer, overwrite=True)
    return plain, params


def _absolute(path: str) -> str:
    """A local folder as an absolute path ("" stays ""): the PEFT export's base when it is
    the user's own `model.path`, valid from wherever the export is loaded."""
    return os.path.abspath(path) if path else ""


PEFT_BASE = "./base"  # a base saved inside the PEFT folder, as its adapter_config.json names it


def _export_policy(model, params, path: Path, tokenizer, *, base_path: str | None) -> None:
    """The policy as a Hugging Face folder at `path`. With LoRA adapters: merged into the
    weights there, and the adapters alone as a PEFT folder `path/peft` for their base —
    `base_path` (the checkpoint the phase started from: `model.path`, absolute), or else (an
    SFT warm start changed it, or QLoRA quantised it) the base written to `path/peft/base`,
    de-quantised, and recorded relative to the PEFT folder (`PEFT_BASE`), so the export
    loads wherever the workdir moves: `PeftModel.from_pretrained(AutoModelForCausalLM.
    from_pretrained(peft_dir / base_model_name_or_path), peft_dir)` (docs/training.md)."""
    quantized = quant.has_quantized(params)
    plain, params = _export_merged(model, params, path, tokenizer)
    if not lora.has_adapters(params):
        return
    if not base_path or quantized:
        save_pretrained(plain, lora.without_adapters(params), path / "peft" / "base", tokenizer=tokenizer,
                        overwrite=True)
        base_path = PEFT_BASE
    peft_export.save_peft(model.config, params, path / "peft", base_model_name_or_path=base_path)


@contextlib.contextmanager
def _exporting(workdir: Path):
    """The folder to write the export into: `.export.tmp-*/export` in `workdir`, renamed to
    `workdir/export` when the block ends (the previous export replaced only then). The
    temporary folder is removed on every way out, a signal's included."""
    tmp = Path(tempfile.mkdtemp(prefix=".export.tmp-", dir=workdir))
    try:
        yield tmp / "export"
        exits.signal_at("export")  # test hook
        move_into_place(tmp / "export", workdir / "export")
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _remove_stale_exports(workdir: Path) -> None:
    """The temporary folders of an export that was killed before it could clean up."""
    for stale in sorted([*workdir.glob(".export.tmp-*"), *workdir.glob(".export.old-*")]):
        log.info("removing %s, left by an interrupted export", stale)
        shutil.rmtree(stale, ignore_errors=True)


def _evaluating(accuracy):
    """`accuracy` (`held_out.make_accuracy_fn`) with the test hook `exits.signal_at("eval")` first."""
    def evaluate(params, **kwargs):
        exits.signal_at("eval")
        return accuracy(params, **kwargs)

    return evaluate


def train_and_evaluate(config, workdir: str | Path, *, should_stop=None, resume_with_changes: bool = False) -> dict:
    """Run `config` end to end in `workdir`; returns the summary dict (also `summary.json`).

    The run holds the workdir's lock throughout, and a workdir started with another config
    is refused before anything in it is written (`runs.workdir.claim`), unless every change
    is safe to resume with (its option is marked `safe`, `runs.sections`) and `resume_with_changes` is set.
    Every step compiles under `placement.kernels()` (the splash kernel split over the mesh).
    """
    registry.algorithm(config)  # a registered one (the built-in five: `runs.builtin`)
    validation.check_values(config)  # every option within its field's bounds, first
    sampled = SampledEval.from_config(config.train)  # checked before any work
    if python_rewards(config.get("reward")) and config.algorithm == "ppo" and config.ppo.reward == "model":
        raise ValueError("reward.fns: PPO scores with its reward model (ppo.reward='model'); set "
                         "ppo.reward='task' to train on the task's reward and these functions")
    folder = (config.get("reward") or {}).get("model_path", "")
    if folder:
        if config.algorithm not in ("grpo", "ppo"):
            raise ValueError(f"reward.model_path: a reward model from a folder scores GRPO and PPO responses, not "
                             f"algorithm={config.algorithm!r}; leave it empty")
        if config.algorithm == "ppo" and config.ppo.reward == "model":
            raise ValueError("reward.model_path: PPO with ppo.reward='model' trains its own reward model; set "
                             "ppo.reward='task' to score with the folder's (beside the task's reward at "
                             "reward.task_weight, 0 = the folder's model alone)")
        reward_folder.check_folder(folder)  # a classifier folder, before any work
    stops = stopping.from_config(config, sampled)  # {phase: EarlyStop}, checked before any work
    hooks.check_train(config.train)  # train.hooks import: before any work
    start = time.perf_counter()
    placement = Placement.from_config(config)
    validation.check_config(config, placement)  # every phase's counts and batch shapes, before any work
    log.info("%s", placement.describe())
    task = _task(config)  # its options (stop tokens and strings, template variables and names), before any work
    validation.check_built(config, task)  # every library config the phases build, with the task's tokens
    with claim(workdir, config, resume_with_changes=resume_with_changes), placement.kernels(), \
            reward_workers.closing():  # the reward functions' worker processes stopped, whichever way out
        return _run(config, Path(workdir), task=task, placement=placement, sampled=sampled, stops=stops, start=start,
                    should_stop=should_stop)


def _task(config):
    """The run's task with the Python rewards of `config.reward`, built before the workdir is
    claimed so that a bad task option (`task.stop_tokens` against the tokenizer,
    `task.stop_strings`, `task.chat_template_kwargs`, a chat template name that would write
    outside the export, a data file) stops the run with nothing written. Its log lines wait
    for `train.log` (`runlog.capture`)."""
    task = with_python_rewards(build_task(config.task, model_path=config.model.path, env=config.get("env")),
                               config.get("reward"))
    if task.episodes is not None:
        if config.algorithm not in ("grpo", "ppo", "sft"):
            raise ValueError(f"task.name={config.task.name!r} runs multi-turn episodes: algorithm 'grpo' or 'ppo' (or "
                             f"'sft' on its demonstrations), not {config.algorithm!r}")
        if config.algorithm == "ppo" and config.ppo.reward != "task":
            raise ValueError(f"ppo.reward={config.ppo.reward!r}: episodes are scored by their environment's reward; "
                             "set ppo.reward='task'")
        if config.train.eval_samples:
            raise ValueError(f"train.eval_samples={config.train.eval_samples}: the held-out evaluation of episodes is "
                             "greedy only; set it to 0")
    if config.algorithm == "grpo" and config.grpo.guide_coef > 0:  # a task without references: before any phase
        task.reference_keys(f"grpo.guide_coef={config.grpo.guide_coef}")
    if len(task.stop_ids) > 1:
        tok = task.tokenizer
        name = tok.convert_ids_to_tokens if hasattr(tok, "convert_ids_to_tokens") else (
            lambda i: tok.decode([i], stop_at_eos=False, skip_special_tokens=False))  # the character tokenizer
        log.info("responses end at any of the token ids %s (%s)", list(task.stop_ids),
                 ", ".join(repr(name(i)) for i in task.stop_ids))
    return task


def _run(config, workdir: Path, *, task, placement, sampled, stops, start, should_stop) -> dict:
    """The phases of `registry.plan(config)`, the summary table and the export, in a workdir
    this run holds."""
    main = jax.process_index() == 0
    runlog.attach(workdir, main_process=main)  # the command line's train.log (nothing without it)
    if main:
        _remove_stale_exports(workdir)
    folder_rm = reward_folder.load(config.get("reward"), config.model, tokenizer=task.tokenizer,
                                   policy_vocab=task.vocab_size, placement=placement)
    model, params = setup.build_model(config.model, vocab_size=task.vocab_size, seed=config.seed, pad_id=task.pad_id,
                                      bos_id=task.bos_id, eos_id=task.eos_id, placement=placement)
    plain, model = model, setup.lora_model(config.model, model)  # model.lora: its phases train fresh adapters
    if task.episodes is not None:  # greedy episodes on the held-out rows (`runs.episode_phase`)
        accuracy = _evaluating(make_episode_accuracy_fn(model, task, batch_size=config.train.eval_batch_size,
                                                        placement=placement))
    else:
        accuracy = _evaluating(make_accuracy_fn(model, task, batch_size=config.train.eval_batch_size,
                                                placement=placement, sampled=sampled, seed=config.seed,
                                                slots=config.train.eval_slots))
    wandb_run = None
    if config.train.wandb and main:
        wandb_run = start_wandb(workdir, project=config.train.wandb_project, mode=config.train.wandb_mode,
                                config=config.to_dict())
    writer = MetricsWriter(workdir, tensorboard=config.train.tensorboard, wandb_run=wandb_run)
    run = registry.Run(config=config, task=task, placement=placement, workdir=workdir, writer=writer,
                       should_stop=should_stop, model=model, plain=plain, params=params, accuracy=accuracy,
                       stops=stops, adapted=validation.lora_phases(config), folder_reward_model=folder_rm,
                       rng=jax.random.key(config.seed))
    samples = []
    try:
        trained = None  # the last policy phase
        for i, name in enumerate(registry.plan(config)):
            if i:
                exits.signal_at("between_phases")  # test hook
            spec = registry.PHASES[name]
            if spec.policy:
                run.rows.append(("start" if trained is None else f"after {trained.upper()}", accuracy(run.params)))
                trained = name
            spec.run(run)
        algorithm = registry.algorithm(config)
        if algorithm.exports == "policy":
            final, samples = accuracy(run.params, return_samples=config.train.show_samples)
            run.rows.append((f"after {config.algorithm.upper()}", final))
            if config.train.export:
                host_params = placement.fetch(run.params)  # every process takes part in the gather
                if main:
                    tokenizer = task.tokenizer.to_hf() if hasattr(task.tokenizer, "to_hf") else task.tokenizer
                    # an earlier policy phase (the SFT warm start) changed the base
                    warm_started = any(registry.PHASES[p].policy for p in registry.plan(config)[:-1])
                    with _exporting(workdir) as out:
                        _export_policy(model, host_params, out, tokenizer,
                                       base_path=None if warm_started else _absolute(config.model.path))
        elif config.train.export:
            rm_model, rm_params = run.reward_model
            host_params = placement.fetch(rm_params)
            if main:
                with _exporting(workdir) as out:
                    if config.reward_model.ensemble > 1:  # stacked members: one folder each
                        for k in range(config.reward_model.ensemble):
                            member = jax.tree.map(lambda x: x[k], host_params)
                            _export_merged(rm_model, member, out / f"member{k}")
                    else:
                        _export_merged(rm_model, host_params, out)
    finally:
        writer.close()
    rows, extras = run.rows, run.extras
    text = _print_summary(rows, samples, time.perf_counter() - start, show=main, sampled=sampled)
    if main:
        for name, m in extras.items():
            print(f"{name}: " + ", ".join(f"{k}={v:.4g}" for k, v in m.items()), flush=True)
        for name, rule in stops.items():
            print(rule.describe(name), flush=True)
    if stops:
        extras["early_stopping"] = {name: rule.report() for name, rule in stops.items()}
    summary = {"stages": {name: m for name, m in rows}, "samples": samples, "table": text,
               "seconds": time.perf_counter() - start, **extras}
    if main:
        (workdir / "summary.json").write_text(json.dumps(summary, indent=2))
    return summary
