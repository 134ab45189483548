"""Tasks a run trains on: the data arrays and the reward (the held-out evaluation that
decodes and scores them is `runs.held_out`).

"addition" is the built-in task (no downloads): multi-digit addition with a character
tokenizer and an exact answer. "jsonl" reads prompts/answers, SFT examples or preference
pairs (`task.kind`) from local JSONL/Parquet files and TFDS datasets, mixed by weight
(`data.sources`), with a Hugging Face tokenizer, and scores answers on the host with
`data.final_answer_reward` (GSM8K-style "#### 42", `\\boxed{}` or the last number); every
other field of a row travels with its prompt as a reward extra. The config's `reward`
section adds Python rewards by import path to any task's own (`with_python_rewards`).
"calculator" is the built-in multi-turn tool task (`data.calculator`): its reward is an
episode's (`Task.episodes`), the environment's, run by `runs.episode_phase`; "env" runs
your own environment class (`env.cls`) on the rows of JSONL files the same way (both built
by `runs.env_task`).
"word_problems" generates one-digit arithmetic questions in words for a real chat model
(`data.make_word_problems`), scored the same way, plus an optional answer-format reward.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

import jax.numpy as jnp
import numpy as np

from jaxrlhf import data, reward_workers, rewards
from jaxrlhf.data import chat
from jaxrlhf.algorithms.guide import GUIDE_KEYS
from jaxrlhf.rollout import stop_strings
from jaxrlhf.rollout.sampler import SampleOutput, until_stop


@dataclasses.dataclass
class Episodes:
    """What a task of multi-turn episodes adds (`runs.episode_phase`): `make_env()` makes one
    environment (a `envs.TokenEnv`) per episode, reset with a row of `rows` (training) or
    `test_rows` (held out); `stop_ids` end a policy turn; the limits and `cut_reward` are
    the `env` section's (`rollout.episodes.run_episodes`)."""

    make_env: Callable[[], Any]
    rows: list
    test_rows: list
    stop_ids: tuple[int, ...]
    max_turns: int
    max_turn_tokens: int
    max_total_tokens: int
    max_env_tokens: int
    cut_reward: float = 0.0


@dataclasses.dataclass
class Task:
    """Everything algorithm runners need from a task.

    sft: whole-set SFT arrays (`tokens`, `input_mask`, `loss_mask`, ...), or None.
    prompts / test_prompts: `prompt_ids`, `prompt_mask` `[N, P]` plus reward extras.
    pairs / test_pairs: preference arrays (`data.preference_batch` layout), or None.
    reward: the `rewards.Reward` of a response.
    final_answer: `(response_ids [N, T], response_mask [N, T]) -> N` hashable answers (None:
      no answer), what sampled evaluation's majority vote (maj@k) compares; default: the
      response's valid tokens up to EOS, None for a response without EOS.
    stop_ids: every token id that ends a response (`eos_id` first), what the samplers stop
      on and the rewards cut at: a text task adds its checkpoint's `generation_config.json`
      `eos_token_id` list and `task.stop_tokens` (`text_stop_ids`).
    stop_strings: text that ends a response (`task.stop_strings`), cut on the host after
      sampling (`cut`: the rule of `rollout.stop_strings`); () = none.
    episodes: a task of multi-turn episodes (`Episodes`): GRPO runs them and the held-out
      evaluation is greedy episodes (`runs.episode_phase`); `reward` is then the
      environment's episode reward (the host component "env"). None: single responses.
    """

    name: str
    tokenizer: Any
    vocab_size: int
    pad_id: int
    bos_id: int | None
    eos_id: int
    prompt_len: int
    response_len: int
    sft: dict | None
    prompts: dict
    test_prompts: dict
    pairs: dict | None
    test_pairs: dict | None
    reward: rewards.Reward
    extra_keys: tuple[str, ...]
    decode: Callable[[np.ndarray], str]
    final_answer: Callable[[np.ndarray, np.ndarray], list] | None = None
    stop_ids: tuple[int, ...] = ()
    stop_strings: tuple[str, ...] = ()
    episodes: Episodes | None = None

    def __post_init__(self):
        if not self.stop_ids:
            object.__setattr__(self, "stop_ids", (self.eos_id,))

    def cut(self, out: SampleOutput) -> SampleOutput:
        """Sampled responses (host arrays) cut at the task's stop strings
        (`rollout.stop_strings.cut`); `out` itself when the task has none."""
        if not self.stop_strings:
            return out
        return stop_strings.cut(out, self.tokenizer, self.stop_strings, pad_id=self.pad_id)

    def reference_keys(self, field: str) -> tuple[str, ...]:
        """The prompts' reference completions (`guide.GUIDE_KEYS`, right-padded ids and mask)
        that `field` (a config setting that learns them) needs beside the reward's extras; a
        task without them is a ValueError naming `field`."""
        missing = [k for k in GUIDE_KEYS if k not in self.prompts]
        if missing:
            raise ValueError(f"{field} learns the reference completions of the prompts, but task {self.name!r} has "
                             f"none (no {missing} arrays): turn {field.split('=')[0]} off, or use a task with "
                             "reference completions (the built-in addition task)")
        return tuple(k for k in GUIDE_KEYS if k not in self.extra_keys)

    def answers(self, response_ids_NxT, response_mask_NxT) -> list:
        """The final answer of each response (`final_answer`, or its default)."""
        if self.final_answer is not None:
            return list(self.final_answer(response_ids_NxT, response_mask_NxT))
        return [tuple(v) if done else None
                for v, done in _until_eos(response_ids_NxT, response_mask_NxT, self.stop_ids)]


