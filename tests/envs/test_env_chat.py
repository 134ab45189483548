"""Exact tokens through real chat templates: `render_delta` (the environment's text after a
policy turn is the tail of the template's full rendering, for each fixture template or its
documented failure) and `ChatEpisode` (the episode's ids decode to the template's rendering,
the environment's ids are its text tokenised alone, cut turns, stop strings, errors)."""

from __future__ import annotations

import os
import sys

import pytest

from jaxrlhf.data.chat import render
from jaxrlhf.envs import ChatEpisode, EnvError, EnvLimit, Step, ToolEnv, render_delta, tool_from_function

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _tiny_chat import TEMPLATES, tiny_tokenizer  # noqa: E402


def add(a: int, b: int) -> int:
    """Adds two integers.

    Args:
        a: the first integer
        b: the second integer
    """
    return a + b


def mul(a: int, b: int) -> int:
    """Multiplies two integers.

    Args:
        a: the first integer
        b: the second integer
    """
    return a * b


TOOLS = [tool_from_function(add), tool_from_function(mul)]
SCHEMAS = [t.schema for t in TOOLS]
QUESTION = "What is 2 + 3, then times 4?"

# What a policy writes in each call format: a call, two calls in one turn, the answer.
TURNS = {
    "hermes": ['<tool_call>\n{"name": "add", "arguments": {"a": 2, "b": 3}}\n</tool_call>',
               '<tool_call>\n{"name": "mul", "arguments": {"a": 5, "b": 4}}\n</tool_call>\n'
               '<tool_call>\n{"name": "add", "arguments": {"a": 20, "b": 0}}\n</tool_call>',
               "The answer is 20."],
    "llama3": ['{"name": "add", "parameters": {"a": 2, "b": 3}}',
               '<|python_tag|>{"name": "mul", "parameters": {"a": 5, "b": 4}}',
               "The answer is 20."],
    "mistral": ['[TOOL_CALLS][{"name": "add", "arguments": {"a": 2, "b": 3}, "id": "abcdef123"}]',
                '[TOOL_CALLS][{"name": "mul", "arguments": {"a": 5, "b": 4}, "id": "abcdef124"}]',
                "The answer is 20."],
}
TURNS["prompt"] = TURNS["hermes"]
QWEN3_THINKING = ["<think>\nFirst the sum.\n</think>\n\n" + TURNS["hermes"][0],
                  "<think>\nNow the product.\n</think>\n\n" + TURNS["hermes"][1],
                  "<think>\nDone.\n</think>\n\nThe answer is 20."]


def tool_chat(name: str, turns: list[str]) -> tuple[list[dict], list[dict] | None]:
    """A chat of a user question, the policy's `turns` (raw text, as sampled) and the tool
    results after each call turn; the tools given to the template (None: described in the
    system prompt)."""
    env = ToolEnv(TOOLS, lambda row, text: 1.0, format=TEMPLATES[name]["format"])
    chat = env.reset({"prompt": QUESTION})
    for text in turns:
        chat.append({"role": "assistant", "content": text})
        chat += env.step(text).messages
    return chat, env.tool_schemas


def assistant_turns(chat: list[dict]) -> list[int]:
    return [i for i, m in enumerate(chat) if m["role"] == "assistant"]


def check_incremental(tokenizer, chat: list[dict], tools, stop: str, template_kwargs=None) -> None:
    """Each assistant turn that the environment answers: the rendering before it, the turn's
    content and stop token, and render_delta's text are the rendering up to the next turn;
    the delta's ids are its text tokenised alone."""
    kw = dict(template_kwargs=dict(template_kwargs or {}, **({"tools": tools} if tools else {})))
    turns = assistant_turns(chat)
    for turn, (i, j) in enumerate(zip(turns, turns[1:]), start=1):
        before = render(tokenizer, chat[:i], True, **kw)
        delta = render_delta(tokenizer, chat[:i + 1], chat[i + 1:j], stop_text=stop, tools=tools,
                             template_kwargs=template_kwargs, turn=turn)
        assert before + chat[i]["content"] + stop + delta.text == render(tokenizer, chat[:j], True, **kw)
        assert delta.rendered == render(tokenizer, chat[:j], True, **kw)
        assert delta.ids == tokenizer.encode(delta.text, add_special_tokens=False)
        assert delta.text.startswith(TEMPLATES_GLUE.get(stop, ""))


TEMPLATES_GLUE = {"<|im_end|>": "\n", "<end_of_turn>": "\n"}


