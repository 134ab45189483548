"""The jitted token-level rewards against the host-side loop and text versions."""

import jax
import numpy as np
import pytest

from jaxrlhf.data import text_rewards, token_rewards
from jaxrlhf.data.batching import right_pad
from jaxrlhf.data.char_tokenizer import EOS_ID, CharTokenizer

E = EOS_ID


def _pad(rows, length):
    """Right-pad lists of ids; returns (ids, mask) as a rollout would produce them."""
    return right_pad(rows, length, truncate=True)


def test_hand_made_cases():
    # Answer "95" is ids [13, 9] ("9" -> 4 + 9, "5" -> 4 + 5); target = [13, 9, EOS].
    answer_ids, answer_mask = _pad([[13, 9]] * 6, 3)
    resp = [
        [13, 9, E],          # exact                                    -> 1, 3/3
        [13, 9, E, 7, 7],    # exact; tokens after EOS are ignored      -> 1, 3/3
        [13, 9],             # truncated, no EOS                        -> 0, 2/3
        [13, 8, E],          # one wrong digit                          -> 0, 2/3 (9 and EOS)
        [13, E],             # dropped digit                            -> 0, 1/3
        [E],                 # empty answer                             -> 0, 0/3
    ]
    response_ids, response_mask = _pad(resp, 6)
    args = (response_ids, response_mask, answer_ids, answer_mask)
    np.testing.assert_array_equal(jax.jit(token_rewards.exact_match_reward)(*args), [1, 1, 0, 0, 0, 0])
    np.testing.assert_allclose(
        jax.jit(token_rewards.token_match_reward)(*args), [1, 1, 2 / 3, 2 / 3, 1 / 3, 0], rtol=1e-6)
    # The EOS must be inside the mask: the same ids with the mask cut before EOS score 0.
    cut_mask = response_mask.copy()
    cut_mask[0, 2] = False
    assert token_rewards.exact_match_reward(response_ids, cut_mask, answer_ids, answer_mask)[0] == 0


def _random_case(rng, B, T, A, vocab):
    """Answers of digit ids; responses mostly near-correct: a random token replaced, one
    dropped, or all random, with junk after the EOS. Tokens drawn from `vocab`."""
    answers = [rng.integers(4, 14, size=rng.integers(1, A + 1)).tolist() for _ in range(B)]
    responses = []
    for ans in answers:
        r = ans + [E] + rng.choice(vocab, size=3).tolist()
        kind = rng.integers(5)
        if kind == 1:
            r[rng.integers(len(r))] = int(rng.choice(vocab))
        elif kind == 2:
            del r[rng.integers(len(ans) + 1)]
        elif kind == 3:
            r = rng.choice(vocab, size=rng.integers(0, T + 1)).tolist()
        responses.append(r)
    return (*_pad(responses, T), *_pad(answers, A))


ALL_IDS = np.arange(20)
# The text route drops special tokens when decoding, so it agrees with the id route only
# on responses whose sole special token is EOS.
TEXT_IDS = np.array([E, *range(4, 20)])


@pytest.mark.parametrize("T", [2, 5, 9])  # shorter than, equal to and longer than A + 1
def test_jitted_rewards_equal_host_versions_on_random_cases(T):
    rng = np.random.default_rng(T)
    exact_fn = jax.jit(token_rewards.exact_match_reward)
    partial_fn = jax.jit(token_rewards.token_match_reward)
    tok = CharTokenizer()
    for _ in range(3):
        args = _random_case(rng, B=64, T=T, A=4, vocab=ALL_IDS)
        exact = np.asarray(exact_fn(*args))
        np.testing.assert_array_equal(exact, token_rewards.exact_match(*args))
        np.testing.assert_allclose(partial_fn(*args), token_rewards.token_match_fraction(*args), rtol=1e-6)
        assert np.all((np.asarray(partial_fn(*args)) == 1.0) == (exact == 1.0))

        args = _random_case(rng, B=64, T=T, A=4, vocab=TEXT_IDS)
        exact = np.asarray(exact_fn(*args))
        texts, finished = text_rewards.decode_responses(tok, args[0], args[1])
        answers = [tok.decode(row[m]) for row, m in zip(args[2], args[3])]
        np.testing.assert_array_equal(exact, text_rewards.exact_match_text(texts, answers, finished=finished))


def test_extra_padding_changes_nothing():
    args = _random_case(np.random.default_rng(0), B=32, T=6, A=3, vocab=ALL_IDS)
    wider = (*_pad([r[m].tolist() for r, m in zip(args[0], args[1])], 11), args[2], args[3])
    for fn in (token_rewards.exact_match_reward, token_rewards.token_match_reward):
        np.testing.assert_array_equal(fn(*args), fn(*wider))


def test_shape_errors_are_clear():
    with pytest.raises(ValueError, match="batch sizes differ"):
        token_rewards.exact_match_reward(np.zeros((2, 3)), np.ones((2, 3)), np.zeros((3, 2)), np.ones((3, 2)))
