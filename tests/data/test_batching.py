"""Padding layout, the SFT/preference batches, and the resumable sharded iterator."""

import itertools

import numpy as np
import pytest

from jaxrlhf.data import batching
from jaxrlhf.data.char_tokenizer import EOS_ID as E
from jaxrlhf.data.char_tokenizer import PAD_ID as _


def test_prompts_left_padded_responses_right_padded():
    b = batching.prompt_response_batch([[1, 5, 6], [1, 7]], [[8], [9, 9]], prompt_len=4, response_len=4)
    np.testing.assert_array_equal(b["prompt_ids"], [[_, 1, 5, 6], [_, _, 1, 7]])
    np.testing.assert_array_equal(b["prompt_mask"], [[0, 1, 1, 1], [0, 0, 1, 1]])
    np.testing.assert_array_equal(b["response_ids"], [[8, E, _, _], [9, 9, E, _]])
    np.testing.assert_array_equal(b["response_mask"], [[1, 1, 0, 0], [1, 1, 1, 0]])
    assert b["prompt_ids"].dtype == np.int32 and b["prompt_mask"].dtype == bool


def test_sft_batch_joins_and_masks_only_the_response():
    b = batching.sft_batch([[1, 5, 6], [1, 7]], [[8], [9, 9]], prompt_len=4, response_len=4)
    np.testing.assert_array_equal(b["tokens"], [[_, 1, 5, 6, 8, E, _, _], [_, _, 1, 7, 9, 9, E, _]])
    np.testing.assert_array_equal(b["input_mask"], [[0, 1, 1, 1, 1, 1, 0, 0], [0, 0, 1, 1, 1, 1, 1, 0]])
    np.testing.assert_array_equal(b["loss_mask"], [[0, 0, 0, 0, 1, 1, 0, 0], [0, 0, 0, 0, 1, 1, 1, 0]])


def test_preference_batch():
    b = batching.preference_batch([[1, 4]], [[8]], [[8, 9]], prompt_len=3, response_len=4)
    np.testing.assert_array_equal(b["chosen_ids"], [[8, E, _, _]])
    np.testing.assert_array_equal(b["rejected_ids"], [[8, 9, E, _]])
    np.testing.assert_array_equal(b["rejected_mask"], [[1, 1, 1, 0]])


def test_overlong_raises_or_truncates():
    with pytest.raises(ValueError, match="prompt 1 has 4 tokens"):
        batching.left_pad([[1], [1, 2, 3, 4]], 3)
    with pytest.raises(ValueError, match="response 0 has 3 tokens"):  # 2 tokens + EOS
        batching.right_pad([[4, 5]], 2, append_id=E)
    ids, mask = batching.left_pad([[1, 2, 3, 4]], 3, truncate=True)
    np.testing.assert_array_equal(ids, [[2, 3, 4]])  # keeps the end of the prompt
    ids, mask = batching.right_pad([[4, 5]], 2, append_id=E, truncate=True)
    np.testing.assert_array_equal(ids, [[4, 5]])  # a cut response loses its EOS


def test_iterator_is_deterministic_and_reshuffles_each_epoch():
    a = batching.BatchIterator(20, 4, seed=3)
    b = batching.BatchIterator(20, 4, seed=3)
    first = [next(a) for _ in range(10)]
    assert all(np.array_equal(x, y) for x, y in zip(first, (next(b) for _ in range(10))))
    epoch0, epoch1 = np.concatenate(first[:5]), np.concatenate(first[5:])
    assert sorted(epoch0) == sorted(epoch1) == list(range(20))
    assert not np.array_equal(epoch0, epoch1)


@pytest.mark.parametrize("k", [0, 3, 5, 7])  # before, inside, at and past an epoch boundary
def test_iterator_resumes_exactly_from_its_position(k):
    it = batching.BatchIterator(23, 4, seed=1)  # 5 batches per epoch, 3 examples dropped
    for _ in range(k):
        next(it)
    saved = dict(it.position)
    expected = [next(it) for _ in range(6)]
    fresh = batching.BatchIterator(23, 4, seed=1, position=saved)
    assert all(np.array_equal(x, y) for x, y in zip(expected, (next(fresh) for _ in range(6))))


def test_restore_rejects_bad_positions():
    it = batching.BatchIterator(10, 2)
    with pytest.raises(ValueError, match="exactly the keys"):
        it.restore({"epoch": 0})
    with pytest.raises(ValueError, match="invalid position"):
        it.restore({"epoch": 0, "index": 11})


def test_process_shards_are_disjoint_and_cover_each_global_batch():
    n, per_host, hosts, steps = 30, 3, 3, 7  # 3 global batches per epoch, crosses into epoch 2
    iters = [batching.BatchIterator(n, per_host, seed=5, process_index=p, process_count=hosts)
             for p in range(hosts)]
    single = batching.BatchIterator(n, per_host * hosts, seed=5)
    for _ in range(steps):
        shares = [next(it) for it in iters]
        joined = np.concatenate(shares)
        assert len(set(joined.tolist())) == per_host * hosts  # disjoint
        np.testing.assert_array_equal(joined, next(single))  # = the one-host global batch
    # One epoch across hosts covers every example exactly once (30 = 3 batches of 9, + 3 dropped).
    iters = [batching.BatchIterator(27, per_host, seed=0, process_index=p, process_count=hosts)
             for p in range(hosts)]
    epoch = [i for it in iters for i in itertools.chain(*(next(it) for _ in range(3)))]
    assert sorted(epoch) == list(range(27))


def test_eval_batches_cover_every_example_once_with_fixed_shapes():
    seen = []
    for p in range(2):
        batches = list(batching.eval_batches(11, 3, process_index=p, process_count=2))
        assert len(batches) == 2 and all(idx.shape == (3,) for idx, _ in batches)
        seen += [i for idx, valid in batches for i in idx[valid].tolist()]
    assert sorted(seen) == list(range(11))