@pytest.mark.parametrize("name", ["qwen2.5", "llama3.1", "smollm2"])
def test_incremental_rendering_is_the_full_renderings_tail(name):
    tokenizer = tiny_tokenizer(name)
    chat, tools = tool_chat(name, TURNS[TEMPLATES[name]["format"]])
    assert [m["role"] for m in chat].count("tool") == (2 if name == "llama3.1" else 3)  # Llama: one call a turn
    check_incremental(tokenizer, chat, tools, TEMPLATES[name]["stop"])


USER_CHAT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
             {"role": "assistant", "content": "Hello!"}, {"role": "user", "content": "2 + 2?"},
             {"role": "assistant", "content": "4"}, {"role": "user", "content": "Thanks"},
             {"role": "assistant", "content": "Bye"}]


@pytest.mark.parametrize("name", ["qwen2.5", "llama3.1", "smollm2", "gemma3"])
def test_incremental_rendering_over_several_user_turns(name):
    check_incremental(tiny_tokenizer(name), USER_CHAT, None, TEMPLATES[name]["stop"])


def test_qwen3_holds_in_a_tool_loop_with_its_thinking_format():
    tokenizer = tiny_tokenizer("qwen3")
    chat, tools = tool_chat("qwen3", QWEN3_THINKING)
    check_incremental(tokenizer, chat, tools, "<|im_end|>")


def test_qwen3_fails_clearly_when_a_new_user_message_drops_earlier_thinking():
    tokenizer = tiny_tokenizer("qwen3")
    chat = [{"role": "user", "content": "Hi"},
            {"role": "assistant", "content": "<think>\nA greeting.\n</think>\n\nHello!"}]
    with pytest.raises(ValueError, match=r"tiny-qwen3.*turn 1 does not start with.*per-turn mode"):
        render_delta(tokenizer, chat, [{"role": "user", "content": "And 2 + 2?"}], stop_text="<|im_end|>", turn=1)


def test_qwen3_without_thinking_fails_clearly():
    """enable_thinking=False puts an empty <think> block in the generation prompt, which the
    template does not write again for an earlier assistant turn."""
    tokenizer = tiny_tokenizer("qwen3")
    chat, tools = tool_chat("qwen3", TURNS["hermes"])
    i = assistant_turns(chat)[0]
    with pytest.raises(ValueError, match="tiny-qwen3.*turn 1 does not start with"):
        render_delta(tokenizer, chat[:i + 1], chat[i + 1:i + 2], stop_text="<|im_end|>", tools=tools,
                     template_kwargs={"enable_thinking": False}, turn=1)


def test_mistral_nemo_holds_for_one_tool_round():
    tokenizer = tiny_tokenizer("mistral-nemo")
    chat, tools = tool_chat("mistral-nemo", TURNS["mistral"][:1] + TURNS["mistral"][2:])
    check_incremental(tokenizer, chat, tools, "</s>")


def test_mistral_nemo_refuses_a_second_tool_round():
    """Its template counts an assistant turn without structured `tool_calls` as a reply in
    the user/assistant alternation, and raises at the second one after a tool result."""
    tokenizer = tiny_tokenizer("mistral-nemo")
    chat, tools = tool_chat("mistral-nemo", TURNS["mistral"])
    i = assistant_turns(chat)[1]
    with pytest.raises(ValueError, match=r"tiny-mistral-nemo.*could not render the chat after the policy's turn 2 "
                                         r"\(TemplateError: After the optional system message"):
        render_delta(tokenizer, chat[:i + 1], chat[i + 1:i + 2], stop_text="</s>", tools=tools, turn=2)


def test_mistral_nemo_moves_its_system_prompt():
    tokenizer = tiny_tokenizer("mistral-nemo")
    chat = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
            {"role": "assistant", "content": "Hello!"}]
    with pytest.raises(ValueError, match="tiny-mistral-nemo.*turn 1 does not start with"):
        render_delta(tokenizer, chat, [{"role": "user", "content": "Bye"}], stop_text="</s>", turn=1)


def test_mistral_nemo_moves_its_tool_list_before_a_new_user_message():
    tokenizer = tiny_tokenizer("mistral-nemo")
    chat = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello!"}]
    with pytest.raises(ValueError, match="tiny-mistral-nemo.*turn 1 does not start with"):
        render_delta(tokenizer, chat, [{"role": "user", "content": "Bye"}], stop_text="</s>", tools=SCHEMAS, turn=1)
    render_delta(tokenizer, chat, [{"role": "user", "content": "Bye"}], stop_text="</s>", turn=1)  # no tools: holds


