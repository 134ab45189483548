"""Small arithmetic questions in words, for a real chat model: no downloads, checkable answers.

The text counterpart of the built-in addition task, made for a pretrained instruct model
and its own tokenizer: one-digit sums, differences and products asked plainly ("What is 7
times 8?") or as a one-line story ("Mia has 9 shells and gives away 4. How many shells
does Mia have left?"). Answers are whole numbers ("56", "5"). A 135M instruct model gets
about half of them right before training, mostly by rambling past its answer; every
answer is checkable, so an exact-answer reward can teach it to answer and stop.

Which problems are held out is a property of the problem (a hash of its kind and
operands), not of the sampling seed, as in `arithmetic.is_held_out`: a test question's
numbers and kind never appear in any training record, under any seed.

    records = make_word_problems(4000, split="train", seed=0)
    records[0]  # {"question": "What is 3 + 5?", "answer": "8"}
"""

from __future__ import annotations

import numpy as np

from jaxrlhf.data.arithmetic import SPLITS, _splitmix64

KINDS = ("add", "subtract", "multiply", "add_story", "subtract_story")
NAMES = ("Tom", "Anna", "Maria", "Sam", "Lily", "Ben", "Omar", "Mia")
ITEMS = ("apples", "books", "coins", "stickers", "marbles", "pencils", "cards", "shells")
_SALT = 0x5EED


def question(kind: str, a: int, b: int, name: str = "Tom", item: str = "apples") -> tuple[str, int]:
    """`(question text, answer)` of one problem; subtractions take `a ≥ b`."""
    if kind == "add":
        return f"What is {a} + {b}?", a + b
    if kind == "subtract":
        return f"What is {a} - {b}?", a - b
    if kind == "multiply":
        return f"What is {a} times {b}?", a * b
    if kind == "add_story":
        return f"{name} has {a} {item} and gets {b} more. How many {item} does {name} have now?", a + b
    if kind == "subtract_story":
        return f"{name} has {a} {item} and gives away {b}. How many {item} does {name} have left?", a - b
    raise ValueError(f"kind={kind!r}; expected one of {KINDS}")


def is_held_out(kind: np.ndarray, a: np.ndarray, b: np.ndarray, fraction: float = 0.2) -> np.ndarray:
    """[N] bool: whether problem (kind index, a, b) belongs to the test split."""
    key = (np.asarray(kind, np.int64) * 100 + np.asarray(a, np.int64) * 10 + np.asarray(b, np.int64))
    unit = (_splitmix64(key.astype(np.uint64) ^ np.uint64(_SALT)) >> np.uint64(11)).astype(np.float64) / 2.0**53
    return unit < fraction


def make_word_problems(num: int, *, split: str, seed: int, held_out_fraction: float = 0.2) -> list[dict]:
    """`num` records `{"question", "answer"}` of `split` ("train" or "test"), drawn uniformly
    over the kinds, operands 0–9 (the larger first in a subtraction), names and items;
    problems repeat (there are 5 × 100 of them before names and items)."""
    if split not in SPLITS:
        raise ValueError(f"split={split!r}; expected one of {SPLITS}")
    if not 0.0 < held_out_fraction < 1.0:
        raise ValueError(f"held_out_fraction={held_out_fraction}; expected a value in (0, 1)")
    kinds, a, b = np.meshgrid(np.arange(len(KINDS)), np.arange(10), np.arange(10), indexing="ij")
    kinds, a, b = kinds.ravel(), a.ravel(), b.ravel()
    subtract = np.isin(kinds, [KINDS.index("subtract"), KINDS.index("subtract_story")])
    keep = (~subtract | (a >= b)) & (is_held_out(kinds, a, b, held_out_fraction) == (split == "test"))
    kinds, a, b = kinds[keep], a[keep], b[keep]
    rng = np.random.default_rng([seed, SPLITS.index(split)])
    pick = rng.integers(0, len(kinds), num)
    names, items = rng.integers(0, len(NAMES), num), rng.integers(0, len(ITEMS), num)
    out = []
    for i, j in enumerate(pick):
        text, answer = question(KINDS[kinds[j]], int(a[j]), int(b[j]), NAMES[names[i]], ITEMS[items[i]])
        out.append({"question": text, "answer": str(answer)})
    return out
