"""Validating and tokenizing dict records (from JSONL, Parquet or TFDS) into prompt data,
SFT examples (`sft_from_records`) and preference pairs (`pairs_from_records`).

Every problem with a record becomes a `DataError` that names where it is (`file:line`),
which field, and why. With `on_error="skip"` bad records are dropped instead and counted
per reason in a `SkipReport`; the reason names are those in `REASONS`.

A prompt longer than `max_prompt_tokens` follows `long_prompts` (`LONG_PROMPTS`): "drop"
makes it a `too_long` bad record (dropped and counted, or an error with
`on_error="raise"`); "left_truncate" keeps its last `max_prompt_tokens` tokens (a leading
BOS kept), so that its end, the chat template's generation prompt, survives, and counts
it in the report's `truncated`. Either way the log says how many.

Input is bounded before it is expanded. The readers refuse a row of more than
`max_row_bytes` bytes (`row_too_long`) before it is parsed (a JSONL line) or used (a
Parquet or TFDS row's cells, `check_row_bytes`). A text that is
to be dropped when over a token limit (a prompt with `long_prompts="drop"`, a response) is
`too_long` without tokenizing it when it has more UTF-8 bytes than the limit's tokens can
hold: `limit × longest_token_bytes(tokenizer)`, a safe bound for tokenizers whose tokens
each stand for at most their own text's bytes (byte-level BPE, SentencePiece, the
character tokenizer; templates only add tokens).
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import weakref
from typing import Any, Iterable, NamedTuple

import numpy as np

from jaxrlhf.data import chat
from jaxrlhf.data.char_tokenizer import CharTokenizer

REASONS = ("invalid_utf8", "invalid_json", "row_too_long", "not_an_object", "missing_key", "wrong_type", "empty",
           "untokenizable", "too_long", "no_assistant_turn", "bad_template")
_MAX_KEPT_MESSAGES = 5
LONG_PROMPTS = ("drop", "left_truncate")
MAX_ROW_BYTES = 2**20  # the readers' default bound on one row (`check_row_bytes`, `jsonl.read_records`)

log = logging.getLogger(__name__)


class DataError(ValueError):
    """A bad record: `location` ("path:line"), `field` (None for the record as a whole), `reason`."""

    def __init__(self, location: str, field: str | None, reason: str, detail: str):
        self.location, self.field, self.reason, self.detail = location, field, reason, detail
        where = f"{location}: field {field!r}" if field is not None else location
        super().__init__(f"{where}: {detail}")


@dataclasses.dataclass
class SkipReport:
    """What `on_error="skip"` dropped: counts per reason and the first few messages; and
    `truncated`, the prompts kept with their first tokens cut (`long_prompts="left_truncate"`)."""

    counts: collections.Counter = dataclasses.field(default_factory=collections.Counter)
    messages: list[str] = dataclasses.field(default_factory=list)
    truncated: int = 0

    @property
    def total(self) -> int:
        return sum(self.counts.values())

    def add(self, error: DataError) -> None:
        self.counts[error.reason] += 1
        if len(self.messages) < _MAX_KEPT_MESSAGES:
            self.messages.append(str(error))

    def merge(self, other: "SkipReport") -> None:
        """Adds `other`'s counts and (up to the kept few) messages: one report of several sources."""
        self.counts.update(other.counts)
        self.truncated += other.truncated
        self.messages.extend(other.messages[:max(0, _MAX_KEPT_MESSAGES - len(self.messages))])

    def __str__(self) -> str:
        cut = f"; left-truncated {self.truncated} prompts" if self.truncated else ""
        if not self.total:
            return "no records skipped" + cut
        per_reason = ", ".join(f"{r}: {n}" for r, n in sorted(self.counts.items()))
        return f"skipped {self.total} records ({per_reason}){cut}; first: " + " | ".join(self.messages)


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
    """Kept preference pairs, column-wise. Plain-text responses carry no special tokens (no
    EOS: the caller appends it); with a chat template a response is the template's rendering
    of the assistant turn (`chat.response_text`), its end-of-turn marker included."""

    prompt_text: list[str]
    prompt_ids: list[list[int]]
    chosen_text: list[str]
    chosen_ids: list[list[int]]
    rejected_text: list[str]
    rejected_ids: list[list[int]]
    location: list[str]
    skipped: SkipReport


