"""Chats through a tokenizer's chat template: which text is the assistant's.

SFT on `messages` learns the assistant turns only, and a preference pair given as messages
compares the assistant's rendered turns. Both need to know where, in the template's own
rendering of the whole chat, each assistant turn starts and ends. A turn's text is what
the template adds for it after the generation prompt: the rendering of the chat up to that
turn (`add_generation_prompt=True`) is the start, the rendering including the turn is the
end. The pieces therefore join back into exactly the template's rendering of the chat.

Every function takes `template_kwargs`, the extra variables the template reads
(`task.chat_template_kwargs`, e.g. Qwen3's `{"enable_thinking": False}`), passed to every
`apply_chat_template` call so that prompts, SFT chats and pairs render alike, and
`timeout`, the seconds one rendering may take (`task.chat_template_timeout`; None or 0: no
limit). A template is code from the checkpoint: `transformers` runs it in a jinja2 sandbox
(no file or attribute access) and compiles it once per template string (its own
`lru_cache`), but a sandboxed loop can still run for hours — `range` is capped at 100 000
items, two nested ones are not. Past its time a rendering stops with `TemplateTimeout`,
naming the template. The limit is a `SIGALRM` timer, so it holds in the main thread,
where the runs render (building the task); in another thread a rendering runs unlimited.

`check_template_names(tokenizer, field)`: the names of a tokenizer's extra chat templates
(`tokenizer_config.json`'s list of `{"name", "template"}`), each saved by `transformers`
as `additional_chat_templates/<name>.jinja` in the export: a name holding a path separator
would write outside that folder, and is refused before the run starts.
"""

from __future__ import annotations

import contextlib
import logging
import signal
import threading
import time
from typing import Any, Mapping

DEFAULT_TIMEOUT = 10.0  # seconds per rendering: `task.chat_template_timeout`'s default

log = logging.getLogger(__name__)


class TemplateTimeout(TimeoutError):
    """A chat template rendering that ran past its time limit (not a bad row: the template
    itself, or a chat it cannot handle in time; the run stops, naming both)."""


def describe_template(tokenizer: Any) -> str:
    """'the chat template of <tokenizer's name_or_path> (<its first 60 characters>)'."""
    template = getattr(tokenizer, "chat_template", None)
    if isinstance(template, dict):
        template = template.get("default", next(iter(template.values()), ""))
    head = (template or "")[:60]
    source = getattr(tokenizer, "name_or_path", "") or type(tokenizer).__name__
    return f"the chat template of {source} ({head!r}{'...' if len(template or '') > 60 else ''})"


_warned_thread = []


@contextlib.contextmanager
def _time_limit(seconds: float | None, tokenizer: Any):
    """Raise `TemplateTimeout` in the block after `seconds` (a `SIGALRM` timer; in the main
    thread only, elsewhere no limit). A timer already armed outside (another SIGALRM user)
    is re-armed with its remaining time afterwards."""
    if not seconds or threading.current_thread() is not threading.main_thread():
        if seconds and not _warned_thread:
            _warned_thread.append(True)
            log.warning("chat templates render without a time limit outside the main thread")
        yield
        return

    def expire(signum, frame):
        raise TemplateTimeout(f"{describe_template(tokenizer)} took more than {seconds:g} s to render one chat "
                              "(task.chat_template_timeout): a template that loops too long")

    previous = signal.signal(signal.SIGALRM, expire)
    outer, _ = signal.setitimer(signal.ITIMER_REAL, seconds)
    start = time.monotonic()
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
        if outer:
            signal.setitimer(signal.ITIMER_REAL, max(outer - (time.monotonic() - start), 1e-6))


def render(tokenizer: Any, messages: list[dict], add_generation_prompt: bool, *,
           template_kwargs: Mapping[str, Any] | None = None, timeout: float | None = DEFAULT_TIMEOUT) -> str:
    """The chat template's text of `messages` (untokenized), `template_kwargs` given to it;
    `TemplateTimeout` after `timeout` seconds (None or 0: no limit)."""
    with _time_limit(timeout, tokenizer):
        return tokenizer.apply_chat_template(messages, add_generation_prompt=add_generation_prompt, tokenize=False,
                                             **(template_kwargs or {}))


def check_template_names(tokenizer: Any, field: str) -> None:
    """A ValueError naming `field` (the config key of the tokenizer's folder) when one of
    the tokenizer's named chat templates could not be saved as its own file in the export's
    `additional_chat_templates/` folder (a name with a path separator, e.g. "../x")."""
    template = getattr(tokenizer, "chat_template", None)
    if not isinstance(template, dict):
        return
    for name in template:
        if not isinstance(name, str) or not name or any(c in name for c in "/\\\0"):
            raise ValueError(f"{field}={getattr(tokenizer, 'name_or_path', '')}: its tokenizer has a chat template "
                             f"named {name!r}, which the export would save outside its additional_chat_templates/ "
                             "folder; rename it in tokenizer_config.json (a name without / or \\)")


def turn_pieces(tokenizer: Any, messages: list[dict], *, template_kwargs: Mapping[str, Any] | None = None,
                timeout: float | None = DEFAULT_TIMEOUT) -> list[tuple[str, bool]]:
    """`[(text, is_assistant), ...]`: the template's rendering of the whole chat cut at the
    start and end of every assistant turn (their concatenation is that rendering).

    Raises ValueError when the template renders the first turns of a chat differently from
    the start of the whole chat (e.g. one that rewrites earlier turns), since then no
    piece of the whole is the assistant's own.
    """
    kw = dict(template_kwargs=template_kwargs, timeout=timeout)
    full = render(tokenizer, messages, False, **kw)
    pieces, pos = [], 0
    for i, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        start = render(tokenizer, messages[:i], True, **kw) if i else ""
        end = render(tokenizer, messages[:i + 1], False, **kw)
        if not (pos <= len(start) <= len(end) and full.startswith(end) and end.startswith(start)):
            raise ValueError(f"the chat template renders the chat up to assistant turn {i} differently from the "
                             "start of the whole chat, so its assistant text cannot be located")
        pieces += [(full[pos:len(start)], False), (full[len(start):len(end)], True)]
        pos = len(end)
    pieces.append((full[pos:], False))
    return [(text, assistant) for text, assistant in pieces if text]


def response_text(tokenizer: Any, prompt: list[dict], response: list[dict], *,
                  template_kwargs: Mapping[str, Any] | None = None, timeout: float | None = DEFAULT_TIMEOUT) -> str:
    """What the template adds to the rendered `prompt` (with its generation prompt) for the
    `response` turns: the text a model prompted with `prompt` would have to produce,
    end-of-turn marker included."""
    start = render(tokenizer, prompt, True, template_kwargs=template_kwargs, timeout=timeout)
    full = render(tokenizer, prompt + response, False, template_kwargs=template_kwargs, timeout=timeout)
    if not full.startswith(start) or len(full) == len(start):
        raise ValueError("the chat template's rendering of the prompt with its generation prompt is not the start of "
                         "its rendering of the prompt and response")
    return full[len(start):]
