"""Tools as a layer on the text environment: schemas, call parsers, running calls, `ToolEnv`.

A tool is a name, a JSON schema (the `{"type": "function", "function": {...}}` layout chat
templates read) and a Python callable: `Tool(name, schema, fn)`. `tool_from_function(fn)`
builds one from the function's signature, type hints and docstring (`transformers`'
`get_json_schema`: every argument needs a type hint and a line under `Args:`);
`import_tools("pkg.mod:fn,pkg.mod:g", field="env.tools")` imports several.

Call formats (`format=`), what the policy writes to call tools, as the templates describe:

    "hermes"   Hermes, Qwen2.5, Qwen3: one or more
               <tool_call>{"name": "add", "arguments": {"a": 1}}</tool_call>
    "llama3"   Llama 3.1: the whole message is {"name": "add", "parameters": {"a": 1}},
               optionally after <|python_tag|>; several objects separated by ";" are
               several calls
    "mistral"  Mistral Nemo / 7B v0.3: [TOOL_CALLS][{"name": "add", "arguments": {"a": 1},
               "id": "abcdef123"}, ...]
    "prompt"   templates without tools: the "hermes" syntax, described to the policy by a
               system prompt that `tool_prompt(tools)` writes

Text up to the last "</think>" is reasoning and never parsed. A parser returns, in order,
`Call(name, arguments, id)` items and `Malformed(text, reason)` items (invalid JSON, no
name, arguments not an object, an unclosed tag); a message without calls is `[]`, the
final answer.

Running calls: `run_calls(calls, tools, timeout_s)` runs each call in call order and
answers with one tool message per call, in the same order:
`{"role": "tool", "name": name, "content": str(result), "tool_call_id": id}`. What goes
wrong is an observation the policy reads, never a crash: the content is
`"error: <kind>: ..."`, the kinds `malformed`, `unknown_tool`, `bad_arguments` (not an
object, or not matching the function's signature), `raised` (the tool raised), `timeout`.
It returns the messages with per-kind counts and the seconds the tools took.

Trust model. The tools are the user's code, trusted like the rest of the run's code: they
run in this process, each call in a thread that is waited for at most `timeout_s` seconds.
A timed-out call's thread cannot be killed: it runs on in the background (a daemon
thread) while the episode goes on with a `timeout` observation. Code the policy writes is
never run by this module; running it needs a sandbox, which jaxrlhf does not have yet.

`ToolEnv`: a text `Env` made of tools and a final-answer check. `reset(row)` gives the
system prompt (the tool description for the "prompt" format, then `system_prompt`) and the
row's user message (`row[prompt_key]`: a string, or a list of messages); `step(text)`: a
turn with tool calls gets the tool messages, reward 0, not done; a turn without is the
final answer: reward `answer_reward(row, text)`, done. Its `stats` dict counts for the
run's metrics: `turns`, `tool_calls`, `tool_seconds`, and one count per error kind.
"""

from __future__ import annotations

import inspect
import json
import re
import threading
import time
from typing import Any, Callable, Iterable, Mapping, NamedTuple, Sequence

from jaxrlhf.envs.base import Step, import_object

ERROR_KINDS = ("malformed", "unknown_tool", "bad_arguments", "raised", "timeout")
FORMATS = ("hermes", "llama3", "mistral", "prompt")
DEFAULT_TIMEOUT_S = 10.0


class Tool(NamedTuple):
    """A tool: its `name`, its JSON `schema` (`{"type": "function", "function": {"name",
    "description", "parameters"}}`) and the Python callable `fn` that runs a call."""

    name: str
    schema: dict
    fn: Callable[..., Any]


class Call(NamedTuple):
    """A parsed tool call: the tool's `name`, its `arguments` (a dict when well formed),
    and the call's `id` when the format carries one (Mistral)."""

    name: str
    arguments: Any
    id: str | None = None


class Malformed(NamedTuple):
    """A tool call that could not be parsed: the `text` of the attempt and the `reason`."""

    text: str
    reason: str


