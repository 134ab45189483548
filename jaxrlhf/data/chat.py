"""Chats through a tokenizer's chat template: which text is the assistant's.

SFT on `messages` learns the assistant turns only, and a preference pair given as messages
compares the assistant's rendered turns. Both need to know where, in the template's own
rendering of the whole chat, each assistant turn starts and ends. A turn's text is what
the template adds for it after the generation prompt: the rendering of the chat up to that
turn (`add_generation_prompt=True`) is the start, the rendering including the turn is the
end. The pieces therefore join back into exactly the template's rendering of the chat.

Every function takes `template_kwargs`, the extra variables the template reads
(`task.chat_template_kwargs`, e.g. Qwen3's `{"enable_thinking": False}`), passed to every
`apply_chat_template` call so that prompts, SFT chats and pairs render alike.
"""

from __future__ import annotations

from typing import Any, Mapping


def render(tokenizer: Any, messages: list[dict], add_generation_prompt: bool, *,
           template_kwargs: Mapping[str, Any] | None = None) -> str:
    """The chat template's text of `messages` (untokenized), `template_kwargs` given to it."""
    return tokenizer.apply_chat_template(messages, add_generation_prompt=add_generation_prompt, tokenize=False,
                                         **(template_kwargs or {}))


def turn_pieces(tokenizer: Any, messages: list[dict], *,
                template_kwargs: Mapping[str, Any] | None = None) -> list[tuple[str, bool]]:
    """`[(text, is_assistant), ...]`: the template's rendering of the whole chat cut at the
    start and end of every assistant turn (their concatenation is that rendering).

    Raises ValueError when the template renders the first turns of a chat differently from
    the start of the whole chat (e.g. one that rewrites earlier turns), since then no
    piece of the whole is the assistant's own.
    """
    kw = dict(template_kwargs=template_kwargs)
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
                  template_kwargs: Mapping[str, Any] | None = None) -> str:
    """What the template adds to the rendered `prompt` (with its generation prompt) for the
    `response` turns: the text a model prompted with `prompt` would have to produce,
    end-of-turn marker included."""
    start = render(tokenizer, prompt, True, template_kwargs=template_kwargs)
    full = render(tokenizer, prompt + response, False, template_kwargs=template_kwargs)
    if not full.startswith(start) or len(full) == len(start):
        raise ValueError("the chat template's rendering of the prompt with its generation prompt is not the start of "
                         "its rendering of the prompt and response")
    return full[len(start):]
