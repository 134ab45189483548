"""The built-in multi-turn tool task: sums of several numbers with a calculator, no downloads.

A problem is a sum of `num_terms` numbers of up to `num_digits` digits ("123+456+789="),
more than a small model adds in its head, but an easy one with a calculator. The policy
calls the calculator by writing `[a+b]` (two or more numbers, digits only, joined by `+`);
the `]` ends its turn, and the environment appends the result, `=579;`, as environment
tokens (context the policy reads, never trained on). The policy calls again or writes its
final answer, the digits, and EOS. An episode with the character tokenizer (`CHARS`):

    prompt   <bos>123+456+789=
    policy   [123+456]          environment  =579;
    policy   [579+789]          environment  =1368;
    policy   1368<eos>          reward 1 (exact match of the final answer), else 0

A malformed call (`[12+]`, `[7]`, text before the `[`, a number over `MAX_DIGITS` digits)
is an observation, `=?;`, never a crash; it is counted by kind in the environment's
`stats` (`tool_calls`, `malformed`, `one_number`, `too_long`), which the run turns into
`episode/...` metrics. A turn cut at the per-turn token limit ends the episode with
reward 0.

`CalculatorEnv` is the token environment (`envs.TokenEnv`, made with no arguments, reset
with a row `{"question": "123+456+789", "answer": "1368"}`; `answer` may be left out).
`demonstration` writes an expert's episode as ids and a policy mask (the SFT examples: the
loss on policy tokens only), by playing the scripted expert against the environment
itself, so the demonstrations are exactly what an episode looks like.

The expert adds two numbers at a time with the calculator. With `memory_rate` > 0 it is an
imperfect demonstrator: on problems whose first number is below half its range (its
leading digit, written in full, below 5) it writes the answer from memory, without a call,
that share of the time (its answers are right; a small model's from memory are not). A
policy imitating it learns to skip the calculator there; the outcome reward teaches it not
to (docs/episodes.md#a-built-in-task-sums-with-a-calculator).

Which problems are held out depends on the problem itself (a hash of its numbers), as in
`data.arithmetic`: a held-out sum is never a training sum, whatever the seeds.
"""

from __future__ import annotations

import dataclasses
import re

import numpy as np

from jaxrlhf.data import arithmetic
from jaxrlhf.data.char_tokenizer import EOS_ID, PAD_ID, CharTokenizer
from jaxrlhf.envs.base import TokenStep

CHARS = "0123456789+=[];?"
TOKENIZER = CharTokenizer(CHARS)
CALL_OPEN, CALL_END = "[", "]"
CALL_END_ID = TOKENIZER.encode(CALL_END)[0]
STOP_IDS = (EOS_ID, CALL_END_ID)  # what ends a policy turn: the final answer's EOS, a call's "]"
MAX_DIGITS = 12  # a calculator operand of more digits is refused ("too_long")
ERROR_KINDS = ("malformed", "one_number", "too_long")
_CALL = re.compile(r"\[(\d+(?:\+\d+)*)\]")


@dataclasses.dataclass(frozen=True)
class CalculatorTask:
    """Sums of `num_terms` numbers, each uniform in [0, 10**num_digits).

    memory_rate: the share of "low" problems (first number < 10**num_digits / 2) the
      expert answers from memory, without the calculator (module docstring); 0: it always
      calls it.
    held_out_fraction, split_salt: as `arithmetic.AdditionTask`'s.
    """

    num_terms: int = 3
    num_digits: int = 3
    memory_rate: float = 0.0
    held_out_fraction: float = 0.1
    split_salt: int = 0

    def __post_init__(self):
        if not 2 <= self.num_terms <= 8:
            raise ValueError(f"num_terms must be in [2, 8], got {self.num_terms}")
        if not 1 <= self.num_digits <= 6:
            raise ValueError(f"num_digits must be in [1, 6], got {self.num_digits}")
        if not 0.0 <= self.memory_rate <= 1.0:
            raise ValueError(f"memory_rate must be in [0, 1], got {self.memory_rate}")

    @property
    def prompt_len(self) -> int:
        """The longest prompt: BOS, the numbers, the '+'s and '='."""
        return 1 + self.num_terms * (self.num_digits + 1)

    @property
    def episode_len(self) -> int:
        """The longest expert episode after the prompt: each pairwise call `[a+b]` with its
        result `=s;`, then the answer and EOS."""
        width = self.num_digits + len(str(self.num_terms - 1))  # digits of a partial sum, at most
        call = 2 + self.num_digits + 1 + width  # "[" s "+" b "]": s a partial sum, b a number
        return (self.num_terms - 1) * (call + width + 2) + width + 1


