"""The generated word problems: right answers, a held-out split by problem, determinism."""

import re

import pytest

from jaxrlhf import data
from jaxrlhf.data import word_problems


def _solve(question: str) -> int:
    a, b = map(int, re.findall(r"\d+", question))
    if "+" in question or "gets" in question:
        return a + b
    if "-" in question or "gives away" in question:
        return a - b
    assert "times" in question
    return a * b


def _problem(question: str) -> tuple:
    """The problem without its name and item: (kind words, a, b)."""
    words = "add" if ("+" in question or "gets" in question) else "sub" if ("-" in question or "away" in question) \
        else "mul"
    return (words, "has" in question, *map(int, re.findall(r"\d+", question)))


def test_answers_are_right_and_subtractions_never_negative():
    for split in ("train", "test"):
        for r in data.make_word_problems(500, split=split, seed=3):
            assert int(r["answer"]) == _solve(r["question"]) >= 0


def test_held_out_problems_never_appear_in_training_under_any_seed():
    test = {_problem(r["question"]) for r in data.make_word_problems(2000, split="test", seed=0)}
    for seed in range(3):
        train = {_problem(r["question"]) for r in data.make_word_problems(2000, split="train", seed=seed)}
        assert not train & test
    assert 0.1 < len(test) / (len(test) + len(train)) < 0.3  # about held_out_fraction = 0.2 of the problems


def test_deterministic_per_seed_and_split():
    assert data.make_word_problems(50, split="train", seed=1) == data.make_word_problems(50, split="train", seed=1)
    assert data.make_word_problems(50, split="train", seed=1) != data.make_word_problems(50, split="train", seed=2)
    kinds = {_problem(r["question"])[:2] for r in data.make_word_problems(400, split="train", seed=0)}
    assert len(kinds) == len(word_problems.KINDS)


def test_bad_arguments():
    with pytest.raises(ValueError, match="split='dev'"):
        data.make_word_problems(5, split="dev", seed=0)
    with pytest.raises(ValueError, match="held_out_fraction=1.5"):
        data.make_word_problems(5, split="train", seed=0, held_out_fraction=1.5)
    with pytest.raises(ValueError, match="kind='divide'"):
        word_problems.question("divide", 1, 2)
