"""Decoding and scoring a task's prompts: the held-out evaluation (`make_accuracy_fn`:
greedy exact match and reward, and the sampled metrics) and the sampled, scored responses
that sampled evaluation and the reward model's on-policy pairs share
(`make_sampled_responses`). The responses are cut at the task's stop strings and scored
by its reward: the JAX components on the mesh, the host ones on the decoded text."""

from __future__ import annotations

import functools
from typing import Callable

import jax
import numpy as np

from jaxrlhf import rewards
from jaxrlhf.models.transformer import Transformer
from jaxrlhf.rollout.continuous import sample_continuous
from jaxrlhf.rollout.sampler import SampleOutput, sample
from jaxrlhf.runs.evaluation import SampledEval, sampled_metrics
from jaxrlhf.runs.tasks import Task


def host_extras(batch: dict, keys) -> dict:
    """Reward extras of a batch: object arrays (e.g. answer strings) become lists."""
    return {k: list(batch[k]) if batch[k].dtype == object else batch[k] for k in keys}


def _prompt_batches(prompts: dict, prompts_per_batch: int, placement):
    """(first prompt, host batch, its rows, its prompts padded and placed on the mesh) of
    each batch of `prompts_per_batch` prompts. Every batch is padded to the same rows, so a
    short last batch compiles nothing new."""
    from jaxrlhf.runs.sharding import pad_rows

    num_prompts = prompts["prompt_ids"].shape[0]
    padded_rows = placement.padded_rows(min(prompts_per_batch, num_prompts))
    for i in range(0, num_prompts, prompts_per_batch):
        batch = {k: v[i:i + prompts_per_batch] for k, v in prompts.items()}
        rows = batch["prompt_ids"].shape[0]
        padded = pad_rows({k: batch[k] for k in ("prompt_ids", "prompt_mask")}, padded_rows)
        yield i, batch, rows, placement.put_rows(padded)


def _make_scorer(task: Task, placement):
    """`score(out, batch, rows, repeat) -> (reward components [rows·repeat], out on the
    host)` of the first rows·repeat rows of `out`, the responses to the prompts of `batch`,
    `repeat` per prompt, cut at the task's stop strings first (`Task.cut`): the JAX
    components on the mesh, the host ones on the decoded text. A row that every weighted
    reward leaves unscored (Python functions returning None) stays, NaN in their scores:
    `Reward.scored` finds it; a batch with no scored row is an error."""
    from jaxrlhf.runs.sharding import pad_rows

    device_scores = jax.jit(lambda out, extras: task.reward.device_scores(rewards.RewardInput.from_sample(out), extras),
                            out_shardings=placement.replicated)

    def score(out, batch, rows, repeat):
        extras = host_extras({k: np.repeat(batch[k], repeat, axis=0) for k in task.extra_keys}, task.extra_keys)
        arrays = {k: v for k, v in extras.items() if hasattr(v, "shape")}
        if arrays:
            arrays = placement.put_rows(pad_rows(arrays, out.response_ids.shape[0]))
        n = rows * repeat
        if task.stop_strings:  # every process holds every row (`out` is replicated): each cuts them all
            out = SampleOutput(**placement.put_rows(task.cut(placement.fetch(out)).arrays()))
        parts = {k: np.asarray(v)[:n] for k, v in placement.fetch(device_scores(out, arrays)).items()}
        out = jax.tree.map(lambda x: x[:n], placement.fetch(out))
        if not task.reward.is_jax:
            # A row no weighted reward scores is left to the caller (`Reward.scored`), not an error.
            parts.update(task.reward.host_scores(rewards.RewardInput.from_sample(out), extras, drop_unscored=True))
        return parts, out

    return score


def _sampler(slots: int) -> Callable:
    """`sampler.sample`, or with `slots` = S > 0 `continuous.sample_continuous` over S slots
    (the same arguments and tokens; `train.eval_slots`)."""
    return functools.partial(sample_continuous, slots=slots) if slots else sample


