"""The reward model's preference pairs from the policy's own samples, ranked by the task's rule.

InstructGPT's recipe (Ouyang et al. 2022, §3.5): the reward model learns from comparisons
of the SFT policy's own responses, ranked by a labeller. Here the labeller is the task's
reward (its first component, the exact match of the built-in tasks): after SFT,
`samples_per_prompt` responses to each training prompt are sampled from the policy (the
sampler the RL phases use, `held_out.make_sampled_responses`), and every prompt with mixed
outcomes gives one pair per distinct wrong response — chosen = a correct sample,
rejected = that wrong one. The rejected answers are the mistakes PPO will actually meet,
where the task's synthetic pairs (`data.make_preference_pairs`) corrupt the right answer
in fixed ways the policy may never make.

`config.reward_model.pairs` picks the training pairs: "task" (the task's synthetic pairs,
the default), "policy" (these), or "both" (the two sets together). The held-out pairs are
the task's synthetic test pairs (when the task has them) and, whenever
`reward_model.samples_per_prompt` > 0 (also with "task": how well a reward model trained
on synthetic pairs judges the policy's real mistakes), on-policy pairs from the held-out
prompts, drawn the same way (`reward_model_phase` reports both).

The pairs are a deterministic function of the phase's RNG (`config.seed`) and the
policy's parameters: a resumed run restores the SFT parameters and draws the same pairs
again (recomputed, not stored; a few seconds on the built-in task).
"""

from __future__ import annotations

import dataclasses
import functools
import logging

import jax
import numpy as np

from jaxrlhf.runs.held_out import make_sampled_responses
from jaxrlhf.runs.tasks import Task

log = logging.getLogger("jaxrlhf")



@dataclasses.dataclass(frozen=True)
class PolicyPairsConfig:
    """How on-policy pairs are drawn: `samples_per_prompt` (k) responses per prompt at
    `temperature` to the first `num_prompts` training prompts (0 = all of them) — these
    train the reward model when `train` — and to every held-out prompt (always evaluated)."""

    samples_per_prompt: int = 8
    temperature: float = 1.0
    num_prompts: int = 0
    train: bool = True

    @classmethod
    def from_config(cls, cfg) -> "PolicyPairsConfig | None":
        """From the `reward_model` section (`pairs`, `samples_per_prompt`, `temperature`,
        `num_prompts`, each within its field's bounds: `runs.sections.RewardModelRun`); None
        when there are no on-policy pairs (`samples_per_prompt=0`, only with `pairs="task"`).
        A pair needs a right and a wrong sample of one prompt: `samples_per_prompt` is 0 or
        >= 2, and > 0 when `pairs` samples the policy; errors name the field."""
        source, k = cfg.pairs, cfg.samples_per_prompt
        if source == "task" and k == 0:
            return None
        if k < 2:
            need = "" if source == "task" else f" (reward_model.pairs={source!r} samples the policy)"
            raise ValueError(f"reward_model.samples_per_prompt={k!r}: expected 0 (no on-policy pairs) or an integer "
                             f">= 2 (a pair needs a right and a wrong sample of one prompt){need}")
        return cls(samples_per_prompt=k, temperature=float(cfg.temperature), num_prompts=cfg.num_prompts,
                   train=source != "task")


def pairs_from_samples(prompt_ids_NxP, prompt_mask_NxP, response_ids_NkxT, response_mask_NkxT, correct_Nxk) -> dict:
    """Preference pairs (`data.preference_batch` layout) from k scored samples per prompt.

    Sample j of prompt i is row i·k + j of the responses (right-padded, the mask marking
    the valid tokens, EOS included when drawn). Each prompt with a correct and a wrong
    sample gives one pair per distinct wrong response, in order of first appearance:
    chosen = its first correct sample, rejected = that wrong response. Adds `prompt_index`
    `[M]`, the row of each pair's prompt. Prompts whose samples are all right or all wrong
    give none.
    """
    correct_Nxk = np.asarray(correct_Nxk, bool)
    n, k = correct_Nxk.shape
    ids = np.asarray(response_ids_NkxT).reshape(n, k, -1)
    mask = np.asarray(response_mask_NkxT).astype(bool).reshape(n, k, -1)
    prompt_rows, chosen_rows, rejected_rows = [], [], []
    for i in np.flatnonzero(correct_Nxk.any(axis=1) & ~correct_Nxk.all(axis=1)):
        right = int(np.argmax(correct_Nxk[i]))
        seen = set()
        for j in np.flatnonzero(~correct_Nxk[i]):
            text = tuple(ids[i, j][mask[i, j]].tolist())
            if text not in seen:
                seen.add(text)
                prompt_rows.append(i)
                chosen_rows.append(i * k + right)
                rejected_rows.append(i * k + j)
    flat_ids, flat_mask = ids.reshape(n * k, -1), mask.reshape(n * k, -1)
    prompt_rows = np.asarray(prompt_rows, np.int64)
    return dict(prompt_ids=np.asarray(prompt_ids_NxP)[prompt_rows], prompt_mask=np.asarray(prompt_mask_NxP)[prompt_rows],
                chosen_ids=flat_ids[chosen_rows], chosen_mask=flat_mask[chosen_rows],
                rejected_ids=flat_ids[rejected_rows], rejected_mask=flat_mask[rejected_rows],
                prompt_index=prompt_rows)