def test_gemma3_refuses_tool_messages():
    tokenizer = tiny_tokenizer("gemma3")
    assert render(tokenizer, USER_CHAT[:2], True).startswith("<bos><start_of_turn>user\nBe brief.\n\nHi")
    chat, tools = tool_chat("gemma3", TURNS["prompt"])
    i = assistant_turns(chat)[0]
    with pytest.raises(ValueError, match=r"tiny-gemma3.*could not render.*turn 1.*roles must alternate"):
        render_delta(tokenizer, chat[:i + 1], chat[i + 1:i + 2], stop_text="<end_of_turn>", turn=1)


@pytest.mark.parametrize("name", ["llama3.1", "gemma3"])
def test_a_template_that_trims_content_keeps_the_policys_whitespace(name):
    """Llama 3.1 and Gemma 3 write `content | trim`: the sequence keeps the policy's
    trailing newline, and the environment's text starts after the trimmed content."""
    tokenizer, stop = tiny_tokenizer(name), TEMPLATES[name]["stop"]
    chat = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello!\n"}]
    new = [{"role": "user", "content": "Bye"}]
    delta = render_delta(tokenizer, chat, new, stop_text=stop, turn=1)
    before = render(tokenizer, chat[:1], True)
    assert before + "Hello!" + stop + delta.text == render(tokenizer, chat + new, True)


def test_done_gives_no_tokens_and_renders_nothing():
    class Broken:
        chat_template = "{{ raise_exception('never rendered') }}"

    assert render_delta(Broken(), [{"role": "assistant", "content": "x"}], [], done=True) == ("", [], "")


# ----------------------------------------------------------------------------- ChatEpisode


def run_episode(name: str, turns: list[str], template_kwargs=None, cut_last=False):
    """A ToolEnv episode through ChatEpisode with scripted turns (each the canonical ids of
    its text, then the stop token): the sequence's ids, each step and the episode."""
    tokenizer, spec = tiny_tokenizer(name), TEMPLATES[name]
    env = ToolEnv(TOOLS, lambda row, text: float("20" in text), format=spec["format"])
    episode = ChatEpisode(env, tokenizer, template_kwargs=template_kwargs)
    sequence = episode.reset({"prompt": QUESTION})
    stop_id = tokenizer.convert_tokens_to_ids(spec["stop"])
    steps = []
    for text in turns:
        action = tokenizer.encode(text, add_special_tokens=False) + [stop_id]
        step = episode.step(action, False)
        sequence += action + step.ids
        steps.append(step)
        if step.done:
            break
    return tokenizer, episode, sequence, steps


@pytest.mark.parametrize("name, turns, glue", [
    ("qwen2.5", TURNS["hermes"], "\n"), ("llama3.1", TURNS["llama3"], ""), ("smollm2", TURNS["prompt"], "\n"),
    ("qwen3", QWEN3_THINKING, "\n"),
    ("mistral-nemo", TURNS["mistral"][::2], None),  # its template refuses the whole chat (alternation)
])
def test_episode_ids_decode_to_the_templates_rendering(name, turns, glue):
    tokenizer, episode, sequence, steps = run_episode(name, turns)
    assert [s.done for s in steps] == [False] * (len(turns) - 1) + [True]
    assert [s.reward for s in steps] == [0.0] * (len(turns) - 1) + [1.0]
    assert steps[-1].ids == []
    text = tokenizer.decode(sequence, skip_special_tokens=False, clean_up_tokenization_spaces=False)
    kw = {"tools": episode.tools} if episode.tools else {}
    last = episode.messages[-1]
    assert last["role"] == "assistant"
    stop = TEMPLATES[name]["stop"]
    assert text == render(tokenizer, episode.messages[:-1], True, template_kwargs=kw) + last["content"] + stop
    if glue is not None:  # the closing glue of the last turn is not in the sequence (done)
        assert render(tokenizer, episode.messages, False, template_kwargs=kw) == text + glue
    for step in steps[:-1]:  # the environment's ids are its text tokenised alone
        delta = tokenizer.decode(step.ids, skip_special_tokens=False, clean_up_tokenization_spaces=False)
        assert step.ids == tokenizer.encode(delta, add_special_tokens=False)
    assert episode.stats["tool_calls"] == len(turns) - 1 + (name in ("qwen2.5", "smollm2", "qwen3"))
    assert episode.turns == len(turns)


