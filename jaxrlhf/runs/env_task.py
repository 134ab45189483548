"""The tasks of multi-turn episodes (`Task.episodes`, run by `runs.episode_phase`): the
built-in "calculator" (`data.calculator`) and "env", your own environment class (`env.cls`)
on the rows of JSONL files.

`make_env_factory` reads the `env` section: `env.cls` by import path, made once per
episode (with `env.tools`: `cls(tools=[...])`, an `envs.ToolEnv` subclass), a token
environment as it is, a text one (`step(assistant_text)`) wrapped in `envs.ChatEpisode`
with the task's tokenizer and chat template. `env_task` checks what it can before any work
(the run's workdir is claimed after the task is built, `runs.experiment`): the class
imports, the rows read, and the first training row's prompt renders within
`task.max_prompt_tokens`.
"""

from __future__ import annotations

from jaxrlhf import data, options, rewards
from jaxrlhf.runs import tasks
from jaxrlhf.runs.tasks import Episodes, Task, task_tokenizer, template_kwargs, text_stop_ids


def build_task(cfg, *, model_path: str = "", env=None) -> Task:
    """The task of section `cfg` (`task`), any of them: those of episodes here
    (`tasks.EPISODE_TASKS`; `env`: the `env` section), the others by `tasks.build_task`."""
    if cfg.name == "calculator":
        return calculator(cfg, env)
    if cfg.name == "env":
        return env_task(cfg, env, model_path=model_path)
    return tasks.build_task(cfg, model_path=model_path, env=env)


def episode_reward(tokenizer) -> rewards.Reward:
    """The reward of an episode task: the environment's episode reward, handed to the host
    component "env" as the extra `env_reward` (`runs.episode_phase`; logged as `reward/env`)."""
    return rewards.host_reward(lambda prompts, responses, ex: [float(x) for x in ex["env_reward"]], tokenizer,
                               name="env")


def _episodes(env, make_env, rows, test_rows, stop_ids) -> Episodes:
    """`Episodes` with the limits of the `env` section (`sections.EnvSection`; None: its defaults)."""
    e = _env_section(env)
    return Episodes(make_env=make_env, rows=rows, test_rows=test_rows, stop_ids=tuple(stop_ids),
                    max_turns=e.max_turns, max_turn_tokens=e.max_turn_tokens, max_total_tokens=e.max_total_tokens,
                    max_env_tokens=e.max_env_tokens, cut_reward=e.cut_reward)


def _env_section(env):
    """`sections.EnvSection` of the `env` section (None: its defaults), built and checked by
    `options.build` as every section is."""
    from jaxrlhf.runs.sections import EnvSection

    return options.build(EnvSection, env or {}, "env.")


def _is_text_env(cls) -> bool:
    """Whether environment class `cls` is a text one (`step(assistant_text)`) rather than a
    token one (`step(action_ids, cut)`), read from its `step`'s signature."""
    import inspect

    try:
        params = [p for p in inspect.signature(cls.step).parameters.values()
                  if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)][1:]  # without self
    except (TypeError, ValueError, AttributeError):
        raise ValueError(f"env.cls={cls!r}: an environment class needs a step method") from None
    if len(params) not in (1, 2):
        raise ValueError(f"env.cls: {cls.__qualname__}.step takes {len(params)} arguments; expected step("
                         "assistant_text) (a text environment) or step(action_ids, cut) (a token environment)")
    return len(params) == 1


def make_env_factory(env, *, default=None, tokenizer=None, template_kwargs=None, template_timeout=10.0):
    """`(make_env, stop_ids or None)` of the `env` section: `env.cls` (else `default`), made
    with `env.tools` when given (`cls(tools=[...])`) and `env.tool_timeout` when set
    (`timeout_s=`, an `envs.ToolEnv` subclass); a text environment wrapped in
    `envs.ChatEpisode` with `tokenizer`, `template_kwargs`, `template_timeout` (seconds per
    rendering) and `env.max_env_chars`. `stop_ids`: the class's own `stop_ids` attribute,
    if any."""
    from jaxrlhf import envs as envs_lib

    e = _env_section(env)
    if not e.cls and default is None:
        raise ValueError("env.cls is empty: task.name='env' runs your environment class, 'pkg.mod:Class'")
    cls = envs_lib.import_env(e.cls) if e.cls else default
    kwargs = {}
    if e.tools.strip():
        kwargs["tools"] = envs_lib.import_tools(e.tools)
    if e.tool_timeout is not None:
        if not issubclass(cls, envs_lib.ToolEnv):
            raise ValueError(f"env.tool_timeout={e.tool_timeout}: env.cls={e.cls!r} is not an envs.ToolEnv subclass, "
                             "whose tool calls it limits; unset it (None)")
        kwargs["timeout_s"] = float(e.tool_timeout)

    def base():
        return cls(**kwargs)

    if not _is_text_env(cls):
        return base, getattr(cls, "stop_ids", None)
    if not hasattr(tokenizer, "apply_chat_template"):
        raise ValueError(f"env.cls={e.cls!r} is a text environment: it needs a Hugging Face tokenizer with a chat "
                         "template (model.path or task.tokenizer_path)")
    return (lambda: envs_lib.ChatEpisode(base(), tokenizer, template_kwargs=template_kwargs,
                                         timeout=template_timeout, max_env_chars=e.max_env_chars)), None