class CallsResult(NamedTuple):
    """What `run_calls` returns: the tool `messages` in call order, `counts` (`calls` and
    one count per error kind) and `seconds` (wall time spent in the tools)."""

    messages: list[dict]
    counts: dict[str, int]
    seconds: float


# ----------------------------------------------------------------------------- tools


def tool_from_function(fn: Callable[..., Any], name: str | None = None) -> Tool:
    """A `Tool` from a function with type hints and a Google-style docstring (`Args:`), its
    schema from `transformers.utils.get_json_schema`; a ValueError naming the function when
    the schema cannot be built (a missing type hint, docstring or argument description)."""
    if not callable(fn):
        raise ValueError(f"a tool must be a function; got {type(fn).__name__} {fn!r}")
    from transformers.utils import get_json_schema

    label = getattr(fn, "__qualname__", repr(fn))
    try:
        schema = get_json_schema(fn)
    except Exception as e:  # noqa: BLE001 - DocstringParsingException, TypeHintParsingException
        raise ValueError(f"tool {label}: cannot build its JSON schema ({type(e).__name__}: {e}); a tool needs a type "
                         "hint on every argument and a docstring with a description, and an 'Args:' line per "
                         "argument") from e
    if name is not None:
        schema = {**schema, "function": {**schema["function"], "name": name}}
    return Tool(schema["function"]["name"], schema, fn)


def import_tools(spec: str | Sequence[str], field: str = "env.tools") -> list[Tool]:
    """The tools at the comma-separated import paths `spec` ("pkg.mod:fn,pkg.mod:g"; or a
    list of paths): each a function (made a `Tool` by `tool_from_function`) or a `Tool`.
    ValueError naming `field` and the path when one does not import, is not callable, has
    no schema, or two tools share a name."""
    paths = [p.strip() for p in spec.split(",")] if isinstance(spec, str) else [str(p).strip() for p in spec]
    if not paths or any(not p for p in paths):
        raise ValueError(f"{field}={spec!r}: expected comma-separated import paths 'package.module:function'")
    tools: list[Tool] = []
    for path in paths:
        obj = import_object(path, field, "package.module:function")
        if isinstance(obj, Tool):
            tools.append(obj)
            continue
        if not callable(obj) or isinstance(obj, type):
            raise ValueError(f"{field}={spec!r}: {path!r} is not a function ({type(obj).__name__})")
        try:
            tools.append(tool_from_function(obj))
        except ValueError as e:
            raise ValueError(f"{field}={spec!r}: {e}") from e
    names = [t.name for t in tools]
    twice = sorted({n for n in names if names.count(n) > 1})
    if twice:
        raise ValueError(f"{field}={spec!r}: two tools are named {', '.join(twice)}")
    return tools


def tool_prompt(tools: Sequence[Tool]) -> str:
    """The system prompt that describes `tools` and the "prompt" call format to a policy
    whose chat template has no tools of its own."""
    schemas = "\n".join(json.dumps(t.schema, ensure_ascii=False) for t in tools)
    return ("# Tools\n\nYou may call one or more tools to help with the request. The tools, as JSON schemas:\n"
            f"<tools>\n{schemas}\n</tools>\n\n"
            "To call a tool, write a JSON object with its name and arguments between <tool_call> and </tool_call>, "
            "one pair of tags per call:\n"
            '<tool_call>\n{"name": <tool name>, "arguments": <the arguments as a JSON object>}\n</tool_call>\n'
            "The results come back in the next message. When you have the answer, write it without a tool call.")


# ----------------------------------------------------------------------------- parsers


def _after_reasoning(text: str) -> str:
    """The text after the last "</think>" (reasoning is never parsed for calls)."""
    return text.rpartition("</think>")[2] if "</think>" in text else text


