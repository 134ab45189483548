"""Final-answer extraction and the GSM8K-style text reward."""

import numpy as np
import pytest

from jaxrlhf.data.text_rewards import (answer_format_reward, exact_match_text, extract_final_answer,
                                       final_answer_reward, normalize_number)


@pytest.mark.parametrize("text, expected", [
    ("Natalia sold 48/2 = <<48/2=24>>24 clips in May.\n#### 72", "72"),  # GSM8K reference
    ("#### 1,234", "1234"),
    ("#### $18.00", "18"),
    ("#### 42\nand then 7", "42"),                # "####" wins over a later number
    ("The answer is \\boxed{17}. Check: 3", "17"),  # boxed wins over the last number
    ("\\boxed{\\frac{1}{2}}", "\\frac{1}{2}"),   # not a single number: kept whole
    ("first \\boxed{1} then \\boxed{2}", "2"),
    ("I get 3, then 5.", "5"),                    # last number
    ("x = -3.5", "-3.5"),
    ("pages 3-5", "5"),                           # a minus after a digit is not a sign
    ("no digits here", None),
])
def test_extract_final_answer(text, expected):
    assert extract_final_answer(text) == expected


def test_normalize_number():
    assert normalize_number(" 1,000.0 ") == "1000"
    assert normalize_number("7.") == "7"
    assert normalize_number("0.50") == "0.5"
    assert normalize_number("abc ") == "abc"


def test_final_answer_reward_against_gsm8k_references():
    refs = ["... #### 72", "#### 5", "10", "#### 3"]
    responses = ["So she sold 72 clips.", "\\boxed{5.0}", "It is 11", "no idea"]
    np.testing.assert_array_equal(final_answer_reward(responses, refs), [1, 1, 0, 0])


def test_exact_match_text():
    np.testing.assert_array_equal(
        exact_match_text([" 95", "95", "9"], ["95", "95", "95"], finished=[True, False, True]), [1, 0, 0])


@pytest.mark.parametrize("text, expected", [
    ("so the total is 12.\n#### 12", 1.0),
    ("#### -3", 1.0),
    ("#### 4 or 5", 0.0),            # two numbers: not one final answer
    ("#### twelve", 0.0),
    ("#### 12\nthen #### x", 0.0),   # the last #### counts
    ("the answer is 12", 0.0),
    ("", 0.0),
])
def test_answer_format_reward(text, expected):
    assert answer_format_reward([text]).tolist() == [expected]
