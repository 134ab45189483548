"""Episodes' environments: the contract (`base`), at the text and token levels; a text
environment through a chat template as tokens (`chat`); tools and their call formats
(`tools`)."""

from jaxrlhf.envs.base import (Env, EnvError, EnvLimit, Step, TokenEnv, TokenStep, call, check_ids, check_messages,
                               check_step, check_token_step, close, import_env, import_object, name_of)
from jaxrlhf.envs.chat import ChatEpisode, Delta, render_delta
from jaxrlhf.envs.tools import (Call, CallsResult, Malformed, Tool, ToolEnv, import_tools, parse_calls, run_calls,
                                tool_from_function, tool_prompt)

__all__ = ["Call", "CallsResult", "ChatEpisode", "Delta", "Env", "EnvError", "EnvLimit", "Malformed", "Step",
           "TokenEnv", "TokenStep", "Tool", "ToolEnv", "call", "check_ids", "check_messages", "check_step",
           "check_token_step", "close", "import_env", "import_object", "import_tools", "name_of", "parse_calls",
           "render_delta", "run_calls", "tool_from_function", "tool_prompt"]
