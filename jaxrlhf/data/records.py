"""Validating and tokenizing dict records (from JSONL, Parquet or TFDS) into prompt data.

Every problem with a record becomes a `DataError` that names where it is (`file:line`),
which field, and why. With `on_error="skip"` bad records are dropped instead and counted
per reason in a `SkipReport`; the reason names are those in `REASONS`.
"""

from __future__ import annotations

import collections
import dataclasses
import logging
from typing import Any, Iterable, NamedTuple

from jaxrlhf.data.char_tokenizer import CharTokenizer

REASONS = ("invalid_utf8", "invalid_json", "not_an_object", "missing_key", "wrong_type", "empty", "untokenizable", "too_long")
_MAX_KEPT_MESSAGES = 5

log = logging.getLogger(__name__)


class DataError(ValueError):
    """A bad record: `location` ("path:line"), `field` (None for the record as a whole), `reason`."""

    def __init__(self, location: str, field: str | None, reason: str, detail: str):
        self.location, self.field, self.reason, self.detail = location, field, reason, detail
        where = f"{location}: field {field!r}" if field is not None else location
        super().__init__(f"{where}: {detail}")


@dataclasses.dataclass
class SkipReport:
    """What `on_error="skip"` dropped: counts per reason and the first few messages."""

    counts: collections.Counter = dataclasses.field(default_factory=collections.Counter)
    messages: list[str] = dataclasses.field(default_factory=list)

    @property
    def total(self) -> int:
        return sum(self.counts.values())

    def add(self, error: DataError) -> None:
        self.counts[error.reason] += 1
        if len(self.messages) < _MAX_KEPT_MESSAGES:
            self.messages.append(str(error))

    def __str__(self) -> str:
        if not self.total:
            return "no records skipped"
        per_reason = ", ".join(f"{r}: {n}" for r, n in sorted(self.counts.items()))
        return f"skipped {self.total} records ({per_reason}); first: " + " | ".join(self.messages)


class PromptData(NamedTuple):
    """Kept records, column-wise. `prompt_text` is what was tokenized (after any chat
    template); `answer` is None per record when no answer key was asked for; `fields` the
    record's other fields as read (all but the prompt's), for rewards that look at them."""

    prompt_text: list[str]
    prompt_ids: list[list[int]]
    answer: list[str | None]
    location: list[str]
    fields: list[dict]
    skipped: SkipReport


class PairData(NamedTuple):
    """Kept preference pairs, column-wise; response ids carry no special tokens (no EOS)."""

    prompt_text: list[str]
    prompt_ids: list[list[int]]
    chosen_text: list[str]
    chosen_ids: list[list[int]]
    rejected_text: list[str]
    rejected_ids: list[list[int]]
    location: list[str]
    skipped: SkipReport


# A record source yields (location, record), record being a dict or the DataError met
# while reading it (e.g. invalid JSON), so that skip mode also covers reading errors.
Records = Iterable[tuple[str, Any]]


def encode(tokenizer: Any, text: str, *, add_special_tokens: bool) -> list[int]:
    """Token ids from a `CharTokenizer` or a Hugging Face tokenizer.

    `add_special_tokens` means the tokenizer's own (BOS for a prompt); responses and
    chat-templated text (which carries its own BOS) pass False.
    """
    if isinstance(tokenizer, CharTokenizer):
        return tokenizer.encode(text, add_bos=add_special_tokens)
    return list(tokenizer.encode(text, add_special_tokens=add_special_tokens))


def _field(record: Any, key: str, location: str) -> Any:
    if not isinstance(record, dict):
        raise DataError(location, None, "not_an_object", f"expected a JSON object, got {type(record).__name__}")
    if key not in record:
        raise DataError(location, key, "missing_key", f"missing (keys present: {sorted(record)})")
    return record[key]


def _text(value: Any, key: str, location: str, *, numbers_ok: bool = False) -> str:
    if isinstance(value, bool) or not isinstance(value, (str, int, float) if numbers_ok else str):
        want = "a string or a number" if numbers_ok else "a string"
        raise DataError(location, key, "wrong_type", f"expected {want}, got {type(value).__name__}")
    text = value if isinstance(value, str) else str(value)
    if not text.strip():
        raise DataError(location, key, "empty", "is empty")
    return text


def _messages(value: Any, key: str, location: str) -> list[dict[str, str]]:
    if not isinstance(value, list) or not all(
        isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
        for m in value):
        raise DataError(location, key, "wrong_type",
                        "expected a string or a list of {'role': str, 'content': str} messages")
    if not value or not any(m["content"].strip() for m in value):
        raise DataError(location, key, "empty", "has no message content")
    return value


