"""A text environment as a token environment, with exact tokens: `ChatEpisode`, `render_delta`.

`ChatEpisode(env, tokenizer)` runs a text `Env` (messages in, messages out) through the
tokenizer's chat template and gives the episode engine ids ("token in, token out"):

    reset(row)                -> ids of the template's rendering of env.reset(row), with its
                                 generation prompt (tokenised with add_special_tokens=False:
                                 only the special tokens the template writes)
    step(action_ids, cut)     -> TokenStep(ids, reward, done): `ids` are the environment's
                                 tokens that follow the policy's `action_ids` in the sequence

The rule (exact tokens). The episode's sequence is the prompt's ids, then each turn's
`action_ids` exactly as sampled, then the environment's ids, and so on. Nothing already in
the sequence is ever re-tokenised. The environment's ids of a turn are the tokenisation,
alone, of the template's text that follows the policy's turn: the template's rendering of
[history + new messages] (with its generation prompt) minus what the sequence already
holds, i.e. the rendering of the chat before the turn (with its generation prompt), the
assistant's content, and the turn's stop token. That text is

    glue                 what the template writes after the assistant's content that the
                         policy did not sample: Qwen's "\\n" after "<|im_end|>"; the whole
                         closing "<|im_end|>\\n" when the turn was `cut` (ended at the
                         per-turn token limit), or ended by a stop string
    the new messages     their rendering (a tool result, a user's reply)
    generation prompt    "<|im_start|>assistant\\n": the policy writes next

The assistant's text given to the environment (and kept in the history) is `action_ids`
decoded (special tokens kept, no clean-up of spaces) without the stop token: when the turn
was not cut and its last token is a special token (the template's end-of-turn marker,
"<|im_end|>", "<|eot_id|>", "</s>", "<end_of_turn>"), that token's text is removed. A turn
ended by a stop string keeps all its text, and the template's whole closing follows it.
A special stop token other than the template's marker (e.g. Qwen's "<|endoftext|>" where
the template closes with "<|im_end|>") stays in the sequence, and the template's whole
closing follows it too.

Templates that trim the assistant's content (Llama 3.1, Gemma 3: `content | trim`): when the
policy's text has whitespace at either end, the sequence keeps it (the policy's tokens)
and the environment's text starts after the template's trimmed content.

When `done`, the episode is over and the environment's ids are empty: the sequence ends
with the policy's last token (its stop token, or the token where it was cut). Messages an
environment returns with `done=True` go to the history (`ChatEpisode.messages`) and are
never rendered.

A template whose rendering of the longer chat does not start with what the sequence holds
(it rewrites or moves earlier text: Qwen3 drops the `<think>` blocks of turns before the
last user message; Mistral Nemo moves the system prompt and the tool list to the last user
message) raises a ValueError naming the template and the turn. Exact tokens with such a
template need a per-turn mode (each turn's prompt rendered anew, the episode trained as
separate prompts), which this module does not build. A template that raises while
rendering (a role it refuses) gives a ValueError naming the template and the turn too.

Limits and errors. An observation (the summed length of the new messages' contents) over
`max_env_chars` is not rendered or tokenised: `step` raises `EnvLimit("env_tokens", ...)`,
which the engine counts as an episode cut by a limit. An exception raised by the user's
environment, or a result of the wrong type, is an `EnvError` naming the environment's class
and method (the original exception as its `__cause__`). `close()` always calls the
environment's `close` (when it has one).
"""

from __future__ import annotations

from typing import Any, Mapping, NamedTuple, Sequence

from jaxrlhf.data import chat as chat_text
from jaxrlhf.envs.base import EnvError, EnvLimit, TokenStep, call, check_messages, check_step, close, name_of


class Delta(NamedTuple):
    """The environment's part of a turn: `text` (glue, the new messages' rendering, the
    generation prompt), `ids` (`text` tokenised alone), and `rendered`, the template's
    rendering of the whole chat so far with its generation prompt (the next turn's
    `prompt_text`)."""

    text: str
    ids: list[int]
    rendered: str