class SFTData(NamedTuple):
    """Kept SFT examples, column-wise: the prompt (everything before the first assistant
    turn, or the `prompt` field) and the rest of the example as response ids with a
    per-token `loss_mask` (True on the assistant turns / the completion and its EOS);
    `answer` the first assistant turn's content / the completion, for held-out evaluation."""

    prompt_text: list[str]
    prompt_ids: list[list[int]]
    response_ids: list[list[int]]
    loss_mask: list[list[bool]]
    answer: list[str]
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


def _utf8_len(text: str) -> int:
    return len(text) if text.isascii() else len(text.encode("utf-8"))


def text_bytes(value: Any) -> int:
    """The bytes of text in a record's value: strings (UTF-8) and bytes, summed through
    lists, tuples, dicts and numpy arrays (TFDS rows); numbers count nothing."""
    if isinstance(value, str):
        return _utf8_len(value)
    if isinstance(value, bytes):
        return len(value)
    if isinstance(value, dict):
        return sum(text_bytes(v) for v in value.values())
    if isinstance(value, (list, tuple)):
        return sum(text_bytes(v) for v in value)
    if isinstance(value, np.ndarray) and value.dtype.kind in "OSU":
        return sum(text_bytes(v) for v in value.ravel().tolist())
    return 0


def check_row_bytes(record: Any, location: str, limit: int | None) -> DataError | None:
    """A `row_too_long` DataError when a Parquet/TFDS row holds more than `limit` bytes of
    text (`text_bytes`), naming its longest field; None when it fits (or `limit` is None).
    Measured on the cells as read, before anything is tokenized."""
    if limit is None:
        return None
    sizes = {k: text_bytes(v) for k, v in record.items()} if isinstance(record, dict) else {None: text_bytes(record)}
    if sum(sizes.values()) <= limit:
        return None
    field = max(sizes, key=sizes.get)
    return DataError(location, field, "row_too_long", f"the row has {sum(sizes.values())} bytes of text ("
                     f"{sizes[field]} in this field), more than max_row_bytes={limit}")


_LONGEST_TOKEN: "weakref.WeakKeyDictionary[Any, int]" = weakref.WeakKeyDictionary()


def longest_token_bytes(tokenizer: Any) -> int:
    """The UTF-8 length of the tokenizer's longest token string (its vocabulary with the
    added and special tokens), computed once per tokenizer. A byte-level BPE token's string
    (bytes mapped to characters like "Ġ") or a SentencePiece piece ("▁the", "<0xE2>") has at
    least as many bytes as the text it stands for, so no token covers more text than this."""
    try:
        return _LONGEST_TOKEN[tokenizer]
    except (KeyError, TypeError):
        pass
    vocab = tokenizer.vocab if isinstance(tokenizer, CharTokenizer) else tokenizer.get_vocab()
    longest = max((len(t.encode("utf-8")) for t in vocab), default=1)
    try:
        _LONGEST_TOKEN[tokenizer] = longest
    except TypeError:  # not weakly referenceable: computed again next time
        pass
    return longest


def _check_bytes(tokenizer, text, limit, key, location, limit_name):
    """`too_long` when `text` has more UTF-8 bytes than `limit` tokens can hold (module
    docstring), decided without tokenizing it; nothing when `limit` is None."""
    if limit is None:
        return
    longest = longest_token_bytes(tokenizer)
    size = _utf8_len(text)
    if size > limit * longest:
        raise DataError(location, key, "too_long", f"has {size} bytes, more than {limit_name}={limit} tokens can "
                        f"hold (the tokenizer's longest token is {longest} bytes)")


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