def _call_from(obj: Any, source: str, args_keys: tuple[str, ...]) -> Call | Malformed:
    """A `Call` from a decoded JSON object with a name and arguments under one of
    `args_keys` (an object, or a JSON string of one; absent: no arguments)."""
    if not isinstance(obj, dict):
        return Malformed(source, f"expected a JSON object with a name and arguments, got {type(obj).__name__}")
    name = obj.get("name")
    if not isinstance(name, str) or not name:
        return Malformed(source, "the call has no \"name\" string")
    args: Any = next((obj[k] for k in args_keys if k in obj), {})
    if isinstance(args, str):
        try:
            args = json.loads(args)
        except json.JSONDecodeError as e:
            return Malformed(source, f"the arguments of {name!r} are a string that is not JSON ({e.msg})")
    if not isinstance(args, dict):
        return Malformed(source, f"the arguments of {name!r} are a {type(args).__name__}, not a JSON object")
    call_id = obj.get("id")
    return Call(name, args, call_id if isinstance(call_id, str) else None)


def _loads(body: str) -> tuple[Any, str | None]:
    try:
        return json.loads(body), None
    except json.JSONDecodeError as e:
        return None, f"invalid JSON ({e.msg} at character {e.pos})"


def parse_hermes(text: str) -> list[Call | Malformed]:
    """`<tool_call>{"name": ..., "arguments": {...}}</tool_call>` calls, in order (Hermes,
    Qwen2.5, Qwen3, and the "prompt" format). An opening tag without its closing tag is
    malformed (and ends the parsing)."""
    text = _after_reasoning(text)
    out: list[Call | Malformed] = []
    pos = 0
    while (start := text.find("<tool_call>", pos)) >= 0:
        body_start = start + len("<tool_call>")
        end = text.find("</tool_call>", body_start)
        if end < 0:
            out.append(Malformed(text[start:], "<tool_call> without its closing </tool_call>"))
            break
        source = text[start:end + len("</tool_call>")]
        obj, error = _loads(text[body_start:end].strip())
        out.append(Malformed(source, error) if error else _call_from(obj, source, ("arguments", "parameters")))
        pos = end + len("</tool_call>")
    return out


_LLAMA_CALL = re.compile(r'^\{\s*"name"\s*:')


def parse_llama3(text: str) -> list[Call | Malformed]:
    """Llama 3.1's JSON calls: the message (after an optional `<|python_tag|>`) is
    `{"name": ..., "parameters": {...}}`, or several such objects separated by ";". A
    message that does not start with `{"name":` is an answer (`[]`), unless it follows
    `<|python_tag|>` (Llama's built-in `tool.call(...)` syntax is not supported: malformed)."""
    body = _after_reasoning(text).strip()
    tagged = body.startswith("<|python_tag|>")
    if tagged:
        body = body[len("<|python_tag|>"):].strip()
    if not _LLAMA_CALL.match(body):
        return [Malformed(body, 'after <|python_tag|>: expected a JSON object {"name": ..., "parameters": {...}}')] \
            if tagged else []
    decoder, out, pos = json.JSONDecoder(), [], 0
    while pos < len(body):
        try:
            obj, end = decoder.raw_decode(body, pos)
        except json.JSONDecodeError as e:
            out.append(Malformed(body[pos:], f"invalid JSON ({e.msg} at character {e.pos - pos})"))
            break
        out.append(_call_from(obj, body[pos:end], ("parameters", "arguments")))
        pos = end
        while pos < len(body) and body[pos] in " \t\r\n;":
            pos += 1
    return out


def parse_mistral(text: str) -> list[Call | Malformed]:
    """Mistral's `[TOOL_CALLS][{"name": ..., "arguments": {...}, "id": ...}, ...]` (Nemo,
    7B v0.3): the calls of the JSON list after the marker, in order; one object instead of
    a list is one call. No marker: `[]`."""
    text = _after_reasoning(text)
    start = text.find("[TOOL_CALLS]")
    if start < 0:
        return []
    body = text[start + len("[TOOL_CALLS]"):].lstrip()
    try:
        obj, end = json.JSONDecoder().raw_decode(body)
    except json.JSONDecodeError as e:
        return [Malformed(body, f"invalid JSON after [TOOL_CALLS] ({e.msg} at character {e.pos})")]
    items = obj if isinstance(obj, list) else [obj]
    if not items:
        return [Malformed(body[:end], "an empty list of calls after [TOOL_CALLS]")]
    return [_call_from(item, json.dumps(item, ensure_ascii=False), ("arguments", "parameters")) for item in items]