def _until_eos(response_ids_NxT, response_mask_NxT, eos_id) -> list[tuple[list, bool]]:
    """(valid token ids before the first EOS, whether there was one) of each response."""
    out = []
    for row, m in zip(np.asarray(response_ids_NxT), np.asarray(response_mask_NxT).astype(bool)):
        out.append(until_stop(row[m].tolist(), eos_id))
    return out


def addition(cfg) -> Task:
    task = data.AdditionTask(num_digits=cfg.num_digits, reverse_answer=cfg.reverse_answer)
    tok = data.CharTokenizer()
    train = data.make_problems(task, cfg.num_train, split="train", seed=cfg.seed)
    test = data.make_problems(task, cfg.num_test, split="test", seed=cfg.seed + 1)
    exact = rewards.jax_reward(
        lambda ids, mask, ex: data.exact_match_reward(ids, mask, ex["answer_ids"], ex["answer_mask"],
                                                      eos_id=data.EOS_ID), name="exact_match")
    reward = exact
    if cfg.partial_credit > 0:
        partial = rewards.jax_reward(
            lambda ids, mask, ex: data.token_match_reward(ids, mask, ex["answer_ids"], ex["answer_mask"],
                                                          eos_id=data.EOS_ID), name="token_match")
        reward = rewards.combine([(1.0, exact), (cfg.partial_credit, partial)])
    if cfg.length_bonus > 0:  # a deliberately misspecified reward: it pays for length
        length = rewards.jax_reward(lambda ids, mask, ex: jnp.mean(jnp.asarray(mask, jnp.float32), axis=-1),
                                    name="length")
        reward = rewards.combine([(1.0, reward), (cfg.length_bonus, length)])
    pairs = test_pairs = None
    if cfg.num_pairs:
        pairs = data.preference_arrays(task, data.make_preference_pairs(
            task, data.make_problems(task, cfg.num_pairs, split="train", seed=cfg.seed + 2), seed=cfg.seed))
        test_pairs = data.preference_arrays(task, data.make_preference_pairs(task, test, seed=cfg.seed + 3))
    return Task(
        name="addition", tokenizer=tok, vocab_size=tok.vocab_size, pad_id=data.PAD_ID, bos_id=data.BOS_ID,
        eos_id=data.EOS_ID, prompt_len=task.prompt_len, response_len=task.response_len,
        sft=data.sft_arrays(task, train), prompts=data.rl_arrays(task, train), test_prompts=data.rl_arrays(task, test),
        pairs=pairs, test_pairs=test_pairs, reward=reward, extra_keys=("answer_ids", "answer_mask"),
        decode=lambda ids: tok.decode(ids),
        # the text up to EOS, special tokens written out: equal answers <=> equal exact match
        final_answer=lambda ids, mask: [tok.decode(v, skip_special_tokens=False) if done else None
                                        for v, done in _until_eos(ids, mask, data.EOS_ID)])


def _objects(values: list) -> np.ndarray:
    """A 1-D object array of `values` as they are (lists stay one entry each)."""
    out = np.empty(len(values), dtype=object)
    for i, v in enumerate(values):
        out[i] = v
    return out


_RESERVED = ("prompt_ids", "prompt_mask", "answer")  # the task's own arrays: a row field of that name is not kept