def _render(tokenizer: Any, messages: list[dict], generation_prompt: bool, *, tools: Sequence[dict] | None,
            template_kwargs: Mapping[str, Any] | None, timeout: float | None, turn: int | None) -> str:
    """The template's text of `messages` (`tools` given to it when set); a template error is
    a ValueError naming the template and the turn (`TemplateTimeout` passes through)."""
    kw = dict(template_kwargs or {})
    if tools:
        kw["tools"] = list(tools)
    try:
        return chat_text.render(tokenizer, messages, generation_prompt, template_kwargs=kw, timeout=timeout)
    except chat_text.TemplateTimeout:
        raise
    except Exception as e:  # noqa: BLE001 - jinja2's TemplateError, raise_exception(...), a KeyError in the template
        where = "the episode's first messages" if not turn else f"the chat after the policy's turn {turn}"
        raise ValueError(f"{chat_text.describe_template(tokenizer)} could not render {where} "
                         f"({type(e).__name__}: {e})") from e


def _first_difference(a: str, b: str) -> int:
    n = min(len(a), len(b))
    return next((i for i in range(n) if a[i] != b[i]), n)


def render_delta(tokenizer: Any, history: list[dict], new_messages: list[dict], *, stop_text: str = "",
                 done: bool = False, prompt_text: str | None = None, tools: Sequence[dict] | None = None,
                 template_kwargs: Mapping[str, Any] | None = None,
                 timeout: float | None = chat_text.DEFAULT_TIMEOUT, turn: int | None = None) -> Delta:
    """The environment's text and ids after the policy's turn (the module docstring's rule).

    `history`: the chat whose last message is the assistant's turn just sampled (its
    `content` the policy's text without its stop token). The sequence holds `prompt_text`
    (the template's rendering of `history[:-1]` with its generation prompt; rendered here
    when None), the content, and `stop_text` (the stop token's text; "" for a cut turn or a
    stop string). `new_messages`: the environment's reply. Returns `Delta(text, ids,
    rendered)`: `rendered` is the rendering of `history + new_messages` with a generation
    prompt, `text` what of it follows the sequence, `ids` its tokenisation alone. When
    `done`: `Delta("", [], "")`, nothing rendered.

    ValueError, naming the template and `turn`, when the rendering does not start with
    `prompt_text` and the content (or the content trimmed), or when the template raises.
    """
    if done:
        return Delta("", [], "")
    if not history or history[-1].get("role") != "assistant":
        raise ValueError("render_delta: the history must end with the assistant's turn just sampled")
    kw = dict(tools=tools, template_kwargs=template_kwargs, timeout=timeout, turn=turn)
    if prompt_text is None:
        prompt_text = _render(tokenizer, history[:-1], True, **{**kw, "turn": (turn or 1) - 1})
    full = _render(tokenizer, list(history) + list(new_messages), True, **kw)
    content = history[-1].get("content") or ""
    held = next((prompt_text + c for c in (content, content.strip()) if full.startswith(prompt_text + c)), None)
    if held is None:
        expected = prompt_text + content
        i = _first_difference(full, expected)
        raise ValueError(
            f"{chat_text.describe_template(tokenizer)}: its rendering of the chat after the policy's turn "
            f"{turn if turn is not None else '?'} does not start with the rendering before that turn followed by "
            f"the policy's text (first difference at character {i}: the sequence holds {expected[i:i + 40]!r}, the "
            f"template writes {full[i:i + 40]!r}). The template rewrites or moves earlier text (e.g. Qwen3 drops "
            "the <think> blocks of earlier turns; Mistral Nemo moves the system prompt and the tool list), so the "
            "environment's tokens cannot follow the policy's exactly; such a template needs a per-turn mode "
            "(each turn a new prompt), which jaxrlhf does not have yet (docs/episodes.md#chat-templates)")
    text = full[len(held):]
    if stop_text and text.startswith(stop_text):
        text = text[len(stop_text):]
    return Delta(text, list(tokenizer.encode(text, add_special_tokens=False)), full)


def special_ids(tokenizer: Any) -> frozenset[int]:
    """The ids of the tokenizer's special tokens (its named ones and every added token
    marked special): a turn's last token among them is its stop token."""
    ids = set(getattr(tokenizer, "all_special_ids", None) or ())
    for i, token in (getattr(tokenizer, "added_tokens_decoder", None) or {}).items():
        if getattr(token, "special", False):
            ids.add(int(i))
    return frozenset(ids)


