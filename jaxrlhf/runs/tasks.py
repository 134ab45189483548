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


TASKS = {"addition": addition}


def build_task(cfg) -> Task:
    if cfg.name not in TASKS:
        raise ValueError(f"task.name={cfg.name!r}; expected one of {sorted(TASKS)}")
    return TASKS[cfg.name](cfg)


def make_accuracy_fn(model: Transformer, task: Task, *, batch_size: int = 512):
    """`accuracy(params) -> {"accuracy", "reward"}`: greedy decoding on the held-out prompts.

    `accuracy` is the fraction whose exact-match component is 1; `reward` the full reward.
    """
    p = task.test_prompts
    n = p["prompt_ids"].shape[0]

    @jax.jit
    def scores(params, prompt_ids, prompt_mask, extras):
        out = sample(model, params, prompt_ids, prompt_mask, jax.random.key(0), max_new_tokens=task.response_len,
                     temperature=0.0, eos_id=task.eos_id, pad_id=task.pad_id)
        parts = task.reward.device_scores(rewards.RewardInput.from_sample(out), extras)
        return task.reward.total(parts), parts, out.response_ids, out.response_mask

    def accuracy(params, *, return_samples: int = 0):
        totals, exact, samples = [], [], []
        for i in range(0, n, batch_size):
            sl = slice(i, i + batch_size)
            extras = {k: jnp.asarray(p[k][sl]) for k in task.extra_keys}
            total, parts, ids, mask = scores(params, jnp.asarray(p["prompt_ids"][sl]), jnp.asarray(p["prompt_mask"][sl]),
                                             extras)
            totals.append(np.asarray(total))
            exact.append(np.asarray(parts[task.reward.components[0].name]))
            if len(samples) < return_samples:
                for j in range(min(return_samples - len(samples), ids.shape[0])):
                    prompt = task.decode(np.asarray(p["prompt_ids"][i + j])[np.asarray(p["prompt_mask"][i + j])])
                    resp = task.decode(np.asarray(ids[j])[np.asarray(mask[j])])
                    samples.append((prompt, resp, float(exact[-1][j])))
        result = {"accuracy": float(np.concatenate(exact).mean()), "reward": float(np.concatenate(totals).mean())}
        return (result, samples) if return_samples else result

    return accuracy
