"""The environment contract: what an episode's environment is, at the text and token levels.

An episode is one conversation between the policy and an environment (a tool, a user, a
grader): the environment gives the first messages, the policy writes a turn, the
environment answers with new messages, a reward and whether the episode is over, and so on.
A user writes the text level; the library turns it into tokens
(`envs.chat.ChatEpisode`), and the episode engine (`rollout.episodes`) runs the token level.

Text level (`Env`), one instance per episode, made with no arguments:

    class MyEnv:
        def reset(self, row: dict) -> list[dict]: ...     # the first chat messages
        def step(self, assistant_text: str): ...          # -> Step(messages, reward, done)
        def close(self): ...                              # optional, always called

`step` returns a `Step` or a plain `(messages, reward, done)` tuple: the messages that
follow the assistant's turn (a tool result, a user's reply; `[]` when done), the reward of
this step (an episode's reward is the sum of its steps'), and whether the episode ended.
Each of a GRPO group's G episodes has its own instance, reset with the same row.

Token level (`TokenEnv`), for environments that want ids (the engine's own contract):

    class MyTokenEnv:
        def reset(self, row: dict) -> list[int]: ...                    # the prompt's ids
        def step(self, action_ids: list[int], cut: bool): ...            # -> TokenStep(ids, reward, done)
        def close(self): ...

`action_ids` are the tokens the policy sampled in this turn, exactly as sampled, the stop
token that ended the turn included; `cut` is True when the turn ended at the per-turn
token limit instead (no stop token). `TokenStep.ids` are the environment's tokens that
follow them in the episode's sequence (context the policy reads; never trained on).

Errors: `EnvError`, an environment that broke the contract (raised, returned a wrong type),
naming its class and method; `EnvLimit(kind, message)`, an episode stopped by one of its
limits (`kind="env_tokens"`: an observation over its size), which the engine counts as cut.
"""

from __future__ import annotations

from typing import Any, NamedTuple, Protocol, runtime_checkable

from jaxrlhf import imports


class Step(NamedTuple):
    """What a text environment's `step` returns: the messages that follow the assistant's
    turn, this step's reward, and whether the episode is over."""

    messages: list[dict]
    reward: float
    done: bool


class TokenStep(NamedTuple):
    """What a token environment's `step` returns: the environment's token ids that follow
    the policy's turn (context, mask 0), this step's reward, and whether the episode is over."""

    ids: list[int]
    reward: float
    done: bool


@runtime_checkable
class Env(Protocol):
    """An episode's environment at the text level (module docstring)."""

    def reset(self, row: dict) -> list[dict]: ...

    def step(self, assistant_text: str) -> Step: ...


@runtime_checkable
class TokenEnv(Protocol):
    """An episode's environment at the token level (module docstring)."""

    def reset(self, row: dict) -> list[int]: ...

    def step(self, action_ids: list[int], cut: bool) -> TokenStep: ...


class EnvError(RuntimeError):
    """An environment broke its contract (raised, returned a wrong type): the message names
    the environment's class and the method."""


class EnvLimit(Exception):
    """An episode stopped by one of its limits, not by a bug: `kind` names the limit
    (`"env_tokens"`: an environment's observation over its size limit, refused before it is
    tokenised). The engine ends the episode there and counts it as cut by that limit."""

    def __init__(self, kind: str, message: str):
        super().__init__(message)
        self.kind = kind


def name_of(env: Any) -> str:
    """`package.module:Class` of an environment instance (for messages)."""
    cls = type(env)
    return f"{cls.__module__}:{cls.__qualname__}"


def import_object(spec: str, field: str, what: str = "package.module:name") -> Any:
    """The object at import path `spec` ("package.module:name", dotted attributes allowed);
    a ValueError naming `field` and `spec` when the path is not of that form, the module
    does not import or has no such attribute (`jaxrlhf.imports`)."""
    return imports.import_object(spec, label=f"{field}={spec!r}", what=what)