def _field_names(*prompts: data.PromptData) -> tuple[str, ...]:
    """The row fields a text task hands its rewards: every field of any row (train or
    test), but the prompt's and the reserved names."""
    return tuple(sorted({k for p in prompts for f in p.fields for k in f} - set(_RESERVED)))


def _prompt_arrays(prompts: data.PromptData, prompt_len: int, pad_id: int, field_names: tuple[str, ...]) -> dict:
    """Left-padded prompts, the answer text, and one object array per row field (None
    where a row lacks it): the reward extras of a text task."""
    ids, mask = data.left_pad(prompts.prompt_ids, prompt_len, pad_id=pad_id)
    fields = {k: _objects([f.get(k) for f in prompts.fields]) for k in field_names}
    return dict(fields, prompt_ids=ids, prompt_mask=mask, answer=_objects(prompts.answer))


def text_stop_ids(tok, folder: str, stop_tokens: str = "") -> tuple[int, ...]:
    """The ids that end a chat model's response: the tokenizer's EOS, the `eos_token_id`
    (one id or a list, e.g. Qwen's `<|im_end|>` and `<|endoftext|>`) of `folder`'s
    `generation_config.json` if it has one, and `stop_tokens` ("<|eot_id|>,128001": token
    strings or ids, comma-separated; `task.stop_tokens`), in that order, each once. A
    truncated `generation_config.json` is a `CheckpointError` naming it."""
    from jaxrlhf.models import load_generation_config

    ids = [tok.eos_token_id]
    if folder:
        eos = load_generation_config(folder).get("eos_token_id")
        ids += eos if isinstance(eos, list) else [eos]
    vocab = tok.get_vocab()
    for item in (s.strip() for s in stop_tokens.split(",")):
        if not item:
            continue
        if item.isdigit() and int(item) < len(tok):
            ids.append(int(item))
        elif item in vocab:
            ids.append(vocab[item])
        else:
            raise ValueError(f"task.stop_tokens: {item!r} is neither a token of the tokenizer nor an id below "
                             f"{len(tok)}; give token strings (e.g. '<|endoftext|>') or ids, comma-separated")
    return tuple(dict.fromkeys(int(i) for i in ids if i is not None))


def _text_task(name: str, tok, train: data.PromptData, test: data.PromptData, cfg, *, source: str,
               folder: str, format_weight: float = 0.0, min_prompt_len: int = 0) -> Task:
    """A task on text prompts with reference answers: a Hugging Face tokenizer, and on the
    host the exact-answer reward (`data.final_answer_reward`, the evaluation's accuracy),
    plus `format_weight` × `data.answer_format_reward` when that weight is > 0. Responses
    end at any of `text_stop_ids(tok, folder, cfg.stop_tokens)`, and are cut after the
    first of `cfg.stop_strings` (`Task.cut`). The prompts are padded to at least
    `min_prompt_len` (other phases' prompts share the width)."""
    if not train.prompt_ids or not test.prompt_ids:
        raise ValueError(f"{source}: no usable prompts (train: {train.skipped}; test: {test.skipped})")
    prompt_len = max(min_prompt_len, *(len(x) for x in train.prompt_ids + test.prompt_ids))
    pad_id = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
    stops = text_stop_ids(tok, folder, cfg.get("stop_tokens", ""))
    reward = rewards.host_reward(lambda prompts, responses, ex: data.final_answer_reward(responses, ex["answer"]),
                                 tok, name="exact_answer", eos_id=stops)
    if format_weight > 0:
        fmt = rewards.host_reward(lambda prompts, responses, ex: data.answer_format_reward(responses), tok,
                                  name="format", eos_id=stops)
        reward = rewards.combine([(1.0, reward), (float(format_weight), fmt)])
    fields = _field_names(train, test)
    return Task(
        name=name, tokenizer=tok, vocab_size=len(tok), pad_id=pad_id, bos_id=tok.bos_token_id,
        eos_id=tok.eos_token_id, prompt_len=prompt_len, response_len=cfg.max_new_tokens, sft=None,
        prompts=_prompt_arrays(train, prompt_len, pad_id, fields),
        test_prompts=_prompt_arrays(test, prompt_len, pad_id, fields),
        pairs=None, test_pairs=None, reward=reward, extra_keys=("answer", *fields),
        decode=lambda ids: tok.decode(ids, skip_special_tokens=True),
        # what `final_answer_reward` compares: the extracted final answer of the text before EOS
        final_answer=lambda ids, mask: [data.extract_final_answer(tok.decode(v, skip_special_tokens=True))
                                        for v, _ in _until_eos(ids, mask, stops)],
        stop_ids=stops, stop_strings=stop_strings.parse(cfg.get("stop_strings", "")))