def _chat(value, key, location, system_prompt) -> list[dict[str, str]]:
    """A prompt field as chat messages: a string becomes one user turn; the system prompt
    goes first unless the messages have their own."""
    messages = [{"role": "user", "content": _text(value, key, location)}] if isinstance(value, str) else list(
        _messages(value, key, location))
    if system_prompt is not None and messages[0]["role"] != "system":
        messages.insert(0, {"role": "system", "content": system_prompt})
    return messages


def _render(fn, *args, key, location, template_kwargs, timeout):
    """`fn(*args, template_kwargs=..., timeout=...)` of `chat`, its ValueError (or the
    template's own error) a DataError; a rendering past its time (`chat.TemplateTimeout`)
    stops the parse whatever `on_error` says, naming the row."""
    try:
        return fn(*args, template_kwargs=template_kwargs, timeout=timeout)
    except chat.TemplateTimeout as e:
        raise chat.TemplateTimeout(f"{location}: field {key!r}: {e}") from None
    except Exception as e:  # jinja2's TemplateError, or chat's ValueError
        raise DataError(location, key, "bad_template", f"chat template: {e}") from None


def _prompt(tokenizer, value, key, location, *, chat_template, system_prompt, max_tokens, long_prompts,
            template_kwargs, timeout):
    """(text, ids, truncated) of one prompt, chat-templated if asked, fitted to `max_tokens`
    (`_fit_prompt`)."""
    if chat_template:
        messages = _chat(value, key, location, system_prompt)
        text = _render(chat.render, tokenizer, messages, True, key=key, location=location,
                       template_kwargs=template_kwargs, timeout=timeout)
    else:
        if isinstance(value, list):
            raise DataError(location, key, "wrong_type", "a message list needs chat_template=True")
        text = _text(value, key, location)
    ids = _encode_prompt(tokenizer, text, key, location, add_special_tokens=not chat_template, max_tokens=max_tokens,
                         long_prompts=long_prompts)
    return (text, *_fit_prompt(tokenizer, ids, max_tokens, long_prompts, key, location))


def _encode_prompt(tokenizer, text, key, location, *, add_special_tokens, max_tokens, long_prompts) -> list[int]:
    """A prompt's ids; one that would be dropped as too long is refused by its bytes first."""
    return _encode_or_error(tokenizer, text, key, location, add_special_tokens=add_special_tokens,
                            limit=max_tokens if long_prompts == "drop" else None, limit_name="max_prompt_tokens")


def _fit_prompt(tokenizer, ids, limit, long_prompts, key, location) -> tuple[list[int], bool]:
    """(ids, truncated) of a prompt held to `limit` tokens (`max_prompt_tokens`; None: no
    limit) by the `long_prompts` rule of the module docstring."""
    if limit is None or len(ids) <= limit:
        return ids, False
    if long_prompts == "drop":
        _check_len(ids, limit, key, location, "max_prompt_tokens")
    bos = getattr(tokenizer, "bos_token_id", getattr(tokenizer, "bos_id", None))
    head = ids[:1] if bos is not None and ids[0] == bos and limit > 1 else []
    return head + ids[len(ids) - (limit - len(head)):], True


def _encode_or_error(tokenizer, text, key, location, *, add_special_tokens, limit=None, limit_name=None):
    """`encode`, a character outside a CharTokenizer's vocabulary `untokenizable`; with a
    token `limit` (named `limit_name`), a text with more bytes than that many tokens can
    hold is `too_long` before it is tokenized (`_check_bytes`)."""
    _check_bytes(tokenizer, text, limit, key, location, limit_name)
    try:
        return encode(tokenizer, text, add_special_tokens=add_special_tokens)
    except ValueError as e:  # CharTokenizer: a character outside its vocabulary
        raise DataError(location, key, "untokenizable", str(e)) from None