PARSERS: dict[str, Callable[[str], list]] = {"hermes": parse_hermes, "llama3": parse_llama3,
                                             "mistral": parse_mistral, "prompt": parse_hermes}


def parse_calls(text: str, format: str) -> list[Call | Malformed]:
    """The calls in the policy's `text`, in order, in call format `format` (`FORMATS`)."""
    if format not in PARSERS:
        raise ValueError(f"tool call format {format!r}: expected one of {', '.join(FORMATS)}")
    return PARSERS[format](text)


# ----------------------------------------------------------------------------- running calls


def _table(tools: Iterable[Tool] | Mapping[str, Tool]) -> dict[str, Tool]:
    return dict(tools) if isinstance(tools, Mapping) else {t.name: t for t in tools}


def _run(fn: Callable[..., Any], arguments: dict, timeout_s: float | None, name: str) -> tuple[str, Any]:
    """("ok", result), ("raised", exception) or ("timeout", None): `fn(**arguments)` in a
    daemon thread waited for at most `timeout_s` seconds (None: no limit). A thread still
    running at the timeout cannot be killed; it finishes, or not, in the background."""
    box: dict[str, Any] = {}

    def target():
        try:
            box["value"] = fn(**arguments)
        except BaseException as e:  # noqa: BLE001 - everything a tool raises is an observation
            box["error"] = e

    thread = threading.Thread(target=target, name=f"tool-{name}", daemon=True)
    thread.start()
    thread.join(timeout_s)
    if thread.is_alive():
        return "timeout", None
    return ("raised", box["error"]) if "error" in box else ("ok", box.get("value"))


def _bad_arguments(fn: Callable[..., Any], arguments: dict) -> str | None:
    """Why `fn(**arguments)` cannot be called (missing or unexpected arguments), or None."""
    try:
        inspect.signature(fn).bind(**arguments)
    except TypeError as e:
        return str(e)
    except ValueError:  # no signature (a builtin): let the call itself tell
        return None
    return None


def call_id(call: Call | Malformed, index: int) -> str:
    """The call's own id when it is 9 letters or digits (what Mistral's template requires
    of a tool message), else `call` and the call's index in the turn, 9 characters."""
    given = getattr(call, "id", None)
    if isinstance(given, str) and len(given) == 9 and given.isalnum():
        return given
    return f"call{index:05d}"


def run_calls(calls: Sequence[Call | Malformed], tools: Iterable[Tool] | Mapping[str, Tool],
              timeout_s: float | None = DEFAULT_TIMEOUT_S) -> CallsResult:
    """Runs `calls` in order with `tools` (a list of `Tool`s or a name -> Tool mapping), each
    under `timeout_s` seconds (the module docstring: a timed-out thread cannot be killed).
    One tool message per call, in call order; errors are observations (`ERROR_KINDS`)."""
    table = _table(tools)
    counts = {"calls": 0, **{k: 0 for k in ERROR_KINDS}}
    messages: list[dict] = []
    seconds = 0.0
    for index, call in enumerate(calls):
        counts["calls"] += 1
        name = call.name if isinstance(call, Call) else ""
        kind, content = None, ""
        if isinstance(call, Malformed):
            kind, content = "malformed", f"the tool call could not be read: {call.reason}"
        elif not isinstance(call, Call):
            kind, content = "malformed", f"not a tool call: {type(call).__name__}"
        elif call.name not in table:
            kind, content = "unknown_tool", (f"there is no tool named {call.name!r}; the tools are: "
                                             f"{', '.join(sorted(table)) or '(none)'}")
        elif not isinstance(call.arguments, dict):
            kind, content = "bad_arguments", f"the arguments of {call.name!r} must be a JSON object"
        elif (why := _bad_arguments(table[call.name].fn, call.arguments)) is not None:
            kind, content = "bad_arguments", f"{call.name!r} cannot take these arguments: {why}"
        else:
            start = time.monotonic()
            status, value = _run(table[call.name].fn, call.arguments, timeout_s, call.name)
            seconds += time.monotonic() - start
            if status == "ok":
                content = str(value)
            elif status == "raised":
                kind, content = "raised", f"{call.name!r} raised {type(value).__name__}: {value}"
            else:
                kind, content = "timeout", f"{call.name!r} did not finish within {timeout_s:g} s"
        if kind is not None:
            counts[kind] += 1
            content = f"error: {kind}: {content}"
        messages.append({"role": "tool", "name": name, "content": content, "tool_call_id": call_id(call, index)})
    return CallsResult(messages, counts, seconds)


