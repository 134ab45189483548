"""The built-in synthetic task: multi-digit addition ("37+58=" -> "95"), no downloads.

A tiny transformer learns it in minutes on a CPU, and every answer is checkable, so it
serves as the default task for SFT, reward modelling, DPO and RL end to end.

Which problems are held out is a property of the problem itself (a hash of the operands),
not of the sampling seed: a held-out problem never appears in any training sample, under
any seed, and eval sets drawn with different seeds stay disjoint from every training set.

Token layout (character tokenizer, `char_tokenizer.py`):
  prompt  = [BOS] "37+58="     (left-padded later to P)
  answer  = "95"               (no EOS; batch builders append EOS to responses)
With `reverse_answer=True` the answer digits are written least significant first ("59"),
which lets a left-to-right model emit each digit after the carries it depends on: markedly
easier to learn. `zero_pad=True` gives fixed-width operands and answer ("07+58=" -> "065").
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import numpy as np

from jaxrlhf.data import batching
from jaxrlhf.data.char_tokenizer import EOS_ID, CharTokenizer

SPLITS = ("train", "test")
# Below this many possible problems, enumerate them all (exact, unique sampling);
# above, sample with rejection (collisions are then rare).
_ENUMERATE_LIMIT = 2_000_000


@dataclasses.dataclass(frozen=True)
class AdditionTask:
    """Addition of two operands, each uniform in [0, 10**num_digits).

    Attributes:
      num_digits: digits per operand (at most 9, so sums fit int64 hashing comfortably).
      reverse_answer: write the answer least significant digit first.
      zero_pad: operands padded to `num_digits`, the answer to `num_digits + 1`.
      held_out_fraction: share of all problems reserved for the "test" split.
      split_salt: changes which problems are held out; keep it fixed across a project.
    """

    num_digits: int = 2
    reverse_answer: bool = False
    zero_pad: bool = False
    held_out_fraction: float = 0.1
    split_salt: int = 0

    def __post_init__(self):
        if not 1 <= self.num_digits <= 9:
            raise ValueError(f"num_digits must be in [1, 9], got {self.num_digits}")
        if not 0.0 < self.held_out_fraction < 1.0:
            raise ValueError(f"held_out_fraction must be in (0, 1), got {self.held_out_fraction}")

    @property
    def prompt_len(self) -> int:
        """Longest prompt in tokens: BOS, two operands, '+', '='."""
        return 2 * self.num_digits + 3

    @property
    def response_len(self) -> int:
        """Longest response in tokens: the answer digits and EOS."""
        return self.num_digits + 2

    @property
    def num_problems(self) -> int:
        return 10 ** (2 * self.num_digits)


class Problems(NamedTuple):
    """N problems; `*_ids` are ragged lists of token ids (answers without EOS)."""

    a: np.ndarray  # [N] int64
    b: np.ndarray  # [N] int64
    prompt_text: list[str]
    answer_text: list[str]
    prompt_ids: list[list[int]]
    answer_ids: list[list[int]]


class PreferencePairs(NamedTuple):
    """N (prompt, chosen, rejected) triples; responses without EOS. `kind` names the corruption."""

    prompt_text: list[str]
    chosen_text: list[str]
    rejected_text: list[str]
    prompt_ids: list[list[int]]
    chosen_ids: list[list[int]]
    rejected_ids: list[list[int]]
    kind: list[str]


def _splitmix64(x: np.ndarray) -> np.ndarray:
    """A well-mixed 64-bit hash (Steele et al. 2014), vectorised; wraps modulo 2**64."""
    x = x.astype(np.uint64)
    with np.errstate(over="ignore"):
        x = x + np.uint64(0x9E3779B97F4A7C15)
        x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        return x ^ (x >> np.uint64(31))


def is_held_out(task: AdditionTask, a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """[N] bool: whether problem (a, b) belongs to the test split. Depends on (a, b) only."""
    key = np.asarray(a, np.int64) * 10**task.num_digits + np.asarray(b, np.int64)
    salted = key.astype(np.uint64) ^ _splitmix64(np.asarray([task.split_salt], np.int64))
    unit = (_splitmix64(salted) >> np.uint64(11)).astype(np.float64) / 2.0**53
    return unit < task.held_out_fraction


def format_prompt(task: AdditionTask, a: int, b: int) -> str:
    w = task.num_digits if task.zero_pad else 0
    return f"{a:0{w}d}+{b:0{w}d}="


def format_answer(task: AdditionTask, value: int) -> str:
    """The answer string for a sum `value` (reversed and/or zero-padded per the task)."""
    w = task.num_digits + 1 if task.zero_pad else 0
    s = f"{value:0{w}d}"
    return s[::-1] if task.reverse_answer else s


def parse_answer(task: AdditionTask, text: str) -> int | None:
    """Inverse of `format_answer`; None if `text` is not a number."""
    s = text.strip()
    if task.reverse_answer:
        s = s[::-1]
    return int(s) if s.isdigit() else None


def _sample_operands(task: AdditionTask, num: int, split: str, seed: int) -> tuple[np.ndarray, np.ndarray]:
    want_held_out = split == "test"
    base = 10**task.num_digits
    rng = np.random.default_rng([seed, SPLITS.index(split)])
    if task.num_problems <= _ENUMERATE_LIMIT:
        keys = np.arange(task.num_problems, dtype=np.int64)
        keys = keys[is_held_out(task, keys // base, keys % base) == want_held_out]
        if num > keys.size:
            raise ValueError(
                f"asked for {num} distinct {split} problems, but only {keys.size} exist with "
                f"num_digits={task.num_digits}; repeat them over epochs instead")
        keys = rng.permutation(keys)[:num]
    else:
        chosen, seen = [], set()
        while len(chosen) < num:
            cand = rng.integers(0, task.num_problems, size=2 * (num - len(chosen)) + 16, dtype=np.int64)
            cand = cand[is_held_out(task, cand // base, cand % base) == want_held_out]
            for k in cand.tolist():
                if k not in seen and len(chosen) < num:
                    seen.add(k)
                    chosen.append(k)
        keys = np.asarray(chosen, np.int64)
    return keys // base, keys % base


def make_problems(
    task: AdditionTask,
    num: int,
    *,
    split: str = "train",
    seed: int = 0,
    tokenizer: CharTokenizer | None = None,
) -> Problems:
    """`num` distinct problems of one split, deterministic given (task, split, seed).

    Train and test problems never overlap, whatever the seeds. Prompt ids start with BOS.
    """
    if split not in SPLITS:
        raise ValueError(f"split must be one of {SPLITS}, got {split!r}")
    tokenizer = tokenizer or CharTokenizer()
    a, b = _sample_operands(task, num, split, seed)
    prompt_text = [format_prompt(task, x, y) for x, y in zip(a.tolist(), b.tolist())]
    answer_text = [format_answer(task, x + y) for x, y in zip(a.tolist(), b.tolist())]
    return Problems(
        a=a,
        b=b,
        prompt_text=prompt_text,
        answer_text=answer_text,
        prompt_ids=[tokenizer.encode(p, add_bos=True) for p in prompt_text],
        answer_ids=[tokenizer.encode(s) for s in answer_text],
    )


def _digitwise_no_carry(task: AdditionTask, a: int, b: int) -> int:
    """The sum a student gets by forgetting every carry: digit sums modulo 10."""
    out, place = 0, 1
    while a or b:
        out += ((a % 10 + b % 10) % 10) * place
        a, b, place = a // 10, b // 10, place * 10
    return out


def _corrupt(task: AdditionTask, a: int, b: int, answer: str, rng: np.random.Generator) -> tuple[str, str]:
    """A plausible wrong answer string and the name of the mistake."""
    kinds = ["digit_off_by_one", "sum_off_by_one", "swapped_digits", "extra_digit", "no_carry"]
    if len(answer) > 1:
        kinds.append("dropped_digit")
    for _ in range(8):
        kind = kinds[rng.integers(len(kinds))]
        i = int(rng.integers(len(answer)))
        if kind == "digit_off_by_one":
            d = (int(answer[i]) + (1 if rng.integers(2) else 9)) % 10
            wrong = answer[:i] + str(d) + answer[i + 1:]
        elif kind == "sum_off_by_one":
            value = a + b + (1 if rng.integers(2) else -1)
            wrong = format_answer(task, value) if value >= 0 else ""
        elif kind == "swapped_digits":
            i = min(i, len(answer) - 2)
            wrong = answer[:i] + answer[i + 1:i + 2] + answer[i:i + 1] + answer[i + 2:] if i >= 0 else ""
        elif kind == "extra_digit":
            wrong = answer[:i] + answer[i] + answer[i:]
        elif kind == "no_carry":
            wrong = format_answer(task, _digitwise_no_carry(task, a, b))
        else:  # dropped_digit
            wrong = answer[:i] + answer[i + 1:]
        if wrong and wrong != answer:
            return wrong, kind
    # Always differs: one digit moved by one.
    return answer[:-1] + str((int(answer[-1]) + 1) % 10), "digit_off_by_one"


def make_preference_pairs(
    task: AdditionTask,
    problems: Problems,
    *,
    seed: int = 0,
    tokenizer: CharTokenizer | None = None,
) -> PreferencePairs:
    """Chosen = the correct answer, rejected = a plausible mistake (never equal to chosen).

    Mistakes: a digit off by one, the sum off by one, two adjacent digits swapped, a digit
    duplicated or dropped, or every carry forgotten. Deterministic given `seed`.
    """
    tokenizer = tokenizer or CharTokenizer()
    rng = np.random.default_rng(seed)
    rejected, kinds = [], []
    for a, b, answer in zip(problems.a.tolist(), problems.b.tolist(), problems.answer_text):
        wrong, kind = _corrupt(task, a, b, answer, rng)
        rejected.append(wrong)
        kinds.append(kind)
    return PreferencePairs(
        prompt_text=list(problems.prompt_text),
        chosen_text=list(problems.answer_text),
        rejected_text=rejected,
        prompt_ids=list(problems.prompt_ids),
        chosen_ids=list(problems.answer_ids),
        rejected_ids=[tokenizer.encode(s) for s in rejected],
        kind=kinds,
    )


# Whole-set arrays: the task is small, so pad everything once and gather rows per step,
# e.g. `{k: v[idx] for k, v in arrays.items()}` with `idx = next(batch_iterator)`.


def sft_arrays(task: AdditionTask, problems: Problems) -> dict[str, np.ndarray]:
    """All problems as one SFT batch (`batching.sft_batch`): response = answer ⧺ EOS,
    `loss_mask` on response tokens only. Shapes [N, P], [N, T] and [N, P + T]."""
    return batching.sft_batch(problems.prompt_ids, problems.answer_ids,
                              prompt_len=task.prompt_len, response_len=task.response_len)


def rl_arrays(task: AdditionTask, problems: Problems) -> dict[str, np.ndarray]:
    """Prompts for sampling and answers for `rewards.exact_match_reward`:
    prompt_ids/prompt_mask [N, P] (left-padded), answer_ids/answer_mask [N, A] with
    A = num_digits + 1 (right-padded, no EOS), and the reference completions answer ⧺ EOS,
    reference_ids/reference_mask [N, T] (right-padded; the SFT responses; what GRPO's
    guidance on failed prompts learns, `algorithms.guide`)."""
    prompt_ids, prompt_mask = batching.left_pad(problems.prompt_ids, task.prompt_len)
    answer_ids, answer_mask = batching.right_pad(problems.answer_ids, task.response_len - 1)
    reference_ids, reference_mask = batching.right_pad(problems.answer_ids, task.response_len, append_id=EOS_ID)
    return dict(prompt_ids=prompt_ids, prompt_mask=prompt_mask, answer_ids=answer_ids, answer_mask=answer_mask,
                reference_ids=reference_ids, reference_mask=reference_mask)


def preference_arrays(task: AdditionTask, pairs: PreferencePairs) -> dict[str, np.ndarray]:
    """All pairs as one `batching.preference_batch` (EOS appended to chosen and rejected).

    A rejected answer can be one token longer than any correct one (a duplicated digit),
    hence T = response_len + 1.
    """
    return batching.preference_batch(pairs.prompt_ids, pairs.chosen_ids, pairs.rejected_ids,
                                     prompt_len=task.prompt_len, response_len=task.response_len + 1)