class ChatEpisode:
    """A text `Env` and a tokenizer with a chat template as a `TokenEnv` (module docstring).

    `tools`: the tool schemas the template is given (`tools=` of `apply_chat_template`);
    None: the environment's `tool_schemas` attribute when it has one (`envs.tools.ToolEnv`
    sets it for the templates' own tool formats), else none. `template_kwargs`: the extra
    variables the template reads (`task.chat_template_kwargs`); `timeout`: seconds one
    rendering may take (`data.chat`: a SIGALRM timer, so it holds in the main thread only).
    `max_env_chars`: the longest observation (summed content length of a step's new
    messages) rendered; longer: `EnvLimit("env_tokens")`.

    Attributes: `messages` (the chat so far: the environment's messages and the policy's
    turns as `{"role": "assistant", "content": text}`), `turns` (policy turns stepped),
    `stats` (the environment's own `stats` dict, e.g. tool counters, or {}).
    """

    def __init__(self, env: Any, tokenizer: Any, *, tools: Sequence[dict] | None = None,
                 template_kwargs: Mapping[str, Any] | None = None,
                 timeout: float | None = chat_text.DEFAULT_TIMEOUT, max_env_chars: int | None = None):
        self.env = env
        self.tokenizer = tokenizer
        self.tools = list(tools) if tools is not None else getattr(env, "tool_schemas", None)
        self.template_kwargs = dict(template_kwargs or {})
        self.timeout = timeout
        self.max_env_chars = max_env_chars
        self.messages: list[dict] = []
        self.turns = 0
        self._special = special_ids(tokenizer)
        self._rendered: str | None = None  # the template's text of `messages`, generation prompt included

    @property
    def stats(self) -> dict:
        stats = getattr(self.env, "stats", None)
        return dict(stats) if isinstance(stats, Mapping) else {}

    def _kw(self, turn: int) -> dict:
        return dict(tools=self.tools, template_kwargs=self.template_kwargs, timeout=self.timeout, turn=turn)

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=False, clean_up_tokenization_spaces=False)

    def reset(self, row: dict) -> list[int]:
        """The prompt's ids: env.reset(row) rendered with the generation prompt."""
        messages = check_messages(self.env, "reset", call(self.env, "reset", row))
        if not messages:
            raise EnvError(f"{name_of(self.env)}.reset returned no messages; expected the episode's first messages")
        self.messages = [dict(m) for m in messages]
        self.turns = 0
        self._rendered = _render(self.tokenizer, self.messages, True, **self._kw(0))
        return list(self.tokenizer.encode(self._rendered, add_special_tokens=False))

    def step(self, action_ids: Sequence[int], cut: bool) -> TokenStep:
        """The environment's ids after the policy's turn `action_ids` (its stop token last
        unless `cut`), this step's reward and whether the episode is over."""
        if self._rendered is None:
            raise RuntimeError("ChatEpisode.step before reset, or after a step that ended the episode")
        ids = [int(i) for i in action_ids]
        self.turns += 1
        stop = not cut and bool(ids) and ids[-1] in self._special
        content = self._decode(ids[:-1] if stop else ids)
        stop_text = self._decode(ids[-1:]) if stop else ""
        result = check_step(self.env, call(self.env, "step", content))
        history = self.messages + [{"role": "assistant", "content": content}]
        self.messages = history + [dict(m) for m in result.messages]
        if result.done:
            self._rendered = None
            return TokenStep([], result.reward, True)
        chars = sum(len(m.get("content") or "") for m in result.messages)
        if self.max_env_chars is not None and chars > self.max_env_chars:
            raise EnvLimit("env_tokens", f"{name_of(self.env)}.step returned an observation of {chars} characters "
                                         f"after turn {self.turns}, over max_env_chars={self.max_env_chars}")
        delta = render_delta(self.tokenizer, history, result.messages, stop_text=stop_text,
                             prompt_text=self._rendered, **self._kw(self.turns))
        self._rendered = delta.rendered
        return TokenStep(delta.ids, result.reward, False)

    def close(self) -> None:
        """The environment's `close()` (when it has one); what it raises is an `EnvError`."""
        close(self.env)
