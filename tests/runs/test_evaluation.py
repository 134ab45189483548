"""The sampled-evaluation estimators (`runs.evaluation`) against independent references,
and the config fields that turn sampled evaluation on."""

from __future__ import annotations

import itertools
import math
from collections import Counter
from fractions import Fraction

import ml_collections as mlc
import numpy as np
import pytest

from jaxrlhf.runs import config_base
from jaxrlhf.runs.evaluation import SampledEval, majority_at_k, parse_ks, pass_at_k, sampled_metrics


def _pass_brute_force(correct_N: np.ndarray, k: int) -> float:
    """The fraction of the k-subsets of the n samples that hold a correct one (float64)."""
    subsets = list(itertools.combinations(range(len(correct_N)), k))
    return float(np.mean([np.any(correct_N[list(s)]) for s in subsets], dtype=np.float64))


def _pass_closed_form(n: int, c: int, k: int) -> float:
    """1 − C(n − c, k) / C(n, k), exactly in rationals."""
    return float(1 - Fraction(math.comb(n - c, k), math.comb(n, k)))


def test_pass_at_k_matches_enumerating_every_k_subset():
    rng = np.random.default_rng(0)
    for n in range(1, 9):
        correct_PxN = rng.random((6, n)) < rng.random((6, 1))  # per-prompt rates, some all-0 / all-1
        correct_PxN[0], correct_PxN[-1] = False, True
        for k in range(1, n + 1):
            got_P = pass_at_k(correct_PxN.sum(1), n, k)
            want_P = [_pass_brute_force(row, k) for row in correct_PxN]
            np.testing.assert_allclose(got_P, want_P, rtol=0, atol=1e-12, err_msg=f"n={n} k={k}")


