"""Reading prompt and preference-pair datasets from JSONL files (and Parquet, via pyarrow).

One JSON object per line; blank lines are ignored. Errors name `path:line` and the field
(for Parquet, `path:row`, rows counted from 1). See `records.py` for the checks and the
`on_error="skip"` report.

Input is bounded before it is expanded: a line of more than `max_row_bytes` bytes
(default `records.MAX_ROW_BYTES`, 1 MiB) is a `row_too_long` bad row, known after
reading at most `max_row_bytes + 1` bytes of it (the rest is read past in pieces of that
size, never kept), so one huge row cannot fill the memory while it is decoded, parsed and
tokenized; a Parquet row is measured by its cells' text before it is used. A file of more
than `max_file_bytes` (default `MAX_FILE_BYTES`, 10 GiB) is refused whole. None: no limit.
"""

from __future__ import annotations

import json
import os
import stat
from typing import Any, BinaryIO, Iterator

from jaxrlhf.data.records import (
    MAX_ROW_BYTES,
    DataError,
    PairData,
    PromptData,
    check_row_bytes,
    pairs_from_records,
    prompts_from_records,
)

MAX_FILE_BYTES = 10 * 2**30


def read_records(path: str | os.PathLike, *, max_row_bytes: int | None = MAX_ROW_BYTES,
                 max_file_bytes: int | None = MAX_FILE_BYTES) -> Iterator[tuple[str, Any]]:
    """Yields (location, record) per row; a line that is not UTF-8, not valid JSON or longer
    than `max_row_bytes` yields a DataError (the file is read as bytes and decoded line by
    line, so one bad byte is one bad row: reported with its line, or skipped under
    `on_error="skip"`). A file larger than `max_file_bytes` raises ValueError."""
    path = os.fspath(path)
    if path.endswith(".parquet"):
        _check_file_size(path, os.path.getsize(path), max_file_bytes)
        yield from _read_parquet(path, max_row_bytes)
        return
    with open(path, "rb") as f:
        info = os.fstat(f.fileno())
        if stat.S_ISREG(info.st_mode):
            _check_file_size(path, info.st_size, max_file_bytes)
        lineno, total = 0, 0
        while raw := f.readline(-1 if max_row_bytes is None else max_row_bytes + 1):
            lineno += 1
            total += len(raw)
            location = f"{path}:{lineno}"
            if max_row_bytes is not None and len(raw) > max_row_bytes and not raw.endswith(b"\n"):
                total += _skip_line(f, max_row_bytes + 1)
                _check_file_size(path, total, max_file_bytes)
                yield location, DataError(location, None, "row_too_long",
                                          f"the line is longer than max_row_bytes={max_row_bytes} bytes")
                continue
            _check_file_size(path, total, max_file_bytes)
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


def _skip_line(f: BinaryIO, piece: int) -> int:
    """Reads past the rest of the current line, `piece` bytes at a time, keeping none; the
    number of bytes read."""
    skipped = 0
    while chunk := f.readline(piece):
        skipped += len(chunk)
        if chunk.endswith(b"\n"):
            break
    return skipped


def _check_file_size(path: str, size: int, limit: int | None) -> None:
    if limit is not None and size > limit:
        raise ValueError(f"{path} has more than max_file_bytes={limit} bytes")


def _read_parquet(path: str, max_row_bytes: int | None) -> Iterator[tuple[str, Any]]:
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise ImportError(f"reading {path} needs pyarrow: pip install pyarrow") from None
    row = 0
    for batch in pq.ParquetFile(path).iter_batches(batch_size=1024):
        for record in batch.to_pylist():
            row += 1
            location = f"{path}:{row}"
            yield location, check_row_bytes(record, location, max_row_bytes) or record


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
    max_row_bytes: int | None = MAX_ROW_BYTES,
    max_file_bytes: int | None = MAX_FILE_BYTES,
) -> PromptData:
    """Prompts (and answers, unless `answer_key=None`) from a .jsonl or .parquet file.

    E.g. GSM8K-style rows: `read_prompts(p, tok, prompt_key="question", answer_key="answer")`.
    """
    return prompts_from_records(
        read_records(path, max_row_bytes=max_row_bytes, max_file_bytes=max_file_bytes), tokenizer,
        prompt_key=prompt_key, answer_key=answer_key, max_prompt_tokens=max_prompt_tokens, chat_template=chat_template,
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
    max_row_bytes: int | None = MAX_ROW_BYTES,
    max_file_bytes: int | None = MAX_FILE_BYTES,
) -> PairData:
    """Preference pairs (prompt, chosen, rejected) from a .jsonl or .parquet file."""
    return pairs_from_records(
        read_records(path, max_row_bytes=max_row_bytes, max_file_bytes=max_file_bytes), tokenizer,
        prompt_key=prompt_key, chosen_key=chosen_key, rejected_key=rejected_key, max_prompt_tokens=max_prompt_tokens,
        max_response_tokens=max_response_tokens, chat_template=chat_template,
        system_prompt=system_prompt, on_error=on_error, source=os.fspath(path))
