"""Tools: schemas from functions, `import_tools` and `import_env` errors, the call parsers of
each format (several calls a turn, malformed calls), `run_calls` (call order, errors as
observations by kind, the timeout) and `ToolEnv` end to end with a scripted assistant."""

from __future__ import annotations

import sys
import textwrap
import threading
import time

import pytest

from jaxrlhf.envs import Call, Malformed, Step, ToolEnv, import_env, import_tools, tool_from_function, tool_prompt
from jaxrlhf.envs.tools import parse_calls, parse_hermes, parse_llama3, parse_mistral, run_calls


def add(a: int, b: int = 0) -> int:
    """Adds two integers.

    Args:
        a: the first integer
        b: the second integer
    """
    return a + b


def fail(reason: str) -> str:
    """Always raises.

    Args:
        reason: what to say
    """
    raise ValueError(reason)


TOOLS = [tool_from_function(add), tool_from_function(fail)]


def test_tool_from_function_builds_the_templates_schema():
    tool = tool_from_function(add)
    assert tool.name == "add" and tool.fn is add
    assert tool.schema["type"] == "function"
    fn = tool.schema["function"]
    assert fn["name"] == "add" and fn["description"] == "Adds two integers."
    assert fn["parameters"]["properties"]["a"] == {"type": "integer", "description": "the first integer"}
    assert fn["parameters"]["required"] == ["a"]
    assert tool_from_function(add, name="plus").schema["function"]["name"] == "plus"


def test_tool_from_function_names_what_is_missing():
    def no_docstring(a: int):
        return a

    def no_hint(a):
        """X.

        Args:
            a: y
        """

    with pytest.raises(ValueError, match=r"tool .*no_docstring: cannot build its JSON schema.*no docstring"):
        tool_from_function(no_docstring)
    with pytest.raises(ValueError, match=r"no_hint.*missing a type hint"):
        tool_from_function(no_hint)
    with pytest.raises(ValueError, match="a tool must be a function"):
        tool_from_function(3)