def test_pass_at_k_matches_the_closed_form_also_where_binomials_overflow():
    for n, k in [(1, 1), (7, 3), (16, 16), (64, 8), (2000, 1000), (2000, 7)]:
        cs = sorted({0, 1, 2, n // 3, n // 2, n - k, n - k + 1, n - 1, n} & set(range(n + 1)))
        got = pass_at_k(np.asarray(cs), n, k)
        assert math.comb(2000, 1000) > 1e308  # float64 binomials would overflow here
        np.testing.assert_allclose(got, [_pass_closed_form(n, c, k) for c in cs], rtol=1e-12, atol=1e-12,
                                   err_msg=f"n={n} k={k}")


def test_pass_at_k_rejects_bad_inputs():
    with pytest.raises(ValueError, match=r"every k must be in \[1, n=4\]"):
        pass_at_k(np.array([1]), 4, 5)
    with pytest.raises(ValueError, match=r"integers in \[0, n=4\]"):
        pass_at_k(np.array([5]), 4, 2)


# maj@k on hand-built cases: (answers of one prompt, correct, k) -> the rule's verdict.
MAJORITY_CASES = [
    (["5", "7", "5"], [0, 1, 0], 3, 0.0),  # "5" twice beats the correct "7"
    (["5", "7", "5"], [0, 1, 0], 1, 0.0),  # only the first sample votes
    (["5", "7", "7"], [0, 1, 1], 2, 0.0),  # 1-1 tie: "5" came first
    (["7", "5", "5"], [1, 0, 0], 2, 1.0),  # 1-1 tie: "7" came first
    (["7", "5", "5"], [1, 0, 0], 3, 0.0),
    (["a", "b", "b", "a"], [0, 1, 1, 0], 4, 0.0),  # 2-2 tie: "a" came first
    (["b", "a", "a", "b"], [1, 0, 0, 1], 4, 1.0),
    ([None, None, "7"], [0, 0, 1], 2, 0.0),  # no answer among the first two
    ([None, None, "7"], [0, 0, 1], 3, 1.0),  # unanswered samples do not vote
    ([None, "5", None, "7", "7"], [0, 0, 0, 1, 1], 5, 1.0),
]


@pytest.mark.parametrize("answers,correct,k,want", MAJORITY_CASES)
def test_majority_at_k_hand_built_cases(answers, correct, k, want):
    assert majority_at_k([answers], np.asarray([correct], bool), k).tolist() == [want]


def test_majority_at_k_matches_counter_most_common():
    """`Counter.most_common` orders equal counts by first occurrence: an independent vote."""
    rng = np.random.default_rng(1)
    n, answers_PxN = 7, []
    for _ in range(200):
        answers_PxN.append([None if a == 0 else f"ans{a}" for a in rng.integers(0, 4, n)])
    truth_P = [f"ans{t}" for t in rng.integers(1, 4, len(answers_PxN))]
    correct_PxN = np.asarray([[a == t for a in row] for row, t in zip(answers_PxN, truth_P)])
    for k in range(1, n + 1):
        want = []
        for row, t in zip(answers_PxN, truth_P):
            votes = Counter(a for a in row[:k] if a is not None).most_common(1)
            want.append(float(bool(votes) and votes[0][0] == t))
        np.testing.assert_array_equal(majority_at_k(answers_PxN, correct_PxN, k), want, err_msg=f"k={k}")


def test_sampled_metrics_identities():
    rng = np.random.default_rng(2)
    correct_PxN = rng.random((50, 8)) < rng.random((50, 1))
    answers_PxN = [[str(int(c)) if c else f"wrong{j % 3}" for j, c in enumerate(row)] for row in correct_PxN]
    m = sampled_metrics(correct_PxN, answers_PxN, (1, 2, 4, 8))
    assert m["mean@8"] == pytest.approx(correct_PxN.mean(), abs=1e-15)
    assert m["pass@1"] == pytest.approx(m["mean@8"], abs=1e-12)  # pass@1 = c / n per prompt
    assert m["pass@8"] == pytest.approx(correct_PxN.any(1).mean(), abs=1e-12)  # k = n: any correct
    assert m["maj@1"] == pytest.approx(correct_PxN[:, 0].mean(), abs=1e-15)  # the first sample alone
    passes = [m[f"pass@{k}"] for k in (1, 2, 4, 8)]
    assert passes == sorted(passes) and passes[0] < passes[-1]
    assert sorted(m) == sorted(["mean@8", *(f"{s}@{k}" for s in ("pass", "maj") for k in (1, 2, 4, 8))])


def test_parse_ks():
    assert parse_ks("8,1, 4,4") == (1, 4, 8)
    assert parse_ks((4, 1)) == parse_ks(4 * [1] + [4]) == (1, 4)
    assert parse_ks(3) == (3,)
    for bad in ("1,x", "", "1.5", True):
        with pytest.raises(ValueError, match="eval_k"):
            parse_ks(bad)


def _train(**kw) -> mlc.ConfigDict:
    return config_base.train(**kw)


def test_sampled_eval_is_off_by_default_and_reads_the_config():
    assert SampledEval.from_config(_train()) is None
    s = SampledEval.from_config(_train(eval_samples=4, eval_k="4,1,2", eval_temperature=0.7))
    assert (s.num_samples, s.ks, s.temperature) == (4, (1, 2, 4), 0.7)


@pytest.mark.parametrize("fields,match", [
    (dict(eval_samples=4, eval_k="1,8"), r"train\.eval_k='1,8' with train\.eval_samples=4: every k must be in"),
    (dict(eval_samples=4, eval_k="0,2"), r"train\.eval_k='0,2'.*every k must be in \[1, n=4\]"),
    (dict(eval_samples=4, eval_k="1,two"), r"train\.eval_k='1,two': expected comma-separated integers"),
])
def test_sampled_eval_config_errors_name_the_field(fields, match):
    with pytest.raises(ValueError, match=match):
        SampledEval.from_config(_train(**fields))


@pytest.mark.parametrize("fields,match", [
    (dict(eval_samples=-1), r"^train\.eval_samples=-1 is impossible: it must be >= 0"),
    (dict(eval_samples=4, eval_temperature=0.0), r"^train\.eval_temperature=0\.0 is impossible: it must be > 0"),
])
def test_the_sampled_evaluation_options_are_bounded_by_their_fields(fields, match):
    """The bounds of `eval_samples` and `eval_temperature` are their fields' (`TrainConfig`),
    checked with every other option before any work."""
    from jaxrlhf import options
    from jaxrlhf.runs.sections import TrainConfig

    with pytest.raises(ValueError, match=match):
        options.check_values((TrainConfig,), _train(**fields), "train.")


def test_tensorboard_tags_of_the_sampled_metrics_are_legal():
    from jaxrlhf.runs.metrics import tensorboard_tag

    assert tensorboard_tag("grpo/eval/pass@4") == "grpo/eval/pass_at_4"
    assert tensorboard_tag("grpo/eval/accuracy") == "grpo/eval/accuracy"
    assert tensorboard_tag("a b:c") == "a_b_c"