def import_env(spec: str, field: str = "env.cls") -> type:
    """The class at import path `spec` ("package.module:Class"); a ValueError naming `field`
    and `spec` when it does not import, has no such attribute or is not a class."""
    obj = import_object(spec, field, "package.module:Class")
    if not isinstance(obj, type):
        attr = str(spec).strip().partition(":")[2]
        raise ValueError(f"{field}={spec!r}: {attr!r} is a {type(obj).__name__}, not a class "
                         "(an environment class, made with no arguments once per episode)")
    return obj


def _reward(env: Any, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) and not hasattr(value, "__float__"):
        raise EnvError(f"{name_of(env)}.step returned reward {value!r} ({type(value).__name__}); expected a number")
    r = float(value)
    if r != r or r in (float("inf"), float("-inf")):
        raise EnvError(f"{name_of(env)}.step returned reward {r}; expected a finite number")
    return r


def check_step(env: Any, result: Any) -> Step:
    """A text environment's `step` result as a `Step`, or an `EnvError` naming the class
    when it is not a `(messages, reward, done)` triple of a list of `{"role", "content"}`
    dicts, a finite number and a bool."""
    if not isinstance(result, tuple) or len(result) != 3:
        raise EnvError(f"{name_of(env)}.step returned {type(result).__name__} {str(result)[:80]!r}; expected "
                       "Step(messages, reward, done) or a (messages, reward, done) tuple")
    messages, reward, done = result
    return Step(check_messages(env, "step", messages), _reward(env, reward), _done(env, done))


def check_token_step(env: Any, result: Any) -> TokenStep:
    """A token environment's `step` result as a `TokenStep` (ids a list of ints), or an
    `EnvError` naming the class."""
    if not isinstance(result, tuple) or len(result) != 3:
        raise EnvError(f"{name_of(env)}.step returned {type(result).__name__} {str(result)[:80]!r}; expected "
                       "TokenStep(ids, reward, done) or an (ids, reward, done) tuple")
    ids, reward, done = result
    return TokenStep(check_ids(env, "step", ids), _reward(env, reward), _done(env, done))


def _done(env: Any, done: Any) -> bool:
    if not isinstance(done, bool) and type(done).__name__ != "bool_":
        raise EnvError(f"{name_of(env)}.step returned done={done!r} ({type(done).__name__}); expected a bool")
    return bool(done)


def check_messages(env: Any, method: str, messages: Any) -> list[dict]:
    """`messages` when it is a list of dicts with a string `role` and a string `content`
    (other keys, e.g. `tool_calls`, `name`, are kept); else an `EnvError`."""
    if not isinstance(messages, list):
        raise EnvError(f"{name_of(env)}.{method} returned {type(messages).__name__} {str(messages)[:80]!r} as its "
                       "messages; expected a list of {'role': ..., 'content': ...} dicts")
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str) or not isinstance(m.get("content", ""), str):
            raise EnvError(f"{name_of(env)}.{method}: message {i} is {str(m)[:80]!r}; expected a dict with a "
                           "string 'role' and a string 'content'")
    return messages


def check_ids(env: Any, method: str, ids: Any) -> list[int]:
    """`ids` as a list of Python ints, or an `EnvError` naming the class and method."""
    try:
        out = [int(i) for i in ids]
    except (TypeError, ValueError) as e:
        raise EnvError(f"{name_of(env)}.{method} returned {str(ids)[:80]!r} as token ids; expected a list of "
                       f"ints ({e})") from e
    if any(isinstance(i, bool) for i in ids) or any(i < 0 for i in out):
        raise EnvError(f"{name_of(env)}.{method} returned token ids {str(ids)[:80]!r}; expected non-negative ints")
    return out


def call(env: Any, method: str, *args: Any) -> Any:
    """`env.<method>(*args)`; what the environment's own code raises becomes an `EnvError`
    naming its class and the method, the original as its `__cause__` (an `EnvError` or an
    `EnvLimit` passes through)."""
    try:
        return getattr(env, method)(*args)
    except (EnvError, EnvLimit):
        raise
    except Exception as e:  # noqa: BLE001 - the user's code: anything it raises is its contract broken
        raise EnvError(f"{name_of(env)}.{method} raised {type(e).__name__}: {e}") from e


def close(env: Any) -> None:
    """`env.close()` when the environment has one, through `call` (what it raises is an
    `EnvError` naming the class)."""
    if callable(getattr(env, "close", None)):
        call(env, "close")
