"""The synthetic addition task: determinism, split disjointness, formatting, preference pairs."""

import numpy as np
import pytest

from jaxrlhf.data import batching, token_rewards

from jaxrlhf.data import arithmetic as ar
from jaxrlhf.data.char_tokenizer import BOS_ID, CharTokenizer


def _keys(problems):
    return set(zip(problems.a.tolist(), problems.b.tolist()))


def test_same_seed_same_problems_other_seed_differs():
    task = ar.AdditionTask(num_digits=3)
    p1, p2 = ar.make_problems(task, 50, seed=7), ar.make_problems(task, 50, seed=7)
    assert p1.prompt_ids == p2.prompt_ids and p1.answer_ids == p2.answer_ids
    assert p1.prompt_text != ar.make_problems(task, 50, seed=8).prompt_text


@pytest.mark.parametrize("num_digits", [1, 2])
def test_splits_partition_every_problem_when_enumerable(num_digits):
    task = ar.AdditionTask(num_digits=num_digits, held_out_fraction=0.2)
    n_test = int(ar.is_held_out(task, *np.divmod(np.arange(task.num_problems), 10**num_digits)).sum())
    train = ar.make_problems(task, task.num_problems - n_test, split="train", seed=1)
    test = ar.make_problems(task, n_test, split="test", seed=2)
    assert not _keys(train) & _keys(test)
    assert len(_keys(train) | _keys(test)) == task.num_problems  # and distinct within a split
    with pytest.raises(ValueError, match="distinct test problems"):
        ar.make_problems(task, n_test + 1, split="test")


def test_held_out_never_in_train_for_large_tasks_across_seeds():
    task = ar.AdditionTask(num_digits=5)  # 10**10 problems: the rejection-sampling path
    train = set().union(*(_keys(ar.make_problems(task, 500, split="train", seed=s)) for s in range(3)))
    test = ar.make_problems(task, 300, split="test", seed=0)
    assert len(_keys(test)) == 300
    assert not train & _keys(test)
    assert ar.is_held_out(task, test.a, test.b).all()


def test_answers_are_sums_and_fit_the_task_lengths():
    tok = CharTokenizer()
    for task in [ar.AdditionTask(3), ar.AdditionTask(3, reverse_answer=True, zero_pad=True)]:
        p = ar.make_problems(task, 200, seed=0)
        assert [ar.parse_answer(task, s) for s in p.answer_text] == (p.a + p.b).tolist()
        assert all(ids[0] == BOS_ID for ids in p.prompt_ids)
        assert max(map(len, p.prompt_ids)) <= task.prompt_len
        assert max(map(len, p.answer_ids)) + 1 <= task.response_len  # + EOS
        assert [tok.decode(ids) for ids in p.answer_ids] == p.answer_text


def test_hand_formatted_examples():
    plain, rev = ar.AdditionTask(2), ar.AdditionTask(2, reverse_answer=True)
    fixed = ar.AdditionTask(2, reverse_answer=True, zero_pad=True)
    assert ar.format_prompt(plain, 37, 58) == "37+58="
    assert ar.format_answer(plain, 37 + 58) == "95"
    assert ar.format_answer(rev, 37 + 58) == "59"
    assert ar.format_prompt(fixed, 7, 5) == "07+05="
    assert ar.format_answer(fixed, 12) == "210"  # "012" reversed


def test_preference_pairs_are_plausible_and_wrong():
    task = ar.AdditionTask(3)
    problems = ar.make_problems(task, 300, seed=0)
    pairs = ar.make_preference_pairs(task, problems, seed=0)
    assert pairs == ar.make_preference_pairs(task, problems, seed=0)
    assert pairs.chosen_text == problems.answer_text
    assert all(r != c and r.isdigit() for r, c in zip(pairs.rejected_text, pairs.chosen_text))
    assert len(set(pairs.kind)) >= 5
    assert [CharTokenizer().decode(ids) for ids in pairs.rejected_ids] == pairs.rejected_text
    # Forgetting the carries of 58 + 67: units 8+7 -> 5, tens 5+6 -> 1: "15" instead of "125".
    assert ar._digitwise_no_carry(task, 58, 67) == 15


def test_whole_set_arrays_fit_and_perfect_answers_score_one():
    task = ar.AdditionTask(3, reverse_answer=True)
    problems = ar.make_problems(task, 64, seed=0)
    sft = ar.sft_arrays(task, problems)
    assert sft["tokens"].shape == (64, task.prompt_len + task.response_len)
    row = batching.sft_batch(problems.prompt_ids[5:6], problems.answer_ids[5:6],
                             prompt_len=task.prompt_len, response_len=task.response_len)
    assert all(np.array_equal(sft[k][5:6], row[k]) for k in row)
    rl = ar.rl_arrays(task, problems)
    # The SFT targets are exactly the responses the reward accepts.
    score = token_rewards.exact_match_reward(sft["response_ids"], sft["response_mask"], rl["answer_ids"], rl["answer_mask"])
    np.testing.assert_array_equal(score, np.ones(64))
    # The references GRPO's guidance learns are the SFT responses.
    np.testing.assert_array_equal(rl["reference_ids"], sft["response_ids"])
    np.testing.assert_array_equal(rl["reference_mask"], sft["response_mask"])
    pairs = ar.make_preference_pairs(task, problems, seed=1)
    pref = ar.preference_arrays(task, pairs)
    score = token_rewards.exact_match_reward(pref["rejected_ids"], pref["rejected_mask"], rl["answer_ids"], rl["answer_mask"])
    np.testing.assert_array_equal(score, np.zeros(64))
