"""Sampled completions for users to read (`train.log_completions_every`): every N steps of
a GRPO or PPO phase, the first `ROWS` responses of the step with their rewards.

Each row is one JSON object of `<workdir>/completions.jsonl` (`MetricsWriter.write_completions`,
and a Weights & Biases table `completions` when `train.wandb` is on):

    phase, step, prompt, completion      the decoded texts (special tokens skipped)
    prompt_ids, completion_ids           the valid tokens they decode (EOS included)
    reward/<name>                        each reward component's unweighted score
    reward                               the weighted total (`Reward.total`)
    advantage                            the response's mean advantage over its tokens
                                         (absent where rows are reselected: dynamic sampling)

The rows come from the step's own sampled responses on this process (the rows it scored),
read on the host; with N = 0 nothing is read or computed. On a logging step the reward's
JAX components are evaluated once more on those responses (host components are the
step's own scores).
"""

from __future__ import annotations

import math

import numpy as np

ROWS = 8  # the first ROWS responses of a logging step (a prompt's samples are contiguous)


def completion_rows(tokenizer, out, scores: dict, total, advantages=None, *, rows: int = ROWS) -> list[dict]:
    """The first `rows` responses of `out` (a `rollout.SampleOutput` of numpy arrays) as
    JSON-ready dicts: texts and valid token ids of prompt and completion, every component
    of `scores` (`{name: [N]}`), the `total` `[N]` and, when given, `advantages` `[N, T]`
    averaged over each response's valid tokens (the writer adds `phase` and `step`)."""
    resp_mask = np.asarray(out.response_mask).astype(bool)
    prompt_mask = np.asarray(out.prompt_mask).astype(bool)
    found = []
    for i in range(min(rows, resp_mask.shape[0])):
        p_ids = np.asarray(out.prompt_ids)[i][prompt_mask[i]].tolist()
        r_ids = np.asarray(out.response_ids)[i][resp_mask[i]].tolist()
        row = dict(prompt=tokenizer.decode(p_ids, skip_special_tokens=True),
                   completion=tokenizer.decode(r_ids, skip_special_tokens=True), prompt_ids=p_ids,
                   completion_ids=r_ids)
        row.update({f"reward/{k}": float(np.asarray(v)[i]) for k, v in scores.items()})
        row["reward"] = float(np.asarray(total)[i])
        if advantages is not None:
            adv = np.asarray(advantages)[i][resp_mask[i]]
            row["advantage"] = float(adv.mean()) if adv.size else math.nan
        found.append(row)
    return found


__all__ = ["ROWS", "completion_rows"]