# ----------------------------------------------------------------------------- the environment


class ToolEnv:
    """A text `Env` of tools and a final-answer check (module docstring).

    Subclass it with class attributes (made with no arguments, once per episode, by the
    engine: `env.cls`), or pass them to the constructor:

        class Calculator(ToolEnv):
            tools = [tool_from_function(add)]
            format = "hermes"                      # FORMATS
            def answer_reward(self, row, text):
                return float(text.strip() == str(row["answer"]))

    `timeout_s`: seconds one call may take; `system_prompt`: instructions placed in the
    system message (after the tool description of the "prompt" format); `prompt_key`: the
    row's field with the user's message (a string) or the first messages (a list).
    """

    tools: Sequence[Tool] = ()
    format: str = "hermes"
    timeout_s: float | None = DEFAULT_TIMEOUT_S
    system_prompt: str = ""
    prompt_key: str = "prompt"

    def __init__(self, tools: Sequence[Tool] | None = None,
                 answer_reward: Callable[[dict, str], float] | None = None, *, format: str | None = None,
                 timeout_s: float | None = None, system_prompt: str | None = None, prompt_key: str | None = None):
        if tools is not None:
            self.tools = list(tools)
        if answer_reward is not None:
            self.answer_reward = answer_reward  # type: ignore[method-assign]
        for key, value in (("format", format), ("timeout_s", timeout_s), ("system_prompt", system_prompt),
                           ("prompt_key", prompt_key)):
            if value is not None:
                setattr(self, key, value)
        if self.format not in FORMATS:
            raise ValueError(f"{type(self).__name__}.format={self.format!r}: expected one of {', '.join(FORMATS)}")
        self.row: dict | None = None
        self.stats: dict[str, float] = {"turns": 0, "tool_calls": 0, "tool_seconds": 0.0,
                                        **{k: 0 for k in ERROR_KINDS}}

    @property
    def tool_schemas(self) -> list[dict] | None:
        """The schemas the chat template is given (`ChatEpisode` reads this); None for the
        "prompt" format, whose tools the system prompt describes."""
        return None if self.format == "prompt" else [t.schema for t in self.tools]

    def answer_reward(self, row: dict, text: str) -> float:
        """The reward of the final answer `text` for `row`; a subclass defines it."""
        raise NotImplementedError(f"{type(self).__name__}: define answer_reward(row, text) -> float")

    def reset(self, row: dict) -> list[dict]:
        self.row = row
        if self.prompt_key not in row:
            raise KeyError(f"the row has no {self.prompt_key!r} field (prompt_key); its fields: {sorted(row)}")
        prompt = row[self.prompt_key]
        messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else [dict(m) for m in prompt]
        system = "\n\n".join(p for p in (tool_prompt(self.tools) if self.format == "prompt" else "",
                                         self.system_prompt) if p)
        if system:
            if messages and messages[0].get("role") == "system":
                messages[0] = {**messages[0], "content": system + "\n\n" + messages[0]["content"]}
            else:
                messages.insert(0, {"role": "system", "content": system})
        return messages

    def step(self, assistant_text: str) -> Step:
        self.stats["turns"] += 1
        calls = parse_calls(assistant_text, self.format)
        if not calls:
            return Step([], float(self.answer_reward(self.row, assistant_text)), True)
        result = run_calls(calls, self.tools, self.timeout_s)
        self.stats["tool_calls"] += result.counts["calls"]
        self.stats["tool_seconds"] += result.seconds
        for kind in ERROR_KINDS:
            self.stats[kind] += result.counts[kind]
        return Step(result.messages, 0.0, False)