def _check_len(ids, limit, key, location, limit_name):
    if limit is not None and len(ids) > limit:
        raise DataError(location, key, "too_long", f"has {len(ids)} tokens, more than {limit_name}={limit}")


def _check_options(on_error: str, chat_template: bool, tokenizer: Any, long_prompts: str) -> None:
    if on_error not in ("raise", "skip"):
        raise ValueError(f"on_error must be 'raise' or 'skip', got {on_error!r}")
    if long_prompts not in LONG_PROMPTS:
        raise ValueError(f"long_prompts must be one of {LONG_PROMPTS}, got {long_prompts!r}")
    if chat_template and not getattr(tokenizer, "chat_template", None):
        raise ValueError(
            f"chat_template=True but the tokenizer ({type(tokenizer).__name__}) has no chat template")


def _collect(records: Records, parse: Any, *, on_error: str, source: str):
    """`(columns, report)` of the rows `parse(record, location) -> {column: value}` accepts.

    A record that is itself a reading error, or whose `parse` raises `DataError`, stops
    the run (`on_error="raise"`) or is counted in the report and skipped. A row's
    `truncated` flag (a left-truncated prompt) is counted in the report, not kept.
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
        report.truncated += int(row.pop("truncated", False))
        for key, value in row.items():
            cols[key].append(value)
    if report.total or report.truncated:
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
    long_prompts: str = "drop",
    chat_template_kwargs: dict | None = None,
    chat_template_timeout: float | None = chat.DEFAULT_TIMEOUT,
) -> PromptData:
    """Validates and tokenizes prompt (and answer) records; see the module docstring.

    A prompt is a non-empty string, or with `chat_template=True` also a list of chat
    messages; it is rendered with `tokenizer.apply_chat_template(...,
    add_generation_prompt=True, **chat_template_kwargs)`, which may take at most
    `chat_template_timeout` seconds per rendering (`chat.TemplateTimeout`, naming the row,
    whatever `on_error`; None or 0: no limit). An answer is a non-empty string or a number
    (kept as text). A prompt over `max_prompt_tokens` follows `long_prompts` (the module
    docstring).
    """
    _check_options(on_error, chat_template, tokenizer, long_prompts)
    fit = dict(long_prompts=long_prompts, template_kwargs=chat_template_kwargs, timeout=chat_template_timeout)

    def parse(record, location):
        text, ids, truncated = _prompt(tokenizer, _field(record, prompt_key, location), prompt_key, location,
                                       chat_template=chat_template, system_prompt=system_prompt,
                                       max_tokens=max_prompt_tokens, **fit)
        answer = None
        if answer_key is not None:
            answer = _text(_field(record, answer_key, location), answer_key, location, numbers_ok=True)
        fields = {k: v for k, v in record.items() if k != prompt_key}
        return dict(prompt_text=text, prompt_ids=ids, answer=answer, location=location, fields=fields,
                    truncated=truncated)

    cols, report = _collect(records, parse, on_error=on_error, source=source)
    return PromptData(**{f: cols[f] for f in PromptData._fields if f != "skipped"}, skipped=report)


def _response(tokenizer, value, key, location, *, prompt, chat_template, max_tokens, template_kwargs, timeout):
    """(text, ids) of one response: plain text (no special tokens), or with a chat template
    the template's rendering of it as the assistant turn(s) after `prompt` (messages)."""
    if chat_template:
        turns = [{"role": "assistant", "content": _text(value, key, location)}] if isinstance(value, str) else (
            _messages(value, key, location))
        text = _render(chat.response_text, tokenizer, prompt, turns, key=key, location=location,
                       template_kwargs=template_kwargs, timeout=timeout)
    else:
        if isinstance(value, list):
            raise DataError(location, key, "wrong_type", "a message list needs chat_template=True")
        text = _text(value, key, location)
    ids = _encode_or_error(tokenizer, text, key, location, add_special_tokens=False, limit=max_tokens,
                           limit_name="max_response_tokens")
    _check_len(ids, max_tokens, key, location, "max_response_tokens")
    return text, ids


