"""Several stop tokens (`eos_id=(a, b)`, a chat model's `<|im_end|>` and `<|endoftext|>`):
the sampler, continuous batching, min_new_tokens, rewards and the missing-EOS penalty.

The reference is the unstopped decode cut by hand: a row's noise at step t does not
depend on whether other rows stopped, so stopping only truncates the same tokens."""

import jax
import numpy as np
import pytest

from jaxrlhf import rewards
from jaxrlhf.algorithms import scoring
from jaxrlhf.models import ModelConfig, Transformer, init_params
from jaxrlhf.rollout import generate, generate_continuous, sampler

CFG = ModelConfig(vocab_size=11, hidden_size=32, intermediate_size=48, num_layers=1, num_heads=2, num_kv_heads=2,
                  head_dim=16, max_position_embeddings=64)
MODEL = Transformer(CFG)
PARAMS = init_params(MODEL, jax.random.key(0))
B, P, T, PAD = 6, 4, 12, 0
IDS = np.random.default_rng(0).integers(1, CFG.vocab_size, (B, P))
MASK = np.ones((B, P), bool)
KW = dict(max_new_tokens=T, temperature=1.0, pad_id=PAD)


@pytest.fixture(scope="module")
def free():
    """The responses with no stop token, and two stop ids that end rows at different steps."""
    out = generate(MODEL, PARAMS, IDS, MASK, jax.random.key(1), **KW)
    tokens = np.asarray(out.response_ids)
    assert np.asarray(out.response_mask).all()
    first = {tok: np.argmax(tokens == tok, axis=1) + T * ~(tokens == tok).any(1) for tok in range(1, CFG.vocab_size)}
    # the two tokens that end the most rows, each ending some row before the other does
    a, b = sorted(first, key=lambda tok: (first[tok] < T).sum())[-2:]
    assert ((first[a] < first[b]) & (first[a] < T)).any() and ((first[b] < first[a]) & (first[b] < T)).any()
    return tokens, (int(a), int(b))


def _cut(tokens, stops):
    """The reference: each row up to and including its first stop token, then padding."""
    ids, mask = np.full_like(tokens, PAD), np.zeros(tokens.shape, bool)
    for r, row in enumerate(tokens):
        hits = np.flatnonzero(np.isin(row, stops))
        end = hits[0] + 1 if hits.size else T
        ids[r, :end], mask[r, :end] = row[:end], True
    return ids, mask


@pytest.mark.parametrize("slots", [0, 4])
def test_any_stop_id_ends_a_row(free, slots):
    tokens, stops = free
    call = generate if not slots else lambda *a, **k: generate_continuous(*a, slots=slots, **k)
    out = call(MODEL, PARAMS, IDS, MASK, jax.random.key(1), eos_id=list(stops), **KW)
    want_ids, want_mask = _cut(tokens, stops)
    np.testing.assert_array_equal(np.asarray(out.response_ids), want_ids)
    np.testing.assert_array_equal(np.asarray(out.response_mask), want_mask)
    one = generate(MODEL, PARAMS, IDS, MASK, jax.random.key(1), eos_id=stops[0], **KW)  # an int still works
    np.testing.assert_array_equal(np.asarray(one.response_mask), _cut(tokens, stops[:1])[1])


def test_min_new_tokens_bans_every_stop_id(free):
    _, stops = free
    out = generate(MODEL, PARAMS, IDS, MASK, jax.random.key(1), eos_id=stops, min_new_tokens=3, **KW)
    assert not np.isin(np.asarray(out.response_ids)[:, :3], stops).any()
    assert (np.asarray(out.lengths) < T).any()  # and they still end rows after that


@pytest.mark.parametrize("eos_id, match", [([], "empty list"), ((3, 11), "outside the vocabulary")])
def test_bad_stop_ids_are_refused(eos_id, match):
    with pytest.raises(ValueError, match=match):
        generate(MODEL, PARAMS, IDS, MASK, jax.random.key(1), eos_id=eos_id, **KW)


def test_rewards_and_penalty_see_every_stop_id():
    ids = np.asarray([[5, 7, 9, 0], [5, 8, 9, 0], [5, 6, 6, 6]])
    mask = np.asarray([[1, 1, 0, 0], [1, 1, 1, 0], [1, 1, 1, 1]], bool)
    scores = scoring.missing_eos_penalty(np.zeros(3, np.float32), ids, mask, eos_id=(7, 9), penalty=1.0)
    np.testing.assert_array_equal(np.asarray(scores), [0.0, 0.0, -1.0])

    class Tok:
        def decode(self, ids, **_):
            return ",".join(map(str, ids))

    seen = []
    reward = rewards.host_reward(lambda p, r, ex: seen.extend(r) or [0.0] * len(r), Tok(), eos_id=(7, 9))
    inputs = rewards.RewardInput.from_sequences(np.concatenate([np.ones((3, 1), int), ids], 1),
                                                np.concatenate([np.ones((3, 1), bool), mask], 1), 1)
    reward.host_scores(inputs, {})
    assert seen == ["5", "5,8", "5,6,6,6"]
    assert sampler.until_stop([5, 9, 7], (7, 9)) == ([5], True)


def test_a_response_cut_short_at_a_stop_string_counts_as_finished():
    """`sampler.finished`: a stop id among the valid tokens, or fewer valid tokens than T
    (`rollout.stop_strings` cut it), but not a full-length row without a stop id."""
    ids = np.asarray([[5, 7, 0], [5, 6, 0], [5, 6, 6], [5, 6, 7]])
    mask = np.asarray([[1, 1, 0], [1, 1, 0], [1, 1, 1], [1, 1, 1]], bool)
    np.testing.assert_array_equal(np.asarray(sampler.finished(ids, mask, (7, 9))), [True, True, False, True])
    scores = scoring.missing_eos_penalty(np.zeros(4, np.float32), ids, mask, eos_id=(7, 9), penalty=1.0)
    np.testing.assert_array_equal(np.asarray(scores), [0.0, 0.0, -1.0, 0.0])
