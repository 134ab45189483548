"""Reading prompt and preference-pair datasets from JSONL files (and Parquet, via pyarrow).

One JSON object per line; blank lines are ignored. Errors name `path:line` and the field
(for Parquet, `path:row`, rows counted from 1). See `records.py` for the checks and the
`on_error="skip"` report.
"""

from __future__ import annotations

import json
import os
from typing import Any, Iterator

from jaxrlhf.data.records import DataError, PairData, PromptData, pairs_from_records, prompts_from_records


def read_records(path: str | os.PathLike) -> Iterator[tuple[str, Any]]:
    """Yields (location, record) per row; a line that is not UTF-8 or not valid JSON yields
    a DataError (the file is read as bytes and decoded line by line, so one bad byte is
    one bad row: reported with its line, or skipped under `on_error="skip"`)."""
    path = os.fspath(path)
    if path.endswith(".parquet"):
        yield from _read_parquet(path)
        return
    with open(path, "rb") as f:
        for lineno, raw in enumerate(f, start=1):
            location = f"{path}:{lineno}"
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as e:
                yield location, DataError(location, None, "invalid_utf8",
                                          f"not UTF-8 (byte 0x{raw[e.start]:02x} at column {e.start + 1})")
                continue
            if not line.strip():
                continue
            try:
                yield location, json.loads(line)
            except json.JSONDecodeError as e:
                yield location, DataError(location, None, "invalid_json", f"invalid JSON ({e.msg} at column {e.colno})")


def _read_parquet(path: str) -> Iterator[tuple[str, Any]]:
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise ImportError(f"reading {path} needs pyarrow: pip install pyarrow") from None
    for row, record in enumerate(pq.read_table(path).to_pylist(), start=1):
        yield f"{path}:{row}", record


def read_prompts(
    path: str | os.PathLike,
    tokenizer: Any,
    *,
    prompt_key: str = "prompt",
    answer_key: str | None = "answer",
    max_prompt_tokens: int | None = None,
    chat_template: bool = False,
    system_prompt: str | None = None,
    on_error: str = "raise",
) -> PromptData:
    """Prompts (and answers, unless `answer_key=None`) from a .jsonl or .parquet file.

    E.g. GSM8K-style rows: `read_prompts(p, tok, prompt_key="question", answer_key="answer")`.
    """
    return prompts_from_records(
        read_records(path), tokenizer, prompt_key=prompt_key, answer_key=answer_key,
        max_prompt_tokens=max_prompt_tokens, chat_template=chat_template,
        system_prompt=system_prompt, on_error=on_error, source=os.fspath(path))


def read_preference_pairs(
    path: str | os.PathLike,
    tokenizer: Any,
    *,
    prompt_key: str = "prompt",
    chosen_key: str = "chosen",
    rejected_key: str = "rejected",
    max_prompt_tokens: int | None = None,
    max_response_tokens: int | None = None,
    chat_template: bool = False,
    system_prompt: str | None = None,
    on_error: str = "raise",
) -> PairData:
    """Preference pairs (prompt, chosen, rejected) from a .jsonl or .parquet file."""
    return pairs_from_records(
        read_records(path), tokenizer, prompt_key=prompt_key, chosen_key=chosen_key,
        rejected_key=rejected_key, max_prompt_tokens=max_prompt_tokens,
        max_response_tokens=max_response_tokens, chat_template=chat_template,
        system_prompt=system_prompt, on_error=on_error, source=os.fspath(path))