def task_tokenizer(cfg, tokenizer_path: str):
    """The task's Hugging Face tokenizer with its own chat template kept: `task.chat_template`
    decides only whether prompts are rendered through it, and the exported model's
    tokenizer (`workdir/export`) carries the template of the source checkpoint — so the
    names of its extra templates are checked here (`chat.check_template_names`), not at
    the export."""
    from jaxrlhf.models import load_tokenizer

    if not tokenizer_path:
        raise ValueError(f"task.name={cfg.name!r} needs a tokenizer: set model.path (or task.tokenizer_path) to a "
                         "Hugging Face checkpoint folder, e.g. one `python -m jaxrlhf.models.gguf` writes")
    tok = load_tokenizer(tokenizer_path)
    chat.check_template_names(tok, "task.tokenizer_path" if cfg.get("tokenizer_path") else "model.path")
    return tok


KINDS = ("prompts", "sft", "pairs")


def template_kwargs(value: str) -> dict:
    """`task.chat_template_kwargs`, a JSON object string ('{"enable_thinking": false}'), as
    the keyword arguments of every `apply_chat_template` call; "" = none."""
    import json

    if not value.strip():
        return {}
    try:
        kwargs = json.loads(value)
    except json.JSONDecodeError as e:
        kwargs = e
    if not isinstance(kwargs, dict):
        raise ValueError(f"task.chat_template_kwargs={value!r} is not a JSON object; give one, e.g. "
                         """--config.task.chat_template_kwargs='{"enable_thinking": false}'""")
    return kwargs


def _record_options(cfg) -> dict:
    """The options every records parser of a text task takes from its config section."""
    return dict(max_prompt_tokens=cfg.max_prompt_tokens, chat_template=cfg.chat_template,
                system_prompt=cfg.system_prompt or None, long_prompts=cfg.long_prompts,
                chat_template_kwargs=template_kwargs(cfg.chat_template_kwargs),
                chat_template_timeout=cfg.get("chat_template_timeout", chat.DEFAULT_TIMEOUT))


def _file_parser(cfg, tok, kind: str):
    """`parse(records, source)` of a `jsonl` task's rows of `kind`, the section's options bound."""
    common = dict(_record_options(cfg), on_error=cfg.on_error)
    if kind == "prompts":
        return lambda records, source: data.prompts_from_records(
            records, tok, prompt_key=cfg.prompt_key, answer_key=cfg.answer_key, source=source, **common)
    if kind == "sft":
        return lambda records, source: data.sft_from_records(
            records, tok, messages_key=cfg.messages_key, prompt_key=cfg.prompt_key, completion_key=cfg.completion_key,
            max_response_tokens=cfg.max_response_tokens, eos_id=tok.eos_token_id, source=source, **common)
    return lambda records, source: data.pairs_from_records(
        records, tok, prompt_key=cfg.prompt_key, chosen_key=cfg.chosen_key, rejected_key=cfg.rejected_key,
        max_response_tokens=cfg.max_response_tokens, source=source, **common)


def _bounds(cfg) -> dict:
    """`task.max_row_bytes` / `task.max_file_bytes` as the readers' limits (None: none)."""
    return dict(max_row_bytes=cfg.max_row_bytes, max_file_bytes=cfg.max_file_bytes)


def _as_prompts(rows) -> data.PromptData:
    """The prompts of SFT examples or pairs, for held-out evaluation: the reference answer
    is the completion (the first assistant turn) or the chosen response."""
    answers = rows.answer if isinstance(rows, data.SFTData) else rows.chosen_text
    return data.PromptData(prompt_text=rows.prompt_text, prompt_ids=rows.prompt_ids, answer=list(answers),
                           location=rows.location, fields=[{} for _ in rows.location], skipped=rows.skipped)