def _prompt(tokenizer, value, key, location, *, chat_template, system_prompt, max_tokens):
    """(text, ids) of one prompt, chat-templated if asked, checked against `max_tokens`."""
    if chat_template:
        if isinstance(value, str):
            messages = [{"role": "user", "content": _text(value, key, location)}]
        else:
            messages = list(_messages(value, key, location))
        if system_prompt is not None and messages[0]["role"] != "system":
            messages.insert(0, {"role": "system", "content": system_prompt})
        text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        ids = _encode_or_error(tokenizer, text, key, location, add_special_tokens=False)
    else:
        if isinstance(value, list):
            raise DataError(location, key, "wrong_type", "a message list needs chat_template=True")
        text = _text(value, key, location)
        ids = _encode_or_error(tokenizer, text, key, location, add_special_tokens=True)
    _check_len(ids, max_tokens, key, location, "max_prompt_tokens")
    return text, ids


def _encode_or_error(tokenizer, text, key, location, *, add_special_tokens):
    try:
        return encode(tokenizer, text, add_special_tokens=add_special_tokens)
    except ValueError as e:  # CharTokenizer: a character outside its vocabulary
        raise DataError(location, key, "untokenizable", str(e)) from None


def _check_len(ids, limit, key, location, limit_name):
    if limit is not None and len(ids) > limit:
        raise DataError(location, key, "too_long", f"has {len(ids)} tokens, more than {limit_name}={limit}")


def _check_options(on_error: str, chat_template: bool, tokenizer: Any) -> None:
    if on_error not in ("raise", "skip"):
        raise ValueError(f"on_error must be 'raise' or 'skip', got {on_error!r}")
    if chat_template and not getattr(tokenizer, "chat_template", None):
        raise ValueError(
            f"chat_template=True but the tokenizer ({type(tokenizer).__name__}) has no chat template")


def _collect(records: Records, parse: Any, *, on_error: str, source: str):
    """`(columns, report)` of the rows `parse(record, location) -> {column: value}` accepts.

    A record that is itself a reading error, or whose `parse` raises `DataError`, stops
    the run (`on_error="raise"`) or is counted in the report and skipped.
    """
    report = SkipReport()
    cols = collections.defaultdict(list)
    for location, record in records:
        try:
            if isinstance(record, DataError):
                raise record
            row = parse(record, location)
        except DataError as e:
            if on_error == "raise":
                raise
            report.add(e)
            continue
        for key, value in row.items():
            cols[key].append(value)
    if report.total:
        log.warning("%s: %s", source, report)
    return cols, report


def prompts_from_records(
    records: Records,
    tokenizer: Any,
    *,
    prompt_key: str = "prompt",
    answer_key: str | None = "answer",
    max_prompt_tokens: int | None = None,
    chat_template: bool = False,
    system_prompt: str | None = None,
    on_error: str = "raise",
    source: str = "records",
) -> PromptData:
    """Validates and tokenizes prompt (and answer) records; see the module docstring.

    A prompt is a non-empty string, or with `chat_template=True` also a list of chat
    messages; it is rendered with `tokenizer.apply_chat_template(...,
    add_generation_prompt=True)`. An answer is a non-empty string or a number (kept as text).
    """
    _check_options(on_error, chat_template, tokenizer)

    def parse(record, location):
        text, ids = _prompt(tokenizer, _field(record, prompt_key, location), prompt_key, location,
                            chat_template=chat_template, system_prompt=system_prompt, max_tokens=max_prompt_tokens)
        answer = None
        if answer_key is not None:
            answer = _text(_field(record, answer_key, location), answer_key, location, numbers_ok=True)
        fields = {k: v for k, v in record.items() if k != prompt_key}
        return dict(prompt_text=text, prompt_ids=ids, answer=answer, location=location, fields=fields)

    cols, report = _collect(records, parse, on_error=on_error, source=source)
    return PromptData(**{f: cols[f] for f in PromptData._fields if f != "skipped"}, skipped=report)


def pairs_from_records(
    records: Records,
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
    source: str = "records",
) -> PairData:
    """Validates and tokenizes preference-pair records (prompt, chosen, rejected strings)."""
    _check_options(on_error, chat_template, tokenizer)

    def parse(record, location):
        text, ids = _prompt(tokenizer, _field(record, prompt_key, location), prompt_key, location,
                            chat_template=chat_template, system_prompt=system_prompt, max_tokens=max_prompt_tokens)
        row = dict(prompt_text=text, prompt_ids=ids, location=location)
        for name, key in (("chosen", chosen_key), ("rejected", rejected_key)):
            resp = _text(_field(record, key, location), key, location)
            resp_ids = _encode_or_error(tokenizer, resp, key, location, add_special_tokens=False)
            _check_len(resp_ids, max_response_tokens, key, location, "max_response_tokens")
            row.update({f"{name}_text": resp, f"{name}_ids": resp_ids})
        return row

    cols, report = _collect(records, parse, on_error=on_error, source=source)
    return PairData(**{f: cols[f] for f in PairData._fields if f != "skipped"}, skipped=report)