def _implicit_prompt(record, chosen_key, rejected_key, location):
    """TRL's implicit-prompt pair: `chosen` and `rejected` whole chats sharing every turn
    but their last (the assistant's) -> (prompt messages, chosen turn, rejected turn)."""
    chosen = _messages(_field(record, chosen_key, location), chosen_key, location)
    rejected = _messages(_field(record, rejected_key, location), rejected_key, location)
    if len(chosen) < 2 or chosen[:-1] != rejected[:-1] or chosen[-1]["role"] != "assistant":
        raise DataError(location, rejected_key, "wrong_type", f"without a prompt field, {chosen_key!r} and "
                        f"{rejected_key!r} must be chats that share every turn but a last assistant turn")
    return chosen[:-1], chosen[-1:], rejected[-1:]


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
    long_prompts: str = "drop",
    chat_template_kwargs: dict | None = None,
    chat_template_timeout: float | None = chat.DEFAULT_TIMEOUT,
) -> PairData:
    """Validates and tokenizes preference-pair records, in TRL's layouts: `prompt`,
    `chosen`, `rejected` strings; with `chat_template=True` also message lists (the
    prompt's turns, and `chosen` / `rejected` the assistant turn(s) after it), or, without
    a prompt field, `chosen` / `rejected` as whole chats differing in their last turn."""
    _check_options(on_error, chat_template, tokenizer, long_prompts)
    fit = dict(long_prompts=long_prompts, template_kwargs=chat_template_kwargs, timeout=chat_template_timeout)

    def parse(record, location):
        implicit = chat_template and isinstance(record, dict) and prompt_key not in record and isinstance(
            record.get(chosen_key), list)
        if implicit:
            turns, chosen, rejected = _implicit_prompt(record, chosen_key, rejected_key, location)
            messages = _chat(turns, chosen_key, location, system_prompt)
            text = _render(chat.render, tokenizer, messages, True, key=chosen_key, location=location,
                           template_kwargs=chat_template_kwargs, timeout=chat_template_timeout)
            ids = _encode_prompt(tokenizer, text, chosen_key, location, add_special_tokens=False,
                                 max_tokens=max_prompt_tokens, long_prompts=long_prompts)
            ids, truncated = _fit_prompt(tokenizer, ids, max_prompt_tokens, long_prompts, chosen_key, location)
            values = {chosen_key: chosen, rejected_key: rejected}
        else:
            value = _field(record, prompt_key, location)
            text, ids, truncated = _prompt(tokenizer, value, prompt_key, location, chat_template=chat_template,
                                           system_prompt=system_prompt, max_tokens=max_prompt_tokens, **fit)
            messages = _chat(value, prompt_key, location, system_prompt) if chat_template else None
            values = {key: _field(record, key, location) for key in (chosen_key, rejected_key)}
        row = dict(prompt_text=text, prompt_ids=ids, location=location, truncated=truncated)
        for name, key in (("chosen", chosen_key), ("rejected", rejected_key)):
            resp, resp_ids = _response(tokenizer, values[key], key, location, prompt=messages,
                                       chat_template=chat_template, max_tokens=max_response_tokens,
                                       template_kwargs=chat_template_kwargs, timeout=chat_template_timeout)
            row.update({f"{name}_text": resp, f"{name}_ids": resp_ids})
        return row

    cols, report = _collect(records, parse, on_error=on_error, source=source)
    return PairData(**{f: cols[f] for f in PairData._fields if f != "skipped"}, skipped=report)