def check_first_row(make_env, row: dict, max_prompt_tokens: int, field: str = "task.path") -> None:
    """One environment of `make_env` reset with `row`, the first training row, before any
    work: what its `reset` raises (a missing field, a template that cannot render the
    messages) stops the run there, and so does a prompt over `max_prompt_tokens`."""
    from jaxrlhf import envs as envs_lib

    environment = make_env()
    try:
        n = len(environment.reset(row))
    finally:
        envs_lib.close(environment)
    if n > max_prompt_tokens:
        raise ValueError(f"{field}: the first row's prompt (the environment's reset, through the chat template for a "
                         f"text environment) has {n} tokens, over task.max_prompt_tokens={max_prompt_tokens}: raise it")


def _rows(path: str, field: str) -> list:
    """The rows of JSONL file `path` (the field `field` names it); a bad row is an error."""
    if not path:
        raise ValueError(f"{field} is empty: give a JSONL file of rows, one per episode")
    rows = []
    for location, record in data.read_records(path):
        if not isinstance(record, dict):
            raise ValueError(f"{field}: {location} is not a JSON object ({record})")
        rows.append(record)
    if not rows:
        raise ValueError(f"{field}={path!r}: no rows")
    return rows


def env_task(cfg, env=None, *, model_path: str = "") -> Task:
    """Your environment (`env.cls`) on the rows of `task.path` / `task.test_path`: the
    reward is the episode's; a text environment runs through the tokenizer's chat template
    (`envs.ChatEpisode`). No tokenizer folder: the calculator's character tokenizer."""
    from jaxrlhf.data import calculator as calc

    folder = cfg.tokenizer_path or model_path
    tok = task_tokenizer(cfg, folder) if folder else calc.TOKENIZER
    make_env, stops = make_env_factory(env, tokenizer=tok, template_kwargs=template_kwargs(cfg.chat_template_kwargs),
                                       template_timeout=cfg.get("chat_template_timeout", 10.0))
    if folder:
        stops = stops or text_stop_ids(tok, folder, cfg.get("stop_tokens", ""))
        pad_id = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
        vocab, bos, eos = len(tok), tok.bos_token_id, tok.eos_token_id
        decode = lambda ids: tok.decode(ids, skip_special_tokens=True)
    else:
        stops = stops or (data.EOS_ID,)
        pad_id, vocab, bos, eos = data.PAD_ID, tok.vocab_size, data.BOS_ID, data.EOS_ID
        decode = lambda ids: tok.decode(ids, stop_at_eos=False)
    episodes = _episodes(env, make_env, _rows(cfg.path, "task.path"), _rows(cfg.test_path, "task.test_path"), stops)
    check_first_row(make_env, episodes.rows[0], cfg.max_prompt_tokens)
    return Task(name="env", tokenizer=tok, vocab_size=vocab, pad_id=pad_id, bos_id=bos, eos_id=eos,
                prompt_len=cfg.max_prompt_tokens, response_len=episodes.max_total_tokens, sft=None, prompts={},
                test_prompts={}, pairs=None, test_pairs=None, reward=episode_reward(tok), extra_keys=(),
                decode=decode, stop_ids=tuple(stops), episodes=episodes)


def calculator(cfg, env=None) -> Task:
    """Sums of several numbers with a calculator, in episodes (`data.calculator`): SFT on the
    expert's demonstrations, GRPO on the environment's reward (exact match of the final answer)."""
    from jaxrlhf.data import calculator as calc

    task = calc.CalculatorTask(num_terms=cfg.num_terms, num_digits=cfg.num_digits, memory_rate=cfg.memory_rate)
    tok = calc.TOKENIZER
    train = calc.make_rows(task, cfg.num_train, split="train", seed=cfg.seed)
    test = calc.make_rows(task, cfg.num_test, split="test", seed=cfg.seed + 1)
    make_env, _ = make_env_factory(env, default=calc.CalculatorEnv)
    episodes = _episodes(env, make_env, train, test, calc.STOP_IDS)
    if episodes.max_total_tokens < task.episode_len:
        raise ValueError(f"env.max_total_tokens={episodes.max_total_tokens} is shorter than the expert's longest "
                         f"episode ({task.episode_len} tokens for task.num_terms={cfg.num_terms}, "
                         f"num_digits={cfg.num_digits}); raise it")
    return Task(
        name="calculator", tokenizer=tok, vocab_size=tok.vocab_size, pad_id=data.PAD_ID, bos_id=data.BOS_ID,
        eos_id=data.EOS_ID, prompt_len=task.prompt_len, response_len=episodes.max_total_tokens,
        sft=calc.sft_arrays(task, train), prompts=calc.prompt_arrays(task, train),
        test_prompts=calc.prompt_arrays(task, test), pairs=None, test_pairs=None, reward=episode_reward(tok),
        extra_keys=(), decode=lambda ids: tok.decode(ids, stop_at_eos=False), stop_ids=calc.STOP_IDS,
        episodes=episodes)