def question(numbers) -> str:
    return "+".join(str(int(x)) for x in numbers)


def _unit(numbers_NxK, salt: int) -> np.ndarray:
    """`[N]` floats in [0, 1): a hash of each problem's numbers and `salt`."""
    numbers_NxK = np.asarray(numbers_NxK, np.int64).reshape(-1, np.shape(numbers_NxK)[-1])
    key = np.zeros(numbers_NxK.shape[0], np.uint64)
    with np.errstate(over="ignore"):
        for k in range(numbers_NxK.shape[1]):
            key = arithmetic._splitmix64(key ^ numbers_NxK[:, k].astype(np.uint64))
        key = key ^ arithmetic._splitmix64(np.asarray([salt], np.int64))
    return (arithmetic._splitmix64(key) >> np.uint64(11)).astype(np.float64) / 2.0**53


def _held_out(task: CalculatorTask, numbers_NxK: np.ndarray) -> np.ndarray:
    return _unit(numbers_NxK, task.split_salt) < task.held_out_fraction


def make_rows(task: CalculatorTask, num: int, *, split: str = "train", seed: int = 0) -> list[dict]:
    """`num` distinct problems of one split as rows `{"question", "answer"}`, deterministic
    given (task, split, seed); train and test rows never share a problem."""
    if split not in arithmetic.SPLITS:
        raise ValueError(f"split must be one of {arithmetic.SPLITS}, got {split!r}")
    rng = np.random.default_rng([seed, arithmetic.SPLITS.index(split), 7])
    space = (10 ** task.num_digits) ** task.num_terms
    if num > space * (task.held_out_fraction if split == "test" else 1 - task.held_out_fraction) / 2:
        raise ValueError(f"asked for {num} {split} problems of {task.num_terms} numbers of {task.num_digits} "
                         "digits: too many for the problems that exist")
    rows, seen = [], set()
    while len(rows) < num:
        cand = rng.integers(0, 10 ** task.num_digits, size=(2 * (num - len(rows)) + 16, task.num_terms))
        cand = cand[_held_out(task, cand) == (split == "test")]
        for numbers in cand.tolist():
            key = tuple(numbers)
            if key not in seen and len(rows) < num:
                seen.add(key)
                rows.append({"question": question(numbers), "answer": str(sum(numbers))})
    return rows


def numbers_of(row: dict) -> list[int]:
    """The numbers of a row's question ("123+456+789")."""
    q = str(row["question"]).strip().removesuffix("=")
    if not re.fullmatch(r"\d+(\+\d+)+", q):
        raise ValueError(f"a calculator row's question must be numbers joined by '+', got {q!r}")
    return [int(x) for x in q.split("+")]


def parse_call(text: str) -> tuple[list[int] | None, str | None]:
    """`(numbers, None)` of a well-formed call `[a+b(+c...)]`, else `(None, error kind)`."""
    m = _CALL.fullmatch(text)
    if m is None:
        return None, "malformed"
    parts = m.group(1).split("+")
    if len(parts) < 2:
        return None, "one_number"
    if any(len(p) > MAX_DIGITS for p in parts):
        return None, "too_long"
    return [int(p) for p in parts], None


class CalculatorEnv:
    """The calculator episode's token environment (module docstring). `stats` after an
    episode: `tool_calls` (calls written, well-formed or not), one count per
    `ERROR_KINDS`, and `correct` (1 when the final answer was right)."""

    tokenizer = TOKENIZER
    stop_ids = STOP_IDS  # what ends a policy turn (a run with env.cls reads it)

    def __init__(self):
        self.row: dict | None = None
        self.answer = ""
        self.stats = {"tool_calls": 0, **{k: 0 for k in ERROR_KINDS}, "correct": 0}

    def reset(self, row: dict) -> list[int]:
        numbers = numbers_of(row)
        self.row = row
        self.answer = str(row.get("answer", sum(numbers))).strip()
        return self.tokenizer.encode(question(numbers) + "=", add_bos=True)

    def step(self, action_ids: list[int], cut: bool) -> TokenStep:
        if cut or not action_ids:
            return TokenStep([], 0.0, True)  # no stop token: no call, no answer
        text = self.tokenizer.decode(action_ids[:-1], stop_at_eos=False)
        if action_ids[-1] == CALL_END_ID:
            self.stats["tool_calls"] += 1
            numbers, error = parse_call(text + CALL_END)
            if error is not None:
                self.stats[error] += 1
                return TokenStep(self.tokenizer.encode("=?;"), 0.0, False)
            return TokenStep(self.tokenizer.encode(f"={sum(numbers)};"), 0.0, False)
        correct = text == self.answer  # the turn ended with EOS: the final answer
        self.stats["correct"] = int(correct)
        return TokenStep([], float(correct), True)


