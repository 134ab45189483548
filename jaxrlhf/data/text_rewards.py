"""Host-side rewards on decoded text: exact match, and GSM8K-style final-answer checking.

These run in Python on the host after decoding, for rewards that are awkward on device
(free-form numbers, `\\boxed{}`); scores come back as a float32 numpy array of shape [B].
"""

from __future__ import annotations

import re
from typing import Any, Sequence

import numpy as np

from jaxrlhf.data.char_tokenizer import EOS_ID

# A number as written in maths answers: sign, thousands separators, decimals. A minus
# right after a word character or ')' is subtraction ("3-5"), not a sign.
_NUMBER = re.compile(r"(?:(?<![\w)])-)?(?:\d[\d,]*(?:\.\d+)?|\.\d+)")
_HASHES = re.compile(r"####\s*([^\n]*)")


def decode_responses(
    tokenizer: Any, response_ids_BxT, response_mask_BxT, *, eos_id: int = EOS_ID
) -> tuple[list[str], np.ndarray]:
    """Decodes each response up to (not including) its first EOS.

    Returns the texts and `finished_B` (bool: an EOS was emitted within the mask), so that
    a truncated response can be told from a complete one with the same text. Works with
    `CharTokenizer` and with Hugging Face tokenizers (special tokens skipped).
    """
    ids_BxT = np.asarray(response_ids_BxT)
    mask_BxT = np.asarray(response_mask_BxT).astype(bool)
    texts, finished = [], []
    for row, m in zip(ids_BxT, mask_BxT):
        valid = row[m].tolist()
        done = eos_id in valid
        texts.append(tokenizer.decode(valid[: valid.index(eos_id)] if done else valid, skip_special_tokens=True))
        finished.append(done)
    return texts, np.asarray(finished, dtype=bool)


def exact_match_text(
    responses: Sequence[str], answers: Sequence[str], *, finished: Sequence[bool] | None = None
) -> np.ndarray:
    """[B] float32: 1.0 where the response text equals the answer (surrounding whitespace
    ignored) and, if `finished` is given, the response ended with EOS."""
    if len(responses) != len(answers):
        raise ValueError(f"{len(responses)} responses but {len(answers)} answers")
    finished = [True] * len(responses) if finished is None else list(finished)
    return np.asarray(
        [float(done and r.strip() == a.strip()) for r, a, done in zip(responses, answers, finished)],
        dtype=np.float32)


def _last_boxed(text: str) -> str | None:
    r"""Content of the last `\boxed{...}` (or `\fbox{...}`), braces balanced."""
    start = max(text.rfind("\\boxed{"), text.rfind("\\fbox{"))
    if start < 0:
        return None
    i = text.index("{", start) + 1
    depth, j = 1, i
    while j < len(text) and depth:
        depth += {"{": 1, "}": -1}.get(text[j], 0)
        j += 1
    return text[i:j - 1] if depth == 0 else None


def normalize_number(text: str) -> str:
    """Canonical form of a numeric answer: '$1,234.50' -> '1234.5', '42.0' -> '42', '7.' -> '7'.

    Text that is not a number comes back stripped, otherwise unchanged.
    """
    s = text.strip().replace(",", "").replace("$", "").replace("\\%", "").rstrip("%").strip()
    s = s.rstrip(".") if s.count(".") == 1 and s.endswith(".") else s
    try:
        value = float(s)
    except ValueError:
        return text.strip()
    if value == int(value) and abs(value) < 2**53:
        return str(int(value))
    return repr(value)


def extract_final_answer(text: str) -> str | None:
    r"""The final answer of a worked solution, normalised, or None if there is none.

    Tried in order: the text after the last "####" (GSM8K's format), the content of the
    last `\boxed{...}`, the last number anywhere in the text. A "####" or boxed answer
    holding exactly one number yields that number ("#### $18 dollars" gives "18"); any
    other content comes back whole ("\boxed{\frac{1}{2}}" gives "\frac{1}{2}").
    """
    hashes = [m.group(1) for m in _HASHES.finditer(text)]
    for candidate in (hashes[-1] if hashes else None, _last_boxed(text)):
        if candidate is None or not candidate.strip():
            continue
        numbers = _NUMBER.findall(candidate)
        return normalize_number(numbers[0] if len(numbers) == 1 else candidate)
    numbers = _NUMBER.findall(text)
    return normalize_number(numbers[-1]) if numbers else None


def final_answer_reward(responses: Sequence[str], references: Sequence[str]) -> np.ndarray:
    """[B] float32: 1.0 where the response's final answer equals the reference's.

    `references` may be bare answers ("72") or full GSM8K solutions ending in "#### 72";
    both sides go through `extract_final_answer`. No answer in the response scores 0.
    """
    if len(responses) != len(references):
        raise ValueError(f"{len(responses)} responses but {len(references)} references")
    out = []
    for response, reference in zip(responses, references):
        want, got = extract_final_answer(reference), extract_final_answer(response)
        out.append(float(want is not None and got == want))
    return np.asarray(out, dtype=np.float32)


def answer_format_reward(responses: Sequence[str]) -> np.ndarray:
    """[B] float32: 1.0 where the response states its final answer in GSM8K's format, a
    "####" followed by exactly one number ("#### 42"), whatever that number is."""
    out = []
    for response in responses:
        hashes = [m.group(1) for m in _HASHES.finditer(response)]
        out.append(float(bool(hashes) and len(_NUMBER.findall(hashes[-1])) == 1))
    return np.asarray(out, dtype=np.float32)
