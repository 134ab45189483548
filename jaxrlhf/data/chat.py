"""Chats through a tokenizer's chat template: which text is the assistant's.

SFT on `messages` learns the assistant turns only, and a preference pair given as messages
compares the assistant's rendered turns. Both need to know where, in the template's own
rendering of the whole chat, each assistant turn starts and ends. A turn's text is what
the template adds for it after the generation prompt: the rendering of the chat up to that
turn (`add_generation_prompt=True`) is the start, the rendering including the turn is the
end. The pieces therefore join back into exactly the template's rendering of the chat.
"""

from __future__ import annotations

from typing import Any


def render(tokenizer: Any, messages: list[dict], add_generation_prompt: bool) -> str:
    """The chat template's text of `messages` (untokenized)."""
    return tokenizer.apply_chat_template(messages, add_generation_prompt=add_generation_prompt, tokenize=False)


def turn_pieces(tokenizer: Any, messages: list[dict]) -> list[tuple[str, bool]]:
    """`[(text, is_assistant), ...]`: the template's rendering of the whole chat cut at the
    start and end of every assistant turn (their concatenation is that rendering).

    Raises ValueError when the template renders the first turns of a chat differently from
    the start of the whole chat (e.g. one that rewrites earlier turns), since then no
    piece of the whole is the assistant's own.
    """
    full = render(tokenizer, messages, add_generation_prompt=False)
    pieces, pos = [], 0
    for i, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        start = render(tokenizer, messages[:i], add_generation_prompt=True) if i else ""
        end = render(tokenizer, messages[:i + 1], add_generation_prompt=False)
        if not (pos <= len(start) <= len(end) and full.startswith(end) and end.startswith(start)):
            raise ValueError(f"the chat template renders the chat up to assistant turn {i} differently from the "
                             "start of the whole chat, so its assistant text cannot be located")
        pieces += [(full[pos:len(start)], False), (full[len(start):len(end)], True)]
        pos = len(end)
    pieces.append((full[pos:], False))
    return [(text, assistant) for text, assistant in pieces if text]


def response_text(tokenizer: Any, prompt: list[dict], response: list[dict]) -> str:
    """What the template adds to the rendered `prompt` (with its generation prompt) for the
    `response` turns: the text a model prompted with `prompt` would have to produce,
    end-of-turn marker included."""
    start = render(tokenizer, prompt, add_generation_prompt=True)
    full = render(tokenizer, prompt + response, add_generation_prompt=False)
    if not full.startswith(start) or len(full) == len(start):
        raise ValueError("the chat template's rendering of the prompt with its generation prompt is not the start of "
                         "its rendering of the prompt and response")
    return full[len(start):]
