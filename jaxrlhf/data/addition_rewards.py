"""Python rewards for the addition task, in TRL's `reward_funcs` convention, so that a
config reaches them by import path alone (`--config.reward.fns=jaxrlhf.data.addition_rewards:answer_format`).

`answer_format` scores the form of an answer, not its value: configs/addition_gdpo.py puts it
beside the task's exact match at weight 100, two rewards of very different scales
(docs/grpo.md#gdpo-several-rewards).
"""

from __future__ import annotations

import re
from typing import Sequence

_ANSWER = re.compile(r"[0-9]{1,3}")  # a 2-digit sum has at most 3 digits


def answer_format(prompts: Sequence[str] = (), completions: Sequence[str] = (), **fields) -> list[float]:
    """1.0 for each completion (decoded up to its EOS) that is a bare number of one to three
    digits, whatever its value; 0.0 otherwise (empty, a non-digit character, four digits or
    more: e.g. a response that ran to `max_new_tokens` without stopping)."""
    del prompts, fields
    return [float(_ANSWER.fullmatch(text) is not None) for text in completions]


__all__ = ["answer_format"]