def test_the_environments_ids_do_not_depend_on_how_the_policy_tokenised_its_turn():
    """Token in, token out: the policy's ids stay as sampled (a non-canonical split here);
    the environment's ids are the same as after the canonical tokens."""
    tokenizer = tiny_tokenizer("qwen2.5")
    stop = tokenizer.convert_tokens_to_ids("<|im_end|>")
    text = TURNS["hermes"][0]
    canonical = tokenizer.encode(text, add_special_tokens=False)
    per_char = [i for c in text for i in tokenizer.encode(c, add_special_tokens=False)]
    assert per_char != canonical
    results = []
    for action in (canonical, per_char):
        episode = ChatEpisode(ToolEnv(TOOLS, lambda row, text: 0.0), tokenizer)
        episode.reset({"prompt": QUESTION})
        results.append(episode.step(action + [stop], False))
        assert episode.messages[-2] == {"role": "assistant", "content": text}
    assert results[0] == results[1]
    assert tokenizer.decode(results[0].ids).startswith("\n<|im_start|>user\n<tool_response>\n5\n</tool_response>")


class Recorder:
    """Answers every turn with a user message; records the texts it is given."""

    def __init__(self):
        self.texts = []
        self.closed = 0

    def reset(self, row):
        return [{"role": "user", "content": row["prompt"]}]

    def step(self, text):
        self.texts.append(text)
        return Step([{"role": "user", "content": "Go on."}], 0.5, False)

    def close(self):
        self.closed += 1


def test_a_cut_turn_gets_the_closing_glue_as_environment_tokens():
    tokenizer = tiny_tokenizer("qwen2.5")
    env = Recorder()
    episode = ChatEpisode(env, tokenizer)
    episode.reset({"prompt": "Hi"})
    action = tokenizer.encode("Hello the", add_special_tokens=False)  # the per-turn limit: no stop token
    step = episode.step(action, True)
    assert env.texts == ["Hello the"]
    assert tokenizer.decode(step.ids) == "<|im_end|>\n<|im_start|>user\nGo on.<|im_end|>\n<|im_start|>assistant\n"
    assert step.reward == 0.5 and not step.done


def test_a_turn_ended_by_a_stop_string_keeps_its_text_and_gets_the_whole_closing():
    tokenizer = tiny_tokenizer("qwen2.5")
    env = Recorder()
    episode = ChatEpisode(env, tokenizer)
    episode.reset({"prompt": "Hi"})
    step = episode.step(tokenizer.encode("x </tool_call>", add_special_tokens=False), False)
    assert env.texts == ["x </tool_call>"]
    assert tokenizer.decode(step.ids).startswith("<|im_end|>\n<|im_start|>user\n")


def test_a_special_stop_token_other_than_the_templates_marker_is_left_in_place():
    """Qwen's <|endoftext|> ends a turn whose template closes with <|im_end|>: the stop token
    is not the environment's text, and the template's whole closing follows it."""
    tokenizer = tiny_tokenizer("qwen2.5")
    env = Recorder()
    episode = ChatEpisode(env, tokenizer)
    episode.reset({"prompt": "Hi"})
    eot = tokenizer.convert_tokens_to_ids("<|endoftext|>")
    step = episode.step(tokenizer.encode("Hello", add_special_tokens=False) + [eot], False)
    assert env.texts == ["Hello"]
    assert tokenizer.decode(step.ids).startswith("<|im_end|>\n<|im_start|>user\nGo on.")


def test_reset_renders_the_tools_the_environment_names():
    tokenizer = tiny_tokenizer("qwen2.5")
    ids = ChatEpisode(ToolEnv(TOOLS, lambda r, t: 0.0), tokenizer).reset({"prompt": QUESTION})
    text = tokenizer.decode(ids)
    assert text.startswith("<|im_start|>system\n") and "# Tools" in text and '"name": "mul"' in text
    assert text == render(tokenizer, [{"role": "user", "content": QUESTION}], True, template_kwargs={"tools": SCHEMAS})
    assert ids == tokenizer.encode(text, add_special_tokens=False)
    prompt_env = ToolEnv(TOOLS, lambda r, t: 0.0, format="prompt")
    text = tokenizer.decode(ChatEpisode(prompt_env, tokenizer).reset({"prompt": QUESTION}))
    assert "<tool_call>" in text and "You are Qwen" not in text  # the tool prompt is the system message