def concat_pairs(a: dict, b: dict, *, pad_id: int) -> dict:
    """Two pair sets (`data.preference_batch` layout) as one: responses right-padded with
    `pad_id` to the longer T of the two; keys that only one set has are dropped."""
    width = max(a["chosen_ids"].shape[1], b["chosen_ids"].shape[1])

    def wide(x, key):
        if key.startswith(("chosen", "rejected")) and x.shape[1] < width:
            fill = pad_id if key.endswith("_ids") else 0
            x = np.pad(x, ((0, 0), (0, width - x.shape[1])), constant_values=fill)
        return x

    return {key: np.concatenate([wide(np.asarray(a[key]), key), wide(np.asarray(b[key]), key)])
            for key in a if key in b}


def sample_pairs(model, params, task: Task, prompts: dict, cfg: PolicyPairsConfig, *, rng: jax.Array,
                 batch_size: int = 512, placement=None) -> tuple[dict, dict]:
    """`(pairs, stats)`: on-policy pairs (`pairs_from_samples`) of `prompts` (the
    `task.prompts` layout) from `cfg.samples_per_prompt` samples of the policy `params`.

    `stats`: `prompts`, `mixed_prompts` (those giving pairs), `pairs`, and `sampled_accuracy`
    (the fraction of correct samples, the policy's mean@k on these prompts).
    """
    draw = make_sampled_responses(model, task, num_samples=cfg.samples_per_prompt, temperature=cfg.temperature,
                                  rng=rng, batch_size=batch_size, placement=placement)
    correct, ids, mask = draw(params, prompts)
    pairs = pairs_from_samples(prompts["prompt_ids"], prompts["prompt_mask"], ids, mask, correct)
    stats = dict(prompts=correct.shape[0], mixed_prompts=int(np.unique(pairs["prompt_index"]).size),
                 pairs=int(pairs["prompt_index"].size), sampled_accuracy=float(correct.mean()))
    return pairs, stats


def training_prompts(task: Task, cfg: PolicyPairsConfig) -> dict:
    """The first `cfg.num_prompts` training prompts of the task (all for 0), with the
    reward's extras: never a held-out prompt."""
    n = task.prompts["prompt_ids"].shape[0]
    if cfg.num_prompts > n:
        raise ValueError(f"reward_model.num_prompts={cfg.num_prompts} is more than the task's {n} training prompts; "
                         "lower it (0 = all of them)")
    count = cfg.num_prompts or n
    return {k: v[:count] for k, v in task.prompts.items()}


def phase_pairs(cfg, train, *, policy_model, policy_params, task: Task, rng, placement):
    """`(training pairs, {name: held-out pairs}, stats)` of the reward-model phase as
    `cfg.pairs` picks them: the task's synthetic pairs, on-policy
    pairs sampled from `policy_params` and ranked by the task's reward, or both. The
    held-out sets: the task's synthetic test pairs ("" prefix) when the task has them, and
    with `cfg.samples_per_prompt` > 0 on-policy pairs of the held-out prompts
    ("policy_pairs/"; none when every held-out prompt's samples are all right or all wrong)."""
    pcfg = PolicyPairsConfig.from_config(cfg)
    if cfg.pairs in ("task", "both") and task.pairs is None:
        raise ValueError(f"reward_model.pairs={cfg.pairs!r} needs the task's preference pairs, and task "
                         f"{task.name!r} has none: set task.num_pairs > 0 (addition), task.kind='pairs' or "
                         "task.pairs_path (files), or reward_model.pairs='policy'")
    held_out = {"": task.test_pairs} if task.test_pairs is not None else {}
    if pcfg is None:
        return task.pairs, held_out, {}
    draw = functools.partial(sample_pairs, policy_model, policy_params, task, cfg=pcfg,
                             batch_size=train.eval_batch_size, placement=placement)
    train_rng, test_rng = jax.random.split(rng)
    test_pairs, test_stats = draw(task.test_prompts, rng=test_rng)
    if test_stats["pairs"]:
        held_out["policy_pairs/"] = test_pairs
    stats = {f"policy_pairs/test_{k}": v for k, v in test_stats.items()}
    log.info("reward_model: %d held-out on-policy pairs from %d of %d prompts (%d samples each at temperature %g, "
             "%.3f of them correct)", test_stats["pairs"], test_stats["mixed_prompts"], test_stats["prompts"],
             pcfg.samples_per_prompt, pcfg.temperature, test_stats["sampled_accuracy"])
    if not pcfg.train:
        return task.pairs, held_out, stats
    pairs, train_stats = draw(training_prompts(task, pcfg), rng=train_rng)
    log.info("reward_model: %d on-policy training pairs from %d of %d prompts (%.3f of the samples correct)",
             train_stats["pairs"], train_stats["mixed_prompts"], train_stats["prompts"],
             train_stats["sampled_accuracy"])
    if not train_stats["pairs"]:
        raise ValueError(f"reward_model.pairs={cfg.pairs!r}: the policy's samples gave no pair (every prompt's "
                         f"{pcfg.samples_per_prompt} samples all right or all wrong); raise reward_model.temperature "
                         "or reward_model.samples_per_prompt")
    if cfg.pairs == "both":
        pairs = concat_pairs(task.pairs, pairs, pad_id=task.pad_id)
    stats.update({f"policy_pairs/train_{k}": v for k, v in train_stats.items()})
    return pairs, held_out, stats


__all__ = ["PolicyPairsConfig", "concat_pairs", "pairs_from_samples", "phase_pairs", "sample_pairs",
           "training_prompts"]