def expert_actions(task: CalculatorTask, row: dict) -> list[str]:
    """The expert's turns for `row` as text, stop characters included ("<eos>" for EOS):
    pairwise calls then the answer, or (memory, module docstring) the answer alone."""
    numbers = numbers_of(row)
    total = sum(numbers)
    if _from_memory(task, numbers):
        return [f"{total}<eos>"]
    actions, acc = [], numbers[0]
    for b in numbers[1:]:
        actions.append(f"[{acc}+{b}]")
        acc += b
    return actions + [f"{total}<eos>"]


def _from_memory(task: CalculatorTask, numbers: list[int]) -> bool:
    """Whether the expert answers this problem from memory: a "low" first number, and a
    hash of the problem below `memory_rate` (the same decision at every call)."""
    if task.memory_rate <= 0 or numbers[0] >= 10 ** task.num_digits // 2:
        return False
    return bool(_unit([numbers], task.split_salt + 1)[0] < task.memory_rate)


def _ids(text: str) -> list[int]:
    if text.endswith("<eos>"):
        return TOKENIZER.encode(text[:-5]) + [EOS_ID]
    return TOKENIZER.encode(text)


def demonstration(task: CalculatorTask, row: dict) -> tuple[list[int], list[int], list[bool]]:
    """`(prompt_ids, episode_ids, policy_mask)` of the expert's episode on `row`, played
    against `CalculatorEnv`: `episode_ids` the policy's and the environment's tokens after
    the prompt, `policy_mask` True on the policy's. The episode scores 1."""
    env = CalculatorEnv()
    prompt = env.reset(row)
    ids, mask = [], []
    for action in expert_actions(task, row):
        a = _ids(action)
        step = env.step(a, False)
        ids += a + step.ids
        mask += [True] * len(a) + [False] * len(step.ids)
    if step.reward != 1.0 or not step.done:
        raise AssertionError(f"the expert's episode on {row} did not end with reward 1")
    return prompt, ids, mask


def sft_arrays(task: CalculatorTask, rows: list[dict]) -> dict[str, np.ndarray]:
    """The expert's demonstrations as SFT arrays (`algorithms.sft` layout): `tokens`
    prompt (left-padded to `task.prompt_len`) ⧺ episode (right-padded to
    `task.episode_len`), `input_mask` on every real token, `loss_mask` on the policy's
    tokens only (never the calculator's)."""
    p, r = task.prompt_len, task.episode_len
    n = len(rows)
    tokens = np.full((n, p + r), PAD_ID, np.int32)
    input_mask = np.zeros((n, p + r), bool)
    loss_mask = np.zeros((n, p + r), bool)
    for i, row in enumerate(rows):
        prompt, ids, mask = demonstration(task, row)
        if len(prompt) > p or len(ids) > r:
            raise AssertionError(f"demonstration of {row} longer than the task's bounds ({p}, {r})")
        tokens[i, p - len(prompt):p] = prompt
        tokens[i, p:p + len(ids)] = ids
        input_mask[i, p - len(prompt):p + len(ids)] = True
        loss_mask[i, p:p + len(ids)] = mask
    return {"tokens": tokens, "input_mask": input_mask, "loss_mask": loss_mask}


def prompt_arrays(task: CalculatorTask, rows: list[dict]) -> dict[str, np.ndarray]:
    """The rows' prompts left-padded to `task.prompt_len` (`prompt_ids`, `prompt_mask`)."""
    from jaxrlhf.data import batching

    prompts = [CalculatorEnv().reset(row) for row in rows]
    ids, mask = batching.left_pad(prompts, task.prompt_len)
    return {"prompt_ids": ids, "prompt_mask": mask}


__all__ = ["CALL_END_ID", "CHARS", "CalculatorEnv", "CalculatorTask", "ERROR_KINDS", "STOP_IDS", "TOKENIZER",
           "demonstration", "expert_actions", "make_rows", "numbers_of", "parse_call", "prompt_arrays", "sft_arrays"]