@pytest.fixture
def tool_module(tmp_path, monkeypatch):
    (tmp_path / "my_tools.py").write_text(textwrap.dedent('''
        from jaxrlhf.envs import tool_from_function

        def double(x: int) -> int:
            """Doubles.

            Args:
                x: the number
            """
            return 2 * x

        def undocumented(x):
            return x

        prebuilt = tool_from_function(double, name="twice")
        NUMBER = 3

        class MyEnv:
            def reset(self, row):
                return []
    '''))
    (tmp_path / "broken_tools.py").write_text("raise RuntimeError('broken on import')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    yield "my_tools"
    for name in ("my_tools", "broken_tools"):
        sys.modules.pop(name, None)


def test_import_tools(tool_module):
    tools = import_tools("my_tools:double, my_tools:prebuilt")
    assert [t.name for t in tools] == ["double", "twice"]
    assert tools[0].fn(4) == 8
    assert [t.name for t in import_tools(["my_tools:double"])] == ["double"]


@pytest.mark.parametrize("spec, match", [
    ("my_tools.double", r"env\.tools='my_tools\.double': expected an import path 'package\.module:function'"),
    ("my_tools:double,", r"expected comma-separated import paths"),
    ("nowhere_at_all:f", r"module 'nowhere_at_all' does not import \(ModuleNotFoundError"),
    ("broken_tools:f", r"module 'broken_tools' does not import \(RuntimeError: broken on import\)"),
    ("my_tools:missing", r"module 'my_tools' has no attribute 'missing'"),
    ("my_tools:NUMBER", r"'my_tools:NUMBER' is not a function \(int\)"),
    ("my_tools:MyEnv", r"'my_tools:MyEnv' is not a function \(type\)"),
    ("my_tools:undocumented", r"tool undocumented: cannot build its JSON schema"),
    ("my_tools:double,my_tools:double", r"two tools are named double"),
])
def test_import_tools_errors_name_the_field_and_the_path(tool_module, spec, match):
    with pytest.raises(ValueError, match=match):
        import_tools(spec)


def test_import_env_errors(tool_module):
    assert import_env("my_tools:MyEnv").__name__ == "MyEnv"
    with pytest.raises(ValueError, match=r"env\.cls='my_tools': expected an import path 'package\.module:Class'"):
        import_env("my_tools")
    with pytest.raises(ValueError, match=r"module 'nowhere_at_all' does not import"):
        import_env("nowhere_at_all:Env")
    with pytest.raises(ValueError, match=r"has no attribute 'Nope'"):
        import_env("my_tools:Nope")
    with pytest.raises(ValueError, match=r"'double' is a function, not a class"):
        import_env("my_tools:double", field="task.env")


# ----------------------------------------------------------------------------- parsers


def test_hermes_several_calls_in_order_and_malformed_ones():
    text = ('Let me compute.\n<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>\n'
            '<tool_call>{"name": "add", "arguments": "{\\"a\\": 5}"}</tool_call>'
            '<tool_call>{"name": "add", "arguments": {"a": 1,}}</tool_call>'
            '<tool_call>{"arguments": {}}</tool_call>'
            '<tool_call>{"name": "add", "arguments": [1, 2]}</tool_call>'
            '<tool_call>{"name": "fail", "arguments": {"reason": "x"}}')
    calls = parse_hermes(text)
    assert calls[:2] == [Call("add", {"a": 1, "b": 2}), Call("add", {"a": 5})]
    assert [type(c) for c in calls[2:]] == [Malformed] * 4
    assert calls[2].reason.startswith("invalid JSON") and calls[2].text.startswith("<tool_call>")
    assert calls[3].reason == 'the call has no "name" string'
    assert "are a list, not a JSON object" in calls[4].reason
    assert calls[5].reason == "<tool_call> without its closing </tool_call>"
    assert parse_hermes("The answer is 3.") == []
    assert parse_calls(text, "prompt") == calls


def test_reasoning_is_never_parsed():
    text = '<think>\nI could write <tool_call>{"name": "fail"}</tool_call>.\n</think>\n\nThe answer is 3.'
    assert parse_hermes(text) == []
    assert parse_hermes('I think <tool_call>{"name": "x"}</tool_call></think><tool_call>{"name": "add"}</tool_call>') \
        == [Call("add", {})]


def test_llama3_json_calls():
    assert parse_llama3('{"name": "add", "parameters": {"a": 1}}') == [Call("add", {"a": 1})]
    assert parse_llama3('<|python_tag|>{"name": "add", "parameters": {"a": 1}}') == [Call("add", {"a": 1})]
    assert parse_llama3(' {"name": "add", "parameters": {"a": 1}}; {"name": "fail", "arguments": {"reason": "r"}}\n') \
        == [Call("add", {"a": 1}), Call("fail", {"reason": "r"})]
    assert parse_llama3("The answer is 3.") == []
    assert parse_llama3('{"answer": 3}') == []  # JSON that is not a call: an answer
    bad = parse_llama3('{"name": "add", "parameters": {"a": 1}')
    assert len(bad) == 1 and isinstance(bad[0], Malformed) and bad[0].reason.startswith("invalid JSON")
    builtin = parse_llama3('<|python_tag|>brave_search.call(query="x")')
    assert len(builtin) == 1 and isinstance(builtin[0], Malformed) and "after <|python_tag|>" in builtin[0].reason
    two = parse_llama3('{"name": "add", "parameters": {"a": 1}} {"name": "add", "parameters": 5}')
    assert two[0] == Call("add", {"a": 1}) and isinstance(two[1], Malformed)


def test_mistral_calls():
    text = ('[TOOL_CALLS][{"name": "add", "arguments": {"a": 1}, "id": "abcdef123"}, '
            '{"name": "fail", "arguments": "{\\"reason\\": \\"r\\"}"}, {"arguments": {}}]')
    calls = parse_mistral(text)
    assert calls[:2] == [Call("add", {"a": 1}, "abcdef123"), Call("fail", {"reason": "r"})]
    assert isinstance(calls[2], Malformed) and "no \"name\"" in calls[2].reason
    assert parse_mistral('[TOOL_CALLS]{"name": "add", "arguments": {}}') == [Call("add", {})]
    assert parse_mistral("The answer is 3.") == []
    broken = parse_mistral('[TOOL_CALLS][{"name": "add", ')
    assert len(broken) == 1 and "invalid JSON after [TOOL_CALLS]" in broken[0].reason
    assert "empty list" in parse_mistral("[TOOL_CALLS][]")[0].reason


def test_an_unknown_format_is_refused():
    with pytest.raises(ValueError, match="tool call format 'xml': expected one of hermes, llama3, mistral, prompt"):
        parse_calls("", "xml")


def test_tool_prompt_describes_the_tools_and_the_format():
    prompt = tool_prompt(TOOLS)
    assert '"name": "add"' in prompt and '"name": "fail"' in prompt
    assert "<tool_call>" in prompt and "</tool_call>" in prompt


# ----------------------------------------------------------------------------- run_calls


def test_run_calls_answers_in_call_order_with_errors_as_observations():
    calls = [Call("add", {"a": 1, "b": 2}), Malformed("<tool_call>{", "invalid JSON"), Call("nope", {}),
             Call("add", {"c": 1}), Call("add", [1]), Call("fail", {"reason": "boom"}), Call("add", {"a": 40}, "xyz")]
    result = run_calls(calls, TOOLS)
    contents = [m["content"] for m in result.messages]
    assert contents[0] == "3" and contents[6] == "40"
    assert contents[1] == "error: malformed: the tool call could not be read: invalid JSON"
    assert contents[2] == "error: unknown_tool: there is no tool named 'nope'; the tools are: add, fail"
    assert contents[3].startswith("error: bad_arguments: 'add' cannot take these arguments:")
    assert contents[4] == "error: bad_arguments: the arguments of 'add' must be a JSON object"
    assert contents[5] == "error: raised: 'fail' raised ValueError: boom"
    assert [m["role"] for m in result.messages] == ["tool"] * 7
    assert [m["name"] for m in result.messages] == ["add", "", "nope", "add", "add", "fail", "add"]
    assert [m["tool_call_id"] for m in result.messages] == [f"call{i:05d}" for i in range(7)]
    assert result.counts == {"calls": 7, "malformed": 1, "unknown_tool": 1, "bad_arguments": 2, "raised": 1,
                             "timeout": 0}
    assert result.seconds >= 0.0
    assert run_calls([Call("add", {"a": 1}, "abcdef123")], {"add": TOOLS[0]}).messages[0]["tool_call_id"] == \
        "abcdef123"


def test_run_calls_runs_in_order_and_times_out_a_slow_tool():
    order, release = [], threading.Event()

    def record(tag: str) -> str:
        """Records its tag.

        Args:
            tag: the tag
        """
        order.append(tag)
        return tag

    def hang() -> str:
        """Waits until released."""
        release.wait(30)
        return "late"

    tools = [tool_from_function(record), tool_from_function(hang)]
    start = time.monotonic()
    result = run_calls([Call("record", {"tag": "a"}), Call("hang", {}), Call("record", {"tag": "b"})], tools,
                       timeout_s=0.2)
    elapsed = time.monotonic() - start
    release.set()  # the timed-out thread cannot be killed: let it finish
    assert order == ["a", "b"]
    assert [m["content"] for m in result.messages] == ["a", "error: timeout: 'hang' did not finish within 0.2 s", "b"]
    assert result.counts["timeout"] == 1
    assert 0.2 <= elapsed < 5 and result.seconds >= 0.2


# ----------------------------------------------------------------------------- ToolEnv


class Calculator(ToolEnv):
    tools = TOOLS
    system_prompt = "Answer with a number."

    def answer_reward(self, row, text):
        return float(text.strip() == str(row["answer"]))


def test_tool_env_end_to_end_with_a_scripted_assistant():
    env = Calculator()  # made with no arguments, as the engine makes env.cls
    row = {"prompt": "What is 1 + 2 + 3?", "answer": 6}
    assert env.reset(row) == [{"role": "system", "content": "Answer with a number."},
                              {"role": "user", "content": "What is 1 + 2 + 3?"}]
    assert env.tool_schemas == [t.schema for t in TOOLS]
    step = env.step('<tool_call>{"name": "add", "arguments": {"a": 1, "b": 2}}</tool_call>'
                    '<tool_call>{"name": "add", "arguments": {"a": 3}}</tool_call>')
    assert step == Step([{"role": "tool", "name": "add", "content": "3", "tool_call_id": "call00000"},
                         {"role": "tool", "name": "add", "content": "3", "tool_call_id": "call00001"}], 0.0, False)
    step = env.step('<tool_call>{"name": "fail", "arguments": {"reason": "no"}}</tool_call><tool_call>{</tool_call>')
    assert [m["content"].split(":")[1] for m in step.messages] == [" raised", " malformed"] and not step.done
    assert env.step("6") == Step([], 1.0, True)
    assert env.stats["turns"] == 3 and env.stats["tool_calls"] == 4
    assert env.stats["raised"] == 1 and env.stats["malformed"] == 1 and env.stats["timeout"] == 0
    assert env.stats["tool_seconds"] >= 0.0


def test_tool_env_prompt_format_and_message_rows():
    env = ToolEnv(TOOLS, lambda row, text: 0.5, format="prompt")
    assert env.tool_schemas is None
    messages = env.reset({"prompt": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]})
    assert messages[0]["content"] == tool_prompt(TOOLS) + "\n\nBe brief." and messages[1]["content"] == "Hi"
    assert env.reset({"prompt": "Hi"})[0] == {"role": "system", "content": tool_prompt(TOOLS)}
    assert env.step("Hello") == Step([], 0.5, True)
    llama = ToolEnv(TOOLS, lambda row, text: 0.0, format="llama3")
    llama.reset({"prompt": "Hi"})
    assert llama.step('{"name": "add", "parameters": {"a": 2}}').messages[0]["content"] == "2"


def test_tool_env_errors():
    with pytest.raises(ValueError, match=r"ToolEnv\.format='xml'"):
        ToolEnv(TOOLS, format="xml")
    env = ToolEnv(TOOLS)
    with pytest.raises(KeyError, match="no 'prompt' field"):
        env.reset({"question": "Hi"})
    env.reset({"prompt": "Hi"})
    with pytest.raises(NotImplementedError, match="define answer_reward"):
        env.step("an answer")