def _pair_arrays(pairs: data.PairData, prompt_len: int, pad_id: int, eos_id: int | None) -> dict:
    """`data.preference_batch` of all pairs, `eos_id` appended (None: chat-rendered
    responses end with their template's end-of-turn marker already)."""
    extra = int(eos_id is not None)
    response_len = max(len(x) for x in pairs.chosen_ids + pairs.rejected_ids) + extra
    return data.preference_batch(pairs.prompt_ids, pairs.chosen_ids, pairs.rejected_ids, prompt_len=prompt_len,
                                 response_len=response_len, pad_id=pad_id, eos_id=eos_id)


def jsonl(cfg, *, tokenizer_path: str) -> Task:
    """Rows from JSONL/Parquet files and TFDS datasets (`data.read_mixture`: `task.path`, a
    spec of sources mixed by weight), a Hugging Face tokenizer, and a host-side
    exact-answer reward (`data.final_answer_reward`). `task.kind` says what a row is:
    "prompts" (prompt and reference answer, GRPO/PPO), "sft" (a `messages` chat, or prompt
    and completion: `task.sft`) or "pairs" (prompt, chosen, rejected: `task.pairs`); the
    held-out evaluation of the last two decodes their prompts and compares the final answer
    with the completion's / the chosen response's."""
    kind = cfg.kind
    if kind not in KINDS:
        raise ValueError(f"task.kind={kind!r}; expected one of {KINDS} (prompts: GRPO/PPO, sft: SFT examples, "
                         "pairs: preference pairs for DPO and reward-model training)")
    tok = task_tokenizer(cfg, tokenizer_path)
    parse = _file_parser(cfg, tok, kind)
    test_field = "task.test_path" if cfg.test_path else "task.path"
    train = data.read_mixture(cfg.path, parse, data_dir=cfg.data_dir, seed=cfg.seed, **_bounds(cfg))
    test = data.read_mixture(cfg.test_path or cfg.path, parse, data_dir=cfg.data_dir,
                             seed=cfg.seed + 1, field=test_field, **_bounds(cfg))
    source = f"task.path={cfg.path}, task.test_path={cfg.test_path or cfg.path}"
    extra = _other_phases_rows(cfg, tok, kind)
    width = max((len(x) for rows in extra.values() for x in rows.prompt_ids), default=0)
    prompts = (train, test) if kind == "prompts" else (_as_prompts(train), _as_prompts(test))
    task = _text_task("jsonl", tok, *prompts, cfg, source=source, folder=tokenizer_path, min_prompt_len=width)
    sft = train if kind == "sft" else extra.get("sft")
    pairs = train if kind == "pairs" else extra.get("pairs")
    eos = None if cfg.chat_template else tok.eos_token_id
    if sft is not None:
        task = dataclasses.replace(task, sft=data.sft_batch(
            sft.prompt_ids, sft.response_ids, prompt_len=task.prompt_len,
            response_len=max(len(x) for x in sft.response_ids), pad_id=task.pad_id, eos_id=None,
            response_loss=sft.loss_mask))
    if pairs is not None:
        task = dataclasses.replace(task, pairs=_pair_arrays(pairs, task.prompt_len, task.pad_id, eos),
                                   test_pairs=_pair_arrays(test, task.prompt_len, task.pad_id, eos)
                                   if kind == "pairs" else None)
    return task


def _other_phases_rows(cfg, tok, kind: str) -> dict:
    """The rows of the run's other phases from their own sources: `task.sft_path` (SFT
    examples for a warm start) and `task.pairs_path` (preference pairs for a reward model),
    each a source spec read as that kind; a kind's own path is `task.path`."""
    out = {}
    for name in ("sft", "pairs"):
        spec = cfg.get(f"{name}_path", "")
        if not spec:
            continue
        if kind == name:
            raise ValueError(f"task.{name}_path={spec!r}: this task's own rows are {name} (task.kind={kind!r}, "
                             f"read from task.path); {name}_path gives {name} rows to a task of another kind")
        rows = data.read_mixture(spec, _file_parser(cfg, tok, name), data_dir=cfg.data_dir, seed=cfg.seed,
                                 field=f"task.{name}_path", **_bounds(cfg))
        if not rows.location:
            raise ValueError(f"task.{name}_path={spec!r}: no usable {name} rows ({rows.skipped})")
        out[name] = rows
    return out