def sft_from_records(
    records: Records,
    tokenizer: Any,
    *,
    messages_key: str = "messages",
    prompt_key: str = "prompt",
    completion_key: str = "completion",
    max_prompt_tokens: int | None = None,
    max_response_tokens: int | None = None,
    chat_template: bool = False,
    system_prompt: str | None = None,
    eos_id: int | None = None,
    on_error: str = "raise",
    source: str = "records",
    long_prompts: str = "drop",
    chat_template_kwargs: dict | None = None,
    chat_template_timeout: float | None = chat.DEFAULT_TIMEOUT,
) -> SFTData:
    """Validates and tokenizes SFT records, in TRL's layouts: a `messages` chat (needs
    `chat_template=True`), learnt on its assistant turns only (`chat.turn_pieces`: each
    piece tokenized on its own, so the ids are the prompt's as the sampler sees it followed
    by what the model must write); or `prompt` / `completion` (strings, or with a chat
    template message lists), learnt on the completion: plain text gets `eos_id` appended,
    templated text ends with the template's end-of-turn marker."""
    _check_options(on_error, chat_template, tokenizer, long_prompts)
    fit = dict(long_prompts=long_prompts, template_kwargs=chat_template_kwargs, timeout=chat_template_timeout)

    def parse(record, location):
        if isinstance(record, dict) and messages_key in record:
            if not chat_template:
                raise DataError(location, messages_key, "wrong_type", "a messages chat needs chat_template=True")
            messages = _chat(_field(record, messages_key, location), messages_key, location, system_prompt)
            key = messages_key
        else:
            key = completion_key
            prompt, completion = (_field(record, k, location) for k in (prompt_key, completion_key))
            if not chat_template:
                text, ids, truncated = _prompt(tokenizer, prompt, prompt_key, location, chat_template=False,
                                               system_prompt=None, max_tokens=max_prompt_tokens, **fit)
                answer = _text(completion, completion_key, location)
                resp = _encode_or_error(tokenizer, answer, completion_key, location, add_special_tokens=False,
                                        limit=max_response_tokens, limit_name="max_response_tokens")
                resp += [] if eos_id is None else [eos_id]
                _check_len(resp, max_response_tokens, completion_key, location, "max_response_tokens")
                return dict(prompt_text=text, prompt_ids=ids, response_ids=resp, loss_mask=[True] * len(resp),
                            answer=answer, location=location, truncated=truncated)
            turns = [{"role": "assistant", "content": completion}] if isinstance(completion, str) else completion
            messages = _chat(prompt, prompt_key, location, system_prompt) + _messages(turns, completion_key, location)
        pieces = _render(chat.turn_pieces, tokenizer, messages, key=key, location=location,
                         template_kwargs=chat_template_kwargs, timeout=chat_template_timeout)
        first = next((i for i, (_, assistant) in enumerate(pieces) if assistant), None)
        if first is None:
            raise DataError(location, key, "no_assistant_turn", "has no assistant turn to learn")
        text = "".join(t for t, _ in pieces[:first])
        ids = _encode_prompt(tokenizer, text, key, location, add_special_tokens=False, max_tokens=max_prompt_tokens,
                             long_prompts=long_prompts)
        ids, truncated = _fit_prompt(tokenizer, ids, max_prompt_tokens, long_prompts, key, location)
        _check_bytes(tokenizer, "".join(t for t, _ in pieces[first:]), max_response_tokens, key, location,
                     "max_response_tokens")
        resp, loss = [], []
        for piece, assistant in pieces[first:]:
            piece_ids = _encode_or_error(tokenizer, piece, key, location, add_special_tokens=False)
            resp += piece_ids
            loss += [assistant] * len(piece_ids)
        _check_len(resp, max_response_tokens, key, location, "max_response_tokens")
        answer = next(m["content"] for m in messages if m["role"] == "assistant")
        return dict(prompt_text=text, prompt_ids=ids, response_ids=resp, loss_mask=loss, answer=answer,
                    location=location, truncated=truncated)

    cols, report = _collect(records, parse, on_error=on_error, source=source)
    return SFTData(**{f: cols[f] for f in SFTData._fields if f != "skipped"}, skipped=report)
