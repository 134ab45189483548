"""Stop strings: sampled responses cut on the host where their text first contains one.

A stop string (e.g. "</answer>" or "\\n\\nQuestion:") is text, not a token: it may span
several tokens, or begin or end inside one, so the compiled decode loop cannot check for
it. The rule (`task.stop_strings`): the sampler decodes up to its stop tokens or
`max_new_tokens`, then on the host each response is cut right after the first token at
which its decoded text contains a stop string. That token is kept (like EOS, it is the
last token the policy is trained on); the tokens after it are masked out and set to pad,
and the lengths shrink to match. Every loss, KL, value and advantage is masked by
`response_mask`, so the dropped tokens count nowhere. The text a reward sees ends with
the stop string, followed by whatever else its last token held.
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

import numpy as np

from jaxrlhf.rollout.sampler import SampleOutput


def first_stop(decode: Callable[[list], str], token_ids: list, stop_strings: Sequence[str]) -> int | None:
    """How many of `token_ids` to keep: the smallest k such that `decode(token_ids[:k])`
    contains one of `stop_strings`, or None when the whole text contains none.

    A binary search over prefixes, 1 + ceil(log2 T) decodes instead of T. It relies on
    the decoded text of a prefix being the start of the decoded text of a longer prefix,
    which holds for Hugging Face tokenizers up to a trailing partial character (never
    part of a stop string)."""
    def found(k: int) -> bool:
        text = decode(token_ids[:k])
        return any(s in text for s in stop_strings)

    if not token_ids or not found(len(token_ids)):
        return None
    lo, hi = 0, len(token_ids)  # found(hi), not found(lo): the empty prefix holds no string
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if found(mid):
            hi = mid
        else:
            lo = mid
    return hi


def cut(out: SampleOutput, tokenizer: Any, stop_strings: Sequence[str], *, pad_id: int) -> SampleOutput:
    """`out` (host arrays, `[N, T]` responses) with each response cut after the first token
    at which its text contains one of `stop_strings` (`first_stop`, on the text the rewards
    see: special tokens skipped; to stop on a special token, make it a stop token); the later tokens set to `pad_id`, masked out of `response_mask`
    and `attention_mask`, their log-probs 0, and `lengths` updated. Rows without a stop
    string are returned as they were."""
    ids = np.array(out.response_ids)
    mask = np.array(out.response_mask).astype(bool)
    keep = mask.copy()
    decode = lambda t: tokenizer.decode(t, skip_special_tokens=True)
    for r in range(ids.shape[0]):
        valid = ids[r][mask[r]].tolist()  # the response's tokens: the mask is True from 0 to its end
        k = first_stop(decode, valid, stop_strings)
        if k is not None:
            keep[r, k:] = False
    if (keep == mask).all():
        return out
    response_ids = np.where(keep, ids, pad_id).astype(ids.dtype)
    p = np.shape(out.prompt_ids)[1]
    sequences = np.array(out.sequences)
    sequences[:, p:] = response_ids
    attention_mask = np.array(out.attention_mask)
    attention_mask[:, p:] = keep.astype(attention_mask.dtype)
    return out._replace(
        response_ids=response_ids, response_mask=keep.astype(np.asarray(out.response_mask).dtype),
        logprobs=np.where(keep, np.asarray(out.logprobs), 0).astype(np.asarray(out.logprobs).dtype),
        behaviour_logprobs=None if out.behaviour_logprobs is None else np.where(
            keep, np.asarray(out.behaviour_logprobs), 0).astype(np.float32),
        sequences=sequences, attention_mask=attention_mask,
        lengths=keep.sum(axis=1).astype(np.asarray(out.lengths).dtype))


def parse(value: str, field: str = "task.stop_strings") -> tuple[str, ...]:
    """The stop strings of a config value: comma-separated ("</answer>,\\n\\n"), or a JSON
    list of strings when one of them holds a comma ('["Q:", ", so"]'); "" = none. A
    backslash escape (\\n, \\t) in the comma-separated form is read as in JSON."""
    import json

    value = value.strip()
    if not value:
        return ()
    if value.startswith("["):
        try:
            items = json.loads(value)
        except json.JSONDecodeError as e:
            raise ValueError(f"{field}={value!r} is not a JSON list ({e}); give a JSON list of strings, or "
                             "comma-separated strings") from None
        if not isinstance(items, list) or not all(isinstance(s, str) for s in items):
            raise ValueError(f"{field}={value!r}: expected a JSON list of strings")
    else:
        items = [s.encode("latin-1", "backslashreplace").decode("unicode_escape") for s in value.split(",")]
    if any(not s for s in items):
        raise ValueError(f"{field}={value!r} holds an empty stop string; remove it (an empty string would stop "
                         "every response at its first token)")
    return tuple(dict.fromkeys(items))


__all__ = ["cut", "first_stop", "parse"]