def word_problems(cfg, *, tokenizer_path: str) -> Task:
    """One-digit arithmetic questions in words (`data.make_word_problems`, generated: no
    files) for a Hugging Face chat model; reward = exact answer + `format_weight` × the
    "#### <number>" answer format (`data.answer_format_reward`)."""
    tok = task_tokenizer(cfg, tokenizer_path)

    def make(num, split, seed):
        records = data.make_word_problems(num, split=split, seed=seed)
        return data.prompts_from_records(
            ((f"word_problems[{split}]:{i + 1}", r) for i, r in enumerate(records)), tok, prompt_key="question",
            answer_key="answer", source=f"word_problems[{split}]", **_record_options(cfg))

    return _text_task("word_problems", tok, make(cfg.num_train, "train", cfg.seed),
                      make(cfg.num_test, "test", cfg.seed + 1), cfg, source="task.name='word_problems'",
                      folder=tokenizer_path, format_weight=cfg.format_weight)


TASKS = {"addition": addition, "jsonl": jsonl, "word_problems": word_problems}
EPISODE_TASKS = ("calculator", "env")  # tasks of multi-turn episodes: `runs.env_task`


def build_task(cfg, *, model_path: str = "", env=None) -> Task:
    """The task of section `cfg` (`task`) but those of episodes (`EPISODE_TASKS`), which
    `runs.env_task.build_task` builds (with the others through this function)."""
    if cfg.name not in TASKS:
        hint = "; build it with runs.env_task.build_task" if cfg.name in EPISODE_TASKS else ""
        raise ValueError(f"task.name={cfg.name!r}; expected one of {sorted((*TASKS, *EPISODE_TASKS))}{hint}")
    if cfg.name in ("jsonl", "word_problems"):
        return TASKS[cfg.name](cfg, tokenizer_path=cfg.tokenizer_path or model_path)
    return TASKS[cfg.name](cfg)


def python_rewards(cfg) -> list[tuple[float, str, Callable]]:
    """`(weight, name, function)` of each Python reward of the config's `reward` section
    (None: no section, no rewards): `fns` import paths "pkg.module:function",
    comma-separated, `weights` as many floats ("" = 1.0 each). Imported here, so that a
    path that does not import stops the run before any work (`rewards.import_reward_fn`).
    With a `timeout` (seconds) the function is a `reward_workers.Clocked`: it runs in a
    worker process of its own, stopped past the timeout (`on_timeout`); None: in this
    process, no limit. A component is
    named by its function, or by its whole path when two functions share a name."""
    specs = [s.strip() for s in (cfg.fns if cfg is not None else "").split(",") if s.strip()]
    if not specs:
        return []
    try:
        weights = [float(w) for w in cfg.weights.split(",")] if cfg.weights.strip() else [1.0] * len(specs)
    except ValueError:
        raise ValueError(f"reward.weights={cfg.weights!r}: expected comma-separated numbers, one per "
                         "reward.fns entry") from None
    if len(weights) != len(specs):
        raise ValueError(f"reward.weights={cfg.weights!r} gives {len(weights)} weights for the {len(specs)} "
                         f"functions of reward.fns; give one per function (or none: 1.0 each)")
    names = [s.partition(":")[2] for s in specs]
    fns = [rewards.import_reward_fn(s) for s in specs]
    timeout = cfg.get("timeout")
    if timeout is not None and not timeout > 0:
        raise ValueError(f"reward.timeout={timeout!r}: expected seconds > 0, or None for no limit")
    if timeout is not None:
        fns = [reward_workers.Clocked(s, timeout=timeout, on_timeout=cfg.get("on_timeout", "error")) for s in specs]
    return [(w, s if names.count(n) > 1 else n, fn) for w, s, n, fn in zip(weights, specs, names, fns)]


def with_python_rewards(task: Task, cfg) -> Task:
    """`task` with its reward = `cfg.task_weight` × the task's own reward + the weighted
    Python rewards of `cfg` (the config's `reward` section, or None), each called in TRL's
    convention on the decoded text with the row's fields (`rewards.trl_reward`). The
    task's own reward stays the first component, the held-out `accuracy`, even at weight 0."""
    fns = python_rewards(cfg)
    if not fns and (cfg is None or cfg.task_weight == 1.0):
        return task
    parts = [(float(cfg.task_weight), task.reward)]
    bound = cfg.get("max_abs_score")  # None: no bound
    if bound is not None and not bound > 0:
        raise ValueError(f"reward.max_abs_score={bound!r}: expected a bound > 0 on |score|, or None for none")
    parts += [(w, rewards.trl_reward(fn, task.tokenizer, name=name, eos_id=task.stop_ids, max_abs_score=bound))
              for w, name, fn in fns]
    return dataclasses.replace(task, reward=rewards.combine(parts))