def test_a_rewriting_template_stops_the_episode_with_a_clear_error():
    tokenizer = tiny_tokenizer("qwen3")
    episode = ChatEpisode(Recorder(), tokenizer)
    episode.reset({"prompt": "Hi"})
    action = tokenizer.encode("<think>\nhm\n</think>\n\nHello", add_special_tokens=False)
    with pytest.raises(ValueError, match="tiny-qwen3.*turn 1 does not start with"):
        episode.step(action + [tokenizer.convert_tokens_to_ids("<|im_end|>")], False)


class Raises(Recorder):
    def step(self, text):
        raise KeyError("no such field")


class WrongType(Recorder):
    def step(self, text):
        return "not a step"


class BadMessages(Recorder):
    def step(self, text):
        return [{"role": "user"}, {"content": 3}], 1.0, False


class Huge(Recorder):
    def step(self, text):
        return [{"role": "tool", "content": "x" * 600}, {"role": "tool", "content": "y" * 500}], 0.0, False


class BadReset(Recorder):
    def reset(self, row):
        raise RuntimeError("no dataset")


class CloseRaises(Recorder):
    def close(self):
        raise OSError("already closed")


@pytest.mark.parametrize("env_cls, match", [
    (Raises, r"test_env_chat:Raises\.step raised KeyError"),
    (WrongType, r"test_env_chat:WrongType\.step returned str"),
    (BadMessages, r"test_env_chat:BadMessages\.step: message 1"),
])
def test_a_broken_environment_is_an_env_error_naming_its_class(env_cls, match):
    tokenizer = tiny_tokenizer("qwen2.5")
    episode = ChatEpisode(env_cls(), tokenizer)
    episode.reset({"prompt": "Hi"})
    with pytest.raises(EnvError, match=match) as info:
        episode.step(tokenizer.encode("Hello", add_special_tokens=False), True)
    if env_cls is Raises:
        assert isinstance(info.value.__cause__, KeyError)


def test_reset_errors_name_the_class():
    tokenizer = tiny_tokenizer("qwen2.5")
    with pytest.raises(EnvError, match=r"BadReset\.reset raised RuntimeError: no dataset") as info:
        ChatEpisode(BadReset(), tokenizer).reset({"prompt": "Hi"})
    assert isinstance(info.value.__cause__, RuntimeError)

    class Empty(Recorder):
        def reset(self, row):
            return []

    with pytest.raises(EnvError, match=r"Empty\.reset returned no messages"):
        ChatEpisode(Empty(), tokenizer).reset({"prompt": "Hi"})


def test_an_observation_over_max_env_chars_is_an_env_limit_before_tokenising():
    tokenizer = tiny_tokenizer("qwen2.5")
    episode = ChatEpisode(Huge(), tokenizer, max_env_chars=1000)
    episode.reset({"prompt": "Hi"})
    with pytest.raises(EnvLimit, match=r"Huge\.step returned an observation of 1100 characters.*max_env_chars=1000") \
            as info:
        episode.step(tokenizer.encode("Hello", add_special_tokens=False), True)
    assert info.value.kind == "env_tokens"
    fits = ChatEpisode(Huge(), tokenizer, max_env_chars=1100)
    fits.reset({"prompt": "Hi"})
    assert fits.step(tokenizer.encode("Hello", add_special_tokens=False), True).ids


def test_close_calls_the_environments_close_and_names_its_errors():
    tokenizer = tiny_tokenizer("qwen2.5")
    env = Recorder()
    ChatEpisode(env, tokenizer).close()
    assert env.closed == 1
    ChatEpisode(object(), tokenizer).close()  # no close: nothing to call
    with pytest.raises(EnvError, match=r"CloseRaises\.close raised OSError") as info:
        ChatEpisode(CloseRaises(), tokenizer).close()
    assert isinstance(info.value.__cause__, OSError)


def test_step_after_the_episode_ended_is_refused():
    tokenizer = tiny_tokenizer("qwen2.5")
    tokenizer_stop = tokenizer.convert_tokens_to_ids("<|im_end|>")
    episode = ChatEpisode(ToolEnv(TOOLS, lambda r, t: 1.0), tokenizer)
    episode.reset({"prompt": QUESTION})
    assert episode.step(tokenizer.encode("20", add_special_tokens=False) + [tokenizer_stop], False).done
    with pytest.raises(RuntimeError, match="after a step that ended the episode"):
        episode.step([tokenizer_stop], False)
