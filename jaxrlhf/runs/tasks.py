"""Tasks a run trains on: the data arrays, the reward, and the held-out evaluation.

"addition" is the built-in task (no downloads): multi-digit addition with a character
tokenizer and an exact answer. "jsonl" reads prompts/answers (and preference pairs) from
local files with a Hugging Face tokenizer, and scores answers on the host with
`data.final_answer_reward` (GSM8K-style "#### 42", `\\boxed{}` or the last number).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np

from jaxrlhf import data, rewards
from jaxrlhf.models.transformer import Transformer
from jaxrlhf.rollout.sampler import sample


@dataclasses.dataclass
class Task:
    """Everything algorithm runners need from a task.

    sft: whole-set SFT arrays (`tokens`, `input_mask`, `loss_mask`, ...), or None.
    prompts / test_prompts: `prompt_ids`, `prompt_mask` `[N, P]` plus reward extras.
    pairs / test_pairs: preference arrays (`data.preference_batch` layout), or None.
    reward: the `rewards.Reward` of a response.
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
        decode=lambda ids: tok.decode(ids))


def _prompt_arrays(prompts: data.PromptData, prompt_len: int, pad_id: int) -> dict:
    ids, mask = data.left_pad(prompts.prompt_ids, prompt_len, pad_id=pad_id)
    return dict(prompt_ids=ids, prompt_mask=mask, answer=np.asarray(prompts.answer, dtype=object))


def jsonl(cfg, *, tokenizer_path: str) -> Task:
    """Prompts and reference answers from JSONL/Parquet files, a Hugging Face tokenizer,
    and a host-side exact-answer reward (`data.final_answer_reward`)."""
    from jaxrlhf.models import load_tokenizer

    if not tokenizer_path:
        raise ValueError("task.name='jsonl' needs a tokenizer: set model.path (or task.tokenizer_path)")
    tok = load_tokenizer(tokenizer_path, chat_template=bool(cfg.chat_template))
    read = lambda path: data.read_prompts(path, tok, prompt_key=cfg.prompt_key, answer_key=cfg.answer_key,
                                          max_prompt_tokens=cfg.max_prompt_tokens, chat_template=cfg.chat_template,
                                          system_prompt=cfg.system_prompt or None, on_error=cfg.on_error)
    train, test = read(cfg.path), read(cfg.test_path or cfg.path)
    if not train.prompt_ids or not test.prompt_ids:
        raise ValueError(f"task.path={cfg.path}: no usable prompts ({train.skipped})")
    prompt_len = max(len(x) for x in train.prompt_ids + test.prompt_ids)
    pad_id = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
    reward = rewards.host_reward(lambda prompts, responses, ex: data.final_answer_reward(responses, ex["answer"]),
                                 tok, name="exact_answer")
    return Task(
        name="jsonl", tokenizer=tok, vocab_size=len(tok), pad_id=pad_id, bos_id=tok.bos_token_id,
        eos_id=tok.eos_token_id, prompt_len=prompt_len, response_len=cfg.max_new_tokens, sft=None,
        prompts=_prompt_arrays(train, prompt_len, pad_id), test_prompts=_prompt_arrays(test, prompt_len, pad_id),
        pairs=None, test_pairs=None, reward=reward, extra_keys=("answer",),
        decode=lambda ids: tok.decode(ids, skip_special_tokens=True))


TASKS = {"addition": addition, "jsonl": jsonl}


def build_task(cfg, *, model_path: str = "") -> Task:
    if cfg.name not in TASKS:
        raise ValueError(f"task.name={cfg.name!r}; expected one of {sorted(TASKS)}")
    if cfg.name == "jsonl":
        return jsonl(cfg, tokenizer_path=cfg.tokenizer_path or model_path)
    return TASKS[cfg.name](cfg)


def host_extras(batch: dict, keys) -> dict:
    """Reward extras of a batch: object arrays (e.g. answer strings) become lists."""
    return {k: list(batch[k]) if batch[k].dtype == object else batch[k] for k in keys}


def make_accuracy_fn(model: Transformer, task: Task, *, batch_size: int = 512, placement=None):
    """`accuracy(params) -> {"accuracy", "reward"}`: greedy decoding on the held-out prompts.

    `accuracy` is the mean of the reward's first component (the exact-match reward of the
    built-in tasks); `reward` the mean of the full weighted reward. Host rewards run on
    the decoded text.

    `placement` (a `sharding.Placement`, default: one local device): `params` may be
    sharded on its mesh, across processes too. Every process holds the whole held-out
    set; each batch's prompt rows are split over the batch shards (padded with copies of
    the last prompt to divide) and the outputs come back replicated, so every process
    computes the same numbers (call it on every process).
    """
    from jaxrlhf.runs.sharding import Placement, pad_rows

    placement = placement or Placement.local()
    p = task.test_prompts
    n = p["prompt_ids"].shape[0]

    def greedy(params, prompt_ids, prompt_mask):
        return sample(model, params, prompt_ids, prompt_mask, jax.random.key(0), max_new_tokens=task.response_len,
                      temperature=0.0, eos_id=task.eos_id, pad_id=task.pad_id)

    decode_greedy = jax.jit(greedy, out_shardings=placement.replicated)
    device_scores = jax.jit(lambda out, extras: task.reward.device_scores(rewards.RewardInput.from_sample(out), extras),
                            out_shardings=placement.replicated)

    def accuracy(params, *, return_samples: int = 0):
        totals, exact, samples = [], [], []
        first = task.reward.components[0].name
        for i in range(0, n, batch_size):
            sl = slice(i, i + batch_size)
            batch = {k: p[k][sl] for k in p}
            rows = batch["prompt_ids"].shape[0]
            padded = pad_rows({k: batch[k] for k in ("prompt_ids", "prompt_mask")}, placement.padded_rows(rows))
            placed = placement.put_rows(padded)
            out = decode_greedy(params, placed["prompt_ids"], placed["prompt_mask"])
            extras = host_extras(batch, task.extra_keys)
            arrays = {k: v for k, v in extras.items() if hasattr(v, "shape")}
            if arrays:
                arrays = placement.put_rows(pad_rows(arrays, placement.padded_rows(rows)))
            parts = {k: np.asarray(v)[:rows] for k, v in placement.fetch(device_scores(out, arrays)).items()}
            out = jax.tree.map(lambda x: x[:rows], placement.fetch(out))
            if not task.reward.is_jax:
                parts.update(task.reward.host_scores(rewards.RewardInput.from_sample(out), extras))
            totals.append(np.asarray(task.reward.total(parts)))
            exact.append(np.asarray(parts[first]))
            ids, mask = np.asarray(out.response_ids), np.asarray(out.response_mask)
            for j in range(min(return_samples - len(samples), ids.shape[0])):
                prompt = task.decode(batch["prompt_ids"][j][batch["prompt_mask"][j]])
                samples.append((prompt, task.decode(ids[j][mask[j]]), float(exact[-1][j])))
        result = {"accuracy": float(np.concatenate(exact).mean()), "reward": float(np.concatenate(totals).mean())}
        return (result, samples) if return_samples else result

    return accuracy