def make_sampled_responses(model: Transformer, task: Task, *, num_samples: int, temperature: float, rng: jax.Array,
                           batch_size: int = 512, placement=None, slots: int = 0):
    """`draw(params, prompts) -> (correct [N, n] bool, response_ids [N·n, T], response_mask
    [N·n, T])`: `num_samples` (n) responses to each of the N prompts of `prompts` (the
    `task.prompts` layout, with the reward's extras), sampled at `temperature` and scored by
    the task's reward; a sample is correct when the reward's first component (the exact
    match of the built-in tasks) is >= 0.5. Sample j of prompt i is row i·n + j, whose noise
    is `fold_in(rng, i·n + j)` at every call: the result depends on the parameters and
    prompts only, not on `batch_size` (sequences per batch) or the mesh. Used by sampled
    evaluation and by the reward model's on-policy pairs (`runs.policy_pairs`). `slots` > 0:
    each batch is decoded by continuous batching over that many slots (`_sampler`)."""
    from jaxrlhf.runs.sharding import Placement

    placement = placement or Placement.local()
    n = num_samples
    first = task.reward.components[0].name
    score = _make_scorer(task, placement)

    def one_batch(params, prompt_ids, prompt_mask, first_row):
        return _sampler(slots)(model, params, prompt_ids, prompt_mask, rng, temperature=temperature,
                               num_samples=n, first_row=first_row, max_new_tokens=task.response_len,
                               eos_id=task.stop_ids, pad_id=task.pad_id)

    decode = jax.jit(one_batch, out_shardings=placement.replicated)

    def draw(params, prompts: dict):
        correct, ids, mask = [], [], []
        for i, batch, rows, placed in _prompt_batches(prompts, max(1, batch_size // n), placement):
            out = decode(params, placed["prompt_ids"], placed["prompt_mask"], np.int32(i * n))
            parts, out = score(out, batch, rows, n)
            correct.append(np.asarray(parts[first]).reshape(rows, n) >= 0.5)
            ids.append(np.asarray(out.response_ids))
            mask.append(np.asarray(out.response_mask))
        return np.concatenate(correct), np.concatenate(ids), np.concatenate(mask)

    return draw


def make_accuracy_fn(model: Transformer, task: Task, *, batch_size: int = 512, placement=None,
                     sampled: SampledEval | None = None, seed: int = 0, slots: int = 0):
    """`accuracy(params) -> {"accuracy", "reward", ...}`: the held-out evaluation (with
    `return_samples=k`, 0 included, `(result, the first k greedy samples)`).

    Greedy decoding: `accuracy` is the mean of the reward's first component (the
    exact-match reward of the built-in tasks); `reward` the mean of the full weighted
    reward over the rows some weighted reward scores (NaN when none does). Host rewards run
    on the decoded text.

    Sampled (`sampled`, a `runs.evaluation.SampledEval`, e.g. from `config.train.eval_samples`
    > 0): n responses per prompt at temperature τ, scored by the same code as the greedy
    ones (`make_sampled_responses`); a sample is correct when the reward's first component
    is >= 0.5 (the 0/1 exact match of the built-in tasks). Adds `mean@<n>`, and `pass@k`
    and `maj@k` for each k (`evaluation.sampled_metrics`; maj@k votes over `task.answers`).
    The noise is fixed: sample j of held-out prompt i is row i·n + j of `sample(...,
    rng=jax.random.key(seed))` at every call, so two evaluations differ only by the
    parameters, and the numbers do not depend on the batch size or the mesh. A sampled
    batch holds `batch_size // n` prompts (`batch_size` counts sequences). `slots` > 0
    (`train.eval_slots`): both decode by continuous batching over that many slots, the same
    tokens as the static batch (`rollout.continuous`).

    `placement` (a `sharding.Placement`, default: one local device): `params` may be
    sharded on its mesh, across processes too. Every process holds the whole held-out
    set; each batch's prompt rows are split over the batch shards (padded with copies of
    the last prompt to divide, and a short last batch to the size of the others) and the outputs come back replicated, so every process
    computes the same numbers (call it on every process).
    """
    from jaxrlhf.runs.sharding import Placement

    placement = placement or Placement.local()
    p = task.test_prompts
    first = task.reward.components[0].name

    def greedy(params, prompt_ids, prompt_mask):
        return _sampler(slots)(model, params, prompt_ids, prompt_mask, jax.random.key(0), temperature=0.0,
                               max_new_tokens=task.response_len, eos_id=task.stop_ids, pad_id=task.pad_id)

    decode_greedy = jax.jit(greedy, out_shardings=placement.replicated)
    score = _make_scorer(task, placement)
    draw = None
    if sampled is not None:
        draw = make_sampled_responses(model, task, num_samples=sampled.num_samples, temperature=sampled.temperature,
                                      rng=jax.random.key(seed), batch_size=batch_size, placement=placement,
                                      slots=slots)

    def sampled_eval(params) -> dict:
        n = sampled.num_samples
        correct, ids, mask = draw(params, p)
        flat = task.answers(ids, mask)
        return sampled_metrics(correct, [flat[r * n:(r + 1) * n] for r in range(correct.shape[0])], sampled.ks)

    def accuracy(params, *, return_samples: int | None = None):
        totals, exact, samples = [], [], []
        for _, batch, rows, placed in _prompt_batches(p, batch_size, placement):
            out = decode_greedy(params, placed["prompt_ids"], placed["prompt_mask"])
            parts, out = score(out, batch, rows, 1)
            totals.append(np.asarray(task.reward.total(parts))[np.asarray(task.reward.scored(parts))])
            exact.append(np.asarray(parts[first]))
            ids, mask = np.asarray(out.response_ids), np.asarray(out.response_mask)
            for j in range(min((return_samples or 0) - len(samples), ids.shape[0])):
                prompt = task.decode(batch["prompt_ids"][j][batch["prompt_mask"][j]])
                samples.append((prompt, task.decode(ids[j][mask[j]]), float(exact[-1][j])))
        totals = np.concatenate(totals)  # the rows some weighted reward scored
        result = {"accuracy": float(np.concatenate(exact).mean()),
                  "reward": float(totals.mean()) if totals.size else float("nan")}
        if sampled is not None:
            result.update(sampled_eval(params))
        return result if return_samples is None else (result, samples)

    return accuracy
