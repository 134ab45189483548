"""Sampled held-out evaluation: the estimators over n samples per prompt, and its settings.

Greedy decoding gives one answer per prompt (`eval/accuracy`). Sampled evaluation draws
`n` responses per held-out prompt at temperature τ and reports, from the same samples:

- `mean@n`: the accuracy of one sample (`sampled_metrics`);
- `pass@k`: the chance that at least one of k samples is correct, estimated without bias
  from the n samples (`pass_at_k`, Chen et al. 2021, arXiv:2107.03374);
- `maj@k`: whether the most common final answer of the first k samples is correct
  (`majority_at_k`, self-consistency voting).

The functions here are pure NumPy over host arrays (`correct_PxN`: P prompts × n samples,
sample `j` of prompt `p` in row `p`, column `j`); `held_out.make_accuracy_fn` samples and
scores, then calls `sampled_metrics`. `SampledEval.from_config` reads and checks the
`config.train.eval_*` fields.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Hashable, Sequence

import numpy as np


@dataclasses.dataclass(frozen=True)
class SampledEval:
    """Settings of sampled evaluation: `num_samples` (n) responses per prompt at
    `temperature`, metrics for each k of `ks` (sorted, distinct, each in [1, n])."""

    num_samples: int
    ks: tuple[int, ...]
    temperature: float = 1.0

    def __post_init__(self):
        check_ks(self.ks, self.num_samples)
        if not self.temperature > 0:
            raise ValueError(f"temperature={self.temperature}: sampled evaluation needs a temperature > 0 "
                             "(greedy decoding is eval/accuracy)")

    @classmethod
    def from_config(cls, train) -> "SampledEval | None":
        """From `config.train` (`eval_samples`, `eval_k`, `eval_temperature`, each within its
        field's bounds: `runs.sections.TrainConfig`); None when `eval_samples` is 0 (off).
        The k of `eval_k` must be in [1, eval_samples]; errors name the field."""
        n = train.eval_samples
        if n == 0:
            return None
        ks = parse_ks(train.eval_k, field="train.eval_k")
        try:
            check_ks(ks, int(n))
        except ValueError as e:
            raise ValueError(f"train.eval_k={train.eval_k!r} with train.eval_samples={n}: {e}") from None
        return cls(num_samples=int(n), ks=ks, temperature=float(train.eval_temperature))

    def describe(self) -> str:
        return f"{self.num_samples} samples per prompt at temperature {self.temperature:g}"


def parse_ks(value, *, field: str = "eval_k") -> tuple[int, ...]:
    """`"1,4,8"`, `8` or `(1, 4, 8)` -> `(1, 4, 8)` (sorted, duplicates dropped)."""
    if isinstance(value, str):
        items = [x for x in value.replace(" ", "").split(",") if x]
    else:
        items = list(value) if isinstance(value, (list, tuple)) else [value]
    ok = lambda x: (isinstance(x, (int, np.integer)) and not isinstance(x, bool)) or (
        isinstance(x, str) and re.fullmatch(r"[+-]?\d+", x))
    if not all(ok(x) for x in items):
        raise ValueError(f"{field}={value!r}: expected comma-separated integers, e.g. '1,4,8'")
    ks = [int(x) for x in items]
    if not ks:
        raise ValueError(f"{field}={value!r}: expected at least one k, e.g. '1,4,8'")
    return tuple(sorted(set(ks)))


def check_ks(ks: Sequence[int], n: int) -> None:
    if n < 1:
        raise ValueError(f"the number of samples n={n} must be >= 1")
    bad = [k for k in ks if not 1 <= k <= n]
    if not ks or bad:
        raise ValueError(f"every k must be in [1, n={n}], got {tuple(ks)}")


def pass_at_k(num_correct_P, n: int, k: int) -> np.ndarray:
    """`[P]` float64: the unbiased estimate of pass@k of each prompt from n samples with
    `c = num_correct_P[p]` correct (Chen et al. 2021, arXiv:2107.03374, eq. 1).

        pass@k = 1 − C(n − c, k) / C(n, k)
               = 1 − ∏_{i = n − c + 1}^{n} (1 − k / i)      (1 when n − c < k)

    the chance that a k-subset of the n samples, drawn uniformly without replacement,
    holds at least one correct sample. The product form (theirs) never forms the binomial
    coefficients, which overflow float64 past n ≈ 1000; each factor is in [0, 1). Its
    mean over prompts is the reported `pass@k`; at k = 1 it is c / n exactly.
    """
    c_P = np.asarray(num_correct_P)
    if c_P.ndim != 1:
        raise ValueError(f"num_correct_P must have shape [P], got {c_P.shape}")
    check_ks((k,), n)
    if np.any((c_P < 0) | (c_P > n)) or np.any(c_P != np.round(c_P)):
        raise ValueError(f"num_correct_P must hold integers in [0, n={n}], got {c_P}")
    i_N = np.arange(1, n + 1, dtype=np.float64)
    in_product_PxN = i_N[None, :] > (n - c_P[:, None])
    factors_PxN = np.where(in_product_PxN, 1.0 - k / i_N[None, :], 1.0)
    return np.where(n - c_P < k, 1.0, 1.0 - np.prod(factors_PxN, axis=1))


def majority_at_k(answers_PxN: Sequence[Sequence[Hashable | None]], correct_PxN, k: int) -> np.ndarray:
    """`[P]` float64: 1.0 where the majority answer of a prompt's first k samples is correct.

        maj@k(p) = correct[p, j*],  j* = the first j < k with answers[p][j] = a*,
        a* = argmax_a #{j < k : answers[p][j] = a}       (ties: the a seen first)

    Answers are compared with `==` (a task's final answer: for the built-in addition task
    the response text up to EOS). A `None` answer (no final answer, e.g. a response that
    never ended) does not vote; a prompt whose first k samples all lack one scores 0. The
    voted answer counts as correct when its first sample is, which is exact whenever the
    correctness of a sample is a function of its answer (exact match, final-answer match).
    """
    correct_PxN = np.asarray(correct_PxN, dtype=bool)
    if correct_PxN.ndim != 2 or len(answers_PxN) != correct_PxN.shape[0]:
        raise ValueError(f"correct_PxN must have shape [P, n] with P = len(answers_PxN) = {len(answers_PxN)}, "
                         f"got {correct_PxN.shape}")
    n = correct_PxN.shape[1]
    check_ks((k,), n)
    out = np.zeros(correct_PxN.shape[0], np.float64)
    for p, answers in enumerate(answers_PxN):
        if len(answers) != n:
            raise ValueError(f"prompt {p}: {len(answers)} answers for n={n} samples")
        counts, first = {}, {}
        for j, a in enumerate(answers[:k]):
            if a is not None:
                counts[a] = counts.get(a, 0) + 1
                first.setdefault(a, j)
        if counts:  # dicts keep insertion order, so max() returns the answer seen first among ties
            winner = max(counts, key=counts.__getitem__)
            out[p] = float(correct_PxN[p, first[winner]])
    return out


def sampled_metrics(correct_PxN, answers_PxN: Sequence[Sequence[Hashable | None]], ks: Sequence[int]) -> dict:
    """`{"mean@n", "pass@k", "maj@k" for each k}`, each a mean over the P prompts.

        mean@n = (1 / (P n)) Σ_p Σ_j correct[p, j]

    the expected accuracy of a single sample (reported once, named with the n in use, e.g.
    `mean@8`); `pass@k` is the mean of `pass_at_k` (equal to `mean@n` at k = 1) and
    `maj@k` the mean of `majority_at_k` over the first k samples.
    """
    correct_PxN = np.asarray(correct_PxN, dtype=bool)
    if correct_PxN.ndim != 2 or correct_PxN.shape[0] == 0:
        raise ValueError(f"correct_PxN must have shape [P, n] with P >= 1, got {correct_PxN.shape}")
    n = correct_PxN.shape[1]
    check_ks(ks, n)
    out = {f"mean@{n}": float(correct_PxN.mean())}
    c_P = correct_PxN.sum(axis=1)
    out.update({f"pass@{k}": float(pass_at_k(c_P, n, k).mean()) for k in ks})
    out.update({f"maj@{k}": float(majority_at_k(answers_PxN, correct_PxN, k).mean()) for k in ks})
    return out


__all__ = ["SampledEval", "check_ks", "majority_at_k", "parse_ks", "pass_at_k", "sampled_metrics"]
